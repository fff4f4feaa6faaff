"""The CPU backend's native paged decode attention (``csrc/paged_decode_attention.cpp``).

Compiled once per machine with torch's C++ extension builder (``-march=native``: it runs where it
is built) into torch's extension cache; ``scripts/setup.sh`` builds it ahead. It reads each
sequence's KV straight from the paged cache, once, where the plain-torch path gathers a padded
copy first (three passes over the KV instead of one; measured 4-7x slower per layer at 64 decodes
x 256 context here). The engine argument ``cpu_attention=torch`` (``--cpu-attention torch``)
runs the plain-torch path instead.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from twinserve.core.kernel_settings import CPU_ATTENTION_CHOICES

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention.cpp"

# (query[B, Hq, D], key_cache, value_cache, block_tables[B, M] int32, seq_lens[B] int32, scale
#  [, window, softcap]: 0 for none)
PagedDecode = Callable[..., torch.Tensor]


@functools.cache
def build_paged_decode() -> PagedDecode:
    """Compile (or load the cached build of) the kernel; raises when it cannot be built."""
    from torch.utils.cpp_extension import load  # imports setuptools machinery: only when needed
    load(name="twinserve_cpu_attention", sources=[str(SOURCE)], is_python_module=False,
         extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
         extra_ldflags=["-fopenmp", "-lmvec"])  # (without OpenMP at::parallel_for is serial)
    return torch.ops.twinserve_cpu.paged_decode_attention


@functools.cache
def load_paged_decode(cpu_attention: str = "native") -> PagedDecode | None:
    """The kernel, or None: with ``cpu_attention`` ``torch`` (the engine argument), or (with one
    warning) when it cannot be built."""
    if cpu_attention not in CPU_ATTENTION_CHOICES:
        raise ValueError(f"cpu_attention must be one of {', '.join(CPU_ATTENTION_CHOICES)}; "
                         f"got {cpu_attention!r}.")
    if cpu_attention == "torch":
        return None
    try:
        return build_paged_decode()
    except (OSError, RuntimeError, ImportError) as exc:
        logger.warning("CPU paged-attention kernel unavailable (%s); using the plain-torch path, "
                       "which is several times slower at long contexts.", exc)
        return None
