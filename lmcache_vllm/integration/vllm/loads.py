"""Per-request lookups, the chunks they hold, and asynchronous loads: the worker half's bookkeeping.

- `lookup(query)` answers the scheduler for request R: the engine finds R's chunks from the token vLLM
  already holds on and *holds* them (`CacheEngine.lookup_and_hold`: L1 chunks at once, lower-tier ones
  are read into L1 in the background). The answer never waits on a slow tier for long: the first ask
  waits at most `FIRST_ANSWER_WAIT_S` for the lower tiers to say where the chunks are, later asks only after
  a step that computed nothing (`IDLE_STEP_WAIT_S`); until they answer the result is `pending` (vLLM tries R
  again next step, other requests run). Then,
  when the pace of recent reads (`ReadPace`) says they end within `extra_config.lookup_read_wait_ms`, the
  first ask waits that long for the reads too: a hit read by then is answered `ready` and loads inside the
  step like an L1 hit.
- The held prefix stays registered under R until R's load takes it (`take` / `begin_async`), the
  scheduler says R loads nothing (`release`), R finishes, or the hold time of the storage passes.
- A load naming a prefill instance (disaggregated prefill: no lookup came first) starts its hold in
  `begin_async`, with that instance as a tier in front of the lower ones (`open_peer(spec.peer)`).
- An asynchronous load (`begin_async`) waits for its chunks to be read into L1 while vLLM runs other
  requests; `ready_loads()` hands out those whose reads are over (or whose `timeout_s` passed: then
  whatever is not in L1 is a failed load, recomputed by vLLM — never a hang). `abort(req_ids)` drops the
  loads of requests that finished while waiting (aborted): their holds and reads are released.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, cast

from lmcache_vllm.integration.vllm.lookup import LookupAnswer, LookupQuery
from lmcache_vllm.integration.vllm.metadata import LoadSpec, PeerSpec
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.tier import Tier

if TYPE_CHECKING:  # the engine is built in the worker only, after vLLM's API server imported us
    from lmcache_vllm.engine import CacheEngine, HeldPrefix
    from lmcache_vllm.engine.grouped import GroupedEngine, GroupedHold
    from lmcache_vllm.storage.base import StorageBackend

# A prefill instance of a load (`LoadSpec.peer`) -> the tier that pulls from it (`pd/worker.py`).
OpenPeer = Callable[[PeerSpec], "StorageBackend | None"]  # None: not one to pull from (logged)

logger = logging.getLogger(__name__)

# The first ask for a request waits this long for the lower tiers' existence check (a disk index
# lookup or one Redis pipeline: well under a millisecond when healthy). A slow or paused tier makes
# the answer `pending` instead of stalling vLLM's scheduler, which then runs the other requests.
FIRST_ANSWER_WAIT_S = 0.02
# How long a step with nothing to compute waits for an asynchronous load to finish before returning
# (vLLM then loops over empty steps; waiting here spares it most of that spinning). A lookup asked again
# after such a step waits as long for its answer: a request whose lookup is pending made vLLM loop over
# empty steps too, hundreds a second over every rank, and on a small machine that spinning kept a
# co-located directory or Redis off the CPU for seconds (the P2P lookups that stalled for their bound).
IDLE_STEP_WAIT_S = 0.01


@dataclass
class _Lookup:
    held: HeldPrefix | GroupedHold
    start: int
    num_tokens: int
    created: float


class ReadPace:
    """Seconds per chunk of the recent lower-tier reads of lookups (a moving average over their time from
    lookup to read): what a hit's reads are expected to take. Unknown (0) until a read is seen."""

    def __init__(self) -> None:
        self.per_chunk = 0.0
        self._seen = False

    def expected(self, chunks: int) -> float:
        return chunks * self.per_chunk

    def observe(self, seconds: float, chunks: int) -> None:
        sample = seconds / max(1, chunks)
        self.per_chunk = sample if not self._seen else 0.75 * self.per_chunk + 0.25 * sample
        self._seen = True


@dataclass
class AsyncLoad:
    spec: LoadSpec
    held: HeldPrefix | GroupedHold | None  # None when the lookup's hold is gone
    deadline: float


class RequestLoads:
    """See the module docstring. Thread-safe: lookups come from the lookup server's thread (or vLLM's
    scheduler thread), loads from the worker's step."""

    def __init__(self, engine: CacheEngine | GroupedEngine, *, timeout_s: float, hold_s: float,
                 open_peer: OpenPeer | None = None, read_wait_s: float = 0.0):
        """`read_wait_s` (`extra_config.lookup_read_wait_ms`): how long a first ask may wait for a hit's reads
        (0: never). A hit read in time is answered `ready` and loads inside the step like an L1 hit, instead of
        waiting a step in WAITING_FOR_REMOTE_KVS (in a busy server: a whole step of other requests' work);
        vLLM's scheduler waits meanwhile, so only reads the pace says end within it are waited for."""
        self.engine = engine
        self.read_wait_s = read_wait_s
        self.open_peer = open_peer
        self.timeout_s = float(timeout_s)
        self.hold_s = float(hold_s)
        self._lock = threading.Lock()
        self._lookups: dict[str, _Lookup] = {}
        self._async: dict[str, AsyncLoad] = {}
        self._progress = threading.Event()
        self._idle_step = False  # the last step computed nothing (vLLM loops over empty steps)
        self._last_purge = time.monotonic()
        self.read_pace = ReadPace()

    # ------------------------------------------------------------------ lookups
    def lookup(self, query: LookupQuery) -> LookupAnswer:
        cs = self.engine.keys.chunk_size
        start = max(0, int(query.start)) // cs * cs
        now = time.monotonic()
        stale = None
        with self._lock:
            entry = self._lookups.get(query.req_id)
            first = False
            wait = IDLE_STEP_WAIT_S if self._idle_step else 0.0  # an answer still pending: see IDLE_STEP_WAIT_S
            if entry is not None and (entry.start != start or entry.num_tokens != len(query.token_ids)
                                      or now - entry.created > self.hold_s):
                stale, entry = entry, None
            if entry is None:
                held = self.engine.lookup_and_hold(query.token_ids, start, query.extra)
                entry = self._lookups[query.req_id] = _Lookup(held, start, len(query.token_ids), now)
                first, wait = True, FIRST_ANSWER_WAIT_S
        if stale is not None:
            stale.held.release()
        self._purge(now)
        hit = entry.held.located(wait)
        if hit is None:
            return LookupAnswer(0, pending=True)
        below = sum(t != Tier.LOCAL_CPU for t in hit.chunk_tiers)
        waited = False
        if below and first:  # the first ask of a hit that reads from below
            self._time_reads(entry.held, now, below)
            if self.read_wait_s and self.read_pace.expected(below) <= self.read_wait_s:
                entry.held.wait(self.read_wait_s)
                waited = True
        # Ready only if every chunk located was read: a load inside the step planned on chunks a read did not
        # bring fails, and vLLM then keeps the hit in the request's cached-token count. Such a hit loads
        # asynchronously, whose failures are reported before the request is scheduled.
        ready = not below or entry.held.read_in_full()
        if waited:
            result = "ready" if ready else "late" if not entry.held.ready() else "failed"
            metrics.inc("lookup_read_waits", result=result)
        return LookupAnswer(hit.end, hit.chunk_tiers, hit.start, ready=ready)

    def _time_reads(self, held: HeldPrefix | GroupedHold, started: float, chunks: int) -> None:
        def done() -> None:  # on the storage loop, once the reads are over
            self.read_pace.observe(time.monotonic() - started, chunks)
        held.add_done_callback(done)

    def _purge(self, now: float) -> None:
        """Drops lookups nobody loaded or released within the hold time (their holds are gone)."""
        if now - self._last_purge < self.hold_s:
            return
        self._last_purge = now
        with self._lock:
            old = [r for r, e in self._lookups.items() if now - e.created > self.hold_s]
            entries = [self._lookups.pop(r) for r in old]
        for entry in entries:
            entry.held.release()

    def note_step(self, idle: bool) -> None:
        """Whether the worker's last step computed nothing: a lookup asked again then may wait a little."""
        self._idle_step = idle

    def take(self, req_id: str):
        """The held prefix of `req_id`'s lookup for its load (None: no lookup or it expired)."""
        with self._lock:
            entry = self._lookups.pop(req_id, None)
        return None if entry is None else entry.held

    def release(self, req_ids) -> None:
        """These requests will not load what their lookup holds (or are gone): let it go."""
        with self._lock:
            entries = [self._lookups.pop(r, None) for r in req_ids]
        for entry in entries:
            if entry is not None:
                entry.held.release()

    # ------------------------------------------------------------------ asynchronous loads
    def begin_async(self, spec: LoadSpec) -> None:
        held = self.take(spec.req_id)
        if held is None and spec.peer is not None and self.open_peer is not None:
            # open_peer is set only for an engine of one KV cache group (worker.py: no PD for grouped models)
            engine = cast("CacheEngine", self.engine)
            held = engine.lookup_and_hold(spec.token_ids, spec.skip_leading, spec.extra,
                                          peer=self.open_peer(spec.peer))
        job = AsyncLoad(spec, held, time.monotonic() + self.timeout_s)
        with self._lock:
            self._async[spec.req_id] = job
        if held is not None:
            held.add_done_callback(self._progress.set)

    def pending_async(self) -> int:
        with self._lock:
            return len(self._async)

    def ready_loads(self) -> list[AsyncLoad]:
        """Asynchronous loads whose reads are over or whose time is up (removed from the pending set)."""
        now = time.monotonic()
        with self._lock:
            ready = [job for job in self._async.values()
                     if job.held is None or job.held.ready() or now >= job.deadline]
            for job in ready:
                del self._async[job.spec.req_id]
        for job in ready:
            if job.held is not None and not job.held.ready():
                metrics.inc("async_load_timeouts")
                logger.warning("request %s: chunks not read within %.1fs; what is missing is recomputed",
                               job.spec.req_id, self.timeout_s)
                job.held.release()  # stops the reads; the load takes what reached L1
                job.held = None
        return ready

    def wait_for_progress(self, timeout: float) -> None:
        """Waits until some asynchronous load's reads finish, or `timeout` (bounded by the deadlines)."""
        with self._lock:
            if not self._async:
                return
            nearest = min(job.deadline for job in self._async.values())
        self._progress.wait(max(0.0, min(timeout, nearest - time.monotonic())))
        self._progress.clear()

    def abort(self, req_ids) -> set[str]:
        """Requests that finished (aborted) while their load was pending: their holds and reads are
        released. Returns those that had an asynchronous load (vLLM waits to hear they are done)."""
        ids = set(req_ids)
        with self._lock:
            jobs = [self._async.pop(r) for r in ids if r in self._async]
        for job in jobs:
            if job.held is not None:
                job.held.release()
        self.release(ids)
        metrics.inc("aborted_async_loads", len(jobs))
        return {job.spec.req_id for job in jobs}

    def close(self) -> None:
        with self._lock:
            ids = list(self._async) + list(self._lookups)
        self.abort(ids)
