"""The load thread: a step's layerwise loads copied beside vLLM's forward instead of before it (CPU backend).

A load from L1 is a copy of every loaded token's KV into the paged cache; inline it delays the forward by that
copy (measured: 2.4 ms of a ~95 ms cached step for the medium model's 3840 tokens on AMD Zen 4, at the speed of
a plain copy, so no faster kernel can remove it). The forward needs layer i's KV only when layer i's attention
runs (vLLM calls `wait_for_layer_load` just before it), so the step thread plans the loads (which chunks, held
in L1: `CacheEngine.retrieve_layer`'s first step) and this thread copies them layer by layer, on our background
CPUs, while the forward computes the earlier layers. The step waits only for a layer not copied yet.

Used only where it cannot take the forward's own time: the thread runs on the background CPUs
(`cpu_affinity`), so `extra_config.overlap_loads: auto` turns it on when the step thread can run elsewhere
(`overlap_wanted`). Its parallel torch ops run on it alone (`cpu_affinity.single_threaded_torch`).

Every wait is bounded by the load timeout. A layer copy that fails drops that request's load at that layer
(reported to the caller with the layer, as the inline layerwise path does). Should a wait time out, the thread
is told to stop before its next layer, the step waits (bounded again) until it has, and every load still
running is reported failed: vLLM recomputes those blocks, and no copy of ours writes them afterwards. A copy stuck
past both waits cannot be interrupted: its loads are reported failed all the same, its layers still to come are
never copied (it stops before the next), and while it is stuck the next steps' loads are refused (recomputed)
rather than queued behind it.
"""
from __future__ import annotations

import functools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

from lmcache_vllm.cpu_affinity import background_cpus, enter_background_cpus, single_threaded_torch
from lmcache_vllm.integration.vllm.layerwise import LayerGenerator, LayerSteps
from lmcache_vllm.observability import metrics

logger = logging.getLogger(__name__)

Tag = TypeVar("Tag")


def overlap_wanted(setting: str, device_type: str) -> bool:
    """Whether loads copy on the load thread (`extra_config.overlap_loads`): 'on', 'off', or 'auto' = on the
    CPU backend when our background threads run on CPUs of their own and the calling (step) thread may run on
    another: a worker whose OpenMP threads vLLM bound (its serving processes) computes on CPUs that are not
    ours; an engine in the caller's process (`LLM()` without multiprocessing) is not bound by vLLM 0.32 at all
    and, with vLLM's one torch thread, takes whichever core the load thread leaves free."""
    if setting != "auto":
        return setting == "on"
    cpus = background_cpus()
    if device_type != "cpu" or not cpus or not hasattr(os, "sched_getaffinity"):
        return False
    return bool(os.sched_getaffinity(0) - cpus)


def _thread_init() -> None:
    enter_background_cpus()
    single_threaded_torch()


class LoadThread(Generic[Tag]):
    """Runs the layer steps of a step's loads (generators already past their planning step) on one thread,
    layer by layer; `wait(layer)` returns once every load copied that layer."""

    def __init__(self, num_layers: int, timeout_s: float):
        self.num_layers = num_layers
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmcache-load",
                                            initializer=_thread_init)
        self._cond = threading.Condition()
        self._copied = num_layers  # layers every load of the running batch copied (all: nothing running)
        self._failures: list[tuple[Tag, Exception, int]] = []
        self._cancel = False
        self._running = False  # a batch's `_run` has not ended (an abandoned one included)
        self._batch = 0  # the number of the latest batch started
        self._abandoned = 0  # the number of a batch given up while still running: its failures are reported
        self._tags: list[Tag] = []  # the running batch's loads, reported failed should it be abandoned

    @property
    def running(self) -> bool:
        return self._running

    def start(self, entries: list[tuple[Tag, LayerGenerator]]) -> None:
        """Starts copying `entries` (the previous batch must be waited for: `wait(num_layers - 1)`)."""
        if not entries:
            return
        with self._cond:
            stuck = self._running  # only an abandoned batch is still running here
            if stuck:
                self._failures.extend((tag, TimeoutError("the load thread is stuck"), 0) for tag, _ in entries)
            else:
                self._batch += 1
                self._copied, self._cancel, self._running = 0, False, True
                self._tags = [tag for tag, _ in entries]
        if stuck:  # failed_load_tokens counts them
            for _, gen in entries:
                gen.close()  # lets its chunks go
            return
        metrics.inc("overlapped_loads", len(entries))
        self._executor.submit(self._run, self._batch, entries)

    def _run(self, batch: int, entries: list[tuple[Tag, LayerGenerator]]) -> None:
        steps: LayerSteps[Tag] = LayerSteps()
        for tag, gen in entries:
            steps.add(tag, gen)
        layer = 0
        try:
            while layer < self.num_layers and steps:
                if self._cancel:
                    break
                steps.step(functools.partial(self._failed, batch=batch, layer=layer))
                layer += 1
                with self._cond:
                    if batch != self._abandoned:
                        self._copied = layer
                        self._cond.notify_all()
        finally:
            left = steps.take()  # each generator's `finally` lets its chunks go
            for _, gen in left:
                gen.close()
            with self._cond:
                # stopped (or failed) before the last layer: these loads are holes (an abandoned batch's
                # loads were all reported when it was given up)
                if layer < self.num_layers and batch != self._abandoned:
                    self._failures.extend((tag, TimeoutError("load stopped"), layer) for tag, _ in left)
                self._copied, self._running, self._tags = self.num_layers, False, []
                self._cond.notify_all()

    def _failed(self, tag: Tag, exc: Exception, *, batch: int, layer: int) -> None:
        with self._cond:
            if batch != self._abandoned:
                self._failures.append((tag, exc, layer))

    def _stopped(self) -> None:
        """Waits (bounded, the lock held) for the running batch to stop; one that does not is abandoned: every
        load of it is reported failed now, and the waits of this step return."""
        if self._abandoned == self._batch or self._cond.wait_for(lambda: not self._running, self.timeout_s):
            return  # given up before (its loads reported), or stopped
        logger.error("the load thread did not stop within %.1fs; its loads are recomputed, and later loads "
                     "too while it is stuck", self.timeout_s)
        metrics.inc("load_thread_stuck")
        self._abandoned = self._batch
        self._failures.extend((tag, TimeoutError("the load thread is stuck"), self._copied) for tag in self._tags)
        self._copied, self._tags = self.num_layers, []

    def wait(self, layer: int) -> list[tuple[Tag, Exception, int]]:
        """Waits until every running load copied `layer` (at most the timeout; past it the loads are stopped, then
        waited for once more); returns the failures not reported before: (tag, error, layer it failed at)."""
        with self._cond:
            if self._copied <= layer:
                t0 = time.perf_counter()
                if not self._cond.wait_for(lambda: self._copied > layer, self.timeout_s):
                    self._cancel = True
                    metrics.inc("load_thread_timeouts")
                    logger.warning("the load thread did not copy layer %d within %.1fs; its loads are stopped "
                                   "and recomputed", layer, self.timeout_s)
                    self._stopped()
                metrics.inc("load_wait_seconds", time.perf_counter() - t0)
            failures, self._failures = self._failures, []
        return failures

    def stop(self) -> list[tuple[Tag, Exception, int]]:
        """Stops the running loads before their next layer (the cache is about to be released) and waits
        (bounded) until they stopped; returns the failures not reported before, the stopped loads among them."""
        with self._cond:
            self._cancel = True
            self._stopped()
            failures, self._failures = self._failures, []
        return failures

    def close(self) -> None:
        self.stop()
        with self._cond:
            stuck = self._running  # a copy given up on: not waited for (every wait is bounded)
        self._executor.shutdown(wait=not stuck, cancel_futures=True)
