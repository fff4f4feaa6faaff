"""The engine's orchestration around the model runner: requests in, outputs out (no torch)."""
