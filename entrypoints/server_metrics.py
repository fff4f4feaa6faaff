"""Prometheus metrics of one server app, under vLLM's names, in the app's own registry.

Three sources, each read where it is exact:
- the HTTP layer counts what it hands back (``vllm:prompt_tokens``, ``vllm:generation_tokens``,
  ``vllm:request_success`` by ``finished_reason``, aborts included, also of requests aborted
  while still waiting), so the counters match the ``usage`` the clients received; and the
  requests it refused for overload (``twinserve:request_rejected`` by ``reason``);
- at scrape time, on the engine thread, a snapshot of ``scheduler.stats()`` (running, waiting,
  KV usage, prefix-cache queries/hits, preemptions);
- at scrape time, the engine's finished ``RequestRecord``s not seen before feed the latency
  histograms (TTFT, ITL, E2E, queue time) with the engine's own timestamps;
- with LoRA enabled, ``vllm:lora_requests_info`` as vLLM has it: one sample whose labels are
  ``max_lora`` and the comma-separated ``running_lora_adapters`` (the scheduler's) and
  ``waiting_lora_adapters`` (adapters with more sequences in flight than running), whose value
  is the snapshot's time (Unix seconds).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from twinserve.core.metrics import RequestRecord
from twinserve.core.request_output import RequestOutput
from twinserve.core.scheduler import SchedulerStats

REJECT_REASONS = ("max_waiting_requests", "max_waiting_tokens", "max_tenants",
                  "max_requests_per_tenant", "max_cpu_loras")

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class SchedulerCollector(Collector):
    """Exposes the latest scheduler snapshot (taken on the engine thread at scrape time)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: SchedulerStats | None = None

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        labels = [self.model_name]
        gauges = (("vllm:num_requests_running", "Requests in the running batch.",
                   stats.num_running),
                  ("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                   stats.num_waiting),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", stats.kv_cache_usage),
                  ("vllm:gpu_cache_usage_perc", "KV-cache usage (1 = full), older name.",
                   stats.kv_cache_usage))
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family
        counters = (("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.",
                     stats.prefix_cache_queries),
                    ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.",
                     stats.prefix_cache_hits),
                    ("vllm:num_preemptions", "Preemptions.", stats.num_preemptions))
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, float(value))
            yield family


class LoRAInfoCollector(Collector):
    """``vllm:lora_requests_info`` from the latest snapshot (none before the first)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.snapshot: tuple[list[str], list[str], float] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.snapshot is None:
            return
        running, waiting, when = self.snapshot
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters",
                                           "running_lora_adapters"])
        family.add_metric([str(self.max_loras), ",".join(waiting), ",".join(running)], when)
        yield family


class ServerMetrics:
    """All metrics of one app; nothing is shared with another app in the same process."""

    def __init__(self, model_name: str, max_loras: int | None = None) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerCollector(model_name)
        self.registry.register(self.scheduler)
        self.lora_info = LoRAInfoCollector(max_loras) if max_loras else None
        if self.lora_info is not None:
            self.registry.register(self.lora_info)
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                         registry=reg).labels(model_name)
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       labels + ["finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.",
                             labels, buckets=ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Time from arrival to first scheduling.", labels,
                                    buckets=LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.request_rejected = Counter(
            "twinserve:request_rejected", "Requests refused for overload (503/429).",
            labels + ["reason"], registry=reg)
        for reason in ("stop", "length", "abort"):  # present from the first scrape, at 0
            self.request_success.labels(model_name, reason)
        for reason in REJECT_REASONS:
            self.request_rejected.labels(model_name, reason)

    # ---- the HTTP layer ------------------------------------------------------------------
    def observe_request_end(self, last: RequestOutput | None, num_samples: int = 0) -> None:
        """Counts a request the server handed back (``last`` = its last output, None if it never
        produced a token: its ``num_samples`` samples were aborted while waiting). Unfinished
        samples count as aborted."""
        if last is None:
            if num_samples:
                self.request_success.labels(self.model_name, "abort").inc(num_samples)
            return
        self.prompt_tokens.inc(len(last.prompt_token_ids))
        for comp in last.outputs:
            self.generation_tokens.inc(len(comp.token_ids))
            reason = comp.finish_reason or "abort"
            self.request_success.labels(self.model_name, reason).inc()

    def observe_rejection(self, reason: str) -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    # ---- scrape time ---------------------------------------------------------------------
    def take_engine_snapshot(self, stats: SchedulerStats, records: list[RequestRecord]) -> None:
        """Called with the engine thread's snapshot: ``records`` are the finished-request
        records not seen before."""
        self.scheduler.stats = stats
        for record in records:
            self._observe_record(record)

    def take_lora_snapshot(self, running: list[str], waiting: list[str]) -> None:
        """The adapters' names, running and waiting, as of now."""
        if self.lora_info is not None:
            self.lora_info.snapshot = (running, waiting, time.time())

    def _observe_record(self, record: RequestRecord) -> None:
        if record.first_token_time == record.first_token_time:  # not NaN
            self.ttft.observe(max(record.ttft, 0.0))
        if record.first_scheduled_time == record.first_scheduled_time:
            self.queue_time.observe(max(record.queue_time, 0.0))
        if record.finish_time == record.finish_time:
            self.e2e.observe(max(record.e2el, 0.0))
        for gap in record.itls:
            self.itl.observe(max(gap, 0.0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
