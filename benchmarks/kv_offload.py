"""The host KV tier (``--kv-offloading-size``) on a multi-turn workload, with and without it.

    python -m twinserve.benchmarks.kv_offload                      # twin, then the real engine
    python -m twinserve.benchmarks.kv_offload --skip-real          # the twin only (about a minute)
    python -m twinserve.benchmarks.kv_offload --num-requests 2000 --host-gib 16 64

1. The twin: the Mooncake conversation trace (``traces`` "mooncake": each request lists the
   512-token blocks of its prompt, a turn repeating its conversation's earlier blocks), the
   requests whose prompt and output fit Llama-3-8B's 8192 tokens, in their arrival times, on one
   H100 (the bundled profile): the device's own KV cache as the profile sizes it and a smaller
   one (``--small-gpu-blocks``), each without a host tier and with each ``--host-gib``.
2. The real engine here (the bundled model on this CPU, fp32): every turn of the first
   ``--real-conversations`` multi-turn conversations of the same trace, scaled down (16 tokens
   per trace block, so turns share whole 16-token blocks; prompts cut to
   ``--real-max-prompt``; outputs of ``--real-output`` tokens), arrivals ``--real-speedup``
   times faster,
   ``--real-gpu-blocks`` device blocks so the turns' prefixes are evicted; without and with
   the tier, through ``gpu.engine.replay``.

Each row: completed requests, the device's prefix hit rate (cached prompt tokens / prompt
tokens), the host tier's (vLLM's external prefix cache hits / queries), mean and median TTFT.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any

from twinserve.simulator import SimConfig, simulate
from twinserve.traces import TraceRequest, load_trace

MODEL, HARDWARE, MAX_LEN = "llama-3-8b", "h100-sxm", 8192
REAL_BLOCK_TOKENS = 16


def mooncake_fitting(num_requests: int, max_len: int = MAX_LEN) -> list[TraceRequest]:
    """The first ``num_requests`` Mooncake requests whose prompt and output fit ``max_len``."""
    fits = [tr for tr in load_trace("mooncake") if tr.input_tokens + tr.output_tokens <= max_len]
    return fits[:num_requests]


def _row(label: str, summary: dict[str, Any], total: int, seconds: float) -> str:
    ext = summary.get("external_prefix_cache_hit_rate")
    return (f"{label:28s} {summary['completed']:5d}/{total:<5d} "
            f"{100 * summary['prefix_cache_hit_rate']:7.1f}% "
            f"{'-' if ext is None else f'{100 * ext:.1f}%':>8s} "
            f"{summary['mean_ttft_ms']:10.1f} {summary['median_ttft_ms']:10.1f} {seconds:7.1f}")


HEADER = (f"{'configuration':28s} {'completed':>11s} {'device hit':>8s} {'host hit':>8s} "
          f"{'mean TTFT ms':>10s} {'median TTFT':>10s} {'wall s':>7s}")


def twin_part(num_requests: int, host_gib: list[float], small_blocks: int) -> None:
    trace = mooncake_fitting(num_requests)
    span = trace[-1].arrival_time - trace[0].arrival_time
    print(f"Twin: {MODEL} on {HARDWARE}, the first {len(trace)} Mooncake conversation requests "
          f"fitting {MAX_LEN} tokens ({span / 60:.1f} min of arrivals)")
    print(HEADER)
    for blocks in (None, small_blocks):
        for gib in (None, *host_gib):
            kwargs: dict[str, Any] = {}
            if blocks is not None:
                kwargs["num_gpu_blocks_override"] = blocks
            if gib is not None:
                kwargs["kv_offloading_size"] = gib
            t0 = time.perf_counter()
            result = simulate(SimConfig(model=MODEL, hardware=HARDWARE, **kwargs), trace)
            device = f"{result.num_gpu_blocks} blocks"
            label = f"{device}, " + ("no host tier" if gib is None else f"host {gib:g} GiB")
            print(_row(label, result.summary, len(trace), time.perf_counter() - t0))


def real_slice(num_conversations: int, output_tokens: int, speedup: float,
               max_prompt: int) -> list[TraceRequest]:
    """The Mooncake slice for this CPU: every turn of the first ``num_conversations``
    conversations with several turns among the first 600 requests (a conversation: the requests
    sharing their first two blocks), each trace block standing for ``REAL_BLOCK_TOKENS`` tokens
    (prompts cut to ``max_prompt``), arrivals ``speedup`` times faster."""
    head = load_trace("mooncake")[:600]
    turns = Counter(tr.prefix_blocks[:2] for tr in head)
    chosen: list[tuple[int, ...]] = []
    for tr in head:
        key = tr.prefix_blocks[:2]
        if turns[key] > 1 and key not in chosen and len(chosen) < num_conversations:
            chosen.append(key)
    out = []
    for tr in head:
        if tr.prefix_blocks[:2] not in chosen:
            continue
        blocks = tr.prefix_blocks[:max_prompt // REAL_BLOCK_TOKENS]
        out.append(TraceRequest(tr.request_id, tr.arrival_time / speedup,
                                len(blocks) * REAL_BLOCK_TOKENS, output_tokens,
                                prefix_blocks=blocks, prefix_block_tokens=REAL_BLOCK_TOKENS))
    return out


def real_part(num_conversations: int, output_tokens: int, speedup: float, gpu_blocks: int,
              host_gib: float, max_prompt: int) -> None:
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.engine.replay import replay_real
    trace = real_slice(num_conversations, output_tokens, speedup, max_prompt)
    print(f"\nReal engine: the bundled model on this CPU (fp32), the {len(trace)} turns of "
          f"{num_conversations} Mooncake conversations at {REAL_BLOCK_TOKENS} tokens a block "
          f"(prompts {min(t.input_tokens for t in trace)}"
          f"-{max(t.input_tokens for t in trace)} tokens, {output_tokens} out), arrivals "
          f"{speedup:g}x faster, {gpu_blocks} device blocks")
    print(HEADER)
    for gib in (None, host_gib):
        extra = {} if gib is None else {"kv_offloading_size": gib}
        engine = LLMEngine(EngineArgs(dtype="float32", block_size=REAL_BLOCK_TOKENS,
                                      max_model_len=max_prompt + output_tokens + 16,
                                      num_gpu_blocks_override=gpu_blocks, **extra))
        replay = replay_real(engine, trace, progress=False, detokenize=False)
        label = f"{gpu_blocks} blocks, " + ("no host tier" if gib is None else f"host {gib:g} GiB")
        print(_row(label, replay.summary, len(trace), replay.wall_time_s))
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=2000,
                        help="twin: Mooncake requests (those fitting 8192 tokens)")
    parser.add_argument("--host-gib", type=float, nargs="+", default=[16.0, 64.0],
                        help="twin: host tier sizes to compare, GiB")
    parser.add_argument("--small-gpu-blocks", type=int, default=4096,
                        help="twin: the smaller device cache, in 16-token blocks")
    parser.add_argument("--skip-real", action="store_true", help="the twin only")
    parser.add_argument("--skip-twin", action="store_true", help="the real engine only")
    parser.add_argument("--real-conversations", type=int, default=6)
    parser.add_argument("--real-output", type=int, default=2)
    parser.add_argument("--real-speedup", type=float, default=2.0)
    parser.add_argument("--real-gpu-blocks", type=int, default=48)
    parser.add_argument("--real-host-gib", type=float, default=0.25)
    parser.add_argument("--real-max-prompt", type=int, default=192)
    args = parser.parse_args(argv)
    if not args.skip_twin:
        twin_part(args.num_requests, args.host_gib, args.small_gpu_blocks)
    if not args.skip_real:
        real_part(args.real_conversations, args.real_output, args.real_speedup, args.real_gpu_blocks,
                  args.real_host_gib, args.real_max_prompt)


if __name__ == "__main__":
    main()
