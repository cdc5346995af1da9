"""Simulated serving: the real engine and scheduler on a model-free backend whose decode calls take
virtual time from a measured (or estimated) cost profile. See `cobali simulate`."""
