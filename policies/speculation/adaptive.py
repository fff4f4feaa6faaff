"""The self-tuning speculation policy: drafts only where they buy throughput.

The rule. A step that schedules ``T`` tokens takes ``t(T)`` seconds, a curve measured from the
steps this policy has seen (``StepCurve``). A request whose drafts are accepted with probability
``a`` each (position after position, until the first rejection) turns ``k`` drafts into
``g(k) = a + a^2 + ... + a^k`` expected extra tokens. The policy builds the next step request by
request: with ``E`` useful tokens and ``T`` scheduled tokens granted so far (the step's tokens
without drafts, prefill chunks included, count in both: drafts that take a step's time from
prefills must be worth more than the prompt tokens they displace), it gives the request the
``k`` in ``0..k_max`` that
maximises the step's expected tokens per second ``(E + g(k)) / t(T + k)``, taking ``k > 0``
only when the drafts' own return, ``g(k)`` tokens for the ``t(T + k) - t(T)`` seconds they add,
beats the step's rate without them, ``E / t(T)``, by ``margin`` (relative). Hence:

- a batch so large that ``k`` more tokens cost more time than ``g(k)`` tokens are worth in it
  gets ``k = 0`` for everyone (``E`` grows with the batch, ``g(k)`` does not), and a step curve
  that rises steeply (compute-bound verification) turns speculation off at any batch size;
- a request whose drafts are seldom accepted gets none, whatever the batch;
- the margin keeps noise in the measured curve from making the workload slower than ``k = 0``.

Acceptance per request is a Beta estimate over its verified positions (an accepted draft is a
success, the first rejected one a failure) whose prior is the estimate over all requests so far
(``prior_weight`` pseudo-positions), so a new request starts from what the workload showed.
Until the curve has seen token counts above the current step's, it is extrapolated flat
(optimistic): drafting then measures the curve, and the measurement decides afterwards.

Each request's k is chosen below its own ceiling. The ceiling starts at the configured k
(``num_speculative_tokens``); a verification that accepted every one of ceiling-many drafts
doubles it, up to ``max_num_speculative_tokens`` (the stated cap; default: the configured k, so
the ceiling never rises). A rejection after ``n`` accepted drafts sets it to ``2 (n + 1)``,
within the configured k and the cap: the draft length follows the match, as SuffixDecoding's
does. A request that copies a long passage then verifies more of it per step; one whose copy
broke after a long run keeps part of its ceiling (the copy usually resumes just past the edit),
and one whose drafts were rejected at once starts again from k. (The transformers
assisted-generation heuristic grows its draft length the same way, +2 per fully accepted draft,
-1 otherwise; doubling reaches the cap in fewer steps on copies of a few dozen tokens.) Below
the ceiling the rule above still decides, so a large batch turns the raised k off as it turns
k off.
"""

from __future__ import annotations

from bisect import bisect_left

from twinserve.core.outputs import SchedulerOutput
from twinserve.core.request import Request
from twinserve.policies.speculation.fixed import check_limits

_MAX_TRACKED = 65536  # requests whose counts and ceilings are kept (oldest dropped first)


def _bucket(tokens: int) -> int:
    """A step-curve bucket: exact up to 32 tokens, then 8 buckets per doubling."""
    if tokens < 32:
        return tokens
    shift = tokens.bit_length() - 4
    return ((tokens >> shift) << shift)


def _remember(table: dict[str, int], key: str, value: int) -> None:
    """``table[key] = value``, the key re-inserted as the newest; the oldest dropped past
    ``_MAX_TRACKED`` keys."""
    table.pop(key, None)
    table[key] = value
    if len(table) > _MAX_TRACKED:
        del table[next(iter(table))]


class StepCurve:
    """Seconds per step as a function of its scheduled tokens: a running mean per bucket of
    token counts (exponentially forgetting, ``decay``), linear between the buckets' mean token
    counts, flat below the first, and beyond the last along the slope of the last two
    buckets (flat with one bucket)."""

    __slots__ = ("decay", "_stats", "_xs", "_ys", "_dirty")

    def __init__(self, decay: float = 0.95) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay!r}.")
        self.decay = decay
        self._stats: dict[int, list[float]] = {}  # bucket -> [weight, sum tokens, sum seconds]
        self._xs: list[float] = []
        self._ys: list[float] = []
        self._dirty = False

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or not seconds >= 0.0:
            return
        stats = self._stats.setdefault(_bucket(tokens), [0.0, 0.0, 0.0])
        d = self.decay
        stats[0] = stats[0] * d + 1.0
        stats[1] = stats[1] * d + tokens
        stats[2] = stats[2] * d + seconds
        self._dirty = True

    def _refresh(self) -> None:
        points = sorted((s[1] / s[0], s[2] / s[0]) for s in self._stats.values())
        self._xs = [x for x, _ in points]
        self._ys = [y for _, y in points]
        self._dirty = False

    @property
    def num_buckets(self) -> int:
        return len(self._stats)

    def max_tokens_seen(self) -> float:
        if self._dirty:
            self._refresh()
        return self._xs[-1] if self._xs else 0.0

    def seconds(self, tokens: float) -> float | None:
        """The predicted step time; None before any observation."""
        if self._dirty:
            self._refresh()
        xs, ys = self._xs, self._ys
        if not xs:
            return None
        i = bisect_left(xs, tokens)
        if i == 0:
            return ys[0]
        if i == len(xs):
            if len(xs) == 1:
                return ys[0]
            slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
            return ys[-1] + slope * (tokens - xs[-1])
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)


class AdaptiveSpeculation:
    """Chooses each request's drafts per step (0..k_max) from the measured step-time curve, the
    batch and the request's measured acceptance; the rule is in the module docstring."""

    __slots__ = ("k_max", "k_base", "disable_by_batch_size", "margin", "prior_acceptance",
                 "prior_weight", "curve", "_accepted", "_rejected", "_failures", "_ceilings",
                 "_round_tokens", "_round_gain", "_last_tokens")

    def __init__(self, k_max: int, disable_by_batch_size: int | None = None, margin: float = 0.05,
                 prior_acceptance: float = 0.5, prior_weight: float = 4.0,
                 curve_decay: float = 0.95, max_num_speculative_tokens: int | None = None) -> None:
        """``k_max`` is the configured k; the attribute ``k_max`` is the most drafts the policy
        ever gives (``max_num_speculative_tokens`` when given, else the configured k)."""
        check_limits(k_max, disable_by_batch_size)
        cap = k_max if max_num_speculative_tokens is None else max_num_speculative_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < k_max:
            raise ValueError("max_num_speculative_tokens must be an integer >= "
                             f"num_speculative_tokens ({k_max}), got {cap!r}.")
        if not margin >= 0.0:
            raise ValueError(f"margin must be non-negative, got {margin!r}.")
        if not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {prior_acceptance!r}.")
        if not prior_weight > 0.0:
            raise ValueError(f"prior_weight must be positive, got {prior_weight!r}.")
        self.k_base = k_max
        self.k_max = cap
        self.disable_by_batch_size = disable_by_batch_size
        self.margin = margin
        self.prior_acceptance = prior_acceptance
        self.prior_weight = prior_weight
        self.curve = StepCurve(curve_decay)
        self._accepted = 0  # over all requests: accepted drafts and first rejections
        self._rejected = 0
        self._failures: dict[str, int] = {}  # per request: verifications with a rejection
        self._ceilings: dict[str, int] = {}  # per request: its raised k (absent: k_base)
        self._round_tokens = 0  # drafts granted for the step being built
        self._round_gain = 0.0  # their expected accepted tokens
        self._last_tokens = 0  # the last step's tokens without its drafts

    # ---- acceptance ----------------------------------------------------------------------
    def acceptance(self, request: Request) -> float:
        """The request's estimated per-position acceptance probability."""
        total = self._accepted + self._rejected
        prior = (self._accepted + self.prior_acceptance * self.prior_weight) / \
            (total + self.prior_weight)
        accepted = request.spec_num_accepted_tokens
        failures = self._failures.get(request.request_id, 0)
        return (accepted + prior * self.prior_weight) / (accepted + failures + self.prior_weight)

    def on_verified(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        self._accepted += num_accepted
        rid = request.request_id
        if num_accepted < num_drafts:
            self._rejected += 1
            _remember(self._failures, rid, self._failures.get(rid, 0) + 1)
            followed = min(self.k_max, 2 * (num_accepted + 1))
            if followed > self.k_base:
                _remember(self._ceilings, rid, followed)
            else:
                self._ceilings.pop(rid, None)
        elif self.k_max > self.k_base and num_drafts >= self.ceiling(request):
            _remember(self._ceilings, rid, min(self.k_max, 2 * num_drafts))

    def ceiling(self, request: Request) -> int:
        """The most drafts ``request`` may get now (the module docstring's ceiling)."""
        return self._ceilings.get(request.request_id, self.k_base)

    # ---- the step ------------------------------------------------------------------------
    def on_step(self, out: SchedulerOutput, start: float, end: float) -> None:
        self.curve.observe(out.total_num_scheduled_tokens, end - start)
        self._last_tokens = out.total_num_scheduled_tokens - out.num_spec_tokens
        self._round_tokens = 0
        self._round_gain = 0.0

    def num_drafts(self, request: Request, num_running: int, budget: int) -> int:
        limit = self.disable_by_batch_size
        if (limit is not None and num_running > limit) or budget <= 0:
            return 0
        k_cap = min(self.ceiling(request), budget)
        work = max(num_running, self._last_tokens, 1)  # the step's tokens without drafts
        base_tokens = work + self._round_tokens
        base_gain = work + self._round_gain
        k, gain = self.best_k(self.acceptance(request), base_tokens, base_gain, k_cap)
        self._round_tokens += k
        self._round_gain += gain
        return k

    def best_k(self, acceptance: float, base_tokens: int, base_gain: float,
               k_cap: int) -> tuple[int, float]:
        """The k in 0..k_cap maximising (base_gain + g(k)) / t(base_tokens + k), k > 0 only if it
        beats k = 0 by ``margin``; returns it and its g(k)."""
        curve = self.curve
        t0 = curve.seconds(base_tokens)
        if t0 is None or t0 <= 0.0:
            return k_cap, sum(acceptance ** j for j in range(1, k_cap + 1))  # measure first
        # the margin is on the drafts' own return: their tokens per extra second must beat the
        # step's rate without them by ``margin`` (on the whole step's rate it would forbid
        # drafts in any batch where one request is a small share)
        hurdle = base_gain / t0 * (1.0 + self.margin)
        best_rate = base_gain / t0
        best_k, best_gain, gain, term = 0, 0.0, 0.0, 1.0
        for k in range(1, k_cap + 1):
            term *= acceptance
            gain += term
            seconds = curve.seconds(base_tokens + k)
            if seconds is None or seconds <= 0.0:
                continue
            extra = seconds - t0
            if extra > 0.0 and gain / extra <= hurdle:
                continue
            rate = (base_gain + gain) / seconds
            if rate > best_rate:
                best_rate, best_k, best_gain = rate, k, gain
        return best_k, best_gain
