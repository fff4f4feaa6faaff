"""``prefill_first``: vLLM v0's scheduler without chunked prefill, as a setting of the one shared
scheduler (for studies against older vLLM figures or Vidur's ``vllm`` scheduler): a step that
admits waiting prompts runs only them; decodes run in the steps that admit none."""

from __future__ import annotations

import pytest
from core_helpers import make_req, make_scheduler, step

from twinserve.core.engine_args import EngineArgs
from twinserve.entrypoints.cli.main import main
from twinserve.simulator import SimConfig, simulate
from twinserve.traces import first_n, load_trace


def _v0_scheduler(**kw):
    return make_scheduler(enable_chunked_prefill=False, prefill_first=True,
                          max_num_batched_tokens=256, **kw)


def test_a_step_that_admits_prompts_runs_no_decode() -> None:
    sched = _v0_scheduler()
    sched.add_request(make_req("a", 20, 10))
    step(sched, 0.0)  # a's prefill
    out, _ = step(sched, 0.1)
    assert out.num_decode_seqs == 1 and out.num_prefill_seqs == 0  # nothing waits: a decodes
    sched.add_request(make_req("b", 30, 10))
    out, _ = step(sched, 0.2)
    assert (out.num_prefill_seqs, out.num_decode_seqs) == (1, 0)  # b's prompt alone
    out, _ = step(sched, 0.3)
    assert (out.num_prefill_seqs, out.num_decode_seqs) == (0, 2)


def test_without_the_setting_prompts_and_decodes_share_a_step() -> None:
    sched = make_scheduler(enable_chunked_prefill=False, max_num_batched_tokens=256)
    sched.add_request(make_req("a", 20, 10))
    step(sched, 0.0)
    sched.add_request(make_req("b", 30, 10))
    out, _ = step(sched, 0.1)
    assert (out.num_prefill_seqs, out.num_decode_seqs) == (1, 1)


def test_decodes_go_on_while_the_waiting_prompt_cannot_be_admitted() -> None:
    sched = _v0_scheduler(max_num_seqs=1)
    sched.add_request(make_req("a", 20, 3))
    sched.add_request(make_req("b", 20, 3))
    kinds = []
    for k in range(8):
        out, _ = step(sched, 0.1 * k)
        kinds.append((out.num_prefill_seqs, out.num_decode_seqs))
    assert kinds[:5] == [(1, 0), (0, 1), (0, 1), (1, 0), (0, 1)]  # b waits for a's seat


def test_refused_with_chunked_prefill() -> None:
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        EngineArgs(prefill_first=True)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        make_scheduler(prefill_first=True)


def test_the_twin_never_mixes_prompts_and_decodes(tmp_path) -> None:
    trace = first_n(load_trace("azure-conv"), 150)
    v0 = simulate(SimConfig(prefill_first=True, enable_chunked_prefill=False), trace)
    v1 = simulate(SimConfig(enable_chunked_prefill=False), trace)
    assert all(s.num_prefill_tokens == 0 or s.num_decode_tokens == 0 for s in v0.steps)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in v1.steps)
    assert all(r.success for r in v0.records) and len(v0.records) == 150
    # decodes wait behind every prompt: a longer TPOT than the mixed steps give
    assert v0.summary["mean_tpot_ms"] > v1.summary["mean_tpot_ms"]
    rc = main(["simulate", "--num-requests", "40", "--prefill-first", "--no-enable-chunked-prefill",
               "--disable-tqdm", "--out", str(tmp_path / "v0")])
    assert rc == 0 and (tmp_path / "v0" / "steps.csv").is_file()
