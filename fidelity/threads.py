"""The torch threads a fidelity measurement runs on (docs/fidelity-api.md, "Threads")."""

from __future__ import annotations

from twinserve.gpu.worker.cpu_cores import usable_cores


def measurement_threads() -> int:
    """Every core the process may use but one (``gpu.worker.cpu_cores``), as vLLM's CPU backend
    leaves one to the host's other work: on a shared 2-core VM two OpenMP threads spin-wait on
    whichever core the hypervisor has set aside, and the replays scatter twice as wide."""
    return max(1, usable_cores() - 1)


def set_threads(threads: int | None) -> None:
    """Sets torch's CPU threads (``None`` or 0: leaves them as they are)."""
    if threads:
        import torch
        torch.set_num_threads(threads)
