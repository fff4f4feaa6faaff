"""Tensor parallelism's process groups and collectives (gloo on CPU, NCCL on CUDA)."""
