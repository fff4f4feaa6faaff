"""A data-parallel server's per-request metrics carry vLLM's ``engine`` label: each request
under the replica that served it, each step under the replica that ran it; one engine's have
only ``model_name``."""

from __future__ import annotations

import pytest

from tests.dp_fakes import FakeReplicas, NullSink
from twinserve.core.engine_args import EngineArgs
from twinserve.core.metrics import RequestRecord
from twinserve.core.request_output import CompletionOutput, RequestOutput
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.scheduler import SchedulerStats
from twinserve.entrypoints import dp_front
from twinserve.entrypoints.openai.server_metrics import ServerMetrics
from twinserve.gpu.engine.dp_client import ReplicaEvent


def _record(rid: str, replica: int, output_tokens: int = 3) -> RequestRecord:
    return RequestRecord(rid, 0.0, 0.01, 0.05, 0.2, 12, output_tokens, replica=replica)


def _output(rid: str, tokens: int, reason: str | None = "length") -> RequestOutput:
    return RequestOutput(rid, None, [1] * 12,
                         [CompletionOutput(0, token_ids=[2] * tokens, finish_reason=reason)],
                         finished=True)


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name{labels}`` in a Prometheus text page (None: absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(part.split("=", 1) for part in line[len(name) + 1:line.index("}")]
                     .split(","))
        if {k: v.strip('"') for k, v in found.items()} == labels:
            return float(line.rsplit(" ", 1)[1])
    return None


def test_each_replicas_requests_and_steps_are_counted_under_its_engine() -> None:
    metrics = ServerMetrics("m", max_model_len=64, num_engines=2)
    stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0)
    metrics.take_replica_snapshot([stats, stats],
                                  [_record("a", 0), _record("b", 1), _record("c", 1)],
                                  [(1, 40), (1, 3), (0, 12)])
    metrics.observe_request_end(_output("b", 5), 1, engine=1)
    metrics.observe_request_end(None, 2, engine=0)  # two samples aborted while waiting
    text = metrics.render().decode()
    ttft = "vllm:time_to_first_token_seconds_count"
    assert _sample(text, ttft, model_name="m", engine="0") == 1
    assert _sample(text, ttft, model_name="m", engine="1") == 2
    steps = "vllm:iteration_tokens_total_count"
    assert _sample(text, steps, model_name="m", engine="0") == 1
    assert _sample(text, steps, model_name="m", engine="1") == 2
    assert _sample(text, "vllm:iteration_tokens_total_sum", model_name="m", engine="1") == 43
    assert _sample(text, "vllm:generation_tokens_total", model_name="m", engine="1") == 5
    assert _sample(text, "vllm:generation_tokens_total", model_name="m", engine="0") == 0
    success = "vllm:request_success_total"
    assert _sample(text, success, model_name="m", engine="1", finished_reason="length") == 1
    assert _sample(text, success, model_name="m", engine="0", finished_reason="abort") == 2
    assert _sample(text, success, model_name="m", engine="1", finished_reason="stop") == 0
    # refusals are the front's: no engine
    metrics.observe_rejection("max_waiting_requests")
    text = metrics.render().decode()
    assert _sample(text, "twinserve:request_rejected_total", model_name="m",
                   reason="max_waiting_requests") == 1


def test_one_engines_metrics_have_no_engine_label() -> None:
    metrics = ServerMetrics("m", max_model_len=64)
    metrics.take_engine_snapshot(SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0), [_record("a", 0)])
    metrics.observe_request_end(_output("a", 3, "stop"))
    text = metrics.render().decode()
    assert _sample(text, "vllm:time_to_first_token_seconds_count", model_name="m") == 1
    assert _sample(text, "vllm:request_success_total", model_name="m",
                   finished_reason="stop") == 1
    assert 'engine="' not in text


def test_an_engine_outside_the_app_is_refused_by_name() -> None:
    metrics = ServerMetrics("m", num_engines=2)
    with pytest.raises(ValueError, match="engine 2"):
        metrics.observe_request_end(_output("a", 1), 1, engine=2)
    with pytest.raises(ValueError, match="engine 1"):
        ServerMetrics("m").observe_embeddings(4, 1, engine=1)
    with pytest.raises(ValueError, match="num_engines"):
        ServerMetrics("m", num_engines=-1)


def test_the_front_keeps_each_replicas_step_tokens_for_the_scrape(monkeypatch) -> None:
    monkeypatch.setattr(dp_front, "make_replica_set", FakeReplicas)
    front = dp_front.DataParallelFront(EngineArgs(data_parallel_size=2), "llm", on_cuda=False)
    try:
        stats = SchedulerStats(1, 0, 0.1, 0, 0, 0, 0, 0)
        index = front.submit("a", list(range(20)), SamplingParams(max_tokens=2), {}, NullSink())
        front._handle(ReplicaEvent(index, "message",
                                   ("step", [], ["a"], [], stats, [], [], [], [20, 1])))
        front._handle(ReplicaEvent(1 - index, "message",
                                   ("step", [], [], [], stats, [], [], [])))  # (no tokens sent)
        assert front.take_step_tokens() == [(index, 20), (index, 1)]
        assert front.take_step_tokens() == []
    finally:
        front.shutdown()
