"""KV cache groups: which layers share a block table, and how many layers a block spans.

A model whose layers all attend alike (all full, or all within one window) has one group: every
layer uses the request's one block table, and a block holds ``num_layers`` layers' KV. A model
with mixed layers (Gemma 2's alternating local/global layers, Gemma 3's 5:1) gets vLLM's hybrid
layout (``_get_kv_cache_groups_uniform_page_size``): layers of one kind are split into groups of
equal size, each group with its own block table per request, and all groups draw from one pool
of equally sized blocks::

    Gemma 3, 12 layers (10 sliding, 2 full): group size 2, so 5 sliding groups + 1 full group
      group 0 (full)     layers 5, 11   <- table: every block of the sequence
      group 1 (sliding)  layers 0, 6    <- table: null ... null  b7 b9  (the window only)
      ...
      group 5 (sliding)  layers 4, 10
    a block id is one block in each of 2 "slot" tensors; slot j holds layer j of every group

Why one pool with one page size (vLLM's choice, kept): memory moves freely between the groups as
requests come and go (a short request uses as many sliding blocks as full ones, a long one far
fewer); nothing is split ahead of time that a workload could make wrong; prefix-cache eviction
stays one LRU order; and the kernels keep one ``[num_blocks, block_size, heads, dim]`` tensor per
slot. The cost is padding when a kind's layer count is not a multiple of the group size (Gemma 3
27B: 52 sliding layers in 6 groups of 10 slots, 8 slots unused per block, ~13% of the blocks'
bytes), and one block table per group.

Group size: the fewest layers of any kind, or the most when the counts are within 1.5x of each
other (12 sliding + 13 full -> 13, one padded slot instead of 12 more); a kind's layers go to its
groups round-robin (``layers[i::num_groups]``), as vLLM assigns them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class KVCacheLayout:
    """``group_windows[g]``: group g's attention window (None: full attention);
    ``group_layers[g]``: its decoder layers; ``slots_per_block``: layers a block spans (the
    group size). Full-attention groups come first."""

    group_windows: tuple[int | None, ...]
    group_layers: tuple[tuple[int, ...], ...]
    slots_per_block: int

    def __post_init__(self) -> None:
        if not self.group_windows or len(self.group_windows) != len(self.group_layers):
            raise ValueError("a KV cache layout needs one window per group and at least one group.")
        if any(len(layers) > self.slots_per_block or not layers for layers in self.group_layers):
            raise ValueError(f"every group needs 1..{self.slots_per_block} layers.")
        for w in self.group_windows:
            if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
                raise ValueError(f"a group's window must be a positive integer or None, got {w!r}.")

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_layers(self) -> int:
        return sum(len(layers) for layers in self.group_layers)

    @property
    def layer_group(self) -> tuple[int, ...]:
        """The group of each decoder layer."""
        return self._per_layer(lambda g, _: g)

    @property
    def layer_slot(self) -> tuple[int, ...]:
        """The slot tensor each decoder layer's KV lives in (its place within its group)."""
        return self._per_layer(lambda _, j: j)

    def _per_layer(self, pick) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g, layers in enumerate(self.group_layers):
            for j, layer in enumerate(layers):
                out[layer] = pick(g, j)
        return tuple(out)


def kv_cache_layout(layer_windows: Sequence[int | None]) -> KVCacheLayout:
    """The groups of a model whose decoder layer i attends within ``layer_windows[i]`` tokens
    (None: the whole context)."""
    if not layer_windows:
        raise ValueError("a model needs at least one layer.")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        ((window, layers),) = kinds.items()
        return KVCacheLayout((window,), (tuple(layers),), len(layers))
    counts = [len(layers) for layers in kinds.values()]
    size = max(counts) if max(counts) < 1.5 * min(counts) else min(counts)
    windows: list[int | None] = []
    groups: list[tuple[int, ...]] = []
    # full attention first, then windows in increasing order
    for window in sorted(kinds, key=lambda w: -1 if w is None else w):
        layers = kinds[window]
        num = -(-len(layers) // size)
        for i in range(num):
            windows.append(window)
            groups.append(tuple(layers[i::num]))
    return KVCacheLayout(tuple(windows), tuple(groups), size)


def layout_for_model(num_layers: int, layer_window, disable_sliding_window: bool = False
                     ) -> KVCacheLayout:
    """The layout of a model given ``layer_window(i)`` (``ModelConfig.layer_window``); with
    ``disable_sliding_window`` every layer is full attention (one group)."""
    windows = [None if disable_sliding_window else layer_window(i) for i in range(num_layers)]
    return kv_cache_layout(windows)
