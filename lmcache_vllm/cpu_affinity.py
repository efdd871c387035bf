"""Which CPUs our background threads run on.

vLLM's CPU worker pins its process to the cores it computes on (VLLM_CPU_OMP_THREADS_BIND), and every
thread the process starts later inherits that: our storage loop, disk readers and writers, save thread and
transfer server would otherwise take their time from the model's compute cores while the cores
vLLM reserves (for the API server, the engine core and connectors: it reserves one more per rank when a
KV connector is configured) do less. The integration layer decides the set once per worker process
(`set_background_cpus`, from `extra_config.background_cpus` and vLLM's binding); every background thread of
ours calls `enter_background_cpus()` first. None (the default, and always on a host vLLM does not pin) leaves
threads where they are. The lookup server is the one exception (`integration/vllm/lookup.py`): the scheduler
asks it only between steps, when the worker's compute cores are idle, and on them it answers without
waiting behind vLLM's API server and the other threads on the background CPUs.

`single_threaded_torch()` keeps a background thread out of OpenMP's way. PyTorch runs parallel ops on OpenMP
teams, one team per calling thread. When a second thread (our save thread, or SGLang's storage threads calling
our HiCache backend) runs a parallel op, libgomp then manages more threads than there are cores and stops
letting idle team members spin: every parallel region of the model's thread then has to wake its workers.
Measured on 2 cores: a 32-token forward over a 4000-token context took 40 ms instead of 30 ms for the rest of
the process's life after one background save; and on the shared 2-core machine (load 5) a 1 MiB page copy took
16 ms on a two-thread team against 0.03-0.3 ms on its own thread. Called at the start of a background thread
(or of a call from one), it makes that thread's parallel ops run inline (one thread), so the model's team stays
the only one.
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any, Callable, Iterable, Optional

logger = logging.getLogger(__name__)

_cpus: Optional[frozenset[int]] = None
_lock = threading.Lock()


def parse_cpu_list(text: str) -> frozenset[int]:
    """"0,2-4" -> {0, 2, 3, 4}. Raises ValueError on anything else (empty, negative, reversed ranges)."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. '1' or '2,4-7')")
        lo, hi = int(first), int(last) if dash else int(first)
        if hi < lo or hi >= 1 << 16:
            raise ValueError(f"not a CPU list: {text!r} (range {part!r})")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def openmp_binding(cpus: Iterable[int]) -> dict[str, str]:
    """The OpenMP variables that bind a process's OpenMP team to `cpus`, as vLLM's multiprocess engine binds a
    worker (`vllm.utils.ompmultiprocessing`); OMP_PLACES and OMP_PROC_BIND are OpenMP's own names, which GNU and
    Intel OpenMP both read. They take effect only if set before torch loads OpenMP."""
    ordered = sorted(cpus)
    return {"OMP_NUM_THREADS": str(len(ordered)), "OMP_PLACES": "{" + ",".join(map(str, ordered)) + "}",
            "OMP_PROC_BIND": "true"}


def set_background_cpus(cpus: Optional[Iterable[int]]) -> None:
    """The CPUs our background threads started from now on run on (None or empty: where they are)."""
    global _cpus
    with _lock:
        _cpus = frozenset(cpus) if cpus else None


def background_cpus() -> Optional[frozenset[int]]:
    return _cpus


def enter_background_cpus() -> None:
    """Moves the calling thread onto the background CPUs, if any were set, and gives the OS thread its
    Python name (what `top -H` and /proc show: `lmcache-disk-r...` instead of vLLM's process name). Called
    first in every background thread of ours (thread targets, executor initializers). A set the OS refuses
    (outside the cgroup's cpuset) leaves the thread where it is, with one log line."""
    name_os_thread()
    cpus = _cpus
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("background threads stay on CPUs %s: the OS refused %s (%s)",
                       sorted(os.sched_getaffinity(0)), sorted(cpus), exc)
        set_background_cpus(None)



def name_os_thread() -> None:
    """Gives the calling thread's OS thread its Python name, if it is one of ours (`lmcache-*`)."""
    name = threading.current_thread().name
    if not name.startswith("lmcache"):
        return
    try:  # Linux keeps 15 bytes of a thread's name
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


_omp_set_num_threads = None
_looked_up = False


def _omp_setter() -> Callable[[int], Any] | None:
    global _omp_set_num_threads, _looked_up
    if not _looked_up:
        _looked_up = True
        try:  # the runtime torch loaded (same soname, so dlopen returns the loaded one)
            _omp_set_num_threads = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
        except (OSError, AttributeError):
            _omp_set_num_threads = None
    return _omp_set_num_threads


def single_threaded_torch() -> bool:
    """Makes parallel torch ops (and our compiled ops) called from the current thread run on it alone.
    Only this thread is affected. Returns False where the OpenMP runtime could not be reached."""
    import torch  # here, not at the top: the rest of this module is used before torch loads OpenMP, which
    # reads its variables then (testing/vllm_jobs.py sets them for an engine in its own process)

    torch.get_num_threads()  # torch sets a new thread's OpenMP thread count on first use; do that first
    setter = _omp_setter()
    if setter is None:
        return False
    setter(1)
    return torch.get_num_threads() == 1
