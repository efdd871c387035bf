"""Tests for lmcache_vllm.integration.vllm.threads: a background thread's parallel torch ops stay on that thread."""
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import os, sys, threading, torch
    from lmcache_vllm.cpu_affinity import single_threaded_torch
    torch.set_num_threads(2)
    x = torch.randn(1 << 22)
    (x * 2).sum()  # the main thread's OpenMP team exists now
    def work(out):
        if sys.argv[1] == "single":
            out.append(single_threaded_torch())
        out.append(torch.get_num_threads())
        for _ in range(3):
            (x * 2).sum()
        out.append(len(os.listdir("/proc/self/task")))
    before = len(os.listdir("/proc/self/task"))
    out = []
    t = threading.Thread(target=work, args=(out,)); t.start(); t.join()
    print(before, *out, torch.get_num_threads())
""")


def _run(mode: str) -> list:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True)
    return [{"True": True, "False": False}.get(v) if v in ("True", "False") else int(v)
            for v in out.stdout.split()]


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="needs 2 cores for OpenMP teams")
def test_background_thread_runs_parallel_ops_alone():
    before, ok, threads, during, main_after = _run("single")
    assert ok is True and threads == 1
    assert during == before + 1  # just the background thread itself: no OpenMP workers for it
    assert main_after == 2  # the main thread's own setting is untouched
    # Without it, the same thread starts an OpenMP team of its own (what slowed vLLM's model thread).
    before, threads, during, _ = _run("default")
    assert threads == 2 and during > before + 1
