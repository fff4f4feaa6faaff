"""A KV cache region other engine processes on this machine can read.

One tensor ``[num_slots, 2, num_blocks, block_size, num_kv_heads, head_dim]`` holds the whole
paged cache (slot s's keys at ``[s, 0]``, values at ``[s, 1]``: each a contiguous view, the shape
the attention kernels take), so copying a request's blocks between two regions is one indexed
copy over dimension 2, whatever the number of layers.

Sharing (decided per device):
- CPU: the region lives in an anonymous memory file (``memfd_create``); a peer opens it through
  ``/proc/<pid>/fd/<fd>`` and maps it read-only. Nothing is left in ``/dev/shm`` when a process
  dies, and the file is freed once no process maps it.
- CUDA: a CUDA IPC handle of the region's storage (same machine), opened by the peer with
  ``torch.UntypedStorage._new_shared_cuda``; the copy is then device to device.
"""

from __future__ import annotations

import base64
import mmap
import os
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch

from twinserve.gpu.worker.kv_cache import KVCacheSpec

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.float8_e4m3fn: "float8_e4m3fn"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def boot_id() -> str:
    """This machine's boot id: two processes sharing memory must see the same one."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What two engines must agree on to copy blocks: everything but the number of blocks."""

    num_slots: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("num_slots", "block_size", "num_kv_heads", "head_dim", "num_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}.")

    @classmethod
    def of(cls, spec: KVCacheSpec, num_slots: int, num_blocks: int) -> KVLayout:
        return cls(num_slots, spec.block_size, spec.num_kv_heads, spec.head_dim,
                   DTYPE_NAMES[spec.dtype], num_blocks)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_slots, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty(0, dtype=self.torch_dtype).element_size()
        return 2 * self.num_slots * self.block_size * self.num_kv_heads * self.head_dim * elem

    def check_compatible(self, peer: KVLayout) -> None:
        """Raises ValueError naming the first field (other than the block count) that differs."""
        for name in ("num_slots", "block_size", "num_kv_heads", "head_dim", "dtype"):
            ours, theirs = getattr(self, name), getattr(peer, name)
            if ours != theirs:
                raise ValueError(f"KV layout mismatch: {name} is {ours!r} here and {theirs!r} "
                                 "on the peer engine (both must run the same model, block_size "
                                 "and KV dtype).")


class SharedKVRegion:
    """This engine's KV cache region and the handle a peer opens it with."""

    __slots__ = ("layout", "tensor", "_fd", "_mmap", "_handle")

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self._fd: int | None = None
        self._mmap: mmap.mmap | None = None
        if device.type == "cuda":
            self.tensor = torch.zeros(layout.shape, dtype=layout.torch_dtype, device=device)
            self._handle = _cuda_handle(self.tensor)
        elif device.type == "cpu":
            self._fd = os.memfd_create("twinserve-kv")
            os.ftruncate(self._fd, layout.nbytes)  # zero-filled, as torch.zeros
            self._mmap = mmap.mmap(self._fd, layout.nbytes, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
            self.tensor = torch.frombuffer(self._mmap, dtype=layout.torch_dtype).view(layout.shape)
            self._handle = {"kind": "memfd", "pid": os.getpid(), "fd": self._fd}
        else:
            raise ValueError(f"device: the KV region cannot be shared on {device.type!r}.")

    def slots(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (keys, values) pair per slot: views of the region (``KVCache``'s ``gpu_slots``)."""
        return [(self.tensor[s, 0], self.tensor[s, 1]) for s in range(self.layout.num_slots)]

    def handle(self) -> dict[str, Any]:
        """JSON a peer on this machine opens the region with (``attach``)."""
        return {**self._handle, "boot_id": boot_id(), "layout": self.layout.to_dict()}

    def close(self) -> None:
        """Drops this process's mapping (the views must be gone: callers drop the cache first)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def attach(handle: dict[str, Any], device: torch.device) -> torch.Tensor:
    """A peer's region, read-only where the platform allows (CPU: a PROT_READ mapping)."""
    if handle.get("boot_id") != boot_id():
        raise ValueError("remote_host: the peer engine runs on another machine; the "
                         "PeerConnector moves blocks between processes of one machine.")
    layout = KVLayout.from_dict(handle["layout"])
    if handle["kind"] == "memfd":
        fd = os.open(f"/proc/{int(handle['pid'])}/fd/{int(handle['fd'])}", os.O_RDONLY)
        try:
            mapped = mmap.mmap(fd, layout.nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # a read-only buffer: torch warns that it is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mapped, dtype=layout.torch_dtype).view(layout.shape)
    if handle["kind"] == "cuda_ipc":
        return _open_cuda_handle(handle, layout, device)
    raise ValueError(f"unknown KV region handle kind {handle['kind']!r}.")


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor,
                dst_ids: list[int]) -> None:
    """``dst``'s blocks ``dst_ids`` := ``src``'s blocks ``src_ids`` (every slot, keys and values)."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"remote_block_ids: {len(src_ids)} remote blocks for {len(dst_ids)} "
                         "local blocks.")
    if not src_ids:
        return
    index = torch.tensor(src_ids, dtype=torch.long, device=src.device)
    rows = src.index_select(2, index)
    dst[:, :, torch.tensor(dst_ids, dtype=torch.long, device=dst.device)] = rows.to(dst.device)


def _cuda_handle(tensor: torch.Tensor) -> dict[str, Any]:
    storage = tensor.untyped_storage()
    (device, ipc, size, offset, ref_handle, ref_offset, event, event_sync) = storage._share_cuda_()
    return {"kind": "cuda_ipc", "device": int(device), "ipc": _b64(ipc), "size": int(size),
            "offset": int(offset), "ref_handle": _b64(ref_handle), "ref_offset": int(ref_offset),
            "event": _b64(event), "event_sync": bool(event_sync)}


def _open_cuda_handle(handle: dict[str, Any], layout: KVLayout,
                      device: torch.device) -> torch.Tensor:
    with torch.cuda.device(device):
        storage = torch.UntypedStorage._new_shared_cuda(
            handle["device"], base64.b64decode(handle["ipc"]), handle["size"], handle["offset"],
            base64.b64decode(handle["ref_handle"]), handle["ref_offset"],
            base64.b64decode(handle["event"]), handle["event_sync"])
        flat = torch.empty(0, dtype=layout.torch_dtype, device=device)
        flat.set_(storage, 0, (layout.nbytes // flat.element_size(),))
    return flat.view(layout.shape)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
