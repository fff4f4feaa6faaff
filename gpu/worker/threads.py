"""Torch's CPU threads for a process that runs a model (kept here, behind the worker, so the
engine's orchestration in ``gpu/engine/`` names no torch)."""

from __future__ import annotations

import torch


def set_torch_threads(threads: int) -> None:
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}.")
    torch.set_num_threads(threads)
