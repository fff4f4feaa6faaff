"""The drafts' acceptance of a real run, kept beside it, and the acceptance a twin replays.

A real replay with speculation writes ``acceptance.json`` (an ``AcceptanceProfile``) into its
run folder: vLLM's per-position counters of the engine's scheduler when the replay had them,
else the per-request totals of ``requests.csv``; with the replay's step-by-step drafts
(``drafts.csv``), also the chain of copying and searching steps (``CopyChain``) and one unit per
request (``RequestUnit``), which the twin then draws (``"draws": "requests"``). The twin of a
run takes the profiles given by the user (measured on other workloads: the held-out check;
several are merged), else
the run's own (then the error table is not held out for acceptance, and the log says so), else
none (speculation off, or ``synthetic`` acceptance whose rates the run's config already holds).
"""

from __future__ import annotations

import csv
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from twinserve.core.draft_record import DRAFTS_FILE, read_drafts
from twinserve.fidelity.backend import Log
from twinserve.simulator.acceptance import AcceptanceProfile, CopyChain, RequestUnit
from twinserve.simulator.acceptance_merge import load_profiles

ACCEPTANCE_FILE = "acceptance.json"


def record_acceptance(run_dir: Path, workload: str,
                      accepted_per_pos: Sequence[int] = ()) -> AcceptanceProfile | None:
    """Writes ``run_dir/acceptance.json`` from the run's requests.csv, its config's k_max (the
    cap ``max_num_speculative_tokens`` where the self-tuning policy may raise k to it) and
    ``accepted_per_pos`` (vLLM's counters, when known) and its ``drafts.csv`` (when written);
    None (nothing written) when no draft was verified."""
    with open(run_dir / "requests.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("success") == "1"]
    if not rows or "spec_num_drafts" not in rows[0]:
        return None
    drafts = sum(int(r["spec_num_drafts"]) for r in rows)
    tokens = sum(int(r["spec_num_draft_tokens"]) for r in rows)
    if not drafts or not tokens:
        return None
    spec = json.loads((run_dir / "config.json").read_text()).get("speculative_config") or {}
    profile = AcceptanceProfile.measured(
        workload, num_drafts=drafts, num_draft_tokens=tokens,
        num_accepted_tokens=sum(int(r["spec_num_accepted_tokens"]) for r in rows),
        k_max=int(spec.get("max_num_speculative_tokens") or spec.get("num_speculative_tokens", 1)),
        output_tokens=sum(int(r["output_tokens"]) for r in rows), num_requests=len(rows),
        accepted_per_pos=accepted_per_pos, source=str(run_dir))
    drafts_file = run_dir / DRAFTS_FILE
    if drafts_file.is_file():
        steps = read_drafts(drafts_file)
        units = RequestUnit.fit(steps)
        profile = dataclasses.replace(profile, chain=CopyChain.fit(steps), requests=units,
                                      draws="requests" if units else "pooled")
    profile.save(run_dir / ACCEPTANCE_FILE)
    return profile


def twin_acceptance(real_dir: Path, given: Sequence[Path],
                    log: Log) -> AcceptanceProfile | None:
    """The acceptance the twin of ``real_dir`` replays (module doc); several files given are
    merged (``simulator.acceptance_merge``)."""
    if given:
        profile = load_profiles(given)
        log(f"acceptance: given ({', '.join(map(str, given))}, measured on "
            f"{profile.workload or 'an unnamed workload'}, mean acceptance length "
            f"{profile.mean_acceptance_length:.2f}, {profile.draws} draws)")
        return profile
    own = real_dir / ACCEPTANCE_FILE
    spec = json.loads((real_dir / "config.json").read_text()).get("speculative_config") or {}
    if not own.is_file() or spec.get("rejection_sample_method") == "synthetic":
        return None  # no drafts verified, or the config's synthetic rates
    profile = AcceptanceProfile.load(own)
    log(f"acceptance: measured on this workload ({own}, {profile.draws} draws; not held out: "
        "pass --acceptance-profile to replay the twin with another workload's)")
    return profile
