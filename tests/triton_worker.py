"""The subprocess pattern of the Triton kernel tests: a test file run as a script is the worker
(its checks run in a process whose TRITON_INTERPRET was set before triton was imported) and
prints one ``RESULTS`` JSON line; the tests assert on its entries."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from types import ModuleType

Check = Callable[[], tuple[float, float]]


def run_checks(checks: dict[str, Check]) -> dict[str, dict]:
    out = {}
    for name, check in checks.items():
        try:
            err, tol = check()
            out[name] = {"err": err, "tol": tol, "ok": err <= tol}
        except Exception as exc:  # reported per check, so one failure does not hide the others
            out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return out


def work(mode: str, module: ModuleType, checks: Callable[[ModuleType], dict[str, Check]],
         cuda_checks: Callable[[ModuleType], dict[str, Check]],
         aot_compile: Callable[[ModuleType], None]) -> None:
    """Runs one group of checks in this process and prints the results as one JSON line.

    interpret: the kernel comparisons (needs TRITON_INTERPRET=1); cuda: the same and larger ones
    on the GPU; compile: the AOT compile of the module's kernels for sm_90."""
    results: dict = {"interpreted": module.is_interpreted()}
    if mode == "interpret":
        results["checks"] = run_checks(checks(module))
    elif mode == "cuda":
        results["checks"] = run_checks(cuda_checks(module))
    elif mode == "compile":
        try:
            aot_compile(module)
            results["compile"] = "ok"
        except (ImportError, FileNotFoundError, RuntimeError) as exc:
            results["compile"] = f"unavailable: {type(exc).__name__}: {exc}"
        except Exception as exc:  # a compile error in our kernels
            results["compile"] = f"error: {type(exc).__name__}: {exc}"
    print("RESULTS " + json.dumps(results))


def run(args: list[str], env_update: dict[str, str], timeout: float = 240):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_update)
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def worker_results(test_file: str, mode: str, env_update: dict[str, str],
                   timeout: float = 240) -> dict:
    proc = run([os.path.abspath(test_file), mode], env_update, timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, \
        f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULTS "):])
