"""Native kernels: C++ for the CPU backend (csrc/) and Triton for CUDA."""
