"""benchmarks/step_profile.py: every part of a step is timed, the parts add up to the step, and
the timers come off afterwards."""

from twinserve import LLM
from twinserve.benchmarks.step_profile import TIMED, format_breakdown, profile
from twinserve.gpu.llm_engine import LLMEngine


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
