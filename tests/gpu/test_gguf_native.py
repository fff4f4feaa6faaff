"""GGUF files run as they are (quantization="gguf") against the fp32 directory converted from the
same file (the same weights after dequantization): greedy tokens equal and the chosen tokens'
log-probabilities within 2e-3 (fp32 accumulation in another order). These runs keep fp32
activations (the engine argument ``quant_activations="fp32"``, the exact path); the default int8
activations are compared with them in tests/gpu/test_fused_decode.py."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pytest
import torch
from quant_helpers import assert_close_runs

from twinserve import LLM, SamplingParams
from twinserve.gpu.quantization.cpu_kernel import kernel_available

pytestmark = pytest.mark.skipif(not kernel_available(),
                                reason="the C++ quantized kernel cannot be built (no g++?)")


def _run(model: str, prompts: list, max_tokens: int, **kwargs) -> list:
    """Greedy outputs in float32 unless ``dtype`` is given (``auto`` is bfloat16 on a CPU with
    native bf16, whose greedy tokens part from float32's after a few), with fp32 activations for
    quantized products unless ``quant_activations`` is given."""
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("quant_activations", "fp32")
    llm = LLM(model, max_num_seqs=8, max_num_batched_tokens=512, kv_cache_memory_bytes=64 << 20,
              max_model_len=256, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _k_quant_blocks(rng: np.random.Generator, kind, rows: int, k: int) -> np.ndarray:
    """Random Q4_K / Q6_K blocks (gguf cannot quantize to them; any bytes decode) with small fp16
    scales."""
    import gguf
    values, nbytes = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (rows, k // values, nbytes), dtype=np.uint8)
    offsets, scale = ((0, 2), 2e-3) if kind.name == "Q4_K" else ((208,), 2e-4)
    for off in offsets:
        half = (rng.standard_normal(data.shape[:2]) * scale).astype(np.float16)
        data[:, :, off:off + 2] = half.view(np.uint8).reshape(*data.shape[:2], 2)
    return data.reshape(rows, -1)


MIXED = MappingProxyType({"attn_q": "Q4_K", "attn_k": "Q6_K", "attn_v": "Q8_0",
                          "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "F32",
                          "ffn_down": "Q6_K"})


def write_mixed_gguf(path: Path, kinds: Mapping[str, str] = MIXED) -> Path:
    """A 2-layer Llama GGUF whose projections have the formats ``kinds`` names (by default they
    mix Q4_K, Q6_K, Q8_0, Q4_0 and Q4_1, q/k/v fused from three formats), an untied Q4_K LM head
    and a Q8_0 embedding."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf_helpers import byte_tokens
    rng = np.random.default_rng(0)
    tokens = [*byte_tokens(), "<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt"]
    hidden, ffn, heads, kv_heads = 256, 512, 4, 2
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_context_length, 256), (w.add_embedding_length, hidden),
                       (w.add_feed_forward_length, ffn), (w.add_block_count, 2),
                       (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
                       (w.add_vocab_size, len(tokens))]:
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3, 3, 1])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)

    def add_tensor(name: str, rows: int, k: int, kind) -> None:
        if kind in (Q.Q4_K, Q.Q6_K):
            data = _k_quant_blocks(rng, kind, rows, k)
        else:
            dense = (rng.standard_normal((rows, k)) * 0.1).astype(np.float32)
            data = dense if kind == Q.F32 else gguf.quants.quantize(dense, kind)
        w.add_tensor(name, data, raw_dtype=None if kind == Q.F32 else kind)
    add_tensor("token_embd.weight", len(tokens), hidden, Q.Q8_0)
    add_tensor("output.weight", len(tokens), hidden, Q.Q4_K)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
                  "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
                  "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
        for name, (rows, k) in shapes.items():
            add_tensor(f"blk.{i}.{name}.weight", rows, k, Q[kinds[name]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_mixed_format_gguf_matches_its_fp32_conversion(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from twinserve.gpu.models.default_model import resolve_model_path
    monkeypatch.setenv("TWINSERVE_CACHE", str(tmp_path / "cache"))
    gguf_file = write_mixed_gguf(tmp_path / "mixed.gguf")
    prompts = [[5, 6, 7], [100, 3, 99, 42, 8, 120, 17, 64, 65, 66], [200] * 20]
    native = _run(str(gguf_file), prompts, 24)
    assert_close_runs(native, _run(str(resolve_model_path(gguf_file)), prompts, 24))
    llm = LLM(str(gguf_file), kv_cache_memory_bytes=16 << 20, max_model_len=64)
    model = llm.engine.runner.model
    qkv = model.layers[0].self_attn.qkv_proj if hasattr(model.layers[0], "self_attn") \
        else model.layers[0].qkv_proj
    from twinserve.gpu.quantization.quant_linear import quant_state
    assert [p.fmt.name for _, p in quant_state(qkv).parts] == ["Q4_K", "Q6_K", "Q8_0"]
    assert model.embed_tokens.numel() == 0 and model.quant_head is not model.quant_embed
    with pytest.raises(ValueError, match="does not match the model, which is 'gguf'"):
        LLM(str(gguf_file), quantization="int8")


@pytest.mark.slow
def test_bundled_q4_1_gguf_matches_the_fp32_directory(default_model_dir: Path) -> None:
    """The bundled SmolLM2 Q4_1 file, natively, against the fp32 directory converted from it:
    a batch of mixed prompts (chat, code, digits, a long one), 32 greedy tokens each."""
    from twinserve.gpu.models.default_model import gguf_path
    prompts = ["The capital of France is", "def fibonacci(n):\n    ",
               "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
               "1, 1, 2, 3, 5, 8,"]
    native = _run(str(gguf_path()), prompts, 32)
    assert_close_runs(native, _run(str(default_model_dir), prompts, 32))


def test_gguf_weights_stay_quantized(default_model_dir: Path) -> None:
    from twinserve.gpu.models.default_model import gguf_path
    from twinserve.gpu.quantization.quant_linear import quantized_weight_bytes
    llm = LLM(str(gguf_path()), kv_cache_memory_bytes=16 << 20, max_model_len=64, dtype="float32")
    model = llm.engine.runner.model
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    blocks = quantized_weight_bytes(model) + model.quant_embed.weight_q.nbytes
    # the file's blocks (30 layers of Q4_1 projections, the Q8_0 table) and its fp32 norms
    file_bytes = gguf_path().stat().st_size
    assert 0.95 * file_bytes < blocks + dense <= file_bytes and dense < 1e6
    ids = torch.tensor([0, 5, 49151])
    np.testing.assert_array_equal(model.embed(ids).numpy(), _fp32_rows(default_model_dir, ids))


def _fp32_rows(model_dir: Path, ids: torch.Tensor) -> np.ndarray:
    from safetensors import safe_open
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_slice("model.embed_tokens.weight")[:][ids].numpy()


@pytest.mark.slow
def test_serve_runs_a_gguf_file(tmp_path: Path) -> None:
    """``twinserve serve FILE.gguf`` (the HTTP server) answers from the file's blocks: the same
    greedy completion as ``LLM`` on the fp32 conversion."""
    import httpx

    from tests.server_fixture import live_server
    from twinserve.gpu.models.default_model import gguf_path
    prompt = "The capital of France is"
    with live_server(["--model", str(gguf_path()), "--quant-activations", "fp32"]) as srv:
        reply = httpx.post(srv.url("/v1/completions"), headers=srv.headers, timeout=120, json={
            "model": str(gguf_path()), "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        text = reply.json()["choices"][0]["text"]
    expected = LLM(max_model_len=64, kv_cache_memory_bytes=16 << 20).generate(
        prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert text == expected
