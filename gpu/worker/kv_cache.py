"""The paged KV cache: per-layer device tensors sized from a byte budget, plus a host pool for
swap preemption. Layout per layer (shared with the Triton kernels):
``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and again for values.

With a hybrid layout (``core/kv_cache_groups.py``: Gemma's mixed sliding and full layers) a block
spans one group's ``slots_per_block`` layers: there are that many tensor pairs ("slots"), and
layer i uses slot ``layout.layer_slot[i]``, shared with the layers of the same place in the other
groups. The groups' block tables never hold the same block at once (one pool), so they never
write the same rows. One group: one slot per layer, as without a layout."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from twinserve.core.kv_cache_groups import KVCacheLayout

GiB = 1 << 30


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        """Keys and values of one block across all layers."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def host_memory_available() -> int:
    """Bytes of physical memory currently available (what a CPU cache may at most take)."""
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class KVCache:
    """Device blocks ``gpu[layer] = (key_cache, value_cache)`` and host blocks ``cpu[layer]``
    (layers of one slot share their tensors); ``gpu_slots`` / ``cpu_slots``: each tensor pair
    once."""

    __slots__ = ("spec", "gpu", "cpu", "gpu_slots", "cpu_slots")

    def __init__(self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int,
                 device: torch.device, layout: KVCacheLayout | None = None,
                 shared_slots: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_gpu_blocks}: the KV "
                             "cache budget is smaller than one block.")
        if layout is not None and layout.num_layers != spec.num_layers:
            raise ValueError(f"the KV cache layout has {layout.num_layers} layers, the model "
                             f"{spec.num_layers}.")
        self.spec = spec
        num_slots = spec.num_layers if layout is None else layout.slots_per_block
        slot_of = range(spec.num_layers) if layout is None else layout.layer_slot
        # shared_slots: views of a region other processes read (gpu/kv_transfer)
        self.gpu_slots = shared_slots if shared_slots is not None else [
            self._alloc(num_gpu_blocks, device, False, torch.zeros) for _ in range(num_slots)]
        pin = device.type == "cuda"
        # The host pool is only read where a swap-out wrote: left unfilled, its pages are not
        # touched (nor resident, on a CPU host) until a swap uses them.
        self.cpu_slots = [self._alloc(num_cpu_blocks, torch.device("cpu"), pin, torch.empty)
                          for _ in range(num_slots)]
        self.gpu = [self.gpu_slots[slot] for slot in slot_of]
        self.cpu = [self.cpu_slots[slot] for slot in slot_of]

    def _alloc(self, num_blocks: int, device: torch.device, pin: bool,
               make=torch.zeros) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, *self.spec.block_shape)
        return (make(shape, dtype=self.spec.dtype, device=device, pin_memory=pin),
                make(shape, dtype=self.spec.dtype, device=device, pin_memory=pin))

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu[0][0].shape[0]

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu[0][0].shape[0]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``(device_block, host_block)`` pairs."""
        _copy(self.gpu_slots, self.cpu_slots, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: ``(host_block, device_block)`` pairs."""
        _copy(self.cpu_slots, self.gpu_slots, pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write inside the device pool: ``(src_block, dst_block)`` pairs."""
        _copy(self.gpu_slots, self.gpu_slots, pairs)


def _copy(src: list[tuple[torch.Tensor, torch.Tensor]],
          dst: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    if not pairs:
        return
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.long)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.long)
    # A copy into host memory blocks: a non-blocking one would return before the device had
    # written the gathered rows, and the host pool would take them unfinished (on an H200 a
    # swapped-in request then diverged from its greedy tokens). Host to device stays on the stream.
    non_blocking = dst[0][0].device.type != "cpu"
    for (src_k, src_v), (dst_k, dst_v) in zip(src, dst):
        s_ids, d_ids = src_ids.to(src_k.device), dst_ids.to(dst_k.device)
        dst_k[d_ids] = src_k[s_ids].to(dst_k.device, non_blocking=non_blocking)
        dst_v[d_ids] = src_v[s_ids].to(dst_v.device, non_blocking=non_blocking)
