"""Per-step attention inputs and the choice of kernels (torch on CPU, Triton on CUDA)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from twinserve.gpu.kernels.cpu_decode_kernel import PagedDecode, load_paged_decode
from twinserve.gpu.layers import attention as torch_attention


@dataclass(slots=True)
class AttentionMetadata:
    """One step's flattened batch layout (see ``attention.py``): ``slot_mapping[T]`` int64,
    ``block_tables[B, M]`` int32, ``seq_lens[B]`` int32 (context after this step),
    ``query_start_loc[B + 1]`` int32. ``max_query_len``/``max_seq_len`` are host copies (the
    Triton path needs no device sync then); ``plans`` are the torch path's precomputed gathers,
    one per attention window of the model's layers (None: full attention).

    A hybrid KV layout (``core/kv_cache_groups.py``) gives each KV cache group its own block
    table, hence its own slot mapping: ``groups[g]`` is group g's metadata (sharing ``seq_lens``
    and ``query_start_loc``), ``group_windows[g]`` its window, ``layer_groups[i]`` decoder layer
    i's group; this object's own tables are group 0's. One group: all three empty."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int = 0
    max_seq_len: int = 0
    plans: dict[int | None, torch_attention.AttentionPlan] = field(default_factory=dict)
    groups: tuple[AttentionMetadata, ...] = ()
    group_windows: tuple[int | None, ...] = ()
    layer_groups: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata decoder layer ``layer`` attends with (its group's)."""
        return self.groups[self.layer_groups[layer]] if self.groups else self


class AttentionBackend:
    """Writes KV and attends; one instance per model, chosen by device. No shared state.
    ``windows``: the attention windows of the model's layers (None: full attention);
    ``cpu_attention``: the engine argument choosing the CPU decode kernel (native or torch)."""

    __slots__ = ("write_kv_cache", "_paged_attention", "use_plan", "decode_kernel", "windows")

    def __init__(self, device: torch.device, windows: Iterable[int | None] = (None,),
                 cpu_attention: str = "native") -> None:
        self.write_kv_cache: Callable[..., None]
        self._paged_attention: Callable[..., torch.Tensor]
        self.decode_kernel: PagedDecode | None = None
        self.windows = tuple(sorted(set(windows), key=lambda w: -1 if w is None else w))
        if device.type == "cuda":
            from twinserve.gpu.kernels import triton_attention  # lazy: Triton only where it runs
            self.write_kv_cache = triton_attention.write_kv_cache
            self._paged_attention = triton_attention.paged_attention
            self.use_plan = False
        else:
            self.write_kv_cache = torch_attention.write_kv_cache
            self._paged_attention = torch_attention.paged_attention
            self.use_plan = True
            self.decode_kernel = load_paged_decode(cpu_attention)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Precompute what every layer reuses (the torch path's gather indices): one plan per
        window, or with KV cache groups one per group, for its window."""
        if not self.use_plan:
            return
        if not meta.groups:
            meta.plans = {window: self._plan(meta, block_size, window) for window in self.windows}
            return
        for group, window in zip(meta.groups, meta.group_windows):
            group.plans = {window: self._plan(group, block_size, window)}

    def _plan(self, meta: AttentionMetadata, block_size: int,
              window: int | None) -> torch_attention.AttentionPlan:
        return torch_attention.plan_attention(meta.block_tables, meta.seq_lens,
                                              meta.query_start_loc, block_size,
                                              self.decode_kernel, window)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        plan = meta.plans.get(window)
        if plan is not None:
            return torch_attention.planned_attention(query, key_cache, value_cache, plan,
                                                     scale, softcap)
        if window is None and softcap is None:
            return self._paged_attention(query, key_cache, value_cache, meta.block_tables,
                                         meta.seq_lens, meta.query_start_loc, scale,
                                         max_query_len=meta.max_query_len,
                                         max_seq_len=meta.max_seq_len)
        return self._paged_attention(query, key_cache, value_cache, meta.block_tables,
                                     meta.seq_lens, meta.query_start_loc, scale,
                                     max_query_len=meta.max_query_len,
                                     max_seq_len=meta.max_seq_len, window=window,
                                     softcap=softcap)
