"""Models: tiny offline models, loading and forwards, generator backends, model resolution, image/video inputs, blobs."""
