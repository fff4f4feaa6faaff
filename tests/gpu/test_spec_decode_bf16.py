"""bf16 greedy decoding with drafts equals decoding without, where the CPU multiplies bf16
natively: a verification's 1 + k rows are bitwise the rows decodes would have computed.

The cause of the difference before: torch's one-row bf16 product summed in another order than
its products of 2+ rows (the last bit of ``down_proj``, 1,536 inputs), so at a near-tie of the
bf16 logits a verification row could pick the other token (``Gemm.pad_single``).
"""

from __future__ import annotations

import pytest
import torch

from twinserve.benchmarks.spec_prompts import V1_TEXTS
from twinserve.gpu.kernels.cpu_gemm import Gemm, cpu_flags, cpu_has_native_half

NATIVE_BF16 = cpu_has_native_half(torch.bfloat16)
needs_native = pytest.mark.skipif(not NATIVE_BF16, reason="the CPU has no native bf16 products")
# Where the CPU has AMX, torch's bf16 product (oneDNN) runs products of up to 32 rows and those of
# 33 or more through two kernels that sum in different orders: rows are independent of the count
# within each class, not across (torch 2.13 on a Xeon with amx_bf16; one class on an EPYC with
# avx512_bf16 only). docs/speculative-decoding.md, "bf16 greedy equality", says what it costs.
SMALL_CLASS_ROWS = 32 if "amx_bf16" in cpu_flags() else None


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(576, 1536), (3072, 576), (49152 // 8, 576)])
def test_rows_of_a_product_do_not_depend_on_the_row_count(shape, threads):
    gemm = Gemm.for_device(torch.device("cpu"), torch.bfloat16)
    assert gemm.pad_single and not gemm.slabs
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=generator) * 0.03).bfloat16()
    x = torch.randn(64, shape[1], generator=generator).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = torch.cat([gemm.linear(x[i:i + 1], weight) for i in range(len(x))])
        large = gemm.linear(x, weight)  # the class of the 64-row product
        for count in (2, 5, 9, 17, 32, 33, 40, 64):
            small = SMALL_CLASS_ROWS is None or count <= SMALL_CLASS_ROWS
            assert torch.equal(gemm.linear(x[:count], weight),
                               rows[:count] if small else large[:count]), count
        if SMALL_CLASS_ROWS is None:  # one class: the single rows' (padded to two)
            assert torch.equal(large, rows)
    finally:
        torch.set_num_threads(before)


COPY_PROMPTS = V1_TEXTS[:2]  # a rename and type hints: copies with edits


@needs_native
@pytest.mark.slow
def test_bundled_model_bf16_greedy_tokens_with_drafts_equal_those_without(default_model_dir):
    """Both prompts parted from plain decoding after 25 tokens before the fix (an exact tie of
    the two best bf16 logits, broken the other way by a last-bit difference in layer 8's MLP)."""
    from twinserve.core.engine_args import EngineArgs
    from twinserve.core.sampling_params import SamplingParams
    from twinserve.entrypoints.chat_template import ChatTemplateOptions, encode_chat
    from twinserve.gpu.engine.llm_engine import LLMEngine
    from twinserve.gpu.worker.model_runner import ModelRunner
    common = dict(model=str(default_model_dir), dtype="bfloat16", max_model_len=512, max_num_seqs=1,
                  kv_cache_memory_bytes=32 << 20)
    owner = ModelRunner(EngineArgs(**common))
    outputs: dict[str, list[list[int]]] = {}
    for method in ("none", "ngram", "suffix"):
        spec = None if method == "none" else {"method": method, "num_speculative_tokens": 4,
                                              "policy": "fixed"}
        args = EngineArgs(**common, speculative_config=spec)
        engine = LLMEngine(args, ModelRunner(args, weights_from=owner))
        outputs[method] = []
        for text in COPY_PROMPTS:
            prompt = encode_chat(engine.tokenizer, [{"role": "user", "content": text}],
                                 ChatTemplateOptions()).token_ids
            engine.add_request(list(prompt), SamplingParams(temperature=0.0, max_tokens=64,
                                                            ignore_eos=True))
            tokens: list[int] = []
            while engine.has_unfinished_requests():
                for out in engine.step():
                    tokens = list(out.outputs[0].token_ids)
            outputs[method].append(tokens)
        if method != "none":
            assert engine.scheduler.spec_num_accepted_tokens > 0, method
    assert all(len(tokens) == 64 for tokens in outputs["none"])
    assert outputs["ngram"] == outputs["none"]
    assert outputs["suffix"] == outputs["none"]
