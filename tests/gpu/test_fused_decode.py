"""The fused decode step (gpu/kernels/fused_decode.py, csrc/fused_decode.cpp) against its plain reference,
the per-op path, and the int8-activation products (csrc/quant_q8.h) against theirs.

Tolerances:
- int8 activation blocks: ``d`` and ``q`` bit-equal to ``reference_quantize_q8``'s; the products
  within 1e-5 of the sum of absolute products (+1e-6) of the dequantized activations times the
  dequantized weight, as the fp32 products in test_quant_kernels.py (the integer sums are exact).
- fused against per-op, in the same activation mode: with fp32 activations final hidden states
  within 1e-3 of their largest magnitude (fp32 sums in another order; 3e-6 to 5.9e-4 seen on the
  bundled model over 16 random KV caches), with int8 ones a median under 0.5x the int8-vs-fp32
  difference over those 16 and none over 1.5x (see the test); the fused attention within 1e-5 of attend()'s largest output; greedy tokens equal and the chosen tokens' log-probabilities within 2e-3
  (``assert_close_runs``) on random 2-layer models with fp32 activations; with int8 ones within
  0.25 each and 2e-3 in median (an activation on a rounding boundary may quantize one step
  apart in the two paths: ``_assert_close_int8_runs``).
- int8 against fp32 activations on the bundled model (the cost of llama.cpp's scheme): the chosen
  tokens' log-probabilities within 0.3 on the prefix where the greedy tokens agree, and that
  prefix at least 8 of 16 tokens for 3 of the 4 prompts (measured: 0.1-0.2; one prompt's first
  token flips).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from quant_helpers import LOGPROB_TOL, assert_close_runs
from test_gguf_native import write_mixed_gguf
from test_quant_kernels import ROWS, _gguf_tensor

from twinserve import LLM, SamplingParams
from twinserve.gpu.kernels import fused_decode
from twinserve.gpu.layers.attention_backend import AttentionMetadata
from twinserve.gpu.models.model import CausalLM
from twinserve.gpu.quantization import cpu_kernel
from twinserve.gpu.quantization import formats as F
from twinserve.gpu.quantization.quant_tensor import (
    DIRECT_MAX_TOKENS,
    per_sequence_rows,
    reference_dequantize,
    reference_matmul_q8,
    reference_quantize_q8,
)

pytestmark = pytest.mark.skipif(not cpu_kernel.kernel_available(),
                                reason="the C++ quantized kernel cannot be built (no g++?)")
INT8_FORMATS = (F.Q8_0, F.Q4_0, F.Q4_1)
# every batch size 1..64 (the one-token kernel, the GEMM's 4-token tiles and their remainders), then
# past the GEMM's 64-token blocks
INT8_TOKENS = (*range(1, 65), 65, 130)
PROMPTS = [[5, 6, 7], [100, 3, 99, 42, 8, 120, 17, 64, 65, 66], [200] * 20]


def _activations(tokens: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0.0  # an all-zero block: d = 0, q = 0
    return x


@pytest.mark.parametrize("k", [32, 576])
def test_int8_blocks_match_the_reference(k: int) -> None:
    x = _activations(9, k, k)
    raw = cpu_kernel.quantize_q8(x).view(9, k // 32, 40)
    d, q = reference_quantize_q8(x)
    assert torch.equal(raw[:, :, :4].contiguous().view(torch.float32), d)
    assert torch.equal(raw[:, :, 8:].contiguous().view(torch.int8).float(), q)
    s = raw[:, :, 4:8].contiguous().view(torch.float32)
    torch.testing.assert_close(s, d * q.sum(-1, keepdim=True), rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", INT8_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", ROWS)
def test_int8_products_match_the_reference(fmt: F.QuantFormat, rows: int) -> None:
    for k in (32, 64, 576):
        qt = _gguf_tensor(fmt, rows, k, seed=rows + k)
        w = reference_dequantize(qt)
        for tokens in INT8_TOKENS:
            x = _activations(tokens, k, tokens)
            with per_sequence_rows():  # a decode step's products: int8 at every size
                got = qt.matmul(x, int8_activations=True)
            ref = reference_matmul_q8(x, qt)
            d, q = reference_quantize_q8(x)
            bound = (d * q).abs().reshape(x.shape) @ w.abs().t()
            assert bool(((got - ref).abs() <= 1e-5 * bound + 1e-6).all()), (fmt, rows, k, tokens)


def test_prompt_products_above_the_direct_size_keep_fp32_activations() -> None:
    qt = _gguf_tensor(F.Q4_1, 33, 576, seed=3)
    w = reference_dequantize(qt)
    for tokens, int8 in ((DIRECT_MAX_TOKENS, True), (DIRECT_MAX_TOKENS + 1, False)):
        x = _activations(tokens, 576, tokens)
        ref = reference_matmul_q8(x, qt) if int8 else x @ w.t()
        bound = x.abs() @ w.abs().t()
        got = qt.matmul(x, int8_activations=True)
        assert bool(((got - ref).abs() <= 1e-5 * bound + 1e-6).all()), tokens


def test_int8_refuses_the_other_formats() -> None:
    qt = _gguf_tensor(F.Q4_K, 4, 256)
    with pytest.raises(RuntimeError, match="covers Q8_0, Q4_0 and Q4_1"):
        cpu_kernel.quant_matmul_q8(torch.randn(1, 256), qt.data, F.Q4_K.fmt_id)


def _llm(model: str, fused: bool, activations: str) -> LLM:
    return LLM(model, max_num_seqs=8, max_num_batched_tokens=512, dtype="float32",
               kv_cache_memory_bytes=16 << 20, max_model_len=256, fused_decode=fused,
               quant_activations=activations)


def _greedy(llm: LLM, prompts: list, max_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _count_fused_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    run = fused_decode.FusedDecode.run

    def counting(self, *args):
        calls[0] += 1
        return run(self, *args)
    monkeypatch.setattr(fused_decode.FusedDecode, "run", counting)
    return calls


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"])
def test_fused_greedy_matches_the_per_op_path(kind: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A random 2-layer Llama GGUF with every projection in ``kind``: the same greedy tokens
    with the fused step as without, in each activation mode the format has."""
    gguf_file = write_mixed_gguf(tmp_path / f"{kind}.gguf", dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), kind))
    calls = _count_fused_steps(monkeypatch)
    modes = ("fp32", "int8") if kind in ("Q8_0", "Q4_0", "Q4_1") else ("fp32",)
    for mode in modes:
        plain = _greedy(_llm(str(gguf_file), False, mode), PROMPTS, 16)
        assert calls[0] == 0
        fused = _greedy(_llm(str(gguf_file), True, mode), PROMPTS, 16)
        assert calls[0] == 15  # every decode step of the batch (the first token is a prefill's)
        calls[0] = 0
        if mode == "fp32":
            assert_close_runs(fused, plain)
        else:
            _assert_close_int8_runs(fused, plain)


def test_fused_step_serves_decode_batches_above_32(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """40 sequences at once (above ``DIRECT_MAX_TOKENS``): with int8 activations the fused step
    takes every decode step, as the per-op path's products take the integer GEMM, and the runs
    agree; with fp32 activations the per-op path serves them."""
    gguf_file = write_mixed_gguf(tmp_path / "q4_1.gguf", dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_1"))
    sizes: list[int] = []
    run = fused_decode.FusedDecode.run

    def recording(self, hidden, *args):
        sizes.append(hidden.shape[0])
        return run(self, hidden, *args)
    monkeypatch.setattr(fused_decode.FusedDecode, "run", recording)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 250, int(n))] for n in rng.integers(2, 12, 40)]

    def greedy(fused: bool, activations: str) -> list:
        llm = LLM(str(gguf_file), max_num_seqs=64, max_num_batched_tokens=1024, dtype="float32",
                  kv_cache_memory_bytes=32 << 20, max_model_len=64, fused_decode=fused,
                  quant_activations=activations)
        return _greedy(llm, prompts, 6)
    plain = greedy(False, "int8")
    fused = greedy(True, "int8")
    assert sizes == [40] * 5
    _assert_close_int8_runs(fused, plain)
    sizes.clear()
    greedy(True, "fp32")
    assert sizes == []


def _assert_close_int8_runs(a: list, b: list) -> None:
    """int8 activations: the two paths' fp32 sums differ in order upstream of each product, so an
    activation on a rounding boundary can quantize one step apart (``d = max|x| / 127``); on these
    random 2-layer models such a flip moved one token's log-probability by up to 0.084 (1 of 48).
    The greedy tokens must be equal, every log-probability within 0.25 and their median
    difference within ``LOGPROB_TOL`` (a systematic error would move them all)."""
    diffs = []
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        diffs += [abs(next(iter(sx.values())).logprob - next(iter(sy.values())).logprob)
                  for sx, sy in zip(x.logprobs, y.logprobs, strict=True)]
    assert max(diffs) <= 0.25
    assert float(np.median(diffs)) <= LOGPROB_TOL


@pytest.fixture(scope="module")
def bundled_gguf() -> str:
    from twinserve.gpu.models.default_model import gguf_path
    return str(gguf_path())


def _decode_meta(seq_lens: list[int], block_size: int) -> AttentionMetadata:
    """A decode step of len(seq_lens) sequences over disjoint blocks, one new token each."""
    per_seq = max(-(-n // block_size) for n in seq_lens)
    tables = torch.arange(len(seq_lens) * per_seq, dtype=torch.int32).view(len(seq_lens), per_seq)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    pos = lens.long() - 1
    slots = tables.long()[torch.arange(len(seq_lens)), pos // block_size] * block_size \
        + pos % block_size
    return AttentionMetadata(slots, tables, lens, torch.arange(len(seq_lens) + 1, dtype=torch.int32),
                             max_query_len=1, max_seq_len=max(seq_lens))


def test_fused_hidden_states_match_on_the_bundled_gguf(bundled_gguf: str) -> None:
    """One decode step of 3 sequences (contexts 5, 40, 17 over random KV, 16 draws of it) through
    both paths, in both activation modes (one engine each, on the same KV values; the module
    docstring's tolerances)."""
    runners = {mode: _llm(bundled_gguf, True, mode).engine.runner for mode in ("fp32", "int8")}
    block_size = runners["fp32"].block_size
    meta = _decode_meta([5, 40, 17], block_size)
    ids = torch.tensor([17, 4000, 123])
    positions = meta.seq_lens.long() - 1
    ratios = []
    for seed in range(16):
        gen = torch.Generator().manual_seed(seed)
        for layer in zip(*(runner.kv_cache.gpu for runner in runners.values())):
            for values in zip(*layer):  # (key caches, then value caches) of both engines
                draw = torch.randn(values[0].shape, generator=gen)
                for cache in values:
                    cache.copy_(draw)
        out = {}
        for mode, runner in runners.items():
            model = runner.model
            assert model.fused_step() is not None
            out["fused", mode] = model(ids, positions, runner.kv_cache.gpu, meta)
            model.backend.prepare(meta, block_size)
            out["plain", mode] = CausalLM.forward(model, ids, positions, runner.kv_cache.gpu, meta)
        ref = out["plain", "fp32"]
        # fp32 sums in another order (the products', attention's, the vector exp's), compounded
        # over 30 layers: on a 2-core EPYC (AVX2) 0.7-2.3e-5 of the largest value for draws 0-3,
        # on a 2-core Xeon (AVX-512) 3e-6 to 1.4e-4 for all but draw 10 (5.9e-4)
        assert (out["fused", "fp32"] - ref).abs().max() <= 1e-3 * ref.abs().max()
        ratios.append(float((out["fused", "int8"] - out["plain", "int8"]).norm()
                            / (out["plain", "int8"] - ref).norm()))
    # int8: a rounding of an activation that flips by one step moves it by d = max|x| / 127 and 30
    # layers compound it: the two paths' difference as a ratio to int8's own difference from fp32
    # is a chaotic spread over the KV draws, not a drift (draws 0-3 on the EPYC: 0.04-0.40, median
    # 0.13; all 16 on the Xeon, whose wider vectors sum in yet another order: 0.06-1.11, median
    # 0.32), so the median over many draws is held, and each draw only loosely
    assert max(ratios) <= 1.5
    assert float(np.median(ratios)) <= 0.5


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"),
                         [(9, 3, 64), (4, 4, 8), (8, 2, 24), (6, 1, 40), (16, 2, 128)])
def test_fused_attention_matches_the_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    """The fused step's attention (csrc/fused_attention.h: 8-token score tiles, the vector exp,
    head x 32-dimension value tiles) against paged_attention.h's attend() on the same cache:
    contexts across block edges and 8-token tiles, shuffled block tables."""
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
    lens = [1, 7, 8, 9, 16, 17, 33, 70, 160]
    block_size, per = 16, 10
    blocks = len(lens) * per + 3
    key = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen) * 2
    value = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(blocks, generator=gen)[:len(lens) * per].view(len(lens), per).int()
    query = torch.randn(len(lens), heads * head_dim, generator=gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    fast, ref = (torch.ops.twinserve_quant.fused_attention_check(
        query, key, value, tables.contiguous(), seq_lens, heads, kv_heads, head_dim ** -0.5, f)
        for f in (True, False))
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_fused_step_applies_only_where_valid(tmp_path: Path, bundled_gguf: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    mixed = _llm(str(write_mixed_gguf(tmp_path / "mixed.gguf")), True, "int8")
    assert "mixed formats" in fused_decode.unsupported_reason(mixed.engine.runner.model)
    assert mixed.engine.runner.model.fused_step() is None
    off = _llm(bundled_gguf, False, "int8")
    assert fused_decode.unsupported_reason(off.engine.runner.model) == \
        "the engine argument fused_decode is off"
    with pytest.raises(ValueError, match="does not apply: the engine argument fused_decode is off"):
        fused_decode.FusedDecode.for_model(off.engine.runner.model)
    monkeypatch.setattr(cpu_kernel, "kernel_available", lambda: False)  # no g++: reference path
    assert fused_decode.unsupported_reason(mixed.engine.runner.model) == \
        "the C++ quantized kernel is not built"
    with pytest.raises(ValueError, match="fused_decode must be a boolean, got 'yes'"):
        _llm(bundled_gguf, "yes", "int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quant_activations must be one of int8, fp32; got 'int4'"):
        _llm(bundled_gguf, True, "int4")


@pytest.mark.slow
def test_bundled_gguf_fused_and_int8_runs(bundled_gguf: str) -> None:
    """The bundled Q4_1 file, 4 mixed prompts x 16 greedy tokens: fused = per-op (fp32
    activations), and int8 activations close to fp32 ones (the module docstring's measure)."""
    prompts = ["The capital of France is", "def fibonacci(n):\n    ",
               "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
               "1, 1, 2, 3, 5, 8,"]
    exact = _greedy(_llm(bundled_gguf, True, "fp32"), prompts, 16)
    assert_close_runs(exact, _greedy(_llm(bundled_gguf, False, "fp32"), prompts, 16))
    int8 = _greedy(_llm(bundled_gguf, True, "int8"), prompts, 16)
    agreeing = 0
    for a, b in zip(int8, exact):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), 16)
        lp = [[next(iter(s.values())).logprob for s in o.logprobs[:same]] for o in (a, b)]
        assert np.abs(np.subtract(*lp)).max(initial=0.0) < 0.3
        agreeing += same >= 8
    assert agreeing >= 3


def test_fp8_kv_cache_takes_the_per_op_path(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_file = write_mixed_gguf(tmp_path / "q4_0.gguf", dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_0"))
    calls = _count_fused_steps(monkeypatch)
    llm = LLM(str(gguf_file), kv_cache_dtype="fp8", kv_cache_memory_bytes=16 << 20,
              max_model_len=256, dtype="float32")
    assert len(_greedy(llm, PROMPTS[:1], 4)[0].token_ids) == 4
    assert calls[0] == 0 and llm.engine.runner.model.fused_step() is not None


def test_step_profile_shows_the_fused_step(tmp_path: Path) -> None:
    from twinserve.benchmarks.step_profile import profile
    gguf_file = write_mixed_gguf(tmp_path / "q4_1.gguf", dict.fromkeys(
        ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"), "Q4_1"))
    llm = _llm(str(gguf_file), True, "int8")
    parts, steps = profile(llm, PROMPTS, [6, 6, 6])
    assert steps >= 6 and parts["fused decode step (all layers)"] > 0
    assert parts["LM head"] > 0  # the quantized head (QuantizedCausalLM's own compute_logits)
    assert parts["weight products: MLP (+ SiLU)"] > 0  # the prefill's, by the per-op path
    assert min(parts.values()) > -1e-3
