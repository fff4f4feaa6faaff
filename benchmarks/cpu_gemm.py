"""The decoder's weight products on this CPU: torch's ``F.linear`` against ``gpu.cpu_gemm.Gemm``.

    python -m twinserve.benchmarks.cpu_gemm [--model DIR] [--tokens 1 2 4 8 15 16 63 64] \\
        [--threads 2]

For each dtype (float32, bfloat16) and number of tokens T, times every weight product of one forward
pass of the model (q/k/v, o, gate/up, down for each layer, and the LM head) and prints milliseconds
(median of ``--repeats``, the paths interleaved within each repeat) for torch's path, ``Gemm``'s
slabs without padding the tokens and ``Gemm`` as the model runs it (plain ``F.linear`` for half
weights the CPU multiplies natively), with the speed-ups of the last over the others. No KV
cache and no attention: the products alone, which is what ``cpu_gemm`` chooses between.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from twinserve.gpu.models.default_model import default_model_path
from twinserve.gpu.models.model_loader import load_model

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def weight_shapes(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights one forward multiplies by, in order (the head once)."""
    weights = []
    for layer in model.layers:
        weights += [layer.qkv_proj.weight, layer.o_proj.weight, layer.gate_up_proj.weight,
                    layer.down_proj.weight]
    return weights + [model.embed_tokens if model.lm_head is None else model.lm_head]


def time_products(products: Sequence[Product], weights: Sequence[torch.Tensor], tokens: int,
                  repeats: int) -> list[float]:
    """Per product, median milliseconds of one pass over ``weights`` with ``tokens`` rows."""
    inputs = {w.shape[1]: torch.randn(tokens, w.shape[1]).to(w.dtype) for w in weights}
    times: list[list[float]] = [[] for _ in products]
    for repeat in range(repeats + 1):  # the first is a warm-up
        for product, samples in zip(products, times):
            start = time.perf_counter()
            for w in weights:
                product(inputs[w.shape[1]], w)
            if repeat:
                samples.append(time.perf_counter() - start)
    return [statistics.median(samples) * 1e3 for samples in times]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: the bundled model)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 15, 16, 63, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model_path()
    print(f"{'dtype':10s}{'T':>5s}{'F.linear ms':>13s}{'unpadded ms':>13s}{'Gemm ms':>10s}"
          f"{'vs F.linear':>13s}{'vs unpadded':>13s}")
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(model_dir, dtype, torch.device("cpu"), max_positions=256)
        weights = weight_shapes(model)
        unpadded = dataclasses.replace(model.gemm, slabs=True, pad_tokens=False)
        with torch.inference_mode():
            for tokens in args.tokens:
                plain, flat, ours = time_products(
                    [F.linear, unpadded.linear, model.gemm.linear], weights, tokens, args.repeats)
                print(f"{str(dtype).removeprefix('torch.'):10s}{tokens:5d}{plain:13.1f}{flat:13.1f}"
                      f"{ours:10.1f}{plain / ours:13.2f}{flat / ours:13.2f}")
        del model
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
