"""`twinserve simulate` writing a run folder loads only what the run needs (no progress bar
module without a bar, no pipeline, speculation or host-tier module for a plain run) and runs
numpy's OpenBLAS on one thread unless the user said otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = """
import os, sys
from twinserve.entrypoints.cli.main import main
rc = main(sys.argv[1:])
optional = ("tqdm", "twinserve.simulator.pipeline", "twinserve.simulator.spec_cost",
            "twinserve.simulator.kv_offload", "pandas", "plotly", "torch")
print("LOADED", ",".join(m for m in optional if m in sys.modules))
print("BLAS", os.environ.get("OPENBLAS_NUM_THREADS"))
sys.exit(rc)
"""


def _simulate(tmp_path: Path, *extra: str, env: dict[str, str] | None = None) -> dict[str, str]:
    argv = ["simulate", "--num-requests", "40", "--out", str(tmp_path / "run"), *extra]
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True,
                          timeout=300, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "requests.csv").is_file()
    return dict(line.split(" ", 1) for line in proc.stdout.splitlines()
                if line.startswith(("LOADED", "BLAS")))


def test_a_plain_run_loads_no_optional_module(tmp_path) -> None:
    seen = _simulate(tmp_path, "--disable-tqdm",
                     env={k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"})
    assert seen == {"LOADED": "", "BLAS": "1"}


@pytest.mark.parametrize(("extra", "module"), [
    ((), "tqdm"),  # the progress bar is on by default
    (("--disable-tqdm", "--pipeline-parallel-size", "2"), "twinserve.simulator.pipeline"),
])
def test_what_a_run_needs_is_loaded(tmp_path, extra, module) -> None:
    seen = _simulate(tmp_path, *extra, env={**os.environ, "OPENBLAS_NUM_THREADS": "2"})
    assert seen["LOADED"].split(",") == [module]
    assert seen["BLAS"] == "2"  # the user's own setting is kept
