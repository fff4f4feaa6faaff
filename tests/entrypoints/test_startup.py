"""The simulator's commands start without the real engine: `twinserve --help` and `simulate`
import no torch (a simulation runs in a process where importing torch fails), and the command
list's help strings are the commands' own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from twinserve.entrypoints.cli.main import COMMANDS, build_parser

REFUSE_BACKENDS = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "fastapi", "transformers", "triton"):
            raise ImportError(name + " imported by a simulator command")
sys.meta_path.insert(0, Refuse())
from twinserve.entrypoints.cli.main import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:
    rc = exc.code
heavy = [m for m in ("torch", "scipy", "pandas", "fastapi", "simpy", "numpy") if m in sys.modules]
print("HEAVY", ",".join(heavy))
sys.exit(rc)
"""


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", REFUSE_BACKENDS, *argv], capture_output=True,
                          text=True, cwd=cwd, timeout=300, check=False)


def _heavy(stdout: str) -> set[str]:
    line = next(line for line in stdout.splitlines() if line.startswith("HEAVY"))
    return {m for m in line.removeprefix("HEAVY").strip().split(",") if m}


def test_help_imports_no_backend(tmp_path: Path) -> None:
    proc = _run("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "simulate" in proc.stdout and _heavy(proc.stdout) == set()


def test_a_simulation_runs_where_torch_cannot_be_imported(tmp_path: Path) -> None:
    proc = _run("simulate", "--num-requests", "50", "--out", str(tmp_path / "run"),
                "--disable-tqdm", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
    heavy = _heavy(proc.stdout)
    assert heavy <= {"simpy", "numpy"}, heavy  # no torch, no scipy (fitting only), no pandas


def test_simulate_help_loads_neither_numpy_nor_the_trace_readers(tmp_path: Path) -> None:
    proc = _run("simulate", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--trace" in proc.stdout and _heavy(proc.stdout) == set()


def test_the_lazy_trace_package_exports_every_name_it_lists() -> None:
    import twinserve.traces as traces
    assert sorted(traces.__all__) == sorted(traces._SOURCES)
    for name in traces.__all__:
        assert getattr(traces, name) is not None
    with pytest.raises(AttributeError, match="no_such_name"):
        traces.no_such_name  # noqa: B018


def test_the_command_list_uses_each_commands_own_help() -> None:
    full = build_parser()
    listed = {a.dest: a.help for a in full._subparsers._group_actions[0]._choices_actions}
    assert listed == {name: help_ for name, (help_, _) in COMMANDS.items()}
    lazy = build_parser(only="report")
    assert set(lazy._subparsers._group_actions[0].choices) == set(COMMANDS)


@pytest.mark.parametrize("command", [c.split() for c in (*COMMANDS, "bench serve")])
def test_every_commands_help_builds(command: list[str], capsys) -> None:
    from twinserve.entrypoints.cli.main import main
    with pytest.raises(SystemExit) as info:
        main([*command, "--help"])
    assert info.value.code == 0
    assert "usage: twinserve " + " ".join(command) in capsys.readouterr().out
