"""The host KV tier's worker side: a host buffer and the block copies between it and the KV cache.

Layout: one host tensor pair per KV cache slot (``KVCache.gpu_slots``), ``[num_host_blocks,
block_size, num_kv_heads, head_dim]``, pinned on CUDA; host block ``h`` of every layer is row ``h``.

Order within a step (``start`` before the forward pass, ``get_finished`` after it)::

    start(meta):   loads, host -> device          (CUDA: on the copy stream; the compute stream
                                                   waits for it before the forward pass)
    forward pass
    get_finished:  stores, device -> host         (CUDA: the copy stream waits for the forward
                                                   pass; the next start makes compute wait for
                                                   them before any freed block is rewritten)

Loads and stores of one engine go through one stream in order, so a load never reads a host
block before the store that fills it, and a reused host block is written only after the loads
that read it. On the CPU every copy is done when its call returns.
"""

from __future__ import annotations

import torch

from twinserve.core.kv_connector import KVConnectorMetadata, KVConnectorOutput
from twinserve.core.kv_offload import OffloadingConnectorMetadata

Pair = tuple[torch.Tensor, torch.Tensor]


class HostKVBuffer:
    """Host blocks mirroring the device cache's slots; ``pairs[slot] = (keys, values)``."""

    __slots__ = ("pairs", "num_blocks")

    def __init__(self, device_pairs: list[Pair], num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_host_blocks must be a positive integer, got {num_blocks!r}.")
        pin = device_pairs[0][0].device.type == "cuda"
        self.num_blocks = num_blocks
        self.pairs = [tuple(torch.empty((num_blocks, *t.shape[1:]), dtype=t.dtype,
                                        pin_memory=pin) for t in pair)
                      for pair in device_pairs]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.pairs for t in pair)


class OffloadingConnectorWorker:
    """``KVConnectorWorker`` of the host tier over one ``KVCache``'s device slots."""

    def __init__(self, device_pairs: list[Pair], num_host_blocks: int) -> None:
        self.device_pairs = device_pairs
        self.host = HostKVBuffer(device_pairs, num_host_blocks)
        self.num_device_blocks = device_pairs[0][0].shape[0]
        cuda = device_pairs[0][0].device.type == "cuda"
        self._stream = torch.cuda.Stream(device_pairs[0][0].device) if cuda else None
        self._stores: list[tuple[int, int]] = []
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self.num_blocks_loaded = 0
        self.num_blocks_stored = 0

    def start(self, meta: KVConnectorMetadata) -> None:
        """Loads the ordered blocks (before the forward pass); keeps the stores for after it."""
        if not isinstance(meta, OffloadingConnectorMetadata):
            raise TypeError(f"the host tier's worker got {type(meta).__name__} orders.")
        stream = self._stream
        if stream is not None:  # the last step's stores read blocks this pass may rewrite
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        for rid, pairs in meta.loads.items():
            if not self._in_range(pairs):
                self._failed.add(rid)
                continue
            self._copy([h for h, _ in pairs], [d for _, d in pairs], to_device=True)
            self.num_blocks_loaded += len(pairs)
            self._finished.add(rid)
        if stream is not None and meta.loads:
            torch.cuda.current_stream(stream.device).wait_stream(stream)
        self._stores = list(meta.stores)

    def get_finished(self) -> KVConnectorOutput:
        """Stores the step's completed blocks (after the forward pass) and reports the loads."""
        stores, self._stores = self._stores, []
        if stores:
            if not self._in_range([(h, d) for d, h in stores]):
                raise ValueError("the host tier ordered a store outside the device or host cache.")
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
            self._copy([h for _, h in stores], [d for d, _ in stores], to_device=False)
            self.num_blocks_stored += len(stores)
        finished, failed = self._finished, self._failed
        self._finished, self._failed = set(), set()
        return KVConnectorOutput(set(), finished, failed)

    def wait(self, timeout_s: float) -> None:
        """Nothing to wait for: a load is reported at the ``get_finished`` after its ``start``
        (on CUDA the compute stream waits for it before the next forward pass)."""

    def close(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    def _in_range(self, pairs: list[tuple[int, int]]) -> bool:
        """Every (host, device) pair names blocks that exist."""
        nh, nd = self.host.num_blocks, self.num_device_blocks
        return all(0 <= h < nh and 0 <= d < nd for h, d in pairs)

    def _copy(self, host_ids: list[int], device_ids: list[int], to_device: bool) -> None:
        if self._stream is None:
            _copy_indexed(self.host.pairs, self.device_pairs, host_ids, device_ids, to_device)
            return
        with torch.cuda.stream(self._stream):
            _copy_rows(self.host.pairs, self.device_pairs, host_ids, device_ids, to_device)


def _copy_indexed(host: list[Pair], device: list[Pair], host_ids: list[int],
                  device_ids: list[int], to_device: bool) -> None:
    """CPU: one gather-scatter per tensor."""
    h = torch.tensor(host_ids, dtype=torch.long)
    d = torch.tensor(device_ids, dtype=torch.long)
    for host_pair, dev_pair in zip(host, device):
        for ht, dt in zip(host_pair, dev_pair):
            if to_device:
                dt[d] = ht[h]
            else:
                ht[h] = dt[d]


def _copy_rows(host: list[Pair], device: list[Pair], host_ids: list[int],
               device_ids: list[int], to_device: bool) -> None:
    """CUDA: block by block into pinned rows, asynchronous on the current (copy) stream. (An
    indexed assignment into host memory would run on the CPU before the device's data arrived.)"""
    for host_pair, dev_pair in zip(host, device):
        for ht, dt in zip(host_pair, dev_pair):
            for hi, di in zip(host_ids, device_ids):
                if to_device:
                    dt[di].copy_(ht[hi], non_blocking=True)
                else:
                    ht[hi].copy_(dt[di], non_blocking=True)
