"""The worker: model runner, batch building, KV cache tensors, CUDA graphs, sampling."""
