"""``summarize``'s ITL figures over every gap of every successful record: the same whether the
records hold compact arrays (one copy of their bytes) or plain lists, and as numpy computes
them over the gaps directly (its standard deviation too, summed chunk by chunk)."""

from __future__ import annotations

import dataclasses
import math
import random
from array import array

import numpy as np

from twinserve.core.metrics import (
    _SQUARES_CHUNK,
    RequestRecord,
    _stats,
    _sum_of_squares,
    summarize,
)
from twinserve.core.request import RequestStatus
from twinserve.core.token_times import TokenTimes


def _records(rng: random.Random, as_list: bool = False) -> list[RequestRecord]:
    out = []
    for i in range(40):
        gaps = [rng.expovariate(50) for _ in range(rng.randint(0, 30))]
        out.append(RequestRecord(f"r{i}", i * 0.1, i * 0.1, i * 0.1 + 0.05, i * 0.1 + 1.0, 10,
                                 len(gaps) + 1, success=i % 7 != 3,
                                 itls=gaps if as_list else array("d", gaps)))
    return out


def test_itl_figures_over_arrays_and_lists_are_numpys() -> None:
    compact, plain = _records(random.Random(2)), _records(random.Random(2), as_list=True)
    got = summarize(compact, duration_s=5.0)
    assert got == summarize(plain, duration_s=5.0)
    mixed = compact[:20] + plain[20:]
    assert summarize(mixed, duration_s=5.0) == got
    gaps = np.array([g for r in compact if r.success for g in r.itls]) * 1000.0
    assert got["mean_itl_ms"] == float(gaps.mean())
    assert got["std_itl_ms"] == float(gaps.std())
    assert got["p99_itl_ms"] == float(np.percentile(gaps, 99))
    assert got["median_itl_ms"] == float(np.percentile(gaps, 50))
    before = [r.itls.tobytes() for r in compact]
    summarize(compact, duration_s=5.0)  # (its ITL copy scaled and sorted in place, not theirs)
    assert [r.itls.tobytes() for r in compact] == before
    compact[4].itls = array("d", [math.nan, 0.01])  # an unknown gap is left out
    known = np.array([g for r in compact if r.success for g in r.itls]) * 1000.0
    known = known[~np.isnan(known)]
    with_nan = summarize(compact, duration_s=5.0)
    assert with_nan["mean_itl_ms"] == float(known.mean())
    assert with_nan["p90_itl_ms"] == float(np.percentile(known, 90))


def test_the_standard_deviation_is_numpys_bit_for_bit_at_every_size() -> None:
    """Sizes about the chunk and its multiples, where numpy's pairwise halving is replayed, over
    values spread wide enough that another order of the additions rounds differently (the sum
    itself is compared: the square root can hide a last bit); and a NaN among them, left out as
    the summary leaves it."""
    rng = np.random.default_rng(3)
    c = _SQUARES_CHUNK
    for n in (1, 7, 8, 129, c - 1, c, c + 1, 2 * c + 8, 3 * c + 5, 17 * c + 3, 250_001):
        for _ in range(3):
            vals = rng.lognormal(0.0, 3.0, n)
            mean = float(vals.mean())
            assert _sum_of_squares(vals, mean) == float(np.add.reduce((vals - mean) ** 2)), n
        got = _stats("itl", vals.copy(), owned=True)
        want = vals * 1000.0
        assert (got["std_itl_ms"], got["mean_itl_ms"]) == (float(want.std()), float(want.mean()))
    vals[7] = math.nan
    got = _stats("itl", vals)
    known = vals[~np.isnan(vals)] * 1000.0
    assert (got["std_itl_ms"], got["mean_itl_ms"]) == (float(known.std()), float(known.mean()))


def test_no_successful_record_has_no_itl_figures() -> None:
    failed = RequestRecord("x", 0.0, math.nan, math.nan, math.nan, 5, 0, success=False)
    assert math.isnan(summarize([failed], duration_s=1.0)["mean_itl_ms"])
    assert math.isnan(summarize([], duration_s=1.0)["p90_itl_ms"])


def _by_name(req, origin: float) -> RequestRecord:
    """The record as named fields (``from_request`` builds it positionally)."""
    def shift(t):
        return math.nan if t is None else t - origin
    flat = [t for entry in req.token_times for t in (entry if isinstance(entry, array) else [entry])]
    times = np.asarray(flat, dtype=np.float64)
    return RequestRecord(
        request_id=req.request_id, arrival_time=req.arrival_time - origin,
        first_scheduled_time=shift(req.first_scheduled_time),
        first_token_time=shift(req.first_token_time), finish_time=shift(req.finish_time),
        input_tokens=req.num_prompt_tokens, output_tokens=req.num_output_tokens,
        cached_tokens=req.num_cached_tokens or 0, num_preemptions=req.num_preemptions,
        tenant=req.tenant, priority=req.priority, lora=req.lora or "",
        finish_reason=req.finish_reason or "", success=req.first_token_time is not None,
        itls=array("d", np.diff(times).tobytes()) if len(times) > 1 else array("d"),
        spec_num_drafts=req.spec_num_drafts, spec_num_draft_tokens=req.spec_num_draft_tokens,
        spec_num_accepted_tokens=req.spec_num_accepted_tokens)


def test_a_requests_record_holds_each_field_by_name() -> None:
    from core_helpers import make_req
    done = make_req("done", 20, 5, arrival=1.5, priority=3, tenant="t", lora="ad")
    done.first_scheduled_time, done.first_token_time, done.finish_time = 1.75, 2.0, 2.5
    done.token_times = TokenTimes([2.0, 2.125, 2.25, 2.5])
    done.output_token_ids = [9, 9, 9, 9]
    done.num_cached_tokens, done.num_preemptions = 16, 2
    done.status = RequestStatus.FINISHED_LENGTH_CAPPED
    done.spec_num_drafts, done.spec_num_draft_tokens, done.spec_num_accepted_tokens = 3, 6, 4
    waiting = make_req("waiting", 8, 2, arrival=0.25)  # never scheduled: its times unknown
    for req in (done, waiting):
        for origin in (0.0, 0.5):
            got, want = RequestRecord.from_request(req, origin), _by_name(req, origin)
            assert repr(got) == repr(want)
    listed = RequestRecord.from_request(done)
    run = TokenTimes([2.0])  # (as the twin keeps them: one by one, and a decode run's array)
    run.adopt(array("d", [2.125, 2.25]))
    run.append(2.5)
    done.token_times = run
    assert repr(RequestRecord.from_request(done)) == repr(listed)
    done.token_times = [2.0, 2.125, 2.25, 2.5]  # type: ignore[assignment]  # (any sequence)
    assert repr(RequestRecord.from_request(done)) == repr(listed)


def test_latency_figures_in_numpy_equal_the_records_properties() -> None:
    rng = random.Random(5)
    records = []
    for i in range(300):
        arrival = float(rng.randint(0, 100))  # (whole: the same value as an int below)
        first = arrival + rng.expovariate(3)
        records.append(RequestRecord(f"r{i}", arrival, arrival + rng.choice([0.0, 0.02]), first,
                                     first + rng.expovariate(0.2), 10, rng.choice([0, 1, 2, 57])))
    fast = summarize(records, duration_s=50.0)
    records[7] = dataclasses.replace(records[7], arrival_time=int(records[7].arrival_time))
    assert summarize(records, duration_s=50.0) == fast  # (an int time: the properties' path)
    for name, prop in (("ttft", "ttft"), ("tpot", "tpot"), ("e2el", "e2el"), ("queue", "queue_time")):
        values = np.array([getattr(r, prop) for r in records]) * 1000.0
        values = values[~np.isnan(values)]
        assert fast[f"mean_{name}_ms"] == float(values.mean()), name
        assert fast[f"p99_{name}_ms"] == float(np.percentile(values, 99)), name
