"""When each of a request's output tokens was sampled, as the engine and the twin hand them over.

A request samples hundreds of tokens, and the twin hands their times over a decode run at a time
(``core.decode_run``): one array of step end times that every request of the run shares. One
growing array of doubles per request copied all of its times again at every reallocation (about
sixteen times its final size, in fresh memory, for every request). Here a request keeps the
runs' arrays themselves, and each time it is given alone (the engine's steps) as the step's own
float: both a list append, in C. Read once, by its record (``TokenTimes.tobytes``).
"""

from __future__ import annotations

import struct
from array import array
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    _Entries = list[float | array[float]]
else:  # (``array`` takes no type argument at run time)
    _Entries = list


class TokenTimes(_Entries):
    """A request's token times in order. Each entry is one token's time (a number, ``append``)
    or the times of a run of tokens (an array of doubles, ``adopt``; kept without a copy: the
    caller never changes it afterwards, as a decode run only reads the array it makes for its
    steps). ``len`` counts entries; ``times`` and ``tobytes`` read the times themselves."""

    __slots__ = ()

    # (the list's own append, a C call: a run hands its array to every request of its batch)
    adopt = list.append

    def times(self) -> list[float]:
        return array("d", self.tobytes()).tolist()

    def tobytes(self) -> bytes:
        """The times as native doubles, one after the other (``array.tobytes``' layout)."""
        try:  # single times only (the real engine's): read in C, from a plain list's copy
            return array("d", cast("list[float]", self[:])).tobytes()
        except TypeError:  # (a run's array among them)
            return b"".join([_DOUBLE.pack(entry) if type(entry) is not array else entry
                             for entry in self])


_DOUBLE = struct.Struct("d")
