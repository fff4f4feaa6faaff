"""The CPU backend's native paged decode attention (``csrc/paged_decode_attention.cpp``).

Compiled once per machine with torch's C++ extension builder (``-march=native``: it runs where it
is built) into torch's extension cache; ``scripts/setup.sh`` builds it ahead. It reads each
sequence's KV straight from the paged cache, once, where the plain-torch path gathers a padded
copy first (three passes over the KV instead of one; measured 4-7x slower per layer at 64 decodes
x 256 context here). Set ``TWINSERVE_CPU_ATTENTION=torch`` to use the plain-torch path instead.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.cpp"
CHOICES = ("native", "torch")

# (query[B, Hq, D], key_cache, value_cache, block_tables[B, M] int32, seq_lens[B] int32, scale
#  [, window, softcap]: 0 for none)
PagedDecode = Callable[..., torch.Tensor]


def requested_backend() -> str:
    choice = os.environ.get("TWINSERVE_CPU_ATTENTION", "native")
    if choice not in CHOICES:
        raise ValueError(f"TWINSERVE_CPU_ATTENTION must be one of {', '.join(CHOICES)}, "
                         f"got {choice!r}.")
    return choice


@functools.cache
def build_paged_decode() -> PagedDecode:
    """Compile (or load the cached build of) the kernel; raises when it cannot be built."""
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed
    load(name="twinserve_cpu_attention", sources=[str(SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
         extra_ldflags=["-fopenmp", "-lmvec"])  # (without OpenMP at::parallel_for is serial)
    return torch.ops.twinserve_cpu.paged_decode_attention


@functools.cache
def load_paged_decode() -> PagedDecode | None:
    """The kernel, or None (with one warning) when it is switched off or cannot be built."""
    if requested_backend() == "torch":
        return None
    try:
        return build_paged_decode()
    except (OSError, RuntimeError, ImportError) as exc:
        logger.warning("CPU paged-attention kernel unavailable (%s); using the plain-torch path, "
                       "which is several times slower at long contexts.", exc)
        return None
