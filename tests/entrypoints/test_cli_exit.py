"""`twinserve simulate` run as the program leaves without the interpreter's teardown
(``entrypoints.cli._exit_now``): its output and run folder must be complete all the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_simulate_as_the_program_flushes_its_output_and_writes_its_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "twinserve.entrypoints.cli.main", "simulate", "--trace", "azure-conv",
         "--num-requests", "30", "--out", str(out), "--disable-tqdm"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    # stdout is a pipe here (block-buffered): every line must have been flushed before the exit
    assert "Successful requests:" in proc.stdout
    assert proc.stdout.rstrip().endswith(f"run folder: {out}")
    assert json.loads((out / "summary.json").read_text())["completed"] == 30
    assert len((out / "requests.csv").read_text().splitlines()) == 31


def test_an_error_still_exits_with_its_code(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "twinserve.entrypoints.cli.main", "simulate", "--trace", "no-such",
         "--out", str(tmp_path / "run")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False)
    assert proc.returncode == 2 and "unknown trace" in proc.stderr
