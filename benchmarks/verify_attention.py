"""A verification's attention on the CPU: 1 + k queries over a context served as one masked
chunk or as rows of the native decode kernel (``core.kernel_settings.rows_as_decodes``), against
a single decode, at the bundled model's shapes (9 query heads, 3 KV heads, head dim 64), bf16,
30 layers' worth of calls. Each figure is the fastest of ``--repeats`` timings, so that other
work on a shared host inflates it least.

    python -m twinserve.benchmarks.verify_attention [--contexts 100 300 1000] [--queries 2 5 9 17]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch

from twinserve.core.kernel_settings import rows_as_decodes
from twinserve.gpu.kernels.cpu_decode_kernel import PagedDecode, build_paged_decode
from twinserve.gpu.layers import attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30


def fastest_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(LAYERS):
            fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def chunk_plan(tables: torch.Tensor, context: int, queries: int) -> attention.AttentionPlan:
    """The plan of one chunk of 2+ queries run as the masked chunk (planned without the kernel,
    which is what routes short chunks to decode rows)."""
    return attention.plan_attention(tables, torch.tensor([context], dtype=torch.int32),
                                    torch.tensor([0, queries], dtype=torch.int32), BLOCK_SIZE)


def rows_plan(tables: torch.Tensor, context: int, queries: int,
              kernel: PagedDecode) -> attention.AttentionPlan:
    """The plan of one chunk run as decode rows, whatever ``rows_as_decodes`` says."""
    lens = torch.arange(context - queries + 1, context + 1, dtype=torch.int32)
    return attention.AttentionPlan(torch.arange(queries), None, None, [], kernel,
                                   tables.expand(queries, -1).contiguous(), lens)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[100, 300, 1000])
    p.add_argument("--queries", type=int, nargs="+", default=[2, 5, 9, 17],
                   help="queries per chunk (2 or more)")
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.queries) < 2:
        p.error("--queries: a chunk has 2 or more queries")
    torch.set_num_threads(args.threads)
    kernel = build_paged_decode()
    blocks = -(-max(args.contexts) // BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    shape = (blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(shape, generator=gen).to(torch.bfloat16)
    print(f"ms per {LAYERS} layers (fastest of {args.repeats}); rows_as_decodes: what the engine runs")
    print(f"{'context':>7} {'queries':>7} {'chunk':>8} {'rows':>8} {'1 decode':>9} {'engine':>8}")
    for context in args.contexts:
        tables = torch.arange(-(-context // BLOCK_SIZE), dtype=torch.int32)[None]
        for queries in args.queries:
            query = torch.randn(queries, HEADS, HEAD_DIM, generator=gen).to(torch.bfloat16)
            times = []
            for plan, q in ((chunk_plan(tables, context, queries), query),
                            (rows_plan(tables, context, queries, kernel), query),
                            (rows_plan(tables, context, 1, kernel), query[:1])):
                times.append(fastest_ms(lambda plan=plan, q=q: attention.planned_attention(
                    q, key_cache, value_cache, plan, HEAD_DIM ** -0.5), args.repeats))
            engine = "rows" if rows_as_decodes(queries, context) else "chunk"
            print(f"{context:7} {queries:7} {times[0]:8.2f} {times[1]:8.2f} {times[2]:9.2f} "
                  f"{engine:>8}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
