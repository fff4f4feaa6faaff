"""The host KV tier's worker side on the real engine (vLLM's OffloadingConnector)."""
