"""benchmarks/_common.py: the serving benchmarks move their front ends off the compute core."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# Run in a child: the move changes the calling process's CPUs, and pytest's must stay as they are.
_CHILD = """
import json, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import _common
moved = _common.front_ends_beside_compute(frozenset({min(os.sched_getaffinity(0))}))
started = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True).stdout
print(json.dumps({"moved": moved, "own": sorted(os.sched_getaffinity(0)), "started": json.loads(started)}))
"""


def test_front_ends_leave_the_compute_cpu_and_what_they_start_inherits_that() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    out = json.loads(subprocess.run([sys.executable, "-c", _CHILD, str(BENCHMARKS)], capture_output=True, text=True,
                                    check=True).stdout)
    if len(allowed) == 1:  # nothing to spare: nothing moves
        assert out == {"moved": [], "own": allowed, "started": allowed}
    else:
        assert out == {"moved": allowed[1:], "own": allowed[1:], "started": allowed[1:]}
