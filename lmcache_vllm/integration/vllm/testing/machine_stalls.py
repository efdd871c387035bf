"""`MachineStalls`: the intervals in which a process that only sleeps was given no CPU, for tests and
benchmarks that time something on a shared machine.

On the 2-core VMs every sleeping process (an HTTP client, vLLM's API server, this probe) at times stood
still for 1-3.5 s while vLLM's engine core and worker held both cores; a latency measured across such a
spell says nothing about the code under test. The probe runs beside the measurement (`with
MachineStalls() as stalls: ...`); `stalled(a, b)` is how much of [a, b] it lost, `unexplained(a, b)` the rest.
Times are `time.monotonic()` (CLOCK_MONOTONIC: the same clock in every process of the machine).
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from typing import IO

# Sleeps 5 ms at a time; an oversleep beyond 0.1 s is printed as "start end".
_PROBE = """
import time
last = time.monotonic()
while True:
    time.sleep(0.005)
    now = time.monotonic()
    if now - last > 0.1:
        print(last, now, flush=True)
    last = now
"""


class MachineStalls:
    def __init__(self) -> None:
        self.intervals: list[tuple[float, float]] = []
        self._proc: subprocess.Popen[str] | None = None
        self._out: IO[str] | None = None

    def __enter__(self) -> "MachineStalls":
        # A file, not a pipe: a pipe nobody reads until the end would fill up (64 KiB, ~1,600 stalls) and
        # block the probe, losing every stall after.
        self._out = tempfile.TemporaryFile("w+")
        self._proc = subprocess.Popen([sys.executable, "-c", _PROBE], stdout=self._out, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is None or self._out is None:
            return
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._out.seek(0)
        lines = self._out.read().splitlines()
        self._out.close()
        self._proc, self._out = None, None
        # (a line cut short by the terminate is skipped)
        self.intervals = [(float(a), float(b)) for a, b in (fields for fields in map(str.split, lines)
                                                            if len(fields) == 2)]

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stalled(self, start: float, end: float) -> float:
        """Seconds of [start, end] in which the probe was given no CPU."""
        return sum((max(0.0, min(end, b) - max(start, a)) for a, b in self.intervals), 0.0)

    def unexplained(self, start: float, end: float) -> float:
        """Seconds of [start, end] in which the probe ran: what no machine stall explains."""
        return (end - start) - self.stalled(start, end)
