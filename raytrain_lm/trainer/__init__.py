"""Training: the per-worker loop (the only place that calls ray.train.*) and its parts."""
