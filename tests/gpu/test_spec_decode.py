"""Speculative decoding in the model runner: verification entries give the tokens decoding
without speculation gives (greedy), whatever the drafts, with logprobs for every token.

The runner is driven by hand here (``_decode``), applying the scheduler's rule of the step seam
(``num_computed_tokens = start + len(tokens)``), so these tests do not depend on the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from twinserve.core.outputs import ScheduledRequest, SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.worker.rejection_sampler import VerifySettings
from twinserve.spec_decode.ngram import NgramProposer
from twinserve.spec_decode.suffix import SuffixProposer

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6]
NUM_TOKENS = 24


class _Scripted:
    """Proposes ``script(tokens so far)`` (an oracle, or drafts that are always wrong)."""

    def __init__(self, script: Callable[[list[int]], list[int]]) -> None:
        self.script = script
        self.calls = 0

    def propose(self, requests: Sequence[tuple[object, int]]) -> dict[str, list[int]]:
        self.calls += 1
        return {r.request_id: self.script(list(r.all_token_ids))[:n] for r, n in requests}

    def on_finished(self, request_ids: Sequence[str]) -> None:
        del request_ids


def _decode(runner, params: SamplingParams, k: int, rid: str = "r") -> tuple[Request, int]:
    """Prefill, then steps verifying the drafts the runner proposed; returns the request and the
    number of steps."""
    request = Request(rid, list(PROMPT), params, 0.0)
    blocks = list(range(64))
    entry = ScheduledRequest(request, 0, len(PROMPT), blocks, True, num_draft_next=k)
    steps = 0
    while request.num_output_tokens < NUM_TOKENS:
        out = runner.execute(SchedulerOutput(scheduled=[entry]))
        steps += 1
        tokens = out.sampled_token_ids[rid][:NUM_TOKENS - request.num_output_tokens]
        for token in tokens:
            request.append_output_token(token, 0.0)
        request.num_computed_tokens = entry.start + len(tokens) if entry.spec_token_ids else \
            entry.start + entry.num_new_tokens
        if request.num_output_tokens >= NUM_TOKENS:
            break
        assert len(out.logprobs.get(rid, tokens)) == len(tokens)
        drafts = out.spec_token_ids.get(rid, [])[:NUM_TOKENS - request.num_output_tokens - 1]
        assert len(drafts) <= k
        entry = ScheduledRequest(request, request.num_computed_tokens, 1 + len(drafts), blocks,
                                 True, spec_token_ids=drafts, num_draft_next=k)
    return request, steps


def _reference(runner, params: SamplingParams) -> list[int]:
    runner._spec = None
    return _decode(runner, params, 0)[0].output_token_ids


PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2),
    "penalties": SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                repetition_penalty=1.3, frequency_penalty=0.2),
}


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_greedy_tokens_equal_decoding_without_speculation(tiny_runner, params):
    _, runner = tiny_runner
    expected = _reference(runner, params)
    whole = PROMPT + expected
    oracle = _Scripted(lambda tokens: whole[len(tokens):])
    wrong = _Scripted(lambda tokens: [(t + 1) % 256 for t in whole[len(tokens):]])
    steps = {}
    for name, proposer in (("oracle", oracle), ("wrong", wrong),
                           ("ngram", NgramProposer(1, 3)), ("suffix", SuffixProposer())):
        runner.configure_speculation(proposer, VerifySettings("probabilistic"))
        request, steps[name] = _decode(runner, params, k=4, rid=name)
        assert request.output_token_ids == expected, name
    assert steps["oracle"] <= 1 + -(-(NUM_TOKENS - 1) // 5)  # every draft accepted
    assert steps["wrong"] == NUM_TOKENS  # every draft rejected: one token a step
    assert oracle.calls > 0 and wrong.calls > 0
    # the tiny model repeats itself: lookups find drafts and some are accepted
    assert steps["ngram"] < NUM_TOKENS and steps["suffix"] < NUM_TOKENS


def test_logprobs_of_verified_tokens_equal_those_without_speculation(tiny_runner):
    _, runner = tiny_runner
    params = PARAMS["greedy"]
    runner._spec = None
    plain = _logprobs_run(runner, params)
    expected_tokens = [lp.token_id for lp in plain]
    whole = PROMPT + expected_tokens
    runner.configure_speculation(_Scripted(lambda tokens: whole[len(tokens):]),
                                 VerifySettings("strict"))
    spec = _logprobs_run(runner, params)
    assert [lp.token_id for lp in spec] == expected_tokens
    for a, b in zip(plain, spec):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert a.rank == b.rank and a.top_ids == b.top_ids


def _logprobs_run(runner, params):
    collected = []
    original = runner.execute

    def spy(out):
        res = original(out)
        collected.extend(res.logprobs.get(out.scheduled[0].request_id, []))
        return res

    runner.execute = spy
    try:
        _decode(runner, params, k=3, rid=f"lp{len(collected)}")
    finally:
        del runner.execute
    return collected[:NUM_TOKENS]


def test_synthetic_rate_one_accepts_every_draft(tiny_runner):
    _, runner = tiny_runner
    params = PARAMS["greedy"]
    runner.configure_speculation(_Scripted(lambda tokens: [3] * 8),
                                 VerifySettings("synthetic", (1.0,)))
    request, steps = _decode(runner, params, k=4)
    assert steps == 1 + -(-(NUM_TOKENS - 1) // 5)
    assert request.output_token_ids.count(3) >= 4 * (steps - 2)


@pytest.fixture(scope="module")
def other_tiny_model(tmp_path_factory):
    """A second random model of the same vocabulary (other weights): a poor draft."""
    import json

    from conftest import make_tiny_llama
    from safetensors.torch import load_file, save_file
    path = make_tiny_llama(tmp_path_factory.mktemp("models") / "other-llama")
    tensors = {name: t.flip(0) if t.dim() == 2 else t
               for name, t in load_file(str(path / "model.safetensors")).items()}
    save_file(tensors, str(path / "model.safetensors"))
    assert json.loads((path / "config.json").read_text())["vocab_size"] == 256
    return path


def _draft_proposer(eargs, model):
    import dataclasses

    from twinserve.gpu.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(dataclasses.replace(eargs, kv_cache_memory_bytes=1 << 20),
                              str(model), 256)


@pytest.mark.parametrize("params", PARAMS.values(), ids=PARAMS.keys())
def test_draft_model_greedy_tokens_equal_decoding_without_speculation(
        tiny_runner, tiny_model, other_tiny_model, params):
    eargs, runner = tiny_runner
    expected = _reference(runner, params)
    steps = {}
    for name, model in (("self", tiny_model), ("other", other_tiny_model)):
        proposer = _draft_proposer(eargs, model)
        runner.configure_speculation(proposer, VerifySettings("probabilistic"))
        request, steps[name] = _decode(runner, params, k=4, rid=name)
        assert request.output_token_ids == expected, name
        runner.execute(SchedulerOutput(finished_request_ids=[name]))
        assert len(proposer._free) == proposer.runner.num_gpu_blocks  # every block back
    if params.repetition_penalty == 1.0:  # the draft is the target: every draft accepted
        assert steps["self"] == 1 + -(-(NUM_TOKENS - 1) // 5)
    assert steps["other"] > steps["self"]


def test_draft_model_returns_the_distributions_it_drew_sampled_drafts_from(tiny_runner,
                                                                           tiny_model):
    eargs, _ = tiny_runner
    proposer = _draft_proposer(eargs, tiny_model)
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=8)
    request = Request("s", list(PROMPT), params, 0.0)
    drafts = proposer.propose([(request, 3)])["s"]
    probs = proposer.draft_probs("s", drafts[:2])
    assert len(drafts) == 3 and probs.shape == (2, 256)
    assert torch.allclose(probs.sum(dim=-1), torch.ones(2))
    assert all(int((row > 0).sum()) <= 20 for row in probs)  # top-k applied
    assert all(float(probs[j, d]) > 0 for j, d in enumerate(drafts[:2]))
    assert proposer.draft_probs("s", drafts) is None  # taken once


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_verification_on_cuda_equals_decoding_without_speculation(tiny_model, enforce_eager):
    """On CUDA (Triton attention; decodes in CUDA graphs, verification steps eager)."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner
    eargs = EngineArgs(str(tiny_model), dtype="float32", device="cuda", max_model_len=256,
                       max_num_seqs=8, max_num_batched_tokens=128, kv_cache_memory_bytes=4 << 20,
                       enforce_eager=enforce_eager)
    runner = ModelRunner(eargs, usage_context="server")
    params = PARAMS["greedy"]
    expected = _reference(runner, params)
    whole = PROMPT + expected
    proposers = {"oracle": _Scripted(lambda tokens: whole[len(tokens):]),
                 "ngram": NgramProposer(1, 3), "draft": _draft_proposer(eargs, tiny_model)}
    for name, proposer in proposers.items():
        runner.configure_speculation(proposer, VerifySettings("probabilistic"))
        assert _decode(runner, params, k=4, rid=name)[0].output_token_ids == expected, name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_uniform_verifications_replay_cuda_graphs_and_equal_eager(tiny_model):
    """A runner configured for k = 4 captures (batch size, 5 queries) graphs; the oracle's
    verifications of 4 drafts replay them, with the tokens of decoding without speculation."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner
    eargs = EngineArgs(str(tiny_model), dtype="float32", device="cuda", max_model_len=256,
                       max_num_seqs=8, max_num_batched_tokens=128, kv_cache_memory_bytes=4 << 20,
                       speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    runner = ModelRunner(eargs, usage_context="server")
    graphs = runner._graphs
    assert graphs is not None and (1, 5) in graphs.graphs and (8, 5) in graphs.graphs
    params = PARAMS["greedy"]
    expected = _reference(runner, params)
    whole = PROMPT + expected
    replays: list[tuple[int, int] | None] = []
    run = graphs.run
    graphs.run = lambda inputs: (replays.append(graphs.key(inputs)), run(inputs))[1]
    runner.configure_speculation(_Scripted(lambda tokens: whole[len(tokens):]),
                                 VerifySettings("probabilistic"))
    assert _decode(runner, params, k=4, rid="graphs")[0].output_token_ids == expected
    assert (1, 5) in replays


def test_bundled_model_greedy_tokens_with_ngram_and_suffix(default_model_dir):
    """The bundled model (fp32) copying its prompt: drafts are accepted, tokens unchanged."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runner = ModelRunner(EngineArgs(str(default_model_dir), dtype="float32", max_model_len=256,
                                        kv_cache_memory_bytes=16 << 20), usage_context="server")
        params = PARAMS["greedy"]
        expected = _reference(runner, params)
        steps = {}
        for name, proposer in (("ngram", NgramProposer(1, 4)), ("suffix", SuffixProposer())):
            runner.configure_speculation(proposer, VerifySettings("probabilistic"))
            request, steps[name] = _decode(runner, params, k=4, rid=name)
            assert request.output_token_ids == expected, name
    finally:
        torch.set_num_threads(threads)
    assert min(steps.values()) < NUM_TOKENS
