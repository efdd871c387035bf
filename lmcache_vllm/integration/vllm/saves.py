"""Background saves of the worker half, and when vLLM may reuse the blocks they copy from.

Whole-step saves run on one save thread (`submit`), so the copy out of the paged cache overlaps vLLM's
sampling and scheduling and the next forward. A step never waits for them: a block a save reads is
never rewritten while the save runs, because
- a running request's computed KV is never rewritten (new tokens go to other slots);
- a finished request's blocks stay allocated until its saves are done: the scheduler half tells vLLM to
  delay freeing them (`request_finished` returns True) and `finished` / `newly_done` report the request
  in `get_finished`'s finished_sending once every save of it is over (vLLM frees the blocks then);
- a preempted request's blocks are freed at once, so `drain(preempted ids)` waits for its saves in
  `handle_preemptions`, which vLLM runs before it writes any block of the step.

Durable saves (`durable`, a PD producer): a save that completes a prompt also waits for its chunks to be
written to every lower tier (the shared one a consumer reads), and `wait_for_save` waits for those saves:
the step's output, the producer's answer, leaves only once a consumer looking the prompt up will find it.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from lmcache_vllm.integration.vllm.metadata import SaveSpec
from lmcache_vllm.observability import metrics

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    future: Future
    specs: list[SaveSpec]


class SaveQueue:
    """Save jobs in flight, by request (see the module docstring). `executor` None: saves run inline."""

    def __init__(self, executor: ThreadPoolExecutor | None, *, durable: bool = False,
                 durable_timeout_s: float = 10.0):
        self.executor = executor
        self.durable = durable
        self.durable_timeout_s = durable_timeout_s
        self._lock = threading.Lock()
        self._pending: list[_Pending] = []
        self._delayed: set[str] = set()  # finished requests whose blocks vLLM keeps until we report them

    def submit(self, store: Callable[[list[SaveSpec]], None], saves: list[SaveSpec]) -> Future | None:
        """Runs `store(saves)` on the save thread (inline without one); the future, or None if inline."""
        if self.executor is None:
            store(saves)
            return None
        future = self.executor.submit(store, saves)
        with self._lock:
            self._pending.append(_Pending(future, saves))
        return future

    def _futures(self, req_ids: Iterable[str] | None = None) -> list[Future]:
        pending = self._snapshot()
        if req_ids is None:
            return [p.future for p in pending]
        ids = set(req_ids)
        return [p.future for p in pending if any(s.req_id in ids for s in p.specs)]

    def drain(self, req_ids: Iterable[str] | None = None) -> None:
        """Waits for the saves in flight (of `req_ids` only, when given); each catches its own errors."""
        futures = self._futures(req_ids)
        if not futures:
            return
        t0 = time.perf_counter()
        for future in futures:
            future.result()
        metrics.inc("save_wait_seconds", time.perf_counter() - t0)

    def wait(self, futures: Iterable[Future | None], timeout_s: float) -> bool:
        """Waits (at most `timeout_s` in all) for these saves; False if one is still running."""
        deadline = time.monotonic() + timeout_s
        for future in futures:
            if future is None:
                continue
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except Exception:  # a timeout; a save's own errors are caught inside it
                return False
        return True

    def shares_prefix(self, token_ids, chunk_size: int) -> bool:
        """Whether a save in flight stores the first chunk of `token_ids` (without a common first chunk it
        cannot add to this prompt's hit)."""
        pending = [p.specs for p in self._snapshot()]
        if not pending:
            return False
        first = min(len(token_ids), chunk_size)
        head = np.asarray(token_ids[:first], dtype=np.int64)
        return any(len(spec.token_ids) >= first and
                   np.array_equal(np.asarray(spec.token_ids[:first], dtype=np.int64), head)
                   for specs in pending for spec in specs)

    def when_done(self, req_ids: Iterable[str], callback: Callable[[], None]) -> None:
        """Calls `callback()` once the saves of `req_ids` handed out so far are over: at once when none
        is in flight, else on the save thread after the last of them."""
        futures = self._futures(req_ids)
        if not futures:
            callback()
            return
        left = [len(futures)]
        lock = threading.Lock()

        def one_done(_: Future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                callback()

        for future in futures:
            future.add_done_callback(one_done)

    def finished(self, req_ids: Iterable[str]) -> None:
        """These requests finished and vLLM keeps their blocks until we report them (`newly_done`)."""
        with self._lock:
            self._delayed.update(req_ids)

    def newly_done(self) -> set[str]:
        """Finished requests whose saves are all over: vLLM may free their blocks now (reported once)."""
        busy = {s.req_id for p in self._snapshot() for s in p.specs}
        with self._lock:
            done = {r for r in self._delayed if r not in busy}
            self._delayed -= done
        return done

    def has_delayed(self) -> bool:
        with self._lock:
            return bool(self._delayed)

    def wait_any(self, timeout_s: float) -> None:
        """Waits until one save in flight finishes, at most `timeout_s` (an idle step's short pause)."""
        futures = self._futures()
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def _snapshot(self) -> list[_Pending]:
        with self._lock:
            self._pending = [p for p in self._pending if not p.future.done()]
            return list(self._pending)

    def close(self) -> None:
        self.drain()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
