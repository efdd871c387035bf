"""Which CPUs our background threads run on.

vLLM's CPU worker pins its process to the cores it computes on (VLLM_CPU_OMP_THREADS_BIND), and every
thread the process starts later inherits that: our storage loop, disk readers and writers, save thread,
lookup and transfer servers would otherwise take their time from the model's compute cores while the cores
vLLM reserves (for the API server, the engine core and connectors: it reserves one more per rank when a
KV connector is configured) do less. The integration layer decides the set once per worker process
(`set_background_cpus`, from `extra_config.background_cpus` and vLLM's binding); every background thread of
ours calls `enter_background_cpus()` first. None (the default, and always on a host vLLM does not pin) leaves
threads where they are.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Iterable, Optional

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
    _name_os_thread()
    cpus = _cpus
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("background threads stay on CPUs %s: the OS refused %s (%s)",
                       sorted(os.sched_getaffinity(0)), sorted(cpus), exc)
        set_background_cpus(None)



def _name_os_thread() -> None:
    name = threading.current_thread().name
    if not name.startswith("lmcache"):
        return
    try:  # Linux keeps 15 bytes of a thread's name
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass
