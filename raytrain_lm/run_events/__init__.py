"""A run beyond its processes: its event journal and the goodput derived from it."""
