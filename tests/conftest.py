"""Shared fixtures: the converted default model, tiny random-weight HF directories, and a helper
that drives ``ModelRunner`` with hand-built ``SchedulerOutput``s."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, a Triton kernel launched in the test process runs in Triton's interpreter (the
# variable must be set before triton is imported). On a GPU it compiles: an interpreter left on
# there would take every CUDA engine test's kernels (their tensors are not host memory).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tests live in folders that mirror the packages; the shared helpers (``core_helpers``,
# ``triton_worker``, ...) stay here. Test files that run themselves as scripts in a subprocess
# find them through PYTHONPATH.
TESTS_DIR = str(Path(__file__).resolve().parent)
if TESTS_DIR not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (TESTS_DIR, os.environ.get("PYTHONPATH", "")) if p)

TINY_VOCAB = 320

# name -> (architecture, config overrides)
TINY_MODELS = {
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-untied-llama3rope": ("llama", {
        "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "qwen2-untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
}


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    """torch's intra-op threads set to 2 for the test (a kernel's OpenMP check), then restored."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF (once per cache, ~40 s the first time)."""
    from twinserve.gpu.models.default_model import default_model_path
    return default_model_path()


def _build_tiny(path: Path, arch: str, overrides: dict) -> Path:
    import transformers
    common = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    torch.manual_seed(0)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():  # larger than the 0.02 init so that greedy choices are well separated
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Llama and Qwen2 directories (GQA; tied and untied embeddings)."""
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: _build_tiny(root / name, arch, overrides)
            for name, (arch, overrides) in TINY_MODELS.items()}


@pytest.fixture(scope="session")
def drive() -> Callable:
    """``drive(runner, requests, plan)`` runs steps given as lists of ``(request, num_new_tokens)``
    and appends sampled tokens; each request owns disjoint blocks ``[64 * i, 64 * i + 64)``."""
    from twinserve.core.outputs import ScheduledRequest, SchedulerOutput

    def run(runner, requests, steps):
        blocks = {r.request_id: list(range(64 * i, 64 * i + 64)) for i, r in enumerate(requests)}
        for step in steps:
            scheduled = []
            for request, n in step:
                start = request.num_computed_tokens
                sample = start + n == request.num_tokens
                scheduled.append(ScheduledRequest(request, start, n, blocks[request.request_id],
                                                  sample))
            out = runner.execute(SchedulerOutput(scheduled=scheduled))
            for sr in scheduled:
                sr.request.num_computed_tokens += sr.num_new_tokens
                if sr.sample:
                    sr.request.append_output_token(out.sampled_token_ids[sr.request_id][0], 0.0)
        return requests

    return run


def hf_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain argmax loop over HF's KV cache (no eos or min-length logic to mirror)."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf(torch.tensor([p]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            for _ in range(max_new_tokens - 1):
                out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                         use_cache=True)
                tokens.append(int(out.logits[0, -1].argmax()))
            outs.append(tokens)
    return outs


PLAIN_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def with_trained_tokenizer(src: Path, dst: Path, corpus: list[str],
                           chat_template: str = PLAIN_CHAT_TEMPLATE) -> Path:
    """A copy of tiny model ``src`` at ``dst`` with a byte-level BPE tokenizer trained on
    ``corpus`` (``<unk>``, ``<s>``, ``</s>`` = ids 0, 1, 2) and ``chat_template`` (a plain one by
    default)."""
    import json
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    shutil.copytree(src, dst)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=TINY_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    assert tok.token_to_id("</s>") == 2 and tok.get_vocab_size() <= TINY_VOCAB
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": chat_template}))
    return dst


TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}


def make_tiny_llama(path: Path) -> Path:
    """An HF directory (config.json + model.safetensors, no tokenizer) of random weights."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    cfg = TINY_CONFIG
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h),
               "model.norm.weight": torch.ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter)})
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture()
def tiny_runner(tiny_model: Path):
    """A runner of the tiny model on one torch thread: two OpenMP threads on a shared 2-core
    host stall on each other's descheduling (tiny steps measured 100x slower), one does not."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    eargs = EngineArgs(str(tiny_model), dtype="float32", max_model_len=256, max_num_seqs=8,
                       max_num_batched_tokens=128, kv_cache_memory_bytes=4 << 20)
    yield eargs, ModelRunner(eargs, usage_context="server")
    torch.set_num_threads(threads)
