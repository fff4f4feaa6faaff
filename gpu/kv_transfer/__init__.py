"""The worker side of KV connectors on the real engine (``core/kv_connector.py`` holds the
protocol and the scheduler side): ``PeerConnectorWorker`` moves a request's KV blocks from a
prefill engine process to a decode engine process on the same machine."""
