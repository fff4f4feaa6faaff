"""The seed figures of LLM serving, reproduced in the twin beside the published claims.

    python -m twinserve.benchmarks.sim_seed_figures [--num-requests 1000] [--model llama-3-8b]
                                                    [--hardware h100-sxm]

1. Continuous batching against static batching (Orca, OSDI 2022; Anyscale's "continuous batching"
   post, 2023: 2-10x and more). Baseline: the ``static`` policy, same engine otherwise (paged KV,
   same cost model), at saturation (every request at t=0). Two settings: the Azure conversation
   trace with the default engine (256 sequences), and a decode-heavy workload with widely varied
   output lengths on a 32-sequence engine (the regime of those posts: memory-bound decode, idle
   slots).
2. Prefix caching against none on a long shared system prompt (vLLM / SGLang: 5-10x lower TTFT).
3. Chunked prefill against whole-prompt prefill (Sarathi-Serve, OSDI 2024; vLLM docs: higher
   throughput, +20-50% quoted, and far lower tail inter-token latency): Azure trace at saturation
   and at 3x its real rate; chunks of 512 tokens (``--chunk``) against a budget of
   ``max_model_len``. In this engine "chunking off" still mixes decodes into prefill steps (token-
   budget scheduling, as vLLM v1), so the throughput half of the claim, which measures against
   prefill-only steps that stall decodes, is not expected to show; the tail-latency half is.

Prints one detail row per run, then the summary table: figure, claim, measured ratio, setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from twinserve.simulator import SimConfig, simulate
from twinserve.traces import SyntheticConfig, TraceRequest, first_n, load_trace, scale_time, synthetic_trace


@dataclass(slots=True, frozen=True)
class Run:
    label: str
    summary: dict[str, Any]
    cpu_s: float


@dataclass(slots=True, frozen=True)
class Figure:
    name: str
    claim: str
    measured: str
    setting: str


def run(label: str, cfg: SimConfig, trace: list[TraceRequest]) -> Run:
    cpu0 = time.process_time()
    summary = simulate(cfg, trace).summary
    result = Run(label, summary, time.process_time() - cpu0)
    print(detail_row(result), flush=True)
    return result


DETAIL_HEADER = (f"{'run':44s} {'done':>5s} {'out tok/s':>10s} {'tot tok/s':>10s} "
                 f"{'mean TTFT':>10s} {'p99 TTFT':>10s} {'p99 ITL':>8s} {'hit':>5s} {'cpu s':>6s}")


def detail_row(r: Run) -> str:
    s = r.summary
    return (f"{r.label:44s} {s['completed']:5d} {s['output_throughput']:10.0f} "
            f"{s['total_token_throughput']:10.0f} {s['mean_ttft_ms']:8.0f}ms "
            f"{s['p99_ttft_ms']:8.0f}ms {s['p99_itl_ms']:6.1f}ms "
            f"{s['prefix_cache_hit_rate']:5.2f} {r.cpu_s:6.1f}")


def at_once(trace: list[TraceRequest]) -> list[TraceRequest]:
    return [dataclasses.replace(tr, arrival_time=0.0) for tr in trace]


def ratio(a: Run, b: Run, key: str) -> float:
    """``a[key] / b[key]``."""
    return float(a.summary[key]) / float(b.summary[key])


def batching_figures(base: SimConfig, azure: list[TraceRequest], n: int) -> list[Figure]:
    decode_heavy = synthetic_trace(SyntheticConfig(num_requests=n, input_len=128, output_len=512,
                                                   range_ratio=0.99, seed=0))
    return [
        _continuous_vs_static("azure sat, continuous (fcfs, 256 seqs)",
                              "azure sat, static (as many as fit)", base, at_once(azure),
                              f"azure-conv first {len(azure)} at t=0, max_num_seqs 256"),
        _continuous_vs_static("decode-heavy sat, continuous (32 seqs)",
                              "decode-heavy sat, static (32 seqs)",
                              base.replace(max_num_seqs=32), decode_heavy,
                              f"{n} req at t=0, in 128, out 5-1019 uniform, max_num_seqs 32"),
    ]


def _continuous_vs_static(cont_label: str, static_label: str, cfg: SimConfig,
                          trace: list[TraceRequest], setup: str) -> Figure:
    cont = run(cont_label, cfg, trace)
    static = run(static_label, cfg.replace(scheduling_policy="static"), trace)
    return Figure("continuous vs static batching", "2-10x throughput",
                  f"{ratio(cont, static, 'output_throughput'):.2f}x out tok/s", setup)


def prefix_figure(base: SimConfig, n: int) -> Figure:
    wl = SyntheticConfig(num_requests=max(n // 3, 50), request_rate=4.0, input_len=128,
                         output_len=128, range_ratio=0.5, prefix_len=2000, seed=0)
    trace = synthetic_trace(wl)
    on = run("shared 2000-tok prompt, prefix caching on",
             base.replace(enable_prefix_caching=True), trace)
    off = run("shared 2000-tok prompt, prefix caching off",
              base.replace(enable_prefix_caching=False), trace)
    return Figure("prefix caching TTFT", "5-10x lower TTFT",
                  f"{ratio(off, on, 'mean_ttft_ms'):.1f}x lower mean, "
                  f"{ratio(off, on, 'p99_ttft_ms'):.1f}x lower p99 (hit "
                  f"{on.summary['prefix_cache_hit_rate']:.2f})",
                  f"{len(trace)} req at {wl.request_rate:g}/s, 2000-tok system prompt + 64-192")


def lower(before: Run, after: Run, key: str) -> str:
    """How many times lower ``after[key]`` is than ``before[key]`` (or higher, if it is)."""
    r = ratio(before, after, key)
    return f"{r:.1f}x lower" if r >= 1 else f"{1 / r:.2f}x higher"


def chunked_figures(base: SimConfig, azure: list[TraceRequest], chunk: int) -> list[Figure]:
    chunked_cfg = base.replace(max_model_len=8192, max_num_batched_tokens=chunk)
    whole_cfg = base.replace(max_model_len=8192, max_num_batched_tokens=8192,
                                    enable_chunked_prefill=False)
    setting = f"azure-conv first {len(azure)}, budget {chunk} vs 8192"
    sat_on = run(f"azure sat, chunked prefill ({chunk})", chunked_cfg, at_once(azure))
    sat_off = run("azure sat, whole prefill (8192)", whole_cfg, at_once(azure))
    load_on = run(f"azure 3x rate, chunked prefill ({chunk})", chunked_cfg, scale_time(azure, 3.0))
    load_off = run("azure 3x rate, whole prefill (8192)", whole_cfg, scale_time(azure, 3.0))
    claim = "+20-50% throughput, lower tail ITL"
    return [
        Figure("chunked prefill, saturated", claim,
               f"{ratio(sat_on, sat_off, 'total_token_throughput') - 1:+.1%} tok/s, p99 ITL "
               f"{lower(sat_off, sat_on, 'p99_itl_ms')}", f"{setting}, all at t=0"),
        Figure("chunked prefill, 3x trace rate", claim,
               f"p99 ITL {lower(load_off, load_on, 'p99_itl_ms')}, p99 TTFT "
               f"{lower(load_off, load_on, 'p99_ttft_ms')}",
               f"{setting}, throughput = offered load"),
    ]


def print_table(figures: list[Figure]) -> None:
    widths = [max(len(getattr(f, k)) for f in figures) for k in ("name", "claim", "measured")]
    head = ("figure", "claim", "measured", "setting")
    print("\n" + "  ".join(h.ljust(w) for h, w in zip(head, widths + [0])))
    for f in figures:
        cells = (f.name, f.claim, f.measured, f.setting)
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths + [0])))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-requests", type=int, default=1000,
                   help="requests per workload (the prefix one uses a third); default 1000")
    p.add_argument("--chunk", type=int, default=512,
                   help="max_num_batched_tokens with chunked prefill (default 512)")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--hardware", default="h100-sxm")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Batches given at once, as an offline LLM job (its queue has no bound), with the limits the
    # figures state written out.
    base = SimConfig(model=args.model, hardware=args.hardware, usage_context="llm",
                     max_num_seqs=256, max_num_batched_tokens=8192)
    azure = first_n(load_trace("azure-conv"), args.num_requests)
    print(f"{args.model} on {args.hardware}; offline use, max_num_seqs 256, "
          "max_num_batched_tokens 8192 unless stated\n")
    print(DETAIL_HEADER)
    steps: list[Callable[[], list[Figure]]] = [
        lambda: batching_figures(base, azure, args.num_requests),
        lambda: [prefix_figure(base, args.num_requests)],
        lambda: chunked_figures(base, azure, args.chunk),
    ]
    wall0, cpu0 = time.perf_counter(), time.process_time()
    figures = [f for make in steps for f in make()]
    print_table(figures)
    print(f"\n{time.perf_counter() - wall0:.0f} s wall, {time.process_time() - cpu0:.0f} s CPU")


if __name__ == "__main__":
    main()
