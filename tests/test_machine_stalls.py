"""`MachineStalls` reports the time its probe process was given no CPU: here the probe is stopped
(SIGSTOP) for 0.6 s, a stall made for real, and that is what it reports."""
from __future__ import annotations

import os
import signal
import time

from lmcache_vllm.integration.vllm.testing.machine_stalls import MachineStalls


def test_a_stopped_probe_is_reported_and_discounted():
    with MachineStalls() as stalls:
        time.sleep(0.3)  # the probe is up and sleeping
        assert stalls.pid is not None
        start = time.monotonic()
        os.kill(stalls.pid, signal.SIGSTOP)
        time.sleep(0.6)
        os.kill(stalls.pid, signal.SIGCONT)
        time.sleep(0.2)
        end = time.monotonic()
    assert any(b - a >= 0.5 for a, b in stalls.intervals), stalls.intervals
    assert 0.5 <= stalls.stalled(start, end) <= end - start
    assert stalls.unexplained(start, end) < (end - start) - 0.5
    assert stalls.stalled(end + 1, end + 2) == 0.0

