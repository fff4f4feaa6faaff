"""What the Triton kernel modules (``triton_attention``, ``triton_lora``) share on the host side:
whether a kernel was built by Triton's CPU interpreter, launch checks, block-size rounding."""

from __future__ import annotations

import torch

try:  # Triton is an optional dependency (extra "cuda"); the kernel modules import it from here.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None
    tl = None
    HAS_TRITON = False


def kernel_is_interpreted(kernel: object) -> bool:
    """True when ``kernel`` was built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(kernel).__name__ == "InterpretedFunction"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def check_launchable(t: torch.Tensor, module: str, has_triton: bool, interpreted: bool) -> None:
    """Raises RuntimeError when ``module``'s kernels cannot launch on ``t``."""
    if not has_triton:
        raise RuntimeError(f"twinserve.gpu.{module} needs the `triton` package (extra 'cuda')")
    if t.device.type != "cuda" and not interpreted:
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got device {t.device}); for CPU tensors set "
            f"TRITON_INTERPRET=1 before importing triton / twinserve.gpu.{module}")
