"""Prometheus metrics of one server app, under vLLM's names, in the app's own registry.

Three sources, each read where it is exact:
- the HTTP layer counts what it hands back (``vllm:prompt_tokens``, ``vllm:generation_tokens``,
  ``vllm:request_success`` by ``finished_reason``, aborts included, also of requests aborted
  while still waiting), so the counters match the ``usage`` the clients received; and the
  requests it refused for overload (``twinserve:request_rejected`` by ``reason``);
- at scrape time, on the engine thread, a snapshot of ``scheduler.stats()`` (running, waiting,
  KV usage, prefix-cache queries/hits, preemptions; with speculation vLLM's
  ``vllm:spec_decode_*`` counters, accepted tokens also per draft position);
- at scrape time, the engine's finished ``RequestRecord``s not seen before feed the latency
  histograms (TTFT, ITL, E2E, queue time) with the engine's own timestamps;
- the same records feed vLLM's per-request histograms (prefill time, decode time, mean time
  per output token, prompt and generation token counts); an observer of the engine's steps
  counts ``vllm:iteration_tokens_total`` (the tokens each step computed) on the engine thread
  (with data-parallel replicas, their step messages carry those counts; ``ServerMetrics``);
- ``vllm:cache_config_info``: the KV cache's configuration as labels (value 1), as vLLM has it;
- with LoRA enabled, ``vllm:lora_requests_info`` as vLLM has it: one sample whose labels are
  ``max_lora`` and the comma-separated ``running_lora_adapters`` (the scheduler's) and
  ``waiting_lora_adapters`` (adapters with more sequences in flight than running), whose value
  is the snapshot's time (Unix seconds).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from twinserve.core.metrics import RequestRecord
from twinserve.core.outputs import SchedulerOutput
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


# vLLM's: tokens per engine step (its CUDA-graph sizes)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


def cache_config_labels(async_engine: Any) -> list[dict[str, str]]:
    """``vllm:cache_config_info``'s labels (vLLM's CacheConfig names), one set per engine with
    vLLM's ``engine`` label: the running engine's, or each data-parallel replica's as it
    reported its configuration when ready (the front's own engine holds no real cache)."""
    front = getattr(async_engine, "front", None)
    if front is not None:
        return [_cache_labels(replica.config, str(i))
                for i, replica in enumerate(front.snapshot()) if replica.config is not None]
    config = getattr(async_engine.engine, "engine_config", None)
    return [] if config is None else [_cache_labels(config.to_dict(), "0")]


def _cache_labels(config: dict[str, Any], engine: str) -> dict[str, str]:
    """The labels from an ``EngineConfig.to_dict()``."""
    names = {"block_size": "block_size", "cache_dtype": "kv_cache_dtype",
             "enable_prefix_caching": "enable_prefix_caching",
             "gpu_memory_utilization": "gpu_memory_utilization",
             "num_gpu_blocks": "num_gpu_blocks", "num_cpu_blocks": "num_cpu_blocks",
             "swap_space": "swap_space", "kv_cache_memory_bytes": "kv_cache_bytes"}
    return {**{label: str(config[key]) for label, key in names.items()}, "engine": engine}


class InfoCollector(Collector):
    """A gauge of value 1 whose labels describe a configuration (vLLM's ``*_config_info``), one
    sample per label set (all with the same names)."""

    def __init__(self, name: str, doc: str, label_sets: list[dict[str, str]]) -> None:
        if not label_sets or any(ls.keys() != label_sets[0].keys() for ls in label_sets):
            raise ValueError("an info metric needs label sets with the same names")
        self.name, self.doc, self.label_sets = name, doc, [dict(ls) for ls in label_sets]

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.doc, labels=list(self.label_sets[0]))
        for labels in self.label_sets:
            family.add_metric(list(labels.values()), 1.0)
        yield family


class SchedulerCollector(Collector):
    """Exposes the latest scheduler snapshot (taken on the engine thread at scrape time). With
    data parallelism, one sample per replica with vLLM's ``engine`` label (``engine="0"``...);
    a replica that is down has none."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: SchedulerStats | None = None
        self.per_engine: list[SchedulerStats | None] | None = None

    def _rows(self) -> tuple[list[str], list[tuple[list[str], SchedulerStats]]]:
        if self.per_engine is not None:
            return (["model_name", "engine"],
                    [([self.model_name, str(i)], s) for i, s in enumerate(self.per_engine)
                     if s is not None])
        return ["model_name"], [] if self.stats is None else [([self.model_name], self.stats)]

    def collect(self) -> Iterator[Metric]:
        names, rows = self._rows()
        if not rows:
            return
        gauges = (("vllm:num_requests_running", "Requests in the running batch.", "num_running"),
                  ("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                   "num_waiting"),
                  ("vllm:kv_cache_usage_perc", "KV-cache usage (1 = full).", "kv_cache_usage"),
                  ("vllm:gpu_cache_usage_perc", "KV-cache usage (1 = full), older name.",
                   "kv_cache_usage"))
        counters = (("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.",
                     "prefix_cache_queries"),
                    ("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.",
                     "prefix_cache_hits"),
                    ("vllm:num_preemptions", "Preemptions.", "num_preemptions"),
                    ("vllm:external_prefix_cache_queries",
                     "External prefix-cache queries (the host KV tier), in tokens.",
                     "external_prefix_cache_queries"),
                    ("vllm:external_prefix_cache_hits",
                     "External prefix-cache hits (the host KV tier), in tokens.",
                     "external_prefix_cache_hits"))
        for kind, table in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, doc, attr in table:
                family = kind(name, doc, labels=names)
                for labels, stats in rows:
                    family.add_metric(labels, float(getattr(stats, attr)))
                yield family
        yield from self._speculation(names, rows)

    @staticmethod
    def _speculation(names: list[str], rows: list[tuple[list[str], SchedulerStats]],
                     ) -> Iterator[Metric]:
        """vLLM's ``vllm:spec_decode_*`` counters, when speculation is on (k_max positions)."""
        rows = [(labels, s) for labels, s in rows if s.spec_num_accepted_tokens_per_pos]
        if not rows:
            return
        counters = (("vllm:spec_decode_num_drafts", "Verifications of drafts.", "spec_num_drafts"),
                    ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                     "spec_num_draft_tokens"),
                    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                     "spec_num_accepted_tokens"))
        for name, doc, attr in counters:
            family = CounterMetricFamily(name, doc, labels=names)
            for labels, stats in rows:
                family.add_metric(labels, float(getattr(stats, attr)))
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted, per draft position.",
                                     labels=[*names, "position"])
        for labels, stats in rows:
            for position, value in enumerate(stats.spec_num_accepted_tokens_per_pos or ()):
                family.add_metric([*labels, str(position)], float(value))
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
    """All metrics of one app; nothing is shared with another app in the same process.

    ``num_engines``: the data-parallel replicas behind the app (0: one engine). With replicas,
    every per-request metric and ``vllm:iteration_tokens_total`` carry vLLM's ``engine`` label,
    the replica that served the request or ran the step, as the scheduler's gauges do; a single
    engine's have none (``model_name`` only). Overload refusals (``twinserve:request_rejected``)
    are the front's own and carry no ``engine``."""

    def __init__(self, model_name: str, max_loras: int | None = None, max_model_len: int = 0,
                 cache_configs: list[dict[str, str]] | None = None, num_engines: int = 0) -> None:
        if isinstance(num_engines, bool) or not isinstance(num_engines, int) or num_engines < 0:
            raise ValueError(f"num_engines must be a non-negative integer, got {num_engines!r}.")
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.scheduler = SchedulerCollector(model_name)
        self.registry.register(self.scheduler)
        self.lora_info = LoRAInfoCollector(max_loras) if max_loras else None
        if self.lora_info is not None:
            self.registry.register(self.lora_info)
        # the label values of each engine, in order (one set, ``model_name`` only, for one engine)
        self._engines = ([[model_name, str(i)] for i in range(num_engines)] if num_engines
                         else [[model_name]])
        self._labels = ["model_name", "engine"] if num_engines else ["model_name"]
        reg = self.registry
        self.prompt_tokens = self._per_engine(Counter(
            "vllm:prompt_tokens", "Prefilled prompt tokens.", self._labels, registry=reg))
        self.generation_tokens = self._per_engine(Counter(
            "vllm:generation_tokens", "Generated tokens.", self._labels, registry=reg))
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       [*self._labels, "finished_reason"], registry=reg)
        self.ttft = self._per_engine(Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", self._labels,
            buckets=TTFT_BUCKETS, registry=reg))
        self.itl = self._per_engine(Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", self._labels,
            buckets=ITL_BUCKETS, registry=reg))
        self.e2e = self._per_engine(Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", self._labels,
            buckets=LATENCY_BUCKETS, registry=reg))
        self.queue_time = self._per_engine(Histogram(
            "vllm:request_queue_time_seconds", "Time from arrival to first scheduling.",
            self._labels, buckets=LATENCY_BUCKETS, registry=reg))
        self._add_request_histograms(max_model_len)
        if cache_configs:
            self.registry.register(InfoCollector(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                cache_configs))
        self.request_rejected = Counter(
            "twinserve:request_rejected", "Requests refused for overload (503/429).",
            ["model_name", "reason"], registry=reg)
        for values in self._engines:  # present from the first scrape, at 0
            for reason in ("stop", "length", "abort"):
                self.request_success.labels(*values, reason)
        for reason in REJECT_REASONS:
            self.request_rejected.labels(model_name, reason)

    def _per_engine(self, metric: Any) -> list[Any]:
        """The metric's child of each engine, by engine index."""
        return [metric.labels(*values) for values in self._engines]

    def _engine(self, engine: int) -> int:
        """``engine`` checked against the engines behind the app."""
        if not 0 <= engine < len(self._engines):
            raise ValueError(f"engine {engine} is not one of the app's {len(self._engines)}.")
        return engine

    def _add_request_histograms(self, max_model_len: int) -> None:
        labels, reg = self._labels, self.registry
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.prefill_time = self._per_engine(Histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase "
            "for request.", labels, buckets=LATENCY_BUCKETS, registry=reg))
        self.decode_time = self._per_engine(Histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for "
            "request.", labels, buckets=LATENCY_BUCKETS, registry=reg))
        self.time_per_output_token = self._per_engine(Histogram(
            "vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_"
            "seconds per request.", labels, buckets=ITL_BUCKETS, registry=reg))
        self.request_prompt_tokens = self._per_engine(Histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels,
            buckets=token_buckets, registry=reg))
        self.request_generation_tokens = self._per_engine(Histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            labels, buckets=token_buckets, registry=reg))
        self.iteration_tokens = self._per_engine(Histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            labels, buckets=ITERATION_TOKEN_BUCKETS, registry=reg))

    def on_step(self, out: SchedulerOutput, seconds: float, execute_seconds: float) -> None:
        """A step observer (engine thread): the tokens the step computed."""
        self.iteration_tokens[0].observe(out.total_num_scheduled_tokens)

    # ---- the HTTP layer ------------------------------------------------------------------
    def observe_request_end(self, last: RequestOutput | None, num_samples: int = 0,
                            engine: int = 0) -> None:
        """Counts a request the server handed back (``last`` = its last output, None if it never
        produced a token: its ``num_samples`` samples were aborted while waiting), under the
        engine that served it. Unfinished samples count as aborted."""
        values = self._engines[self._engine(engine)]
        if last is None:
            if num_samples:
                self.request_success.labels(*values, "abort").inc(num_samples)
            return
        self.prompt_tokens[engine].inc(len(last.prompt_token_ids))
        for comp in last.outputs:
            self.generation_tokens[engine].inc(len(comp.token_ids))
            reason = comp.finish_reason or "abort"
            self.request_success.labels(*values, reason).inc()

    def observe_embeddings(self, num_prompt_tokens: int, num_requests: int,
                           engine: int = 0) -> None:
        """Embedding requests the server answered (each prefilled its prompt, then stopped)."""
        values = self._engines[self._engine(engine)]
        self.prompt_tokens[engine].inc(num_prompt_tokens)
        self.request_success.labels(*values, "stop").inc(num_requests)

    def observe_rejection(self, reason: str) -> None:
        self.request_rejected.labels(self.model_name, reason).inc()

    # ---- scrape time ---------------------------------------------------------------------
    def take_engine_snapshot(self, stats: SchedulerStats, records: list[RequestRecord]) -> None:
        """Called with the engine thread's snapshot: ``records`` are the finished-request
        records not seen before."""
        self.scheduler.stats = stats
        for record in records:
            self._observe_record(record, 0)

    def take_replica_snapshot(self, stats: list[SchedulerStats | None],
                              records: list[RequestRecord],
                              step_tokens: Sequence[tuple[int, int]] = ()) -> None:
        """The data-parallel front's snapshot: each replica's stats (None: down), the
        finished-request records its replicas sent since the last one (each naming its
        replica) and ``(replica, tokens)`` of each step they ran since."""
        self.scheduler.per_engine = list(stats)
        for record in records:
            self._observe_record(record, self._engine(record.replica))
        for engine, tokens in step_tokens:
            self.iteration_tokens[self._engine(engine)].observe(tokens)

    def take_lora_snapshot(self, running: list[str], waiting: list[str]) -> None:
        """The adapters' names, running and waiting, as of now."""
        if self.lora_info is not None:
            self.lora_info.snapshot = (running, waiting, time.time())

    def _observe_record(self, record: RequestRecord, engine: int) -> None:
        if record.first_token_time == record.first_token_time:  # not NaN
            self.ttft[engine].observe(max(record.ttft, 0.0))
        if record.first_scheduled_time == record.first_scheduled_time:
            self.queue_time[engine].observe(max(record.queue_time, 0.0))
        if record.finish_time == record.finish_time:
            self.e2e[engine].observe(max(record.e2el, 0.0))
        itl = self.itl[engine]
        for gap in record.itls:
            itl.observe(max(gap, 0.0))
        self.request_prompt_tokens[engine].observe(record.input_tokens)
        self.request_generation_tokens[engine].observe(record.output_tokens)
        first, scheduled, end = (record.first_token_time, record.first_scheduled_time,
                                 record.finish_time)
        if first == first and scheduled == scheduled:  # neither NaN
            self.prefill_time[engine].observe(max(first - scheduled, 0.0))
        if first == first and end == end:
            decode = max(end - first, 0.0)
            self.decode_time[engine].observe(decode)
            if record.output_tokens > 1:
                self.time_per_output_token[engine].observe(decode / (record.output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
