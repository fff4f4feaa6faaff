"""A backend calibration's measurement of constrained decoding's mask time, written into the
profile it saves (``structured_mask_s_per_row`` / ``_per_step``; see
``simulator/structured_cost.py``). ``gpu/`` measures, ``simulator/`` reads: they meet here."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_mask_timing(profile_path: Path, runner: Any,
                    log: Callable[[str], None] | None = None) -> Path:
    """Measures the masks on ``runner``'s vocabulary and stores the fit in the profile at
    ``profile_path``; a model without a tokenizer or an EOS token (no constrained decoding)
    leaves the profile's defaults."""
    from twinserve.gpu.measurement.structured_mask_profile import measure_mask_time
    from twinserve.simulator.hardware import load_hardware
    tokenizer_json = Path(runner.model_dir) / "tokenizer.json"
    tokenizer = getattr(runner, "tokenizer", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    if not tokenizer_json.is_file() or eos is None:
        if log is not None:
            log("structured outputs: no tokenizer.json or EOS token, mask time not measured")
        return profile_path
    timing = measure_mask_time(tokenizer_json, int(runner.vocab_size), int(eos))
    if log is not None:
        log(f"structured outputs: grammar masks {timing.per_row_s * 1e3:.3f} ms per "
            f"constrained row + {timing.per_step_s * 1e3:.3f} ms per step")
    profile = dataclasses.replace(load_hardware(profile_path),
                                  structured_mask_s_per_row=timing.per_row_s,
                                  structured_mask_s_per_step=timing.per_step_s)
    return profile.save(profile_path)
