"""Quantized weights: GGUF blocks run as they are, int8 / fp8 quantized at load time, GPTQ / AWQ
4-bit checkpoints; one file per method, the products by ``gpu/kernels/csrc/quant_matmul.cpp`` on the CPU
(``quant_tensor.QuantTensor``) and ``triton_quant`` on CUDA."""
