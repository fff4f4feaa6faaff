"""A load-pricing router's constants for the hardware at hand, read off the twin's step-time model.

The cache-aware router prices each replica in prompt tokens: the wait for its step in progress
(seconds, times ``prefill_tokens_per_s``) and its decode batch (``decode_weight`` prompt tokens a
running sequence). Both depend on the model and the device: about 70,000 tokens/s and 4 for
Llama-3-8B on an H100, 14,000 and 2 on an A100, a few thousand and under 1 for the bundled model
on a CPU core. The twin and ``validate --data-parallel-size`` read them here from the profile
both run on, so the router in front of the real replicas and the twin's price work alike.

Measured as marginal costs in a step of ``decodes`` running sequences at ``context`` tokens each:
a ``chunk``-token prefill added to it (prefill throughput), and one more decode (its weight).
"""

from __future__ import annotations

from twinserve.core.config import SchedulerConfig
from twinserve.core.outputs import SchedulerOutput
from twinserve.simulator.step_time import StepTimeModel

PRICED_DECODES = 16
PRICED_CONTEXT = 1024
PRICED_CHUNK = 512


def router_prices(cost: StepTimeModel, limits: SchedulerConfig) -> dict[str, float]:
    """``prefill_tokens_per_s`` and ``decode_weight`` for ``cost`` within the engine's limits (a
    batch of at most 16 decodes at up to 1,024 tokens of context, a chunk of up to 512 tokens)."""
    decodes = max(1, min(PRICED_DECODES, limits.max_num_seqs - 1))
    context = max(1, min(PRICED_CONTEXT, limits.max_model_len // 2))
    chunk = max(1, min(PRICED_CHUNK, limits.max_num_batched_tokens - decodes - 1,
                       limits.max_model_len))
    base = cost.step_time(_step(0, decodes, context))
    prefill_s = cost.step_time(_step(chunk, decodes, context)) - base
    decode_s = cost.step_time(_step(0, decodes + 1, context)) - base
    if not prefill_s > 0:
        raise ValueError(f"the step-time model prices a {chunk}-token prefill at {prefill_s!r} s: "
                         "no prefill throughput can be read off it.")
    per_s = chunk / prefill_s
    return {"prefill_tokens_per_s": per_s, "decode_weight": max(0.0, decode_s * per_s)}


def _step(prefill: int, decodes: int, context: int) -> SchedulerOutput:
    """A step's aggregates (what cost models read): one prefill chunk from an empty context and
    ``decodes`` decodes at ``context`` tokens each, counted as the scheduler counts them."""
    return SchedulerOutput(
        total_num_scheduled_tokens=prefill + decodes, num_prefill_tokens=prefill,
        num_prefill_seqs=1 if prefill else 0, num_decode_tokens=decodes, num_decode_seqs=decodes,
        sum_context_tokens=prefill * (prefill + 1) // 2 + decodes * (context + 1),
        sum_decode_context_tokens=decodes * (context + 1), sum_prefill_attention_area=prefill * prefill,
        max_decode_context=context + 1 if decodes else 0)
