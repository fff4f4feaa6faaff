"""The server's ``vllm:spec_decode_*`` counters come from the scheduler's speculation totals."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from twinserve.core.scheduler import SchedulerStats
from twinserve.entrypoints.openai.server_metrics import SchedulerCollector


def scrape(stats: SchedulerStats) -> str:
    registry = CollectorRegistry()
    collector = SchedulerCollector("m")
    collector.stats = stats
    registry.register(collector)
    return generate_latest(registry).decode()


def test_spec_decode_counters_under_vllm_names():
    text = scrape(SchedulerStats(1, 0, 0.1, 0, 0, 0, 10, 20, 7, 21, 12, [6, 4, 2]))
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 7.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 21.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0' in text
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 2.0'
            in text)


def test_no_spec_decode_counters_without_speculation():
    text = scrape(SchedulerStats(1, 0, 0.1, 0, 0, 0, 10, 20, 0, 0, 0, []))
    assert "spec_decode" not in text and "vllm:num_preemptions" in text
