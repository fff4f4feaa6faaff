"""A request's token times: numbers appended one by one and decode runs' arrays, in order."""

from __future__ import annotations

import copy
import pickle
from array import array

import pytest

from twinserve.core.token_times import TokenTimes


def _times() -> tuple[TokenTimes, array]:
    times = TokenTimes()
    times.append(0.5)
    run = array("d", [1.0, 1.5])
    times.adopt(run)
    times.append(2.0)
    times.append(2)  # (any real number)
    times.adopt(array("d"))  # (an empty run adds nothing)
    times.adopt(array("d", [3.0]))
    return times, run


def test_times_read_in_the_order_given() -> None:
    times, run = _times()
    assert times.times() == [0.5, 1.0, 1.5, 2.0, 2.0, 3.0]
    assert times.tobytes() == array("d", [0.5, 1.0, 1.5, 2.0, 2.0, 3.0]).tobytes()
    assert list(run) == [1.0, 1.5]  # appends after an adopted run never write into it
    assert TokenTimes().tobytes() == b"" and TokenTimes().times() == []
    single = TokenTimes([0.5, 1, 2.5])  # (single times only: the real engine's)
    assert single.tobytes() == array("d", [0.5, 1.0, 2.5]).tobytes()


def test_adopted_runs_are_shared_not_copied() -> None:
    run = array("d", [1.0, 2.0])
    a, b = TokenTimes(), TokenTimes()
    a.adopt(run)
    b.adopt(run)
    assert a[0] is run and b[0] is run  # (a run's steps: one array for its whole batch)


def test_a_time_that_is_not_a_number_is_refused_when_read() -> None:
    times = TokenTimes()
    times.append("soon")  # type: ignore[arg-type]
    with pytest.raises(Exception, match="float|number"):
        times.tobytes()


def test_a_copy_holds_its_own_times() -> None:
    times, _ = _times()
    for other in (copy.deepcopy(times), pickle.loads(pickle.dumps(times)), copy.copy(times)):
        assert type(other) is TokenTimes
        other.append(4.0)
        other.adopt(array("d", [5.0]))
        assert other.times() == [0.5, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 5.0]
    assert times.times() == [0.5, 1.0, 1.5, 2.0, 2.0, 3.0]
