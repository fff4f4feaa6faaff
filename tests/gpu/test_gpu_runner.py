"""ModelRunner end to end: greedy output equals HF transformers (fp32) token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS, TINY_VOCAB, hf_greedy

from twinserve.core.engine_args import EngineArgs
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.worker.model_runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def _prompts(lengths: tuple[int, ...], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def _requests(prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[Request]:
    return [Request(f"r{i}", p, params, 0.0) for i, p in enumerate(prompts)]


def _decode_steps(requests: list[Request], n: int) -> list[list[tuple[Request, int]]]:
    return [[(r, 1) for r in requests] for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_runners(tiny_model_dirs):
    return {name: ModelRunner(EngineArgs(str(path), dtype="float32", block_size=4,
                                         kv_cache_memory_bytes=1 << 24, swap_space=0.001))
            for name, path in tiny_model_dirs.items()}


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_tiny_prefill_then_decodes_match_hf(name, tiny_model_dirs, tiny_runners, drive):
    prompts = _prompts((5, 13, 1, 30), TINY_VOCAB)
    requests = _requests(prompts)
    steps = [[(r, r.num_tokens) for r in requests]] + _decode_steps(requests, 9)
    drive(tiny_runners[name], requests, steps)
    assert [r.output_token_ids for r in requests] == hf_greedy(tiny_model_dirs[name], prompts, 10)


@pytest.mark.parametrize("name", ["llama-untied-llama3rope", "qwen2-tied"])
def test_tiny_chunked_prefill_and_mixed_batch_match_hf(name, tiny_model_dirs, tiny_runners,
                                                       drive):
    prompts = _prompts((23, 9, 40), TINY_VOCAB, seed=1)
    a, b, c = requests = _requests(prompts)
    steps = [
        [(a, 10)],                    # a: first chunk, no sample
        [(a, 13), (b, 4)],            # a: last chunk (samples); b: first chunk
        [(a, 1), (b, 5)],             # mixed: a decodes while b finishes its prefill
        [(c, 7), (a, 1), (b, 1)],     # a prefill chunk between decodes
        [(b, 1), (c, 33), (a, 1)],
    ] + _decode_steps(requests, 6)
    drive(tiny_runners[name], requests, steps)
    want = hf_greedy(tiny_model_dirs[name], prompts, 10)
    got = [r.output_token_ids for r in requests]
    assert got == [w[:len(g)] for g, w in zip(got, want)]
    assert [len(g) for g in got] == [10, 9, 7]


def test_seeded_sampling_reproducible_and_children_differ(tiny_runners, drive):
    runner = tiny_runners["llama-tied"]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=32)
    prompt = _prompts((6,), TINY_VOCAB)[0]
    runs = []
    for index in (0, 0, 1):
        req = Request(f"s{len(runs)}", prompt, params, 0.0, index=index)
        drive(runner, [req], [[(req, 6)]] + _decode_steps([req], 11))
        runs.append(req.output_token_ids)
        runner.execute(SchedulerOutput(finished_request_ids=[req.request_id]))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_logprobs_returned(tiny_runners, drive):
    runner = tiny_runners["qwen2-untied"]
    req = Request("lp", [5, 6, 7], SamplingParams(temperature=0.0, logprobs=3), 0.0)
    from twinserve.core.outputs import ScheduledRequest
    out = runner.execute(SchedulerOutput(scheduled=[ScheduledRequest(req, 0, 3, [0], True)]))
    token = out.sampled_token_ids["lp"][0]
    entry = out.logprobs["lp"][0]
    top = dict(zip(entry.top_ids, entry.top_logprobs))
    assert entry.token_id == token and entry.rank == 1
    assert len(top) == 3 and token in top and top[token] == pytest.approx(entry.logprob)
    assert max(top.values()) == pytest.approx(entry.logprob)


def test_runner_attributes(tiny_runners):
    runner = tiny_runners["llama-tied"]
    assert runner.vocab_size == TINY_VOCAB
    assert runner.max_model_len == 256
    assert runner.eos_token_id == 2
    assert runner.num_gpu_blocks > 0 and runner.num_cpu_blocks > 0
    assert runner.tokenizer is None


@pytest.mark.slow
def test_default_model_fp32_matches_hf(default_model_dir, drive):
    runner = ModelRunner(EngineArgs(str(default_model_dir), dtype="float32", max_model_len=512,
                                    kv_cache_memory_bytes=400 << 20, swap_space=0))
    tok = runner.tokenizer
    questions = ["What is the capital of France?", "Name three colors.", "Hi",
                 "Explain gravity in one sentence.", "Write a haiku about autumn leaves.",
                 "What is 12 times 12?", "Translate 'good morning' to French.",
                 "List the planets of the solar system in order from the sun."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True)
               for q in questions]
    requests = _requests(prompts)
    drive(runner, requests, [[(r, r.num_tokens) for r in requests]] + _decode_steps(requests, 31))
    assert [r.output_token_ids for r in requests] == hf_greedy(default_model_dir, prompts, 32)
    assert "Paris" in tok.decode(requests[0].output_token_ids)


def test_a_runner_on_another_runners_weights_matches_hf_with_its_own_cache(tiny_model_dirs,
                                                                           tiny_runners, drive):
    """``weights_from``: the same parameters (no second load), a KV cache and limits of its
    own, HF's greedy tokens; a runner that would outgrow or change the weights is refused."""
    name = "qwen2-tied"
    owner = tiny_runners[name]
    path = str(tiny_model_dirs[name])
    shared = ModelRunner(EngineArgs(path, dtype="float32", block_size=4, max_model_len=64,
                                    kv_cache_memory_bytes=1 << 23), weights_from=owner)
    assert shared.model is owner.model and shared.kv_cache is not owner.kv_cache
    assert shared.num_gpu_blocks < owner.num_gpu_blocks and shared.max_model_len == 64
    prompts = _prompts((7, 19), TINY_VOCAB, seed=3)
    requests = _requests(prompts)
    drive(shared, requests, [[(r, r.num_tokens) for r in requests]] + _decode_steps(requests, 5))
    assert [r.output_token_ids for r in requests] == hf_greedy(tiny_model_dirs[name], prompts, 6)
    for args, what in ((EngineArgs(path, dtype="float32", max_model_len=128),
                        "exceeds the loaded model's 64"),
                       (EngineArgs(path, dtype="bfloat16", max_model_len=64), "the runner loaded"),
                       (EngineArgs(path, dtype="float32", max_model_len=64,
                                   kv_cache_dtype="fp8"), "kv_cache_dtype fp8")):
        with pytest.raises(ValueError, match=what):
            ModelRunner(args, weights_from=shared)
