"""The CPU cores this process may run on: its affinity mask where the OS has one (a container's
or ``taskset``'s cpuset), else every core of the machine. Torch-free, so command-line defaults
can read it without loading torch."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """How many cores the process may run on (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)
