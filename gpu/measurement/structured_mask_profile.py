"""What constrained decoding adds to a step on this machine: the grammar masks filled by
llguidance and applied to the logits, timed per constrained row (calibration's figure for the
twin's ``simulator/structured_cost.py``).

``measure_mask_time`` runs the engine's own code (``StructuredOutputs.bitmask``, then the
sampler's masking of those rows) for batches of 1..N constrained rows whose matchers advance
through a JSON document token by token (a random allowed token each step, seeded), and fits
``seconds = per_step_s + per_row_s * rows`` to the median time of each batch size.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from twinserve.core.request import Request
from twinserve.core.sampling_params import SamplingParams
from twinserve.core.structured_outputs import StructuredOutputsParams
from twinserve.gpu.worker.structured_outputs import StructuredOutputs

# A record with nesting, arrays, enums and bounded strings: the kind of schema JSON mode serves.
PROFILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "kind": {"enum": ["person", "company", "place"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "[0-9]{5}"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "kind", "tags", "address"], "additionalProperties": False}
DEFAULT_ROWS = (1, 8, 32)


@dataclass(frozen=True, slots=True)
class MaskTiming:
    """The fit and the medians it was fitted to (seconds per step, by constrained rows)."""

    per_row_s: float
    per_step_s: float
    rows: tuple[int, ...]
    median_s: tuple[float, ...]


def apply_masks(logits: torch.Tensor, allowed: tuple[list[int], torch.Tensor]) -> torch.Tensor:
    """The sampler's masking of the constrained rows (``gpu/worker/sampler.py``), as it runs there."""
    rows, mask = allowed
    logits = logits.clone()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[idx] = logits[idx].masked_fill(~mask.to(logits.device), float("-inf"))
    return logits


def measure_mask_time(tokenizer_json: Path, vocab_size: int, eos_token_id: int, *,
                      rows: Sequence[int] = DEFAULT_ROWS, steps: int = 24,
                      schema: dict[str, Any] | None = None, seed: int = 0) -> MaskTiming:
    """Times ``steps`` mask steps for each batch size in ``rows`` (see the module doc)."""
    if not rows or any(n < 1 for n in rows) or steps < 1:
        raise ValueError("rows must be positive batch sizes and steps >= 1.")
    structured = StructuredOutputs(Path(tokenizer_json), vocab_size, eos_token_id)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(
        json=schema or PROFILE_SCHEMA))
    generator = torch.Generator().manual_seed(seed)
    medians = []
    for n in rows:
        requests = [Request(f"mask-{n}-{i}", [eos_token_id], params, 0.0,
                            eos_token_id=eos_token_id) for i in range(n)]
        logits = torch.zeros(n, vocab_size)
        structured.bitmask(requests)  # compiles the grammar once (cached per spec)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            allowed = structured.bitmask(requests)
            assert allowed is not None
            masked = apply_masks(logits, allowed)
            times.append(time.perf_counter() - t0)
            tokens = torch.multinomial(torch.softmax(masked, dim=-1), 1,
                                       generator=generator).flatten().tolist()
            structured.advance(requests, tokens)
            for request, token in zip(requests, tokens):
                request.output_token_ids.append(token)
        structured.free([r.request_id for r in requests])
        medians.append(float(np.median(times)))
    per_row, per_step = _fit(list(rows), medians)
    return MaskTiming(per_row, per_step, tuple(rows), tuple(medians))


def _fit(rows: list[int], seconds: list[float]) -> tuple[float, float]:
    """``(per_row, per_step)`` of a least-squares line through the medians, both >= 0."""
    if len(set(rows)) < 2:
        return max(0.0, seconds[0] / rows[0]), 0.0
    slope, intercept = np.polyfit(np.asarray(rows, float), np.asarray(seconds), 1)
    if intercept < 0:
        return max(0.0, float(np.dot(rows, seconds) / np.dot(rows, rows))), 0.0
    return max(0.0, float(slope)), float(intercept)
