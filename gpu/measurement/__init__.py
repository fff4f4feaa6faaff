"""Measuring the real backend: the step profiler and the kernel tuning caches."""
