"""The batched LoRA product, Punica's way: one step mixes base-model rows and rows of up to
``max_loras`` adapters, and each projection adds ``B (A x)`` for every adapter's rows at once.

``LoRABatch`` is the step's grouping of the flattened rows by device slot (one segment per
adapter; rows of base-model requests are in no segment). ``LinearLoRA`` holds one engine linear
layer's adapter weights per slot and adds the deltas:

- CPU (torch): per segment, one shrink ``x[rows] @ A_slot.T`` over all the projections the layer
  fuses (q/k/v, gate/up: their A's stacked) and one expand by their B's block-diagonal, in
  float32, with the adapter's own rank (no padding to ``max_lora_rank``);
- CUDA: the Triton SGMV kernels (``gpu/kernels/triton_lora.py``) over slot-stacked weights padded to
  ``max_lora_rank``, one shrink and one expand per projection for all segments.

Weights are never merged into the base weight; the layer's ``quant_method`` is wrapped
(``LoRALinearMethod``), so the base product is whatever it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from twinserve.gpu.layers.linear import LinearBase, LinearMethodBase


@dataclass(slots=True)
class LoRASegment:
    """The rows of one adapter in the flattened batch: ``rows`` (sorted indices) or, when they
    are contiguous, ``[start, end)`` with ``rows`` None."""

    slot: int
    start: int
    end: int
    rows: torch.Tensor | None


@dataclass(slots=True)
class LoRABatch:
    """A step's rows grouped by adapter slot, and the same as the kernels' segment arrays."""

    segments: list[LoRASegment]
    sorted_rows: torch.Tensor  # int32 [M]
    seg_start: torch.Tensor  # int32 [L + 1]
    seg_slot: torch.Tensor  # int32 [L]
    max_seg_len: int
    stacked: StackedRows | None = None  # CPU, 3+ segments of similar lengths: batched products

    @classmethod
    def build(cls, row_ranges: list[tuple[int, int, int]], device: torch.device) -> LoRABatch:
        """``row_ranges``: ``(slot, start, end)`` per scheduled request with an adapter, in batch
        order."""
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, start, end in row_ranges:
            by_slot.setdefault(slot, []).append((start, end))
        segments, flat, starts = [], [], [0]
        for slot, ranges in by_slot.items():
            rows = torch.cat([torch.arange(s, e) for s, e in ranges])
            contiguous = all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            first, last = ranges[0][0], ranges[-1][1]
            segments.append(LoRASegment(slot, first, last,
                                        None if contiguous else rows.to(device)))
            flat.append(rows)
            starts.append(starts[-1] + rows.numel())
        sorted_rows = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long)
        lengths = [e - s for e, s in zip(starts[1:], starts)]
        return cls(segments, sorted_rows.to(device=device, dtype=torch.int32),
                   torch.tensor(starts, dtype=torch.int32, device=device),
                   torch.tensor(list(by_slot), dtype=torch.int32, device=device),
                   max(lengths, default=0),
                   StackedRows.build(flat, list(by_slot)) if device.type == "cpu" else None)


@dataclass(slots=True)
class StackedRows:
    """The segments padded to one length ``m`` for batched (``torch.bmm``) products on a CPU:
    one shrink and one expand per projection for all adapters, where a loop over segments costs
    a handful of small calls per adapter. ``rows[L * m]`` are the rows of x (padding: row 0),
    ``valid`` the positions holding real rows, ``slots`` the segments' slots (``first_slot`` when
    they are consecutive: the weights are then a view). ``uniform``: the segments are
    consecutive slices of equal length starting at row ``start`` (no gather, no scatter)."""

    m: int
    rows: torch.Tensor
    valid: torch.Tensor
    valid_rows: torch.Tensor
    slots: torch.Tensor
    first_slot: int | None
    uniform: bool
    start: int

    MIN_SEGMENTS = 3

    @classmethod
    def build(cls, flat: list[torch.Tensor], slots: list[int]) -> StackedRows | None:
        """None for fewer than ``MIN_SEGMENTS`` segments, or when padding would more than
        double the rows (a prefill chunk among decodes: the loop is cheaper)."""
        if len(flat) < cls.MIN_SEGMENTS:
            return None
        m = max(r.numel() for r in flat)
        total = sum(r.numel() for r in flat)
        if len(flat) * m > 2 * total:
            return None
        padded = torch.zeros(len(flat), m, dtype=torch.long)
        mask = torch.zeros(len(flat), m, dtype=torch.bool)
        for g, r in enumerate(flat):
            padded[g, :r.numel()] = r
            mask[g, :r.numel()] = True
        rows, valid = padded.view(-1), mask.view(-1).nonzero().view(-1)
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        start = int(flat[0][0])
        uniform = total == len(flat) * m and bool(
            (rows == torch.arange(start, start + total)).all())
        return cls(m, rows, valid, rows[valid], torch.tensor(slots),
                   slots[0] if consecutive else None, uniform, start)


@dataclass(slots=True)
class LoRAContext:
    """What every wrapped layer of one model reads: the current step's batch (None: no
    adapter rows this step)."""

    batch: LoRABatch | None = None


@dataclass(slots=True)
class _SlotWeights:
    """One adapter's weights in one layer (CPU path): ``a`` stacks the A's of the targeted
    projections ``[n r, in]``; ``b`` is their B's block-diagonal ``[out, n r]`` (zero rows for
    the projections it does not target), so a segment costs one shrink and one expand."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(slots=True)
class LinearLoRA:
    """Adapter weights of one engine linear layer, per device slot. ``shards``: the HF
    projection names the layer fuses, with their output column offset and size."""

    shards: list[tuple[str, int, int]]
    input_size: int
    max_loras: int
    max_rank: int
    dtype: torch.dtype
    device: torch.device
    use_triton: bool
    # CPU: keep slot-stacked copies for the batched products of 3+ adapters (the manager turns
    # this off when those copies would be large: they duplicate every resident adapter, padded)
    stacked: bool = True
    slots: list[_SlotWeights | None] = field(default_factory=list)
    stacked_a: list[torch.Tensor] = field(default_factory=list)  # Triton: per shard [S, R, in]
    stacked_b: list[torch.Tensor] = field(default_factory=list)  # Triton: per shard [S, n, R]
    _compute_dtype: torch.dtype = field(init=False, default=torch.float32)
    # CPU, for StackedRows: every slot's ``a`` and block-diagonal ``b`` padded to the layer's
    # widest stack (all shards at max_rank), zeros beyond an adapter's own
    _cpu_a: torch.Tensor | None = field(init=False, default=None)  # [S, n R, in]
    _cpu_b: torch.Tensor | None = field(init=False, default=None)  # [S, out, n R]

    def __post_init__(self) -> None:
        self.slots = [None] * self.max_loras
        # CPU: the small LoRA products in float32 (torch's half matmuls on a CPU without native
        # half units are several times slower than float32 ones; the rank keeps them small).
        self._compute_dtype = (torch.float32 if self.device.type == "cpu" and not self.use_triton
                               else self.dtype)
        if self.stacked and not self.use_triton and self.max_loras >= StackedRows.MIN_SEGMENTS:
            width = len(self.shards) * self.max_rank
            out_size = sum(size for _, _, size in self.shards)
            to = {"dtype": self._compute_dtype, "device": self.device}
            self._cpu_a = torch.zeros(self.max_loras, width, self.input_size, **to)
            self._cpu_b = torch.zeros(self.max_loras, out_size, width, **to)
        if self.use_triton:
            S, R = self.max_loras, self.max_rank
            self.stacked_a = [torch.zeros(S, R, self.input_size, dtype=self.dtype,
                                          device=self.device) for _ in self.shards]
            self.stacked_b = [torch.zeros(S, size, R, dtype=self.dtype, device=self.device)
                              for _, _, size in self.shards]

    def set_slot(self, slot: int, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                 rank: int) -> None:
        """Loads one adapter's ``module -> (A, B scaled)`` for this layer into ``slot`` (an
        adapter that targets none of the layer's projections leaves the slot empty)."""
        targeted = [(k, name, off, size) for k, (name, off, size) in enumerate(self.shards)
                    if name in pairs]
        if self.use_triton:
            for k in range(len(self.shards)):
                self.stacked_a[k][slot].zero_()
                self.stacked_b[k][slot].zero_()
            for k, name, _, _ in targeted:
                a, b = pairs[name]
                self.stacked_a[k][slot, :rank].copy_(a)
                self.stacked_b[k][slot, :, :rank].copy_(b)
            return  # the kernels read only the stacked weights
        if self._cpu_a is not None and self._cpu_b is not None:
            self._cpu_a[slot].zero_()
            self._cpu_b[slot].zero_()
        if not targeted:
            self.slots[slot] = None
            return
        to = {"dtype": self._compute_dtype, "device": self.device}
        a = torch.cat([pairs[name][0] for _, name, _, _ in targeted]).to(**to).contiguous()
        out_size = sum(size for _, _, size in self.shards)
        b = torch.zeros(out_size, len(targeted) * rank, **to)
        for k, (_, name, off, size) in enumerate(targeted):
            b[off:off + size, k * rank:(k + 1) * rank] = pairs[name][1]
        self.slots[slot] = _SlotWeights(a, b)
        if self._cpu_a is not None and self._cpu_b is not None:
            self._cpu_a[slot, :a.shape[0]] = a
            self._cpu_b[slot, :, :a.shape[0]] = b

    def add_deltas(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch,
                   feature_major: bool = False) -> None:
        """``out[t] += B_slot(A_slot x[t])`` for every row in a segment; ``out`` is ``[T, out]``
        (any strides), or ``[out, T]`` with ``feature_major`` (the CPU MLP layout: the deltas
        are then computed feature-major too, so the adds run along contiguous rows)."""
        if self.use_triton:
            self._add_deltas_triton(x, out.t() if feature_major else out, batch)
            return
        dim = 1 if feature_major else 0  # the token dimension of ``out``
        if batch.stacked is not None and self._cpu_a is not None:
            self._add_deltas_stacked(x, out, batch.stacked, dim)
            return
        for seg in batch.segments:
            weights = self.slots[seg.slot]
            if weights is None:
                continue
            rows = seg.rows
            xs = x[seg.start:seg.end] if rows is None else x.index_select(0, rows)
            xs = xs.to(self._compute_dtype)
            # The expand's FLOPs are T x out x n r (n <= 3 projections): the block-diagonal
            # product wastes a little of tiny work to save two calls per layer.
            if feature_major:
                delta = (weights.b @ (weights.a @ xs.t())).to(out.dtype)  # [out, t]
            else:
                delta = F.linear(F.linear(xs, weights.a), weights.b).to(out.dtype)  # [t, out]
            if rows is None:
                out.narrow(dim, seg.start, seg.end - seg.start).add_(delta)
            else:
                out.index_add_(dim, rows, delta)

    def _add_deltas_stacked(self, x: torch.Tensor, out: torch.Tensor, st: StackedRows,
                            dim: int) -> None:
        assert self._cpu_a is not None and self._cpu_b is not None
        num = st.slots.numel()
        if st.first_slot is not None:
            a, b = (w[st.first_slot:st.first_slot + num] for w in (self._cpu_a, self._cpu_b))
        else:
            a, b = self._cpu_a.index_select(0, st.slots), self._cpu_b.index_select(0, st.slots)
        if st.uniform:
            xs = x.narrow(0, st.start, num * st.m)
        else:
            xs = x.index_select(0, st.rows)
        xs = xs.to(self._compute_dtype).reshape(num, st.m, -1)
        delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2))  # [L, m, out]
        delta = delta.reshape(num * st.m, -1).to(out.dtype)
        if dim == 1:
            delta = delta.t()
        if st.uniform:
            out.narrow(dim, st.start, num * st.m).add_(delta)
        else:
            out.index_add_(dim, st.valid_rows, delta.index_select(dim, st.valid))

    def _add_deltas_triton(self, x: torch.Tensor, out: torch.Tensor, batch: LoRABatch) -> None:
        from twinserve.gpu.kernels.triton_lora import lora_expand, lora_shrink
        seg = (batch.sorted_rows, batch.seg_start, batch.seg_slot, batch.max_seg_len)
        for k, (_, off, size) in enumerate(self.shards):
            h = lora_shrink(x, self.stacked_a[k], *seg)
            lora_expand(h, self.stacked_b[k], *seg, out[:, off:off + size])


class LoRALinearMethod(LinearMethodBase):
    """``base`` (the layer's own method) plus the step's LoRA deltas."""

    def __init__(self, base: LinearMethodBase, lora: LinearLoRA, context: LoRAContext) -> None:
        self.base, self.lora, self.context = base, lora, context

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, bias: bool,
                       dtype: torch.dtype, device: torch.device) -> None:
        self.base.create_weights(layer, input_size, output_size, bias, dtype, device)

    def apply(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply(layer, x)
        batch = self.context.batch
        if batch is not None:
            self.lora.add_deltas(x, out, batch)
        return out

    def apply_feature_major(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor:
        out = self.base.apply_feature_major(layer, x)
        batch = self.context.batch
        if batch is not None:
            self.lora.add_deltas(x, out, batch, feature_major=True)
        return out
