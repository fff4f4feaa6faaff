"""Multi-LoRA: adapter weights, the adapter slots, and the LoRA-wrapped layers."""
