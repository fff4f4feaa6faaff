"""Speculative decoding on this CPU at batch 1: generated tokens per second with ``ngram`` and
``suffix`` drafts against none, on prompts the bundled model answers by copying or editing its
input (code edits, rewrites, JSON changes), greedy.

    python -m twinserve.benchmarks.spec_decode_cpu [--rounds 3] [--max-tokens 256] [-k 4]
        [--policy fixed] [--max-num-speculative-tokens K] [--prompt-set copy-edit|v1] [--prompts N]

The prompts (``spec_prompts``): ``copy-edit`` by default, nine chats chosen by the share of the
model's greedy output that is its input copied in order (``spec_replay.copied_share``, at least
80% at 256 tokens; ``spec_prompts`` states the rule and the candidates), never by tok/s; ``v1``,
the first five single messages, which the bundled model mostly answers with new code and prose.

One load of the weights; one engine per method on it (``ModelRunner(weights_from=...)``), so the
methods differ only in speculation. suffix gets a fresh engine each round (``--keep-suffix-cache`` keeps one):
the rounds repeat the prompts, and its global tree of finished outputs would otherwise hold the
very answers from the round before. Each round runs every prompt once per method, one request at
a time, the methods' order rotating from round to round (interleaved rounds); the figures are
the medians over rounds of each method's tokens per second, its ratio to none, and the mean
acceptance length (1 + accepted / drafted proposals, vLLM's definition) from the scheduler's
totals, and the median whole step that verified drafts against none's median decode step
(``verify/decode``: what a verification costs beside the decode it replaces; the speedup is
about the acceptance length over it, less the steps where no drafts were found).
Greedy outputs with speculation are checked equal to those without in every round, round by
round: every engine is warmed up on the same prompt, so that in each round all engines serve
the prompts from the same cached prefixes (in bf16 a prompt served from the prefix cache can
decode differently at a near-tie than one prefilled whole, with or without speculation).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from twinserve.benchmarks.spec_prompts import DEFAULT_PROMPT_SET, PROMPT_SETS, Prompt, prompt_set
from twinserve.core.outputs import SchedulerOutput


def encode_prompts(tokenizer, prompts: Sequence[Prompt]) -> list[list[int]]:
    """The prompts' chats rendered with the model's template and encoded."""
    from twinserve.entrypoints.chat_template import ChatTemplateOptions, encode_chat
    return [list(encode_chat(tokenizer, prompt.chat(), ChatTemplateOptions()).token_ids)
            for prompt in prompts]


def _engines(methods: list[str], k: int, policy: str, dtype: str,
             max_k: int | None = None) -> tuple[dict, Callable[[str], Any]]:
    """One engine per method on one load of the weights, and the function that builds another
    engine of a method on it."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.worker.model_runner import ModelRunner
    owner = ModelRunner(EngineArgs(dtype=dtype, max_num_seqs=1))

    def build(method: str) -> Any:
        spec = None if method == "none" else {"method": method, "num_speculative_tokens": k,
                                              "policy": policy,
                                              "max_num_speculative_tokens": max_k}
        args = EngineArgs(dtype=dtype, max_num_seqs=1, speculative_config=spec)
        return LLMEngine(args, ModelRunner(args, weights_from=owner))
    return {method: build(method) for method in methods}, build


@dataclass(slots=True)
class StepTimes:
    """Whole engine steps (schedule, forward pass, sampling, proposing, output processing) of
    one engine, by kind: ``verify`` steps checked drafts, ``decode`` steps decoded one token
    (no prompt tokens, no drafts); steps with prompt tokens are left out."""

    verify: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)

    def record(self, out: SchedulerOutput, seconds: float) -> None:
        if out.num_spec_tokens:
            self.verify.append(seconds)
        elif out.scheduled and not out.num_prefill_tokens:
            self.decode.append(seconds)


def _timed(engine, times: StepTimes | None = None) -> StepTimes:
    """Records each step of ``engine`` by the kind its runner was handed, into ``times`` (a new
    ``StepTimes`` by default)."""
    times = StepTimes() if times is None else times
    runner, step = engine.runner, engine.step
    last: list[SchedulerOutput] = []
    execute = runner.execute

    def timed_execute(out: SchedulerOutput):
        last[:] = [out]
        return execute(out)

    def timed_step():
        last.clear()
        t0 = time.perf_counter()
        results = step()
        if last:
            times.record(last[0], time.perf_counter() - t0)
        return results
    runner.execute = timed_execute
    engine.step = timed_step
    return times


def _run(engine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, outputs) of the prompts one at a time."""
    from twinserve.core.sampling_params import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = []
    seconds = 0.0
    for prompt in prompts:
        t0 = time.perf_counter()
        engine.add_request(list(prompt), params)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
        seconds += time.perf_counter() - t0
        outputs.append(tokens)
    return seconds, outputs


def first_differences(outputs: list[list[int]], reference: list[list[int]],
                      prompts: Sequence[Prompt]) -> list[tuple[str, int]]:
    """``(prompt name, index of the first differing token)`` where ``outputs`` differ from
    ``reference`` (a length difference counts at the shorter one's end)."""
    parted = []
    for prompt, got, want in zip(prompts, outputs, reference, strict=True):
        if got != want:
            same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b),
                        min(len(got), len(want)))
            parted.append((prompt.name, same))
    return parted


def _acceptance_length(engine, before: tuple[int, int]) -> float:
    drafts, accepted = _spec_totals(engine)
    drafts -= before[0]
    accepted -= before[1]
    return 1.0 + accepted / drafts if drafts else 1.0


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3 if seconds else float("nan")


def _spec_totals(engine) -> tuple[int, int]:
    sched = engine.scheduler
    return sched.spec_num_drafts, sched.spec_num_accepted_tokens


def _draft_tokens(engine) -> int:
    """Draft tokens verified so far (per verification above k: the policy raised it)."""
    return engine.scheduler.spec_num_draft_tokens


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--policy", default="fixed", help="speculation policy (fixed: always k)")
    p.add_argument("--max-num-speculative-tokens", type=int, default=None,
                   help="the cap the adaptive policy may raise k to (default: k)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt-set", choices=list(PROMPT_SETS), default=DEFAULT_PROMPT_SET,
                   help="the prompts (spec_prompts: copy-edit, the default, or v1, the first set)")
    p.add_argument("--prompts", type=int, default=None, help="how many of the set's prompts")
    p.add_argument("--keep-suffix-cache", action="store_true",
                   help="let suffix keep earlier rounds' outputs in its global tree (by default "
                        "each round starts a fresh suffix engine: the rounds repeat the prompts, "
                        "so a kept tree would hold the very answers)")
    args = p.parse_args(argv)
    methods = ["none", "ngram", "suffix"]
    engines, build = _engines(methods, args.num_speculative_tokens, args.policy, args.dtype,
                       args.max_num_speculative_tokens)
    chosen = prompt_set(args.prompt_set)[:args.prompts]
    prompts = encode_prompts(engines["none"].tokenizer, chosen)
    for engine in engines.values():  # warm-up: the same prefix-cache state in every engine
        _run(engine, prompts[:1], 8)
    times = {m: _timed(engine) for m, engine in engines.items()}
    rates: dict[str, list[float]] = {m: [] for m in methods}
    lengths: dict[str, list[float]] = {m: [] for m in methods}
    equal: dict[str, bool] = {m: True for m in methods}
    seen: dict[str, list[list[int]]] = {}  # this round's outputs
    drafts: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(args.rounds):
        if r and not args.keep_suffix_cache:
            engines["suffix"] = build("suffix")
            # the others' prefix caches hold every prompt by now: so does this one's (a prompt
            # prefilled whole can decode differently in bf16 at a near-tie than a cached one)
            _run(engines["suffix"], prompts, 1)
            _timed(engines["suffix"], times["suffix"])
        order = methods[r % len(methods):] + methods[:r % len(methods)]
        for method in order:
            engine = engines[method]
            before = _spec_totals(engine) if method != "none" else (0, 0)
            drafted_before = _draft_tokens(engine)
            seconds, outputs = _run(engine, prompts, args.max_tokens)
            tokens = sum(len(o) for o in outputs)
            rates[method].append(tokens / seconds)
            lengths[method].append(_acceptance_length(engine, before) if method != "none" else 1.0)
            verified = _spec_totals(engine)[0] - before[0]
            drafts[method].append((_draft_tokens(engine) - drafted_before) / verified
                                  if verified else 0.0)
            seen[method] = outputs
        for method in methods[1:]:  # like with like: the same round, so the same cached prefixes
            equal[method] = equal[method] and seen[method] == seen["none"]
            for name, parted in first_differences(seen[method], seen["none"], chosen):
                print(f"round {r + 1}: {method} parted from none on {name} at output token {parted}")
        print(f"round {r + 1}: " + ", ".join(f"{m} {rates[m][-1]:.1f} tok/s" for m in methods))
    base = statistics.median(rates["none"])
    print(f"\nbatch 1, {len(prompts)} prompts of {args.prompt_set} x up to {args.max_tokens} tokens, greedy, "
          f"k={args.num_speculative_tokens}, policy {args.policy}, cap "
          f"{args.max_num_speculative_tokens or args.num_speculative_tokens}, {args.rounds} rounds "
          "(medians)")
    decode_ms = _median_ms(times["none"].decode)
    print(f"{'method':8} {'tok/s':>8} {'vs none':>8} {'accept len':>11} {'drafts':>7} "
          f"{'step ms':>8} {'verify/decode':>14}")
    for m in methods:
        rate = statistics.median(rates[m])
        step_ms = _median_ms(times[m].verify) if m != "none" else decode_ms
        print(f"{m:8} {rate:8.1f} {rate / base:7.2f}x {statistics.median(lengths[m]):11.2f} "
              f"{statistics.median(drafts[m]):7.2f} "
              f"{step_ms:8.2f} {step_ms / decode_ms:14.3f}")
    print("drafts: draft tokens per verification; step ms: the median step that verified drafts "
          "(none: that decoded one token); verify/decode: its ratio to none's")
    for m in methods[1:]:  # the same greedy tokens with and without speculation
        print(f"{m}: outputs equal to none's in every round: "
              f"{equal[m]}")


if __name__ == "__main__":
    main()
