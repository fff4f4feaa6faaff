"""The dependency rule of DESIGN.md, checked on every import statement (inside functions too):

- ``core/`` imports no other project folder, and no torch, simpy, fastapi or pandas;
- ``policies/`` imports ``core/`` only; ``traces/`` imports ``core/`` only; ``routers/`` imports
  ``core/`` only (the twin and the data-parallel front route through the same objects);
- ``spec_decode/`` (draft proposers without a model) imports ``core/`` only, and no torch;
- ``simulator/`` and ``gpu/`` import ``core/``, ``policies/``, ``traces/`` and ``spec_decode/``,
  never each other; ``simulator/`` may import ``routers/``;
- ``planner/`` (the deployment search over twin runs) imports ``core/``, ``policies/``,
  ``traces/``, ``routers/``, ``simulator/`` and ``reports/``;
- ``reports/`` imports ``core/`` only (it reads run results; no backend, no entry point);
- ``fidelity/`` (twin against reality) imports ``core/``, ``policies/``, ``traces/``,
  ``simulator/``, ``gpu/`` and ``reports/``; only ``entrypoints/`` and ``benchmarks/`` import it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT_FOLDERS = ("core", "policies", "routers", "simulator", "gpu", "traces", "reports", "fidelity",
                   "entrypoints", "benchmarks", "spec_decode", "planner")
ALLOWED = {  # the project folders each folder may import, itself included
    "core": {"core"},
    "policies": {"policies", "core"},
    "traces": {"traces", "core"},
    "routers": {"routers", "core"},
    "spec_decode": {"spec_decode", "core"},
    "simulator": {"simulator", "core", "policies", "traces", "routers", "spec_decode"},
    "gpu": {"gpu", "core", "policies", "traces", "spec_decode"},
    "reports": {"reports", "core"},
    "planner": {"planner", "core", "policies", "traces", "routers", "simulator", "reports"},
    "fidelity": {"fidelity", "core", "policies", "traces", "simulator", "gpu", "reports",
                 "routers"},
}
FORBIDDEN_PACKAGES = {"core": {"torch", "simpy", "fastapi", "pandas"},
                      "routers": {"torch", "simpy", "fastapi", "pandas"},
                      "spec_decode": {"torch", "simpy", "fastapi", "pandas"}}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every ``import`` and ``from ... import`` in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append((node.lineno, "." * node.level + (node.module or "")))
    return found


def violations(folder: str) -> list[str]:
    out = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        where = path.relative_to(ROOT)
        for line, module in imported_modules(path):
            if module.startswith("."):
                out.append(f"{where}:{line}: relative import {module!r} (name the folder)")
                continue
            parts = module.split(".")
            if parts[0] in FORBIDDEN_PACKAGES.get(folder, ()):
                out.append(f"{where}:{line}: imports {module}")
            if parts[0] == "twinserve" and len(parts) > 1 and parts[1] in PROJECT_FOLDERS \
                    and parts[1] not in ALLOWED[folder]:
                out.append(f"{where}:{line}: imports {module}")
    return out


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_folder_keeps_the_dependency_rule(folder: str) -> None:
    assert violations(folder) == []


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    from twinserve.gpu.engine import replay\n"
                    "    import torch.nn as nn\n")
    assert imported_modules(path) == [(1, "os"), (4, "twinserve.gpu.engine"), (5, "torch.nn")]


def test_update_from_output_is_called_only_by_the_step_driver() -> None:
    """The step seam is written once: outside the tests, ``core/step_driver.py`` alone applies a
    step's results (``core/scheduler.py`` defines the method)."""
    callers = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".git") or rel.as_posix() == "core/step_driver.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        callers += [f"{rel}:{node.lineno}" for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and node.attr == "update_from_output"
                    and not isinstance(getattr(node, "ctx", None), ast.Store)]
    assert callers == [], callers


def test_every_package_folder_is_listed_in_pyproject() -> None:
    """An installed wheel holds only the packages pyproject.toml lists."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(("twinserve", *p.parent.relative_to(ROOT).parts))
             for folder in PROJECT_FOLDERS for p in (ROOT / folder).rglob("__init__.py")}
    assert found - listed == set()
    assert "twinserve" in listed and listed - found == {"twinserve"}


def test_the_engines_orchestration_imports_no_torch() -> None:
    """``gpu/engine/`` (requests in, outputs out) names no torch or triton itself: the tensors
    stay behind the worker (``gpu/worker/``), so mypy checks it and a reader finds no kernels."""
    found = [f"{path.relative_to(ROOT)}:{line}: imports {module}"
             for path in sorted((ROOT / "gpu" / "engine").rglob("*.py"))
             for line, module in imported_modules(path)
             if module.split(".")[0] in ("torch", "triton")]
    assert found == []
