"""Shared settings of the property-based fuzz tests (`pytest -m fuzz`), and the checks every fuzz run makes.

Profiles (environment variable HYPOTHESIS_PROFILE):
- `ci` (default): derandomized (the same examples on every run, so CI cannot fail now and then), no
  example database, no per-example deadline (a shared 2-core machine is noisy); each test names its own
  `max_examples` through `examples(n)`. All fuzz tests together take well under 3 minutes on 2 cores.
- `explore`: random examples, ten times as many: for hunting, not for CI.

`bounded_run()` is the frame of each fuzz test: it fails the test if the run grew the process's peak
memory by more than `MAX_RSS_GROWTH` or left a thread behind (a dead or stuck worker shows up as one).
"""
from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import HealthCheck, settings

_COMMON = {"deadline": None, "database": None, "print_blob": True,
           "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large, HealthCheck.filter_too_much]}
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("explore", derandomize=False, **_COMMON)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
SCALE = 10 if PROFILE == "explore" else 1
MAX_RSS_GROWTH = 512 << 20


def examples(n: int) -> settings:
    """The settings of a fuzz test that runs `n` examples (times 10 under the explore profile)."""
    return settings(settings.get_profile(PROFILE), max_examples=n * SCALE)


@contextmanager
def bounded_run(thread_grace_s: float = 5.0) -> Iterator[None]:
    threads_before = set(threading.enumerate())
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    assert grown <= MAX_RSS_GROWTH, f"the fuzz run grew peak memory by {grown >> 20} MiB"
    deadline = time.monotonic() + thread_grace_s
    while time.monotonic() < deadline:
        left = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
        if not left:
            return
        time.sleep(0.05)
    raise AssertionError(f"threads left running: {[t.name for t in left]}")
