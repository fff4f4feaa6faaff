"""twinserve: an LLM serving engine and its SimPy digital twin, sharing one scheduler."""

__version__ = "0.1.0"
