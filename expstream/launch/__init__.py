"""Running a pipeline: run, continuous loop, supervisor, fork server, scaling, local servers, collector."""
