"""vLLM's speculation: k_max drafts for every request, every step."""

from __future__ import annotations

from twinserve.core.outputs import SchedulerOutput
from twinserve.core.request import Request


def check_limits(k_max: int, disable_by_batch_size: int | None) -> None:
    """Raises ValueError unless ``k_max`` is a positive integer and ``disable_by_batch_size``
    one or None (both speculation policies take them)."""
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max <= 0:
        raise ValueError(f"k_max must be a positive integer, got {k_max!r}.")
    if disable_by_batch_size is not None and (
            isinstance(disable_by_batch_size, bool) or not isinstance(disable_by_batch_size, int)
            or disable_by_batch_size <= 0):
        raise ValueError("disable_by_batch_size must be a positive integer or None, "
                         f"got {disable_by_batch_size!r}.")


class FixedSpeculation:
    """Always ``k_max`` drafts; none while more than ``disable_by_batch_size`` requests run
    (vLLM's option of that name)."""

    __slots__ = ("k_max", "disable_by_batch_size")

    def __init__(self, k_max: int, disable_by_batch_size: int | None = None,
                 max_num_speculative_tokens: int | None = None) -> None:
        check_limits(k_max, disable_by_batch_size)
        if max_num_speculative_tokens not in (None, k_max):
            raise ValueError("max_num_speculative_tokens: the fixed policy drafts "
                             f"num_speculative_tokens ({k_max}) always; a higher cap needs a "
                             "policy that raises k (adaptive).")
        self.k_max = k_max
        self.disable_by_batch_size = disable_by_batch_size

    def num_drafts(self, request: Request, num_running: int, budget: int) -> int:
        limit = self.disable_by_batch_size
        if limit is not None and num_running > limit:
            return 0
        return min(self.k_max, max(0, budget))

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        pass

    def on_step(self, out: SchedulerOutput, start: float, end: float) -> None:
        pass
