"""What speculative decoding adds to a simulated step: the verification pass, as the engine's
kernels run it, and the proposer's time.

Verification. The scheduler counts an entry verifying k drafts as one decode of 1 + k tokens
(``core/outputs.py``); the backends run it in one of two ways, and the step is timed as the
inner model would time what runs (``recount_verifications``):
- on a CPU with the native attention (the engine's default), a verification over a short
  context runs as 1 + k rows of the decode kernel (``core.kernel_settings.rows_as_decodes``):
  the scheduler's decode counting already holds the tokens and each row's context, and the k
  extra rows are counted as decode sequences (each pays its attention call, ``lm_head`` row
  and sampling, as a fitted profile's per-decode term measured them);
- otherwise (the Triton extend kernel on CUDA, a long context on the CPU) it is a prefill chunk
  of 1 + k tokens after a prefix of ``start``: the GEMMs see every token and attention every
  context, the KV of the context is read once, and the ``lm_head`` and sampling of the k extra
  rows are added (``sample_row_s`` each: the roofline's ``lm_head`` product at the profile's
  compute rate plus its per-sequence overhead, whatever the inner model, since fits hold no
  per-row term for chunks).
Either way the verified tokens count in the step's token total, so a fitted profile prices them
on its token curve, as prompt tokens: at a batch where the weight products are compute-bound,
k drafts per sequence cost what k prompt tokens per sequence cost.

Proposer, charged in the step whose entries ask for drafts (``num_draft_next > 0``: the backend
proposes after sampling, before the step returns):
- ``ngram`` and ``suffix``: host lookups, ``lookup_s_per_step`` once plus ``lookup_s_per_seq``
  per proposing sequence (``LOOKUP_COSTS``; the lookups run on the host whatever the GPU).
- ``draft_model``: the draft model's forward passes on the same hardware, timed by its own cost
  model (``make_cost_model`` of its spec: fitted when the profile holds a fit for it, else the
  roofline): a first pass that catches the draft's KV up (one token per sequence; the whole
  prompt for a sequence whose prompt completes this step) and ``num_draft_next - 1`` decode
  passes, each over the sequences that still want drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from twinserve.core.kernel_settings import KernelSettings, rows_as_decodes
from twinserve.core.outputs import SchedulerOutput
from twinserve.core.speculative_config import SpeculativeConfig
from twinserve.simulator.cost_model import DeviceCostModel, make_cost_model
from twinserve.simulator.model_spec import load_model_spec
from twinserve.simulator.step_time import StepTimeModel

# (seconds per step with proposals, seconds per proposing sequence) of twinserve's pure-Python
# lookups over 300-token requests (``benchmarks/spec_crossover.py --lookup-costs`` on the 2-core
# development machine, quiet host; under a load of ~7 the same took 5-15x longer). ngram's
# continues the source its last drafts came from without a search while they are accepted, and
# scans twice when the last token is new (half the steps of that command's random ids).
LOOKUP_COSTS: Mapping[str, tuple[float, float]] = MappingProxyType({
    "ngram": (2.4e-6, 7.8e-6),
    "suffix": (1e-6, 3e-5),
})


RowsRule = Callable[[int, int], bool]  # (queries, context after them) -> run as decode rows


def recount_verifications(out: SchedulerOutput,
                          as_rows: RowsRule | None = None) -> tuple[SchedulerOutput, int]:
    """``out`` with every verification entry counted as its backend runs it, and how many of
    the verified rows are left to charge as extra sampled rows.

    An entry for which ``as_rows(1 + k, start + 1 + k)`` holds (the CPU's native attention,
    ``core.kernel_settings.rows_as_decodes``) runs as 1 + k decode rows: the scheduler's decode
    counting already holds its tokens and each row's context, so only the k extra sequences are
    added (each row then pays a decode sequence's per-row terms: its attention call, ``lm_head``
    row and sampling). Any other is a prefill chunk after its prefix (the scheduler's own
    counting of chunks, ``Scheduler._count``), whose k extra sampled rows are returned. ``out``
    itself when it verifies nothing; a copy shares ``out``'s lists."""
    if not out.num_spec_tokens:
        return out, 0
    new = dataclasses.replace(out)
    longest, sampled = 0, 0
    for sr in out.scheduled:
        n, start = sr.num_new_tokens, sr.start
        if not sr.spec_token_ids:
            if n == 1 and start >= sr.request.num_prompt_tokens:
                longest = max(longest, start + 1)
            continue
        new.num_spec_tokens -= n - 1
        if as_rows is not None and as_rows(n, start + n):
            new.num_decode_seqs += n - 1
            longest = max(longest, start + n)
            continue
        context = n * start + n * (n + 1) // 2
        new.num_decode_seqs -= 1
        new.num_decode_tokens -= n
        new.sum_decode_context_tokens -= context
        new.num_prefill_seqs += 1
        new.num_prefill_tokens += n
        if start:
            new.num_prefix_chunks += 1
            new.sum_prefix_context_tokens += start
        new.sum_prefill_attention_area += n * (start + n)
        sampled += n - 1
    new.max_decode_context = longest
    return new, sampled


def verification_as_chunks(out: SchedulerOutput) -> SchedulerOutput:
    """``out`` with every verification entry counted as a prefill chunk after its prefix
    (``recount_verifications`` without decode rows: the Triton extend kernel's way)."""
    return recount_verifications(out)[0]


def sample_row_seconds(cost: DeviceCostModel) -> float:
    """One more sampled row: ``lm_head`` at the profile's compute rate plus per-sequence work."""
    roofline = cost.roofline
    m, hw = roofline.model, roofline.hardware
    flops = m.arch.lm_head_flops_per_seq(m) / roofline.tensor_parallel_size
    return flops / (hw.eff_compute * hw.peak_flops) + hw.per_seq_overhead_s


def _draft_pass(contexts: list[int], prompts: list[int]) -> SchedulerOutput:
    """One draft forward pass: a decode of one token at each of ``contexts`` (tokens before it)
    and a fresh prefill of each of ``prompts``."""
    out = SchedulerOutput()
    n = len(contexts)
    out.num_decode_seqs = out.num_decode_tokens = n
    decode = sum(contexts) + n
    out.sum_decode_context_tokens = decode
    out.max_decode_context = max(contexts) + 1 if contexts else 0
    out.num_prefill_seqs, out.num_prefill_tokens = len(prompts), sum(prompts)
    out.sum_prefill_attention_area = sum(p * p for p in prompts)
    out.sum_context_tokens = decode + sum(p * (p + 1) // 2 for p in prompts)
    out.total_num_scheduled_tokens = n + out.num_prefill_tokens
    return out


@dataclass(frozen=True, slots=True)
class ProposerCost:
    """The proposer's seconds in a step (module doc): host lookups, or a draft model's passes
    (``draft`` set)."""

    lookup_s_per_step: float = 0.0
    lookup_s_per_seq: float = 0.0
    draft: StepTimeModel | None = None

    def __post_init__(self) -> None:
        for name in ("lookup_s_per_step", "lookup_s_per_seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}.")

    def time(self, out: SchedulerOutput) -> float:
        wants = [sr for sr in out.scheduled if sr.num_draft_next]
        if not wants:
            return 0.0
        if self.draft is None:
            return self.lookup_s_per_step + self.lookup_s_per_seq * len(wants)
        seconds = 0.0
        for j in range(max(sr.num_draft_next for sr in wants)):
            contexts, prompts = [], []
            for sr in wants:
                if sr.num_draft_next <= j:
                    continue
                end = sr.start + sr.num_new_tokens  # the tokens the step leaves computed
                if j == 0 and sr.start < sr.request.num_prompt_tokens:
                    prompts.append(end)  # the draft has not seen this prompt yet
                else:
                    contexts.append(end + j - 1)
            seconds += self.draft.step_time(_draft_pass(contexts, prompts))
        return seconds


def proposer_cost_for(spec: SpeculativeConfig, cost: DeviceCostModel) -> ProposerCost:
    """The proposer a configuration runs, on ``cost``'s hardware."""
    if spec.method == "draft_model":
        draft_spec = load_model_spec(spec.model or "")
        draft = make_cost_model(draft_spec, cost.hardware, 1, cost.roofline.block_size)
        return ProposerCost(draft=draft)
    per_step, per_seq = LOOKUP_COSTS[spec.method]
    return ProposerCost(per_step, per_seq)


@dataclass(frozen=True, slots=True)
class WithSpeculation:
    """A step-time model (``inner``) whose steps verify drafts and propose new ones;
    ``as_rows``: which verifications run as decode rows (``recount_verifications``)."""

    inner: StepTimeModel
    proposer: ProposerCost
    sample_row_s: float
    as_rows: RowsRule | None = None

    def step_time(self, out: SchedulerOutput) -> float:
        recounted, sampled = recount_verifications(out, self.as_rows)
        return (self.inner.step_time(recounted) + sampled * self.sample_row_s
                + self.proposer.time(out))

    def decode_run_ends(self, out: SchedulerOutput, now: float, horizon: float, base: float,
                        max_steps: int) -> list[float] | None:
        """None: drafts change every step's shape, so steps are timed one by one."""
        return None


def rows_rule_for(cost: DeviceCostModel, kernels: KernelSettings | None) -> RowsRule | None:
    """The CPU's rule when ``cost`` prices a CPU whose attention is the native kernel (the
    engine's default); None (chunks) on a GPU, whose Triton extend kernel takes a
    verification as one chunk."""
    native = kernels is None or kernels.cpu_attention == "native"
    return rows_as_decodes if cost.hardware.device_type == "cpu" and native else None


def with_speculation(inner: StepTimeModel, cost: DeviceCostModel,
                     spec: SpeculativeConfig | None,
                     kernels: KernelSettings | None = None) -> StepTimeModel:
    """``inner`` charged for ``spec``'s verification and proposer (``inner`` itself when off),
    verifications counted as ``kernels`` run them on ``cost``'s device."""
    if spec is None:
        return inner
    return WithSpeculation(inner, proposer_cost_for(spec, cost), sample_row_seconds(cost),
                           rows_rule_for(cost, kernels))
