"""Importing the real backend sets OpenMP's passive wait policy before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ORDER = """
import importlib, sys
seen = []
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "twinserve.gpu"):
            seen.append(name)
sys.meta_path.insert(0, Hook())
importlib.import_module(sys.argv[1])
import os
print(",".join(seen), os.environ.get("OMP_WAIT_POLICY"))
"""


def _run(module: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    proc = subprocess.run([sys.executable, "-c", ORDER, module], capture_output=True, text=True,
                          env={**clean, **env}, timeout=300, check=True)
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["twinserve.entrypoints.llm", "twinserve.entrypoints.server",
                                    "twinserve.gpu.llm_engine"])
def test_engine_entry_points_set_passive_waiting_before_torch(module: str) -> None:
    order, policy = _run(module).split(" ")
    assert order.split(",")[:2] == ["twinserve.gpu", "torch"]
    assert policy == "PASSIVE"


def test_a_policy_the_user_set_is_kept() -> None:
    assert _run("twinserve.gpu", OMP_WAIT_POLICY="ACTIVE").endswith(" ACTIVE")
