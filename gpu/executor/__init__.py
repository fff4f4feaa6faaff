"""Tensor-parallel executors: the driver (rank 0, the engine process) and its worker ranks."""
