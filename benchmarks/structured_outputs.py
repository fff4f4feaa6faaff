"""Decode throughput of a batch where 0%, 50% and 100% of the requests are JSON-schema constrained
(llguidance masks, one batched bitmask per step), side by side in interleaved rounds.

    python -m twinserve.benchmarks.structured_outputs [--requests 64] [--max-tokens 64] [--rounds 3]

The bundled model, greedy, one engine loaded once. Unconstrained requests generate exactly
``--max-tokens`` tokens (ignore_eos). By default the constrained ones follow a schema whose text
field cannot be complete within ``--max-tokens``, so they run as long: every mix runs the same
steps with the same batch sizes, and the difference is the mask's cost. ``--natural`` uses a
small record instead, which ends early (shorter outputs, smaller decode batches: the figures
then mix the mask's cost with the batch's shape). Figures: generated tokens per second of the
whole batch, and of the steps that only decode (from the engine's step records), with the mean
decode batch and output length; each round, the medians and each mix relative to 0%.
"""

from __future__ import annotations

import argparse
import statistics
import time

# A record whose text field cannot be complete within --max-tokens: every constrained request
# runs to max_tokens like the unconstrained ones, so all mixes run the same steps with the same
# batch sizes and the difference is the mask's cost. (--natural: a small record that ends early.)
LONG_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "text": {"type": "string", "minLength": 4000}},
    "required": ["id", "text"],
    "additionalProperties": False,
}
NATURAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20},
                    "maxItems": 4},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}


def run_mix(llm, share: float, requests: int, max_tokens: int,
            schema: dict) -> tuple[float, float, float, float]:
    """(generated tokens per second, decode-step tokens per second, mean decode batch, mean
    output tokens) of one batch."""
    from twinserve import SamplingParams
    from twinserve.core.structured_outputs import StructuredOutputsParams
    constrained = round(share * requests)
    params = [SamplingParams(max_tokens=max_tokens, temperature=0,
                             structured_outputs=StructuredOutputsParams(json=schema))
              if i < constrained else
              SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
              for i in range(requests)]
    chats = [[{"role": "user", "content": f"Describe person number {i} as JSON."}]
             for i in range(requests)]
    steps = llm.engine.metrics.steps
    first = len(steps)
    t0 = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    decodes = [s for s in steps[first:] if s.num_prefill_tokens == 0 and s.num_decode_tokens]
    decode_tokens = sum(s.num_decode_tokens for s in decodes)
    return (sum(tokens) / seconds, decode_tokens / sum(s.duration for s in decodes),
            decode_tokens / len(decodes), statistics.mean(tokens))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--natural", action="store_true", help="a small record that ends early")
    args = p.parse_args(argv)
    schema = NATURAL_SCHEMA if args.natural else LONG_SCHEMA
    from twinserve import LLM
    llm = LLM(dtype=args.dtype, max_num_seqs=args.requests)
    shares = (0.0, 0.5, 1.0)
    run_mix(llm, 1.0, 4, 8, schema)  # warm-up: the first grammar compilation and the kernels
    results: dict[float, list[tuple[float, float, float, float]]] = {s: [] for s in shares}
    for k in range(args.rounds):
        order = shares[k % 3:] + shares[:k % 3]
        for share in order:
            results[share].append(run_mix(llm, share, args.requests, args.max_tokens, schema))
        print(f"round {k + 1}: " + ", ".join(
            f"{int(s * 100)}% {results[s][-1][0]:.1f} tok/s (decode {results[s][-1][1]:.1f})"
            for s in shares), flush=True)
    base = [statistics.median(r[k] for r in results[0.0]) for k in range(4)]
    print(f"\n{'constrained':>11} {'batch tok/s':>12} {'vs 0%':>6} {'decode tok/s':>13} "
          f"{'vs 0%':>6} {'decode batch':>13} {'out tokens':>11}   (medians)")
    for share in shares:
        tps, dec, batch, length = (statistics.median(r[k] for r in results[share])
                                   for k in range(4))
        print(f"{int(share * 100):>10}% {tps:>12.1f} {tps / base[0]:>6.3f} {dec:>13.1f} "
              f"{dec / base[1]:>6.3f} {batch:>13.1f} {length:>11.1f}")


if __name__ == "__main__":
    main()
