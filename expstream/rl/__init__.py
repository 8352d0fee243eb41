"""RL math and data: numerics, layouts, estimators, running moments, experiences, admission (torch-light)."""
