"""`MooncakeClient`: the one `mooncake.store.MooncakeDistributedStore` of a Mooncake tier, and every call to it
made on our own threads under a deadline (Mooncake's calls block: about 4 s each to fail once its master is
gone, and its `setup()` retries for about 90 s when no master listens).

- Setup runs on a thread of its own: it checks that the master's port takes a connection, then calls
  `setup()`; until that succeeds every call fails at once (`CallFailed("not_ready")`), and a failed attempt is
  retried after a pause that doubles up to the breaker's longest. Once set up, Mooncake reconnects to a master
  that restarts by itself.
- `call(fn)` runs `fn(store)` on one of `threads` threads and waits at most its timeout. A call past it keeps
  its thread until Mooncake returns; calls never queue for a thread: with every one taken they fail at once
  (`busy`). A circuit breaker (`storage/breaker.py`) turns a timeout or an unreachable master into failures at
  once, for a pause that doubles per failed probe; the first call after the pause is the probe.
- Memory Mooncake reads or writes (`hold`: chunks in the L1 arena, headers in the tier's own small arena) is
  registered with Mooncake once per arena (RDMA needs it), held while the call runs, and, after a call that
  ended in a way that may leave a transfer in flight (a transfer failure, an error, or no return before the
  timeout: only `settled` results say otherwise), kept from reuse for `QUARANTINE_SECS` more.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.config.remote_url import parse_mooncake_url
from lmcache_vllm.cpu_affinity import enter_background_cpus
from lmcache_vllm.memory import MemoryObj, release_all
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.breaker import Breaker
from lmcache_vllm.storage.tier import Tier

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Mooncake's ErrorCode values (mooncake-store types.h) that its Python calls return.
NO_AVAILABLE_HANDLE = -200  # no room in any segment
INVALID_PARAMS = -600  # e.g. the buffers are smaller than the object: refused before any transfer
REPLICA_IS_NOT_READY = -703
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800  # a transfer failed (or buffers larger than the object); may have been in flight
RPC_FAIL = -900
RPC_TIMEOUT = -901
MASTER_UNREACHABLE = frozenset({RPC_FAIL, RPC_TIMEOUT})
# Answers after which no transfer into or out of our memory can still be running.
SETTLED = frozenset({NO_AVAILABLE_HANDLE, INVALID_PARAMS, REPLICA_IS_NOT_READY, OBJECT_NOT_FOUND,
                     OBJECT_ALREADY_EXISTS, OBJECT_HAS_LEASE, LEASE_EXPIRED, *MASTER_UNREACHABLE})
QUARANTINE_SECS = 60.0  # memory of a call that may have left a transfer running stays unused this long


def settled(codes: Sequence[int]) -> bool:
    """Whether every per-key answer of a batch call says no transfer is left running (bytes read or written,
    or a refusal from `SETTLED`)."""
    return all(code >= 0 or code in SETTLED for code in codes)


class CallFailed(Exception):
    """A call that did not run or did not finish: `reason` is not_ready, breaker_open, busy, timeout, master
    (Mooncake said its master is unreachable) or error."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"mooncake call {reason}" + (f": {detail}" if detail else ""))
        self.reason = reason


@dataclass(frozen=True)
class MooncakeSettings:
    """What `setup()` gets, from `remote_url` and the `extra_config` keys LMCache names the same."""

    master: str
    local_hostname: str
    metadata_server: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    device_name: str
    prefer_local_alloc: bool

    @classmethod
    def from_config(cls, config: LMCacheConfig) -> MooncakeSettings:
        if config.remote_url is None:
            raise ValueError("a Mooncake tier needs remote_url")
        target = parse_mooncake_url(config.remote_url)
        extra = config.extra_config
        return cls(extra.master_server_address or target.master_address, extra.local_hostname,
                   extra.metadata_server, extra.global_segment_size, extra.local_buffer_size, extra.protocol,
                   target.device or extra.device_name, extra.mooncake_prefer_local_alloc)

    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.master.rpartition(":")
        return host.strip("[]"), int(port)


class MooncakeClient:
    def __init__(self, settings: MooncakeSettings, *, threads: int, breaker_base_secs: float,
                 breaker_max_secs: float, connect_timeout: float):
        self.settings = settings
        self.threads = threads
        self.connect_timeout = connect_timeout
        self.retry_max_secs = breaker_max_secs
        self.breaker = Breaker(f"Mooncake master {settings.master}", base_secs=breaker_base_secs,
                               max_secs=breaker_max_secs)
        self.problem: Optional[str] = None  # why setup has not succeeded (yet)
        self.replicate: Any = None  # the ReplicateConfig of every put
        self._store: Any = None  # set once setup succeeded
        self._ready = threading.Event()
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._busy = 0
        self._registered: dict[int, bool] = {}  # arena address -> whether Mooncake took it
        self._quarantine: deque[tuple[float, list[MemoryObj]]] = deque()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="lmcache-mooncake",
                                        initializer=enter_background_cpus)
        self._setup_thread = threading.Thread(target=self._setup_loop, name="lmcache-mooncake-setup", daemon=True)

    # ---- setup ------------------------------------------------------------------------------------
    def start(self, wait_secs: float) -> Optional[str]:
        """Starts setting up; waits at most `wait_secs` for it. None when ready, else what is wrong so far."""
        self._setup_thread.start()
        if self._ready.wait(wait_secs):
            return None
        return self.problem or f"no answer from the Mooncake master at {self.settings.master} within {wait_secs:g}s"

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def _setup_loop(self) -> None:
        enter_background_cpus()
        delay = self.breaker.base_secs
        logged = False
        while not self._closing.is_set():
            self.problem = self._try_setup()
            if self.problem is None:
                return
            if not logged:
                logger.warning("lmcache-vllm: the Mooncake tier cannot reach its master yet (%s); its calls are "
                               "misses until it does (retried every %.0fs at most)", self.problem,
                               self.retry_max_secs)
                logged = True
            self._closing.wait(delay)
            delay = min(self.retry_max_secs, delay * 2)

    def _try_setup(self) -> Optional[str]:
        """Sets the store up; None on success, else what went wrong."""
        s = self.settings
        try:
            socket.create_connection(s.master_host_port(), timeout=self.connect_timeout).close()
        except (OSError, ValueError) as exc:
            return f"no master listens at {s.master} ({type(exc).__name__}: {exc})"
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            return f"the mooncake package cannot be imported ({exc})"
        store = MooncakeDistributedStore()
        try:
            rc = store.setup(s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
                             s.protocol, s.device_name, s.master)
        except Exception as exc:  # Mooncake raising instead of returning a code: the same to us
            rc, detail = -1, f" ({type(exc).__name__}: {exc})"
        else:
            detail = ""
        if rc != 0:
            try:
                store.close()
            except Exception:  # a half set-up store: nothing more to do with it
                logger.debug("mooncake close after a failed setup", exc_info=True)
            return f"setup() with master {s.master} returned {rc}{detail}"
        replicate = ReplicateConfig()
        replicate.replica_num = 1
        if s.prefer_local_alloc:
            replicate.preferred_segment = store.get_hostname()
        self.replicate = replicate
        if self._closing.is_set():  # closed while setting up
            store.close()
            return "closed"
        self._store = store
        self._ready.set()
        logger.info("lmcache-vllm: Mooncake tier set up (master %s, %s)", s.master, s.protocol)
        return None

    # ---- calls ------------------------------------------------------------------------------------
    async def call(self, fn: Callable[[Any], T], *, timeout: float, hold: Sequence[MemoryObj] = (),
                   done: Callable[[T], bool] = lambda result: True,
                   unreachable: Callable[[T], bool] = lambda result: False) -> T:
        """`fn(store)` on one of our threads, its result within `timeout` seconds, or `CallFailed`. `hold`:
        memory the call reads or writes (see the module docstring); `done(result)`: whether no transfer is left
        running once `fn` returned (else its memory is quarantined); `unreachable(result)`: whether Mooncake
        said its master is gone (a failure for the breaker)."""
        self._sweep()
        store = self._store
        if store is None:
            raise CallFailed("not_ready", self.problem or "")
        probe = self.breaker.admit()
        if probe is None:
            metrics.inc("breaker_skipped_calls", tier=Tier.MOONCAKE)
            raise CallFailed("breaker_open")
        with self._lock:
            free = self._busy < self.threads and not self._closing.is_set()
            if free:
                self._busy += 1
        if not free:
            if probe:
                self.breaker.abandon_probe()
            raise CallFailed("busy")
        for obj in hold:
            obj.ref_up()  # the thread's own references, dropped (or quarantined) when it returns
        held = list(hold)

        def run() -> T:
            self._register(store, held)
            return fn(store)

        future = self._pool.submit(run)
        future.add_done_callback(lambda f: self._finished(f, held, done))
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout)
        except asyncio.TimeoutError:
            self.breaker.failed(f"no answer within {timeout:.3g}s")
            raise CallFailed("timeout") from None
        except asyncio.CancelledError:
            if probe:
                self.breaker.abandon_probe()
            raise
        except Exception as exc:
            self.breaker.failed(f"{type(exc).__name__}: {exc}")
            raise CallFailed("error", f"{type(exc).__name__}: {exc}") from exc
        if unreachable(result):
            self.breaker.failed("its master is unreachable")
            raise CallFailed("master")
        self.breaker.succeeded()
        return result

    def _finished(self, future: Future[Any], held: list[MemoryObj], done: Callable[[Any], bool]) -> None:
        """On the call's thread once `fn` returned: the thread is free, its memory released or quarantined."""
        with self._lock:
            self._busy -= 1
        try:
            clean = not future.cancelled() and future.exception() is None and done(future.result())
        except Exception:  # a `done` that cannot tell: assume the worst
            clean = False
        if clean or not held:
            release_all(held)
            return
        with self._lock:
            self._quarantine.append((time.monotonic() + QUARANTINE_SECS, held))

    def _sweep(self, everything: bool = False) -> None:
        """Releases the quarantined memory whose time is up (`everything`: all of it)."""
        now = time.monotonic()
        due: list[MemoryObj] = []
        with self._lock:
            while self._quarantine and (everything or self._quarantine[0][0] <= now):
                due += self._quarantine.popleft()[1]
        release_all(due)

    def quarantined_bytes(self) -> int:
        with self._lock:
            return sum(obj.nbytes for _, objs in self._quarantine for obj in objs)

    def _register(self, store: Any, held: list[MemoryObj]) -> None:
        """Registers the arenas of `held` with Mooncake (once each; on the call's thread)."""
        for obj in held:
            arena = obj.arena
            address = arena.data_ptr()
            with self._lock:
                if address in self._registered:
                    continue
                rc = store.register_buffer(address, arena.numel() * arena.element_size())
                self._registered[address] = rc == 0
            if rc != 0:
                logger.warning("lmcache-vllm: Mooncake did not register a %d-byte arena (%d); transfers into it "
                               "may fail (misses)", arena.numel() * arena.element_size(), rc)

    @property
    def busy_threads(self) -> int:
        with self._lock:
            return self._busy

    # ---- shutdown ---------------------------------------------------------------------------------
    async def close(self, timeout: float = 4.0) -> bool:
        """Stops setting up; once the calls in flight returned (at most `timeout` seconds), closes the store
        (at most `timeout` more) and frees all memory. False when either did not happen in time: the store
        then stays open and its memory held (a transfer may still run), to the end of the process."""
        self._closing.set()
        store, self._store = self._store, None
        deadline = time.monotonic() + timeout
        while self.busy_threads and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        closed = not self.busy_threads
        if store is not None and closed:
            def shut() -> None:
                with self._lock:
                    registered = [address for address, ok in self._registered.items() if ok]
                for address in registered:
                    store.unregister_buffer(address)
                store.close()
            closer = threading.Thread(target=shut, name="lmcache-mooncake-close", daemon=True)
            closer.start()
            await asyncio.get_running_loop().run_in_executor(None, closer.join, timeout)
            closed = not closer.is_alive()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if closed:
            self._sweep(everything=True)
        else:
            logger.warning("lmcache-vllm: Mooncake calls or its close did not return within %.0fs; the store "
                           "stays open and its memory held", timeout)
        return closed
