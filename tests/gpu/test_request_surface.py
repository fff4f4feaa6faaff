"""The rest of vLLM's request surface in the Python API: prompt logprobs (against HF's fp32
log-softmax, also under chunked prefill and with the prefix cache), Logprob objects, bad_words,
truncate_prompt_tokens, logits_processors, and LLM.embed (against HF's last hidden state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from twinserve import LLM, Logprob, PoolingParams
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.worker.sampler import _apply_bad_words

PROMPT = [1, *range(5, 60)]  # 56 tokens: several blocks, several prefill chunks at 16
CORPUS = ["the cat sat on the mat", "a dog ran in the park", "the sun is hot today",
          "hello world and hello again", "we like to read books at night"] * 20


def _llm(model_dir: Path, **kwargs) -> LLM:
    return LLM(str(model_dir), dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=8 << 20, swap_space=0, **kwargs)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dirs, tmp_path_factory) -> Path:
    from conftest import with_trained_tokenizer
    return with_trained_tokenizer(tiny_model_dirs["llama-tied"],
                                  tmp_path_factory.mktemp("surface") / "tok", CORPUS)


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return _llm(model_dir)


@pytest.fixture(scope="module")
def hf(model_dir) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check_prompt_logprobs(got, prompt: list[int], want: torch.Tensor, k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for pos, entry in enumerate(got[1:], start=1):
        token = prompt[pos]
        row = want[pos - 1]
        assert isinstance(entry[token], Logprob)
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = [t for t, v in entry.items() if v.rank is not None and v.rank <= k]
        assert top == row.topk(k).indices.tolist()  # the top-k, in rank order
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_equal_hf_whole_and_chunked_and_after_a_cache_hit(model_dir, llm, hf):
    want = _hf_logprobs(hf, PROMPT)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    _check_prompt_logprobs(out.prompt_logprobs, PROMPT, want, 3)
    # the same prompt again: the prefix cache holds it, but these requests read no cached block
    again = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    _check_prompt_logprobs(again.prompt_logprobs, PROMPT, want, 3)
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0),
                         use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.num_cached_tokens > 0
    chunked = _llm(model_dir, max_num_batched_tokens=16, max_num_seqs=4)
    outs = chunked.generate([PROMPT, PROMPT[:20]], params, use_tqdm=False)
    _check_prompt_logprobs(outs[0].prompt_logprobs, PROMPT, want, 3)
    _check_prompt_logprobs(outs[1].prompt_logprobs, PROMPT[:20], _hf_logprobs(hf, PROMPT[:20]),
                           3)
    assert outs[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_logprob_objects_hold_the_sampled_token_with_its_rank(llm, hf):
    params = SamplingParams(max_tokens=8, temperature=1.5, seed=11, logprobs=2,
                            ignore_eos=True)
    out = llm.generate([PROMPT[:12]], params, use_tqdm=False)[0].outputs[0]
    tokens = out.token_ids
    want = _hf_logprobs(hf, PROMPT[:12] + tokens)
    ranks = []
    for i, (token, entry) in enumerate(zip(tokens, out.logprobs)):
        row = want[11 + i]
        assert token in entry and entry[token].logprob == pytest.approx(float(row[token]),
                                                                        abs=1e-4)
        assert entry[token].rank == int((row >= row[token]).sum())
        assert entry[token].decoded_token == llm.get_tokenizer().decode(
            [token], skip_special_tokens=False)
        ranks.append(entry[token].rank)
        assert len(entry) == (2 if entry[token].rank <= 2 else 3)
    assert max(ranks) > 2  # at this temperature some sampled tokens fall outside the top-2
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(tokens, out.logprobs)), abs=1e-4)


def test_bad_words_hold_and_leave_other_rows_alone(llm):
    tok = llm.get_tokenizer()
    prompt = "the cat sat on the"
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    base = llm.generate([prompt, "a dog ran"], plain, use_tqdm=False)
    first = base[0].outputs[0].token_ids
    word = tok.decode(first[:2]).strip()  # the greedy output's first two tokens, as text
    banned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, bad_words=[word])
    got = llm.generate([prompt, "a dog ran"], [banned, plain], use_tqdm=False)
    sequences = banned.bad_words_token_ids or []
    assert tok.encode(word, add_special_tokens=False) in sequences

    def contains(tokens: list[int], ids: list[int]) -> bool:
        return any(tokens[i:i + len(ids)] == ids for i in range(len(tokens)))
    assert any(contains(first, ids) for ids in sequences)  # the word or its spaced variant
    out = got[0].outputs[0].token_ids
    assert out != first and not any(contains(out, ids) for ids in sequences)
    assert got[1].outputs[0].token_ids == base[1].outputs[0].token_ids


def test_bad_words_rule_as_vllm():
    row = torch.zeros(10)
    _apply_bad_words(row, [[3], [4, 5], [6, 7, 8]], [1, 4])
    assert row[3] == float("-inf") and row[5] == float("-inf")  # prefix [4] was generated
    assert row[8] == 0.0  # prefix [6, 7] was not
    row = torch.zeros(10)
    _apply_bad_words(row, [[6, 7, 8]], [6, 7])
    assert row[8] == float("-inf") and int(torch.isinf(row).sum()) == 1

    sp = SamplingParams(bad_words=["ab", "x"])
    table = {"ab": [1, 2], " ab": [3], "x": [4], " x": [4]}
    sp.update_from_tokenizer(lambda text: table[text])
    # " ab" tokenizes to a different length: not a word-initial variant; " x" repeats "x"
    assert sp.bad_words_token_ids == [[1, 2], [4]]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    params = SamplingParams(max_tokens=6, temperature=0.0, truncate_prompt_tokens=10)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT[-10:]
    alone = llm.generate([PROMPT[-10:]], SamplingParams(max_tokens=6, temperature=0.0),
                         use_tqdm=False)[0]
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = llm.generate([PROMPT[:5]], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == PROMPT[:5]
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=10_000), use_tqdm=False)


def test_logits_processors_two_and_three_arguments(llm):
    seen: list[list[int]] = []

    def force_seven(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        seen.append(list(output_ids))
        forced = torch.full_like(logits, float("-inf"))
        forced[7] = 0.0
        return forced

    def ban_seven(prompt_ids: list[int], output_ids: list[int],
                  logits: torch.Tensor) -> torch.Tensor:
        assert prompt_ids == PROMPT[:8]
        logits[7] = float("-inf")
        return logits

    out = llm.generate([PROMPT[:8]], SamplingParams(max_tokens=4, temperature=0.9, seed=1,
                                                    ignore_eos=True,
                                                    logits_processors=[force_seven]),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [7, 7, 7, 7] and seen == [[], [7], [7, 7], [7, 7, 7]]
    out = llm.generate([PROMPT[:8]], SamplingParams(max_tokens=4, temperature=0.0,
                                                    ignore_eos=True,
                                                    logits_processors=[force_seven, ban_seven]),
                       use_tqdm=False)[0]
    assert 7 not in out.outputs[0].token_ids  # applied in order
    with pytest.raises(ValueError, match="logits processor"):
        llm.generate([PROMPT[:8]], SamplingParams(max_tokens=2, logits_processors=[
            lambda ids, logits: None]), use_tqdm=False)


@pytest.mark.parametrize("kwargs, field", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "skip_reading_prefix_cache": False}, "skip_reading_prefix_cache"),
    ({"bad_words": "cat"}, "bad_words"), ({"bad_words": [""]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 1.5}, "truncate_prompt_tokens"),
    ({"logits_processors": [3]}, "logits_processors"),
])
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        SamplingParams(**kwargs)


def test_embed_equals_hf_last_hidden_state(llm, hf):
    prompts = [PROMPT, PROMPT[:7], [1, 9, 9, 9]]
    outs = llm.embed(prompts, use_tqdm=False)
    raw = llm.embed(prompts[1], PoolingParams(normalize=False), use_tqdm=False)[0]
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            h = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1].float()
            got = torch.tensor(out.outputs.embedding)
            assert out.prompt_token_ids == prompt and out.outputs.hidden_size == h.numel()
            assert torch.allclose(got, torch.nn.functional.normalize(h, dim=-1), atol=1e-4)
        h = hf.model(torch.tensor([prompts[1]])).last_hidden_state[0, -1].float()
        assert torch.allclose(torch.tensor(raw.outputs.embedding), h, atol=1e-4)
    text = llm.embed("the cat sat", use_tqdm=False)[0]
    assert text.prompt == "the cat sat" and len(text.outputs.embedding) == h.numel()
    cut = llm.embed([PROMPT], truncate_prompt_tokens=7, use_tqdm=False)[0]
    assert cut.prompt_token_ids == PROMPT[-7:]
    with pytest.raises(ValueError, match="^dimensions"):
        llm.embed([PROMPT], PoolingParams(dimensions=8), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
