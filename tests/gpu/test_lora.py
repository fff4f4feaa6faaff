"""Multi-LoRA in the real engine: greedy tokens equal HF transformers + PEFT token for token, for
batches that mix the base model and three adapters of different ranks and target modules, under
prefix caching, chunked prefill and preemption, with fewer device slots than adapters; and the
refusals of adapters that cannot be served."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import TINY_VOCAB
from lora_helpers import ADAPTERS, make_adapter, peft_greedy
from safetensors.torch import load_file, save_file

from twinserve.core.engine_args import EngineArgs
from twinserve.core.errors import EngineOverloaded
from twinserve.core.lora import LoRARequest
from twinserve.core.sampling_params import SamplingParams
from twinserve.gpu.engine.llm_engine import LLMEngine

MAX_TOKENS = 12
MODELS = ("llama-untied-llama3rope", "qwen2-tied")
REGIMES = {
    "defaults": {},
    "chunks-of-16": dict(max_num_batched_tokens=16),
    "recompute-preemption": dict(num_gpu_blocks_override=14),
    "swap-preemption": dict(num_gpu_blocks_override=14, preemption_mode="swap"),
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, TINY_VOCAB, (24,), generator=g).tolist()
    own = [torch.randint(3, TINY_VOCAB, (n,), generator=g).tolist() for n in (5, 19, 33, 9, 2)]
    return [*own, shared + own[0], shared + own[1]]


# (prompt index, adapter or None): the same prompt under several adapters and the base model
ASSIGNMENT = [(0, None), (0, "qv4"), (1, "all8"), (2, "mlp16"), (3, None), (4, "qv4"),
              (5, "all8"), (6, "mlp16"), (5, None), (6, "qv4"), (1, "mlp16"), (3, "all8")]


@pytest.fixture(scope="module")
def adapters(tiny_model_dirs, tmp_path_factory) -> dict[str, dict[str, str]]:
    root = tmp_path_factory.mktemp("adapters")
    return {model: {name: str(make_adapter(tiny_model_dirs[model], root / model / name, spec, k))
                    for k, (name, spec) in enumerate(ADAPTERS.items())} for model in MODELS}


@pytest.fixture(scope="module")
def expected(tiny_model_dirs, adapters) -> dict[str, dict[str | None, list[list[int]]]]:
    prompts = _prompts()
    return {model: {name: peft_greedy(tiny_model_dirs[model],
                                      None if name is None else adapters[model][name],
                                      prompts, MAX_TOKENS)
                    for name in (None, *ADAPTERS)} for model in MODELS}


def _engine(model_dir, **overrides) -> LLMEngine:
    args = dict(model=str(model_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=1 << 22,
                swap_space=0.01, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    return LLMEngine(EngineArgs(**{**args, **overrides}))


def _run(engine: LLMEngine, adapter_dirs: dict[str, str]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    ids_ = {name: k + 1 for k, name in enumerate(ADAPTERS)}
    ids = []
    for index, name in ASSIGNMENT:
        lora = None if name is None else LoRARequest(name, ids_[name], adapter_dirs[name])
        ids.append(engine.add_request(prompts[index], params, lora_request=lora))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[i] for i in ids]


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("model", MODELS)
def test_mixed_adapter_batches_give_peft_greedy_tokens(model, regime, tiny_model_dirs, adapters,
                                                       expected):
    engine = _engine(tiny_model_dirs[model], **REGIMES[regime])
    counter = _AdapterCounter()
    engine.driver.observers.append(counter)
    got = _run(engine, adapters[model])
    want = [expected[model][name][index] for index, name in ASSIGNMENT]
    assert got == want
    # the adapters change the tokens (the comparison would be weak otherwise)
    assert expected[model]["qv4"][0] != expected[model][None][0]
    sched = engine.scheduler
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks
    assert sched.loras.num_active == 0 and sched.loras.num_loads > 2  # 3 adapters, 2 slots
    assert not any(engine.runner.lora.is_pinned(n) for n in ADAPTERS)
    assert max(counter.per_step) == 2  # never more than max_loras, and the slots are used
    if "preemption" in regime:
        assert sched.num_preemptions > 0


class _AdapterCounter:
    """A step observer: the distinct adapters of each step."""

    def __init__(self) -> None:
        self.per_step: list[int] = []

    def on_step(self, out, seconds: float, execute_seconds: float) -> None:
        self.per_step.append(len({sr.request.lora for sr in out.scheduled} - {None}))


def test_same_prompt_under_two_adapters_shares_no_blocks(tiny_model_dirs, adapters):
    model = MODELS[0]
    engine = _engine(tiny_model_dirs[model])
    prompt = _prompts()[5]  # 29 tokens: one full block of 16 could be shared
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for k, name in enumerate(("qv4", "all8", "qv4")):
        engine.add_request(prompt, params, lora_request=LoRARequest(name, k % 2 + 1,
                                                                    adapters[model][name]))
        while engine.has_unfinished_requests():
            engine.step()
    kv = engine.scheduler.kv
    assert kv.prefix_hits == 16  # only the third (same adapter as the first) hit the cache


def test_llm_generate_takes_one_lora_request_or_one_per_prompt(tiny_model_dirs, adapters,
                                                               expected):
    from twinserve.entrypoints.llm import LLM
    model = MODELS[1]
    llm = LLM(str(tiny_model_dirs[model]), dtype="float32", kv_cache_memory_bytes=1 << 22,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    one = LoRARequest("all8", 2, adapters[model]["all8"])
    outs = llm.generate(prompts, params, lora_request=one, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected[model]["all8"][:3]
    per = [None, one, LoRARequest("mlp16", 3, adapters[model]["mlp16"])]
    outs = llm.generate(prompts, params, lora_request=per, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == [
        expected[model][None][0], expected[model]["all8"][1], expected[model]["mlp16"][2]]


def _bad_copy(src: str, dst, edit) -> str:
    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def _edit_config(**changes):
    def edit(path) -> None:
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(cfg))
    return edit


def _edit_tensor(path) -> None:
    file = path / "adapter_model.safetensors"
    tensors = load_file(file)
    key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, file)


def _pickled(path) -> None:
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")


@pytest.mark.parametrize("edit, match", [
    (_edit_config(r=32), "rank 32 is above max_lora_rank 16"),
    (_edit_config(target_modules=["q_proj", "embed_tokens"]), r"target_modules \['embed_tokens'\]"),
    (_edit_config(use_dora=True), "use_dora=True is not supported"),
    (_edit_config(modules_to_save=["lm_head"]), "modules_to_save"),
    (_edit_config(layer_replication=[[0, 2]]), "layer_replication"),
    (_edit_tensor, "needs"),
    (_pickled, "adapter_model.bin is a pickle"),
])
def test_adapters_that_do_not_fit_are_refused_with_the_reason(tiny_model_dirs, adapters, tmp_path,
                                                              edit, match):
    model = MODELS[0]
    engine = _engine(tiny_model_dirs[model])
    bad = _bad_copy(adapters[model]["qv4"], tmp_path / "bad", edit)
    if "32" in match:  # the tensors must agree with the rank the config claims
        bad = _bad_copy(str(make_adapter(tiny_model_dirs[model], tmp_path / "r32",
                                         ADAPTERS["qv4"].__class__(32, 8.0, ("q_proj",)), 9)),
                        tmp_path / "bad32", lambda p: None)
    with pytest.raises(ValueError, match=match):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=2),
                           lora_request=LoRARequest("bad", 9, bad))
    # the engine goes on: nothing queued, nothing pinned, a good adapter still serves
    assert not engine.has_unfinished_requests()
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=2),
                       lora_request=LoRARequest("qv4", 1, adapters[model]["qv4"]))
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.runner.lora.is_pinned("qv4")


def test_missing_directory_disabled_lora_and_conflicting_names_are_refused(tiny_model_dirs,
                                                                           adapters, tmp_path):
    model = MODELS[0]
    params = SamplingParams(max_tokens=2)
    engine = _engine(tiny_model_dirs[model])
    with pytest.raises(ValueError, match="no such directory"):
        engine.add_request([5, 6], params, lora_request=LoRARequest("x", 1, str(tmp_path / "no")))
    engine.add_request([5, 6], params, lora_request=LoRARequest("qv4", 1, adapters[model]["qv4"]))
    with pytest.raises(ValueError, match="one name, one adapter"):
        engine.add_request([5, 6], params,
                           lora_request=LoRARequest("qv4", 2, adapters[model]["all8"]))
    plain = LLMEngine(EngineArgs(model=str(tiny_model_dirs[model]), dtype="float32",
                                 kv_cache_memory_bytes=1 << 22))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_request([5, 6], params,
                          lora_request=LoRARequest("qv4", 1, adapters[model]["qv4"]))


def test_host_memory_full_of_adapters_in_use_is_an_overload(tiny_model_dirs, adapters):
    model = MODELS[0]
    engine = _engine(tiny_model_dirs[model], max_cpu_loras=2)
    params = SamplingParams(max_tokens=2)
    for k, name in enumerate(("qv4", "all8")):
        engine.add_request([5, 6], params,
                           lora_request=LoRARequest(name, k + 1, adapters[model][name]))
    with pytest.raises(EngineOverloaded, match="max_cpu_loras"):
        engine.add_request([5, 6], params,
                           lora_request=LoRARequest("mlp16", 3, adapters[model]["mlp16"]))
    while engine.has_unfinished_requests():
        engine.step()
    # once the others are done, their host entries make room
    engine.add_request([5, 6], params,
                       lora_request=LoRARequest("mlp16", 3, adapters[model]["mlp16"]))
    assert [a.name for a in engine.runner.lora.loaded()] == ["all8", "mlp16"]


@pytest.mark.slow
def test_bundled_model_with_two_adapters_gives_peft_greedy_tokens(default_model_dir, tmp_path):
    """SmolLM2-135M with a rank-8 all-projection adapter and a rank-4 q/v adapter beside base
    requests in one batch, fp32, against HF + PEFT."""
    from lora_helpers import AdapterSpec
    specs = {"all8": ADAPTERS["all8"], "qv4": AdapterSpec(4, 16.0, ("q_proj", "v_proj"))}
    dirs = {name: str(make_adapter(default_model_dir, tmp_path / name, spec, k, scale=0.05))
            for k, (name, spec) in enumerate(specs.items())}
    prompts = [[1, 504, 3458, 314, 260, 1345, 282], [1, 10766, 17, 1218, 2442, 30, 33, 34, 35]]
    want = {name: peft_greedy(default_model_dir, dirs.get(name), prompts, 16)
            for name in (None, *specs)}
    assert want["all8"] != want[None] and want["qv4"] != want[None]
    engine = _engine(default_model_dir, kv_cache_memory_bytes=1 << 26)
    got = _greedy_by_adapter(engine, dirs, prompts, 16)
    assert got == {(name, p): want[name][p] for name in want for p in range(len(prompts))}


@pytest.mark.parametrize("family", ["mistral", "qwen3", "llama-biases"])
def test_every_family_with_adapters_gives_peft_greedy_tokens(family, tmp_path):
    """Mistral, Qwen3 (q/k norms, head_dim != hidden / heads: q_proj's LoRA B is wider than the
    hidden size) and Llama with biases, each with two adapters beside the base model."""
    from test_architectures import _hf_model
    base = tmp_path / family
    _hf_model(family).save_pretrained(base, safe_serialization=True)
    names = ("all8", "qv4")
    dirs = {n: str(make_adapter(base, tmp_path / n, ADAPTERS[n], k)) for k, n in enumerate(names)}
    prompts = [[3 + t % 150 for t in p] for p in _prompts()[:3]]  # the families' vocabulary: 160
    want = {n: peft_greedy(base, dirs.get(n), prompts, MAX_TOKENS) for n in (None, *names)}
    assert want["all8"] != want[None]
    got = _greedy_by_adapter(_engine(base), dirs, prompts, MAX_TOKENS)
    assert got == {(n, p): want[n][p] for n in want for p in range(len(prompts))}


def _greedy_by_adapter(engine: LLMEngine, dirs: dict[str, str], prompts: list[list[int]],
                       max_tokens: int) -> dict[tuple[str | None, int], list[int]]:
    """Every prompt under the base model and under each adapter of ``dirs``, in one batch."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = {}
    for k, name in enumerate((None, *dirs)):
        lora = None if name is None else LoRARequest(name, k, dirs[name])
        for p, prompt in enumerate(prompts):
            ids[engine.add_request(prompt, params, lora_request=lora)] = (name, p)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[ids[out.request_id]] = list(out.outputs[0].token_ids)
    return got


def test_calibration_measures_adapter_steps_and_fits_their_terms(tiny_model_dirs, tmp_path):
    """``measure_lora`` times steps with 1..max_loras adapters, loaded in the step or resident;
    the fit over them and the base micro-benchmarks holds LoRA coefficients, and the samples'
    LoRA features survive the CSV."""
    from twinserve.core.lora import LORA_FEATURE_NAMES
    from twinserve.core.step_sample import read_samples, write_samples
    from twinserve.gpu.measurement.profiler import default_grid, measure_lora, run_micro_benchmarks
    from twinserve.simulator.calibration import fit_backend
    runner = _engine(tiny_model_dirs[MODELS[0]], max_num_seqs=16).runner
    lora = measure_lora(runner, str(tmp_path), quick=True, repeats=2)
    loaded = [s for s in lora if s.lora_features["lora_load_bytes"] > 0]
    assert loaded and len(loaded) == len(lora) // 2
    assert {s.lora_features["num_lora_adapters"] for s in lora} == {1.0, 2.0}
    assert not any(runner.lora.is_pinned(a.name) for a in runner.lora.loaded())
    micro = run_micro_benchmarks(runner, default_grid(256, 16, 256, quick=True), repeats=2)
    cal = fit_backend(micro, [], "tiny", None, lora)
    assert set(LORA_FEATURE_NAMES) <= set(cal.forward.coefficients)
    assert "LoRA steps" in cal.report
    # each loaded step is its resident twin plus the adapters' bytes (same products, same count)
    resident = [s for s in lora if s.lora_features["lora_load_bytes"] == 0]
    for a, b in zip(loaded, resident):
        assert a.aggregates == b.aggregates
        assert {k: v for k, v in a.lora_features.items() if k != "lora_load_bytes"} == \
            {k: v for k, v in b.lora_features.items() if k != "lora_load_bytes"}
    back = read_samples(write_samples(tmp_path / "s.csv", [*micro, *lora]))
    assert [s.lora_features for s in back] == [s.lora_features for s in (*micro, *lora)]


def test_real_replay_of_a_trace_naming_adapters_is_refused(tiny_model_dirs):
    """A trace's adapter names carry no weights: the real replay refuses them by name rather
    than serve those requests with the base model."""
    from twinserve.gpu.engine.replay import replay_real
    from twinserve.traces import TraceRequest
    engine = _engine(tiny_model_dirs[MODELS[0]])
    trace = [TraceRequest("r0", 0.0, 8, 2), TraceRequest("r1", 0.0, 8, 2, lora="sql")]
    with pytest.raises(ValueError, match="'r1' of the trace names LoRA adapter 'sql'"):
        replay_real(engine, trace, progress=False)
    assert not engine.has_unfinished_requests()


def test_three_adapters_in_one_step_take_the_batched_products(tiny_model_dirs, adapters, expected):
    """With 3+ slots a step's adapters go through the stacked (bmm) products: same tokens."""
    model = MODELS[0]
    engine = _engine(tiny_model_dirs[model], max_loras=4, max_cpu_loras=4)
    counter = _AdapterCounter()
    engine.driver.observers.append(counter)
    got = _run(engine, adapters[model])
    assert got == [expected[model][name][index] for index, name in ASSIGNMENT]
    assert max(counter.per_step) == 3


def test_slot_stacked_copies_are_kept_only_within_their_budget(tiny_model_dirs):
    """The CPU's padded copies for the batched products duplicate every slot: a large model
    with many wide slots goes without them (the per-adapter loop), a small one keeps them."""
    from twinserve.core.lora import LoRAConfig
    from twinserve.gpu.lora.lora_manager import STACKED_BUDGET_BYTES, LoRAManager
    from twinserve.simulator.model_spec import load_model_spec
    big = LoRAManager._stacked_bytes(load_model_spec("llama-3.1-8b"), LoRAConfig(8, 64, 8))
    assert big > STACKED_BUDGET_BYTES
    engine = _engine(tiny_model_dirs[MODELS[0]], max_loras=4, max_cpu_loras=4)
    assert all(w.stacked and w._cpu_a is not None for w in engine.runner.lora.layers[0])
