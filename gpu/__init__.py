"""The real backend: HF Llama-family models on paged KV, CPU (torch + a C++ decode kernel) and CUDA
(Triton); ``simulator/`` never imports this package."""
