"""Progress of a measurement with an estimate of the time left (a tqdm bar on stderr)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

# Messages that close one unit of work: a pass of the micro-benchmark grid
# (``gpu.measurement.profiler``), an engine-loop workload (``gpu.engine.engine_loop``: "[k] ..."),
# a real replay (``fidelity.replay``).
UNIT_MARKS = ("micro-benchmarks: pass ", "[", "real replay ")


@dataclass(slots=True)
class Progress:
    """A ``Log`` that writes each message (``messages``) and, once told how many units of work
    to expect (``expect``), shows a bar (``bar``) that advances on the messages closing one
    (``UNIT_MARKS``): its rate gives the time left."""

    desc: str = "validate"
    messages: bool = True
    bar: bool = True
    total: int = 0
    done: int = 0
    _bar: Any = field(default=None, repr=False)

    def expect(self, total: int) -> None:
        """Starts the bar at ``total`` units (>= 1)."""
        if total < 1:
            raise ValueError(f"Progress.expect: total must be >= 1, got {total}.")
        self.close()
        self.total, self.done = total, 0
        if self.bar:
            from tqdm import tqdm
            self._bar = tqdm(total=total, desc=self.desc, unit="part", file=sys.stderr,
                             mininterval=0.5, dynamic_ncols=True)

    def __call__(self, msg: str) -> None:
        if self.messages:
            if self._bar is not None:
                self._bar.write(msg, file=sys.stderr)
            else:
                print(msg, file=sys.stderr, flush=True)
        if msg.startswith(UNIT_MARKS) and self.done < self.total:
            self.done += 1
            if self._bar is not None:
                self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
