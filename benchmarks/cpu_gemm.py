"""The decoder's weight products on this CPU: torch's ``F.linear`` against ``gpu.cpu_gemm.Gemm``.

    python -m twinserve.benchmarks.cpu_gemm [--model DIR] [--tokens 1 2 4 8 64] [--threads 2]

For each dtype (float32, bfloat16) and number of tokens T, times every weight product of one forward
pass of the model (q/k/v, o, gate/up, down for each layer, and the LM head) and prints milliseconds
(median of ``--repeats``) for both paths and their ratio. No KV cache and no attention: the products
alone, which is what ``cpu_gemm`` chooses between.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from twinserve.gpu.default_model import default_model_path
from twinserve.gpu.model_loader import load_model

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def weight_shapes(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights one forward multiplies by, in order (the head once)."""
    weights = []
    for layer in model.layers:
        weights += [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
    return weights + [model.embed_tokens if model.lm_head is None else model.lm_head]


def time_products(product: Product, weights: Sequence[torch.Tensor], tokens: int,
                  repeats: int) -> float:
    """Median milliseconds of one pass of ``product`` over ``weights`` with ``tokens`` rows."""
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1]).to(w.dtype) for w in weights}
    for w in weights:  # warm-up
        product(inputs[w.shape[1]], w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            product(inputs[w.shape[1]], w)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_path()
    print(f"{'dtype':10s}{'T':>5s}{'F.linear ms':>13s}{'Gemm ms':>10s}{'speed-up':>10s}")
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(model_dir, dtype, torch.device("cpu"), max_positions=256)
        weights = weight_shapes(model)
        with torch.inference_mode():
            for tokens in args.tokens:
                plain = time_products(F.linear, weights, tokens, args.repeats)
                ours = time_products(model.gemm.linear, weights, tokens, args.repeats)
                print(f"{str(dtype).removeprefix('torch.'):10s}{tokens:5d}{plain:13.1f}{ours:10.1f}"
                      f"{plain / ours:10.2f}")
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
