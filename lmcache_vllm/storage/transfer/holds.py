"""`PeerHolds`: the chunks a prefill instance keeps in L1 for the decode instance that will pull them.

A hold is registered (`expect`) in the step that completes a request's prompt, before vLLM can answer the
request, and filled (`fill`) once the request's saves are over: a reference on each L1 chunk of the prompt,
so the allocator cannot evict them, and each chunk's wire header (a checksum pass, made here so that a pull
only sends; a chunk sent coded, `serde`: `transfer/serde.py`, is coded here too, its payload kept beside the
hold). It ends on the decode instance's RELEASE (`release`), when the request was aborted (`release` too), or
`lease_s` after it was registered (`expire`): memory is never held for a decode instance that never comes.

The bytes held at once are capped (`max_bytes`, `extra_config.pd_max_held_bytes`; `max_held_bytes` gives
the default): a request that would go over it is not held — registered as refused (`HoldState.FULL`), so
its decode instance's pull is answered at once and it recomputes — counted in `pd_holds_refused`, with one
warning per interval. `fill` owns the references it is given whatever happens (a header it cannot make, a
hold gone or refused meanwhile): they are kept or dropped, never leaked.

The transfer server (`server.py`) sends held chunks straight from the arena. It takes its own reference on
the chunks it sends (`checkout`, which also says how long the hold's lease has left: the server cuts off a
send still running when it ends) and hands them back once its sends returned (`sent`), so a hold can end
at any time, also while its chunks are being sent.

Thread-safe: holds are registered on vLLM's worker thread, filled on the save thread, served and expired on
the transfer server's threads.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Iterator, Optional, Sequence

from lmcache_vllm.memory import MemoryObj
from lmcache_vllm.observability import logs, metrics
from lmcache_vllm.storage.base import release_objs
from lmcache_vllm.storage.codec import ChunkBytes, ChunkMac
from lmcache_vllm.storage.transfer.serde import wire_coder
from lmcache_vllm.storage.transfer.wire import chunk_parts

logger = logging.getLogger(__name__)

_REMEMBER_ENDED = 4096  # ended holds remembered (so a late pull hears "expired", not "unknown")
# The default cap on held bytes, as a fraction of the L1 arena: every save lands in L1 first, so chunks
# pinned for decode instances (which L1 cannot evict) must leave room for the instance's own saves and
# prefix hits even while decode instances are down for a whole lease.
DEFAULT_HELD_FRACTION = 0.5


def max_held_bytes(setting: Optional[int], arena_bytes: int) -> int:
    """The cap on held bytes: `extra_config.pd_max_held_bytes` (0: none), by default (None)
    `DEFAULT_HELD_FRACTION` of the L1 arena."""
    return int(arena_bytes * DEFAULT_HELD_FRACTION) if setting is None else int(setting)


class DuplicateKey(ValueError):
    """A PULL named one key twice (each would be sent again: refused)."""


@dataclass(eq=False)
class Hold:
    """One request's held chunks: pending (`keys` None) until its saves are over."""

    req_id: str
    deadline: float
    keys: Optional[list[str]] = None
    objs: list[MemoryObj] = field(default_factory=list)
    headers: list[bytes] = field(default_factory=list)  # each chunk's wire header
    payloads: list[Optional[ChunkBytes]] = field(default_factory=list)  # coded payloads (None: the tensor's)
    nbytes: int = 0

    @property
    def ready(self) -> bool:
        return self.keys is not None

    def prefix(self, keys: Iterable[str]) -> list[int]:
        """Indexes of the held chunks of the longest prefix of `keys` (in order) this hold has; looks at
        no key past the first it lacks. `DuplicateKey` for a key named twice in that prefix."""
        mine = {key: i for i, key in enumerate(self.keys or ())}
        out: list[int] = []
        seen: set[int] = set()
        for key in keys:
            index = mine.get(key)
            if index is None:
                break
            if index in seen:
                raise DuplicateKey(f"key {len(out)} of the PULL repeats an earlier one")
            seen.add(index)
            out.append(index)
        return out


class HoldState(str, Enum):
    READY = "ready"
    PENDING = "pending"  # registered, its saves not over yet
    UNKNOWN = "unknown"  # never registered here (or forgotten long ago)
    RELEASED = "released"
    EXPIRED = "expired"
    FULL = "full"  # refused: the held bytes were at the cap


@dataclass(frozen=True)
class Checkout:
    state: HoldState
    objs: list[MemoryObj] = field(default_factory=list)  # READY: the prefix asked for, a reference each
    headers: tuple[bytes, ...] = ()  # READY: their wire headers
    keys: tuple[str, ...] = ()  # READY: their keys
    first_held_key: str = ""  # READY: the hold's first key (to say what differs, never sent)
    expires_in: float = 0.0  # READY: seconds left of the hold's lease
    payloads: tuple[Optional[ChunkBytes], ...] = ()  # READY: coded payloads (None or missing: the tensor's bytes)


class PeerHolds:
    """See the module docstring. `max_bytes`: the cap on held bytes (0: none); `mac`: the secret the
    chunks' wire headers are signed with; `serde`: their codec (`extra_config.transfer_serde`); `clock` is
    for tests."""

    def __init__(self, lease_s: float, *, max_bytes: int = 0, mac: Optional[ChunkMac] = None,
                 serde: str = "naive", clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.lease_s = float(lease_s)
        self.max_bytes = int(max_bytes)
        self.mac = mac
        self.serde = serde
        self._clock = clock
        self._lock = threading.Lock()
        self._holds: dict[str, Hold] = {}
        self._held_bytes = 0
        self._ended: "OrderedDict[str, HoldState]" = OrderedDict()
        self._newly_ended: list[str] = []  # since the last `take_ended` (the scheduler half's ledger)
        self._unregister = metrics.register_gauges(self._gauges)

    # ------------------------------------------------------------------ registering and filling
    def expect(self, req_id: str) -> bool:
        """Registers a pending hold for `req_id` (its chunks are being saved); an older one is replaced.
        False: refused at once, the held bytes are at the cap."""
        hold = Hold(req_id, self._clock() + self.lease_s)
        with self._lock:
            old = self._pop(req_id)
            full = self.max_bytes > 0 and self._held_bytes >= self.max_bytes
            if full:
                self._remember(req_id, HoldState.FULL)
            else:
                self._holds[req_id] = hold
            held = self._held_bytes
        if old is not None:
            release_objs(old.objs)
        if full:
            self._refused(req_id, held, 0)
        return not full

    def fill(self, req_id: str, keys: Sequence[str], objs: Sequence[MemoryObj]) -> bool:
        """The request's saves are over: `objs` (one reference each, taken over whatever happens) are the
        held chunks of `keys`. False (and the references dropped) when the hold was released or expired
        meanwhile, or the chunks would take the held bytes over the cap. A header that cannot be made
        (e.g. a key longer than a header takes) drops the references and leaves the hold empty (a pull is
        answered at once) before the error goes up."""
        try:
            if len(keys) != len(objs):
                raise ValueError(f"{len(keys)} keys but {len(objs)} chunks")
            coder = wire_coder(self.serde)  # one codec for the request's chunks
            parts = [chunk_parts(key, obj.tensor, self.mac, coder) for key, obj in zip(keys, objs)]
        except BaseException:
            release_objs(objs)
            self._settle(req_id, [], [], [])
            raise
        return self._settle(req_id, keys, objs, parts)

    def _settle(self, req_id: str, keys: Sequence[str], objs: Sequence[MemoryObj],
                parts: list[tuple[bytes, Optional[ChunkBytes]]]) -> bool:
        nbytes = sum(obj.nbytes for obj in objs)
        filled = full = False
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is not None and not hold.ready:
                if self.max_bytes > 0 and nbytes and self._held_bytes + nbytes > self.max_bytes:
                    self._pop(req_id)
                    self._remember(req_id, HoldState.FULL)
                    full = True
                else:
                    hold.keys, hold.objs, hold.nbytes = list(keys), list(objs), nbytes
                    hold.headers, hold.payloads = [h for h, _ in parts], [p for _, p in parts]
                    self._held_bytes += nbytes
                    filled = True
            held = self._held_bytes
        if not filled:
            release_objs(objs)
        if full:
            self._refused(req_id, held, nbytes)
        return filled

    def _refused(self, req_id: str, held: int, nbytes: int) -> None:
        metrics.inc("pd_holds_refused")
        logs.warn(logger, "pd_holds_full", "request %s not held for its decode instance (which recomputes the "
                  "prompt): %d bytes are held for decode instances%s, the cap is %d "
                  "(extra_config.pd_max_held_bytes; counted in pd_holds_refused)", logs.peer_text(req_id), held,
                  f" and it needs {nbytes}" if nbytes else "", self.max_bytes)

    # ------------------------------------------------------------------ serving
    def checkout(self, req_id: str, keys: Iterable[str]) -> Checkout:
        """The held chunks of the longest prefix of `keys`, each with a reference for the caller (who
        hands them back with `sent`); or the state that keeps them from being sent. `DuplicateKey` for a
        key named twice."""
        with self._lock:
            hold = self._holds.get(req_id)
            if hold is None:
                return Checkout(self._ended.get(req_id, HoldState.UNKNOWN))
            if not hold.ready:
                return Checkout(HoldState.PENDING)
            indexes = hold.prefix(keys)
            held_keys = hold.keys or []
            objs = [hold.objs[i] for i in indexes]
            for obj in objs:
                obj.ref_up()
            return Checkout(HoldState.READY, objs, tuple(hold.headers[i] for i in indexes),
                            tuple(held_keys[i] for i in indexes), held_keys[0] if held_keys else "",
                            hold.deadline - self._clock(), payloads=tuple(hold.payloads[i] for i in indexes))

    def sent(self, objs: Sequence[MemoryObj]) -> None:
        """Hands back checked-out chunks (their sends are over or cut off)."""
        release_objs(objs)

    # ------------------------------------------------------------------ ending
    def release(self, req_id: str) -> bool:
        """Ends the hold of `req_id` (the decode instance has its chunks, or the request was aborted)."""
        with self._lock:
            hold = self._pop(req_id)
            if hold is not None:
                self._remember(req_id, HoldState.RELEASED)
        if hold is None:
            return False
        metrics.inc("pd_holds_released")
        release_objs(hold.objs)
        return True

    def _pop(self, req_id: str) -> Optional[Hold]:
        """Removes a hold (under the lock); its bytes no longer count."""
        hold = self._holds.pop(req_id, None)
        if hold is not None:
            self._held_bytes -= hold.nbytes
        return hold

    def _remember(self, req_id: str, state: HoldState) -> None:
        self._ended.pop(req_id, None)
        self._ended[req_id] = state
        while len(self._ended) > _REMEMBER_ENDED:
            self._ended.popitem(last=False)
        self._newly_ended.append(req_id)
        if len(self._newly_ended) > _REMEMBER_ENDED:  # nobody takes them: the ledger's own expiry covers it
            del self._newly_ended[:-_REMEMBER_ENDED]

    def take_ended(self) -> list[str]:
        """The request ids whose holds ended (released, expired or refused) since the last call."""
        with self._lock:
            ended, self._newly_ended = self._newly_ended, []
        return ended

    def expire(self) -> list[str]:
        """Ends the holds whose lease is over; returns their request ids."""
        now = self._clock()
        with self._lock:
            gone = [h for h in self._holds.values() if now >= h.deadline]
            for hold in gone:
                self._pop(hold.req_id)
                self._remember(hold.req_id, HoldState.EXPIRED)
        for hold in gone:
            metrics.inc("pd_holds_expired")
            logger.info("hold of request %s expired after %.0fs without a pull or release (%d chunks)",
                        logs.peer_text(hold.req_id), self.lease_s, len(hold.objs))
            release_objs(hold.objs)
        return [h.req_id for h in gone]

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held_bytes

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        with self._lock:
            count, held = len(self._holds), self._held_bytes
        yield "pd_holds", {}, count
        yield "pd_held_bytes", {}, held

    def close(self) -> None:
        """Ends every hold (a send in flight keeps its own references until it returns)."""
        self._unregister()
        with self._lock:
            holds, self._holds, self._held_bytes = list(self._holds.values()), {}, 0
        for hold in holds:
            release_objs(hold.objs)
