"""Verification steps a proposer needs on recorded greedy outputs: a deterministic figure for
the proposers of ``spec_decode_cpu`` that a loaded host cannot blur.

    python -m twinserve.benchmarks.spec_replay [--outputs /tmp/spec_replay_outputs.json]
        [--prompt-set copy-edit|v1] [--max-tokens 256] [-k 4] [--max-num-speculative-tokens 8]
        [--prompts N]

The benchmark's prompts are answered once by the real engine (bf16, no speculation, greedy,
warmed up as the benchmark warms up) and the outputs cached in ``--outputs`` (reused when the
file holds the same prompts and max tokens). Each proposer is then replayed without a model:
after the step that sampled the first output token, every step asks for drafts on the tokens
so far, accepts the drafts that equal the recorded output's next tokens and appends one token
more (the model's), exactly as greedy verification does; the figure is the number of those
steps. With a cap above k the adaptive policy's ceiling is replayed, each step asking for the
whole ceiling (its rate rule, which can ask for fewer, is left out: it needs step times): the
ceiling doubles after a verification that accepted all of ceiling-many drafts, up to the cap,
and a rejection after n accepted drafts sets it to 2 (n + 1), within k and the cap. ``oracle``
knows the output and copies the longest correct continuation from anywhere in the request's
tokens: the bound a copying proposer can reach; ``occurrence oracle`` chooses as well but only
among the positions just after an earlier occurrence of the last token: the bound of ranking a
lookup's occurrences (without resuming after edits, which it does not see).
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from twinserve.benchmarks.spec_prompts import DEFAULT_PROMPT_SET, PROMPT_SETS, Prompt, prompt_set
from twinserve.core.sampling_params import SamplingParams
from twinserve.spec_decode.proposer import Proposer

DraftFn = Callable[[str, list[int], int], list[int]]  # (request id, tokens so far, k) -> drafts


@dataclass(slots=True)
class _View:
    """What a proposer may read of a request (``ProposalRequest``)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams = field(default_factory=SamplingParams)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass(frozen=True, slots=True)
class Ceiling:
    """The drafts asked for per step: ``k``, raised by doubling up to ``cap`` while every
    draft of a verification that asked for the ceiling is accepted, set to twice the accepted
    drafts + 1 (within k and cap) by a rejection (the adaptive policy's ceiling)."""

    k: int
    cap: int

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k must be >= 1, got {self.k}.")
        if self.cap < self.k:
            raise ValueError(f"cap ({self.cap}) must be >= k ({self.k}).")

    def next(self, ceiling: int, num_drafts: int, num_accepted: int) -> int:
        if num_accepted < num_drafts:  # the draft length follows the match
            return max(self.k, min(self.cap, 2 * (num_accepted + 1)))
        if num_drafts and num_drafts >= ceiling:
            return min(self.cap, 2 * num_drafts)
        return ceiling


@dataclass(frozen=True, slots=True)
class Replayed:
    """``steps`` after the first output token's; ``verifying``: those that had drafts to
    verify (dearer than a decode: ``verify/decode`` in ``spec_decode_cpu``)."""

    steps: int
    verifying: int


def replay(draft: DraftFn, request_id: str, prompt: Sequence[int], output: Sequence[int],
           ceiling: Ceiling) -> Replayed:
    """The steps that greedy verification of ``draft``'s drafts takes to produce ``output``."""
    tokens = [*prompt, *output[:1]]
    pos, steps, verifying, k = min(1, len(output)), 0, 0, ceiling.k
    while pos < len(output):
        drafts = draft(request_id, list(tokens), min(k, len(output) - pos))
        accepted = 0
        while accepted < len(drafts) and pos + accepted < len(output) \
                and drafts[accepted] == output[pos + accepted]:
            accepted += 1
        tokens += output[pos:pos + accepted + 1]
        pos += accepted + 1
        steps += 1
        verifying += bool(drafts)
        k = ceiling.next(k, len(drafts), accepted)
    return Replayed(steps, verifying)


def proposer_draft(proposer: Proposer, num_prompt_tokens: int) -> DraftFn:
    """``proposer`` behind the ``DraftFn`` shape, one request at a time."""
    def draft(request_id: str, tokens: list[int], k: int) -> list[int]:
        view = _View(request_id, tokens, num_prompt_tokens)
        return proposer.propose([(view, k)]).get(request_id, [])
    return draft


def oracle_draft(output: Sequence[int], num_prompt_tokens: int, after_last: bool = False) -> DraftFn:
    """The longest continuation of the tokens so far that equals the output's next tokens,
    copied from any position of the tokens so far (``after_last``: from a position just after
    an earlier occurrence of the last token, the choices a lookup has)."""
    def draft(_: str, tokens: list[int], k: int) -> list[int]:
        pos = len(tokens) - num_prompt_tokens
        want = list(output[pos:pos + k])
        best: list[int] = []
        for start in range(1, len(tokens)) if after_last else range(len(tokens)):
            if after_last and tokens[start - 1] != tokens[-1]:
                continue
            got = tokens[start:start + len(want)]
            n = 0
            while n < len(got) and got[n] == want[n]:
                n += 1
            if n > len(best):
                best = got[:n]
                if n == len(want):
                    break
        return best
    return draft


def count_steps(make: Callable[[], Proposer] | str, prompts: list[list[int]],
                outputs: list[list[int]], ceiling: Ceiling) -> list[Replayed]:
    """Steps per prompt for a fresh proposer from ``make`` (or ``"oracle"``, ``"occurrence
    oracle"``: ``oracle_draft`` anywhere, after the last token), the prompts replayed in order
    with ``on_finished`` after each, as one engine serves them."""
    if isinstance(make, str) and make not in ("oracle", "occurrence oracle"):
        raise ValueError(f"make must be a proposer factory or an oracle's name, got {make!r}.")
    proposer = None if isinstance(make, str) else make()
    steps = []
    for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
        rid = f"r{i}"
        fn = oracle_draft(output, len(prompt), make == "occurrence oracle") if proposer is None \
            else proposer_draft(proposer, len(prompt))
        steps.append(replay(fn, rid, prompt, output, ceiling))
        if proposer is not None:
            proposer.on_finished([rid])
    return steps


def greedy_outputs(path: Path, max_tokens: int, prompts: Sequence[Prompt]) -> tuple[
        list[list[int]], list[list[int]]]:
    """The prompts encoded and the real engine's greedy outputs for them (bf16, no
    speculation), read from ``path`` when it holds the same prompts and max tokens, else
    generated and written there."""
    from twinserve.benchmarks.spec_decode_cpu import _engines, _run, encode_prompts
    key = [[list(m) for m in prompt.messages] for prompt in prompts]
    if path.exists():
        cached = json.loads(path.read_text())
        if cached.get("messages") == key and cached.get("max_tokens") == max_tokens:
            return cached["prompts"], cached["outputs"]
    engine = _engines(["none"], 1, "fixed", "bfloat16")["none"]
    encoded = encode_prompts(engine.tokenizer, prompts)
    _run(engine, encoded[:1], 8)  # the benchmark's warm-up: the same cached prefixes
    _, outputs = _run(engine, encoded, max_tokens)
    path.write_text(json.dumps({"messages": key, "max_tokens": max_tokens, "prompts": encoded,
                                "outputs": outputs}))
    return encoded, outputs


def copied_share(prompt: Sequence[int], output: Sequence[int], min_block: int = 4) -> float:
    """The share of ``output`` that is ``prompt`` copied in order: the tokens of the matching
    blocks of ``min_block``+ tokens (difflib's, no junk heuristic) over the output's length.
    In order, so a model that repeats one line of its input over and over scores low."""
    if not output:
        return 0.0
    matcher = difflib.SequenceMatcher(None, list(prompt), list(output), autojunk=False)
    copied = sum(block.size for block in matcher.get_matching_blocks() if block.size >= min_block)
    return copied / len(output)


def _proposers() -> dict[str, Callable[[], Proposer] | str]:
    from twinserve.spec_decode.ngram import NgramProposer
    from twinserve.spec_decode.suffix import SuffixProposer
    return {"ngram": NgramProposer, "suffix": SuffixProposer, "occurrence oracle": "occurrence oracle",
            "oracle": "oracle"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outputs", type=Path, default=Path("/tmp/spec_replay_outputs.json"))
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-num-speculative-tokens", type=int, default=8,
                   help="the adaptive policy's cap, replayed beside fixed k")
    p.add_argument("--prompt-set", choices=list(PROMPT_SETS), default=DEFAULT_PROMPT_SET)
    p.add_argument("--prompts", type=int, default=None, help="how many of the set's prompts")
    args = p.parse_args(argv)
    chosen = prompt_set(args.prompt_set)[:args.prompts]
    prompts, outputs = greedy_outputs(args.outputs, args.max_tokens, chosen)
    k, cap = args.num_speculative_tokens, args.max_num_speculative_tokens
    print(f"{len(prompts)} prompts of {args.prompt_set}, {sum(map(len, outputs))} output tokens; "
          "copied share (the output that is the prompt copied in order):")
    for prompt, encoded, output in zip(chosen, prompts, outputs, strict=True):
        print(f"  {prompt.name:14} {len(output):4} tokens  {copied_share(encoded, output):.2f}")
    print("steps after each first token")
    print(f"{'proposer':17} {'k=' + str(k):>36} {'cap ' + str(cap):>36}")
    for name, make in _proposers().items():
        print(f"{name:17}" + "".join(_summary(count_steps(make, prompts, outputs, ceiling))
                                      for ceiling in (Ceiling(k, k), Ceiling(k, cap))))
    print("steps (those that verified drafts) [steps per prompt]")


def _summary(counts: list[Replayed]) -> str:
    steps = [c.steps for c in counts]
    return f" {sum(steps):5} ({sum(c.verifying for c in counts):3}) {str(steps):>24}"


if __name__ == "__main__":
    main()
