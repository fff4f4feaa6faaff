"""Draft proposers that run a model (torch)."""
