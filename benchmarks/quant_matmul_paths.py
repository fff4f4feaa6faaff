"""The three CPU products of a quantized weight side by side, at the bundled model's shapes
(SmolLM2-135M: q/k/v 960 x 576, gate/up 3072 x 576, down 576 x 1536; Q4_1 blocks, the LM head's
Q8_0 49152 x 576): the kernel with int8 activations (``csrc/quant_q8.h``: one token streams each
row once, two and more run the tiled int8 GEMM), the direct kernel with fp32 activations
(``csrc/quant_blocks.h``), and dequantize-then-GEMM (``QuantTensor.matmul`` for prompts above
``DIRECT_MAX_TOKENS`` rows: the weight decoded 1024 rows at a time, then torch's fp32 GEMM).

Q4_0/Q4_1 weights also run the int8 product on their 8-row packed copy (``csrc/quant_packed.h``,
what the fused decode step streams): "int8 packed"; the ratios are to "int8 direct" (the file's rows).

Interleaved rounds (every path once per round, in turn), median per path, and each path's time
as a ratio to the int8 one; GMAC/s = multiply-adds per second.

    python -m twinserve.benchmarks.quant_matmul_paths [--tokens 1 4 16 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

SHAPES = {"qkv Q4_1": ("Q4_1", 960, 576), "gate_up Q4_1": ("Q4_1", 3072, 576),
          "down Q4_1": ("Q4_1", 576, 1536), "lm_head Q8_0": ("Q8_0", 49152, 576)}


def weight(fmt_name: str, rows: int, k: int):
    import gguf

    from twinserve.gpu.quantization.formats import GGUF_FORMATS
    from twinserve.gpu.quantization.quant_tensor import QuantTensor
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((rows, k)).astype(np.float32)
    data = gguf.quants.quantize(dense, gguf.GGMLQuantizationType[fmt_name])
    return QuantTensor(GGUF_FORMATS[fmt_name], torch.from_numpy(np.ascontiguousarray(data)), k)


def paths(qt, x: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    from twinserve.gpu.quantization import cpu_kernel
    fmt = qt.fmt.fmt_id

    def tiled() -> torch.Tensor:
        out = x.new_empty(x.shape[0], qt.rows)
        for start in range(0, qt.rows, 1024):
            tile = qt.dequantize(torch.arange(start, min(start + 1024, qt.rows)))
            torch.mm(x, tile.t(), out=out[:, start:start + tile.shape[0]])
        return out
    fns = {"int8 direct": lambda: cpu_kernel.quant_matmul_q8(x, qt.data, fmt)}
    if fmt in cpu_kernel.PACKED_IDS:
        packed = cpu_kernel.quant_pack(qt.data, fmt, qt.in_features)
        fns["int8 packed"] = lambda: cpu_kernel.quant_matmul_q8_packed(x, packed, fmt, qt.rows)
    return {**fns,
            "fp32 direct": lambda: cpu_kernel.quant_matmul(x, qt.data, qt.row_scale, fmt, 0),
            "dequant+GEMM": tiled}


def measure(fns: dict[str, Callable[[], torch.Tensor]], rounds: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'shape':14s} {'T':>3s}  " + "  ".join(f"{p:>26s}" for p in
                                                  ("int8 direct", "int8 packed", "fp32 direct",
                                                   "dequant+GEMM")))
    for label, (fmt, rows, k) in SHAPES.items():
        qt = weight(fmt, rows, k)
        for tokens in args.tokens:
            x = torch.randn(tokens, k)
            med = measure(paths(qt, x), args.rounds)
            base = med["int8 direct"]
            cells = [f"{t * 1e3:8.3f} ms {rows * k * tokens / t / 1e9:5.1f} GMAC/s {t / base:4.2f}x"
                     for t in med.values()]
            if "int8 packed" not in med:
                cells.insert(1, "-")
            print(f"{label:14s} {tokens:3d}  " + "  ".join(f"{c:>26s}" for c in cells))


if __name__ == "__main__":
    main()
