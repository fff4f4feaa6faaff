"""Model definitions, loading (safetensors, GGUF) and the bundled default model."""
