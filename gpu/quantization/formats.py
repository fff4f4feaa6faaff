"""The quantized weight formats the CPU kernel (``gpu/kernels/csrc/quant_matmul.cpp``) and the Triton
kernel read, with their block geometry. A weight is ``[rows, row_bytes]`` bytes, each row
``in_features / values`` blocks of ``block_bytes``; rows are independent, so fused projections
stack their rows and a permutation of output rows is a permutation of byte rows."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QuantFormat:
    """``fmt_id``: the kernels' id; ``values``/``block_bytes``: one block; ``row_scaled``: one
    fp32 scale per output row multiplies the decoded values (int8, fp8)."""

    name: str
    fmt_id: int
    values: int
    block_bytes: int
    row_scaled: bool = False

    def row_bytes(self, in_features: int) -> int:
        if in_features % self.values:
            raise ValueError(f"{self.name}: input size {in_features} is not a multiple of the "
                             f"block size {self.values}.")
        return in_features // self.values * self.block_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.values


Q8_0 = QuantFormat("Q8_0", 0, 32, 34)
Q4_0 = QuantFormat("Q4_0", 1, 32, 18)
Q4_1 = QuantFormat("Q4_1", 2, 32, 20)
Q4_K = QuantFormat("Q4_K", 3, 256, 144)
Q6_K = QuantFormat("Q6_K", 4, 256, 210)
I8 = QuantFormat("int8", 5, 32, 32, row_scaled=True)
F8 = QuantFormat("fp8_e4m3", 6, 32, 32, row_scaled=True)
GGUF_FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K)}
U4_GROUPS = (32, 64, 128)


def u4(group: int) -> QuantFormat:
    """GPTQ/AWQ 4-bit repacked: per group fp32 scale, fp32 min, ``group / 2`` nibble bytes."""
    if group not in U4_GROUPS:
        raise ValueError(f"4-bit group_size must be one of {', '.join(map(str, U4_GROUPS))}, "
                         f"got {group}.")
    return QuantFormat(f"u4g{group}", 7, group, 8 + group // 2)
