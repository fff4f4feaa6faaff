"""benchmarks/step_profile.py: every part of a step is timed, the parts add up to the step, and
the timers come off afterwards; benchmarks/kernel_profile.py: one hand-built step op by op."""

import pytest

from twinserve import LLM
from twinserve.benchmarks.step_profile import TIMED, format_breakdown, profile
from twinserve.gpu.engine.llm_engine import LLMEngine


def test_profile_times_every_part_and_removes_its_timers(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama-tied"]), dtype="float32", kv_cache_memory_bytes=1 << 24)
    before = [getattr(owner, attr) for _, owner, attr in TIMED]
    backend = llm.engine.runner.model.backend
    write_kv = backend.write_kv_cache
    prompts = [[5 + i, 6, 7, 8, 9, 10] for i in range(4)]
    parts, steps = profile(llm, prompts, [8, 3, 5, 8])
    assert steps >= 8  # 8 tokens: one prefill step and seven decodes at least
    for part in ("scheduler (schedule + update_from_output)", "weight products: MLP (+ SiLU)",
                 "weight products: q/k/v, o (+ rope)", "attention over the paged KV",
                 "KV cache write", "RMSNorm", "LM head", "sampling"):
        assert parts[part] > 0, part
    assert min(parts.values()) > -1e-3  # exclusive times: nothing counted twice
    assert [getattr(owner, attr) for _, owner, attr in TIMED] == before
    assert backend.write_kv_cache is write_kv
    assert LLMEngine.step.__name__ == "step" and not hasattr(LLMEngine.step, "__wrapped__")
    text = format_breakdown("tiny", parts, steps, 24)
    assert text.splitlines()[0].startswith(f"tiny: {steps} steps")
    assert len(text.splitlines()) == 1 + len(parts)


def test_kernel_profile_times_a_hand_built_step_op_by_op(tiny_model_dirs):
    from twinserve.benchmarks.kernel_profile import parse_step, profile_step
    from twinserve.core.engine_args import EngineArgs
    from twinserve.gpu.worker.model_runner import ModelRunner
    with pytest.raises(ValueError, match="prefill:N or decode:BxC"):
        parse_step("decode:12")
    assert parse_step("decode:3x40").decodes == (40, 40, 40)
    runner = ModelRunner(EngineArgs(model=str(tiny_model_dirs["llama-tied"]), dtype="float32",
                                    max_model_len=128, kv_cache_memory_bytes=1 << 22))
    text = profile_step(runner, parse_step("prefill:16"), 5)
    assert text.startswith("== prefill 16 after 0:") and "ms wall" in text and "aten::" in text
