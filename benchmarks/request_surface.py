"""What the request-surface extras cost on the bundled model, side by side in interleaved rounds
(medians): prefill with and without ``prompt_logprobs`` (logits at every prompt position), the
same prompts as ``LLM.embed`` (prefill only, pooled), and a decode batch with and without a
``bad_words`` / ``logprobs`` share.

    python -m twinserve.benchmarks.request_surface [--rounds 3] [--prompts 8] [--prompt-len 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from twinserve import LLM, SamplingParams


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    llm = LLM(max_model_len=1024, enable_prefix_caching=False)
    prompts = [[1 + (7 * i + 13 * j) % 40000 for j in range(args.prompt_len)]
               for i in range(args.prompts)]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    with_lp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    decode = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    extras = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True,
                            bad_words=["Paris", "London"], logprobs=2)
    short = [p[:16] for p in prompts]
    cases: dict[str, Callable[[], object]] = {
        "prefill": lambda: llm.generate(prompts, one, use_tqdm=False),
        "prefill + prompt_logprobs=1": lambda: llm.generate(prompts, with_lp, use_tqdm=False),
        "embed": lambda: llm.embed(prompts, use_tqdm=False),
        "decode": lambda: llm.generate(short, decode, use_tqdm=False),
        "decode, half with bad_words + logprobs=2": lambda: llm.generate(
            short, [extras if i % 2 else decode for i in range(len(short))], use_tqdm=False),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(args.rounds):
        for name, fn in cases.items():
            times[name].append(_timed(fn))
    base = {"prefill": statistics.median(times["prefill"]),
            "decode": statistics.median(times["decode"])}
    print(f"{args.prompts} prompts x {args.prompt_len} tokens (decode: x 16 tokens + "
          f"{args.decode_tokens} generated), medians of {args.rounds} interleaved rounds")
    for name, values in times.items():
        ref = base["decode" if name.startswith("decode") else "prefill"]
        median = statistics.median(values)
        print(f"  {name:44s} {median:7.3f} s  {median / ref:5.2f}x")


if __name__ == "__main__":
    main()
