"""`benchmarks/profile_cold.py`'s accounting of the connector's time on vLLM's step thread, which its figures
rest on: only the main thread's calls count, and a public method calling another counts once."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from profile_cold import STEP_TIMES, time_connector_methods  # noqa: E402


class _Connector:
    def outer(self) -> int:
        time.sleep(0.02)
        return self.inner() + 1

    def inner(self) -> int:
        time.sleep(0.02)
        return 1

    def _private(self) -> int:
        time.sleep(0.02)
        return 0

    @classmethod
    def factory(cls) -> "_Connector":
        return cls()


def test_the_step_threads_calls_count_once_and_other_threads_not_at_all() -> None:
    time_connector_methods(_Connector)
    STEP_TIMES.clear()
    connector = _Connector.factory()
    assert connector.outer() == 2  # the wrapped methods still answer
    assert connector.inner() == 1
    connector._private()
    worker = threading.Thread(target=connector.outer)
    worker.start()
    worker.join()

    assert set(STEP_TIMES) == {"outer", "inner"}
    outer_s, outer_calls = STEP_TIMES["outer"]
    inner_s, inner_calls = STEP_TIMES["inner"]
    assert (outer_calls, inner_calls) == (1, 1)  # inner within outer, and the other thread's call: not counted
    assert 0.04 <= outer_s < 0.5 and 0.02 <= inner_s < outer_s
