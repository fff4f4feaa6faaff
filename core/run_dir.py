"""The run folder every backend writes and the reports read.

    RUN_DIR/
      config.json     what ran: backend (sim | twinserve | vllm), model, hardware, policy, trace, knobs
      requests.csv    one row per request (REQUEST_COLUMNS; times in seconds from the run start,
                      latencies in ms, ``itls_ms`` space-separated)
      steps.csv       one row per engine step (STEP_COLUMNS); absent for client-side runs
      tenants.csv     tokens served per step per tenant (time, tenant, prefill_tokens, output_tokens)
      summary.json    ``metrics.summarize`` (vLLM's benchmark keys)
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from twinserve.core.metrics import RequestRecord, StepRecord

REQUEST_COLUMNS = (
    "request_id", "tenant", "priority", "lora", "arrival_time", "first_scheduled_time",
    "first_token_time", "finish_time", "input_tokens", "output_tokens", "cached_tokens", "num_preemptions",
    "finish_reason", "success", "error", "ttft_ms", "tpot_ms", "e2el_ms", "queue_ms", "itls_ms",
)
STEP_COLUMNS = (
    "time", "duration", "num_seqs", "num_prefill_tokens", "num_decode_tokens", "num_running",
    "num_waiting", "kv_usage", "num_preempted", "replica",
)
TENANT_COLUMNS = ("time", "tenant", "prefill_tokens", "output_tokens")


def _fmt(x: float) -> str:
    return "" if math.isnan(x) else repr(round(x, 9))


def _request_row(r: RequestRecord) -> list[Any]:
    return [
        r.request_id, r.tenant, r.priority, r.lora, _fmt(r.arrival_time),
        _fmt(r.first_scheduled_time), _fmt(r.first_token_time), _fmt(r.finish_time),
        r.input_tokens, r.output_tokens, r.cached_tokens, r.num_preemptions, r.finish_reason,
        int(r.success), r.error,
        _fmt(r.ttft * 1e3), _fmt(r.tpot * 1e3), _fmt(r.e2el * 1e3), _fmt(r.queue_time * 1e3),
        " ".join(f"{g * 1e3:.6g}" for g in r.itls),
    ]


def write_run(
    out_dir: str | Path,
    config: dict[str, Any],
    records: list[RequestRecord],
    summary: dict[str, Any],
    steps: list[StepRecord] | None = None,
) -> Path:
    """Writes a run folder (creating it) and returns its path. Output is byte-identical for
    identical inputs (sorted keys, fixed float formatting)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n")
    (out / "summary.json").write_text(json.dumps(_clean(summary), indent=2, sort_keys=True) + "\n")
    with open(out / "requests.csv", "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(REQUEST_COLUMNS)
        w.writerows(_request_row(r) for r in records)
    if steps is not None:
        _write_steps(out, steps)
    return out


def _write_steps(out: Path, steps: list[StepRecord]) -> None:
    with open(out / "steps.csv", "w", newline="") as f, \
            open(out / "tenants.csv", "w", newline="") as g:
        ws = csv.writer(f, lineterminator="\n")
        wt = csv.writer(g, lineterminator="\n")
        ws.writerow(STEP_COLUMNS)
        wt.writerow(TENANT_COLUMNS)
        for s in steps:
            ws.writerow([_fmt(s.time), _fmt(s.duration), s.num_seqs, s.num_prefill_tokens,
                         s.num_decode_tokens, s.num_running, s.num_waiting, f"{s.kv_usage:.6f}",
                         s.num_preempted, s.replica])
            for tenant in sorted(s.tenant_tokens):
                p, o = s.tenant_tokens[tenant]
                wt.writerow([_fmt(s.time), tenant, p, o])


def _clean(value: Any) -> Any:
    """JSON has no NaN: write null instead."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def read_config(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}
