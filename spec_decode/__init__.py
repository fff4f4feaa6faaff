"""Draft proposers for speculative decoding that need no model (torch-free; imports core only)."""
