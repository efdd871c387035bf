"""Backs a host arena with physical pages before it is used, on a background thread.

The first write to a page costs a page fault; in a VM whose memory the host backs lazily it costs far
more (measured here: a first-touch copy runs at 0.3-0.5 GB/s, a copy into touched memory at 6-7 GB/s).
An L1 arena is touched chunk by chunk as stores arrive, so without this every store of fresh data
pays that price inside the serving loop. `ArenaPrefaulter` asks the kernel to populate the arena with
`madvise(MADV_POPULATE_WRITE)` (Linux >= 5.14), which maps pages writable without writing to them:
it is safe while the allocator already hands out and fills regions of the same arena. It also asks
for transparent huge pages (`MADV_HUGEPAGE`, fewer faults and TLB misses), best effort.

`sync` populates before returning: start-up takes longer (1.8-2.7 s per GiB on our VMs, measured with
`benchmarks/bench_prefault.py`; far less on bare metal)
and the arena is ready for the first request. In the background the thread runs at the lowest CPU
priority (nice 19) and populates 2 MiB per call, to fill idle time and hold the process's memory map
only briefly (a 64 MiB call held off vLLM's own allocations for ~170 ms). It still slows the requests
served while it runs on a machine without spare cores (measured on 2 cores: cold requests right after
start-up 10-20 % slower), which is why the config default is off.

Where the kernel lacks either call, or the arena is pinned (already resident), nothing happens.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time

import torch

from lmcache_vllm.cpu_affinity import enter_background_cpus

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
HUGE_PAGE = 2 << 20
STEP_BYTES = 2 << 20  # one huge page per call: short holds of the memory map, quick to stop
MODES = ("off", "background", "sync")


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _madvise(libc: ctypes.CDLL, addr: int, length: int, advice: int) -> int:
    """0 on success, else the errno."""
    if libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), ctypes.c_int(advice)) == 0:
        return 0
    return ctypes.get_errno()


class ArenaPrefaulter:
    """Populates `arena` (a contiguous CPU tensor) in the background or at once (`background=False`);
    `stop()` ends a background run early."""

    def __init__(self, arena: torch.Tensor, *, background: bool = True):
        self._arena = arena  # holds the memory alive while the thread works on it
        self._stop = threading.Event()
        self.populated_bytes = 0
        self.seconds = 0.0
        self.error: int | None = None  # errno that ended populating early (None: done or running)
        self._thread: threading.Thread | None = None
        libc = _libc()
        if libc is None or arena.device.type != "cpu" or arena.numel() == 0:
            return
        start = arena.data_ptr()
        end = start + arena.numel() * arena.element_size()
        # madvise needs page-aligned addresses; huge pages only cover whole 2 MiB-aligned ranges.
        huge_start = -(-start // HUGE_PAGE) * HUGE_PAGE
        huge_end = end // HUGE_PAGE * HUGE_PAGE
        if huge_end > huge_start:
            _madvise(libc, huge_start, huge_end - huge_start, MADV_HUGEPAGE)  # best effort
        page = 4096
        self._range = (-(-start // page) * page, end // page * page)
        self._libc = libc
        if background:
            self._thread = threading.Thread(target=self._run, name="lmcache-prefault", daemon=True)
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        if threading.current_thread() is self._thread:
            enter_background_cpus()
            try:  # Linux: a thread id is a valid target for setpriority
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except (OSError, AttributeError):
                pass
        t0 = time.perf_counter()
        addr, end = self._range
        while addr < end and not self._stop.is_set():
            length = min(STEP_BYTES, end - addr)
            err = _madvise(self._libc, addr, length, MADV_POPULATE_WRITE)
            if err:
                self.error = err
                logger.debug("arena prefault stopped after %d bytes: errno %d", self.populated_bytes, err)
                break
            addr += length
            self.populated_bytes += length
        self.seconds = time.perf_counter() - t0
        if self.populated_bytes:
            logger.info("host arena: %.2f GiB populated in %.2f s", self.populated_bytes / (1 << 30),
                        self.seconds)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        self._stop.set()
        self.wait()
