"""`PinLedger`: the prefixes kept in L1 on purpose, each owned by a tenant (`cache_salt`), refcounted, within
budgets, with an expiry.

Two kinds of pins share it: a request's `lmcache.pin_tokens` hint (docs/CONFIG.md "Per-request hints") and an
operator's pin through the management API (docs/MANAGEMENT.md). A pin keeps one reference on each of its L1
chunks (the allocator evicts only chunks nobody else references), so its chunks survive L1 pressure and quota
eviction until it ends. The rules:

- **Owned.** An entry is (tenant, name): the tenant is the `cache_salt` of the request or of the management
  call ("" for none), the name the prefix's last key. Pinning the same prefix again renews its expiry; an
  explicit (`counted`) pin also raises its count, and it ends when as many unpins came (LMCache's refcounted
  pins). A hint renews without counting: requests cannot pile up counts nobody unpins.
- **Bounded, with a clear refusal.** The bytes pinned by one tenant stay within `tenant_budget_bytes`, all pins
  together within `total_budget_bytes`; a pin past either is refused (`PinRefused`, counted in
  `pins_refused{reason}`), never made by letting another tenant's pin go. A chunk shared by two pins counts for
  both, so the bytes actually kept never exceed the budgets. A total budget of 0 turns pins off.
- **Expiring.** An entry ends `ttl_s` after it was last pinned (None: never); `expire()` lets go what is due
  (the worker calls it when `due()`, a comparison, says so).
- `drop_keys` lets go every entry holding one of some keys (a forced delete); `clear` every entry (a reset).

Thread-safe: the save thread pins hints, the management thread pins and unpins, the step expires.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, Sequence

from lmcache_vllm.observability import metrics

if TYPE_CHECKING:  # vLLM's API server imports the connector (and this) without the cache's memory
    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.memory import MemoryObj


class PinRefused(Exception):
    """A pin the budgets (or a budget of 0: pins off) do not allow; `reason` is off, tenant_budget or
    total_budget."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class PinEntry:
    """One pinned prefix: its owner, its chunks' keys and the references it keeps on them."""

    tenant: str
    name: str
    keys: tuple[str, ...]
    nbytes: int
    count: int
    expires_at: Optional[float]
    objs: list["MemoryObj"] = field(default_factory=list, repr=False)


class PinLedger:
    """See the module docstring. `clock`: monotonic seconds (tests pass their own)."""

    def __init__(self, total_budget_bytes: int, tenant_budget_bytes: int, ttl_s: Optional[float], *,
                 clock: Callable[[], float] = time.monotonic):
        if total_budget_bytes < 0 or tenant_budget_bytes < 0:
            raise ValueError("pin budgets must not be negative")
        self.total_budget_bytes = total_budget_bytes
        self.tenant_budget_bytes = min(tenant_budget_bytes, total_budget_bytes)
        self.ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[tuple[str, str], PinEntry] = {}
        self._by_tenant: dict[str, int] = {}  # bytes
        self._key_pins: dict[str, int] = {}  # key -> entries holding it
        self._bytes = 0
        self._next_expiry = float("inf")
        self._unregister = metrics.register_gauges(self._gauges)

    @classmethod
    def from_config(cls, config: LMCacheConfig) -> "PinLedger":
        """The budgets of `extra_config.max_pinned_fraction` (all pins) and `max_pinned_fraction_per_salt` (one
        tenant's) of L1, and `pin_ttl_secs`; pins are off without L1."""
        extra = config.extra_config
        l1 = config.max_local_cpu_bytes if config.local_cpu else 0
        return cls(int(extra.max_pinned_fraction * l1), int(extra.max_pinned_fraction_per_salt * l1),
                   extra.pin_ttl_secs)

    @property
    def enabled(self) -> bool:
        return self.total_budget_bytes > 0

    @property
    def pinned_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ pin / unpin
    def pin(self, tenant: str, name: str, keys: Sequence[str], objs: Sequence[MemoryObj], *,
            counted: bool = True) -> PinEntry:
        """Takes over the caller's reference on each of `objs` (the L1 chunks of `keys`) as the pin (tenant,
        name), or renews that pin (the new references are dropped then). Raises `PinRefused` past a budget (the
        references are dropped) and ValueError for nothing to pin."""
        objs = list(objs)
        if not objs:
            raise ValueError("nothing to pin: no chunk of the prefix is in L1")
        size = sum(obj.reserved for obj in objs)
        now = self._clock()
        expires = None if self.ttl_s is None else now + self.ttl_s
        release: list[MemoryObj] = list(objs)
        refused: Optional[PinRefused] = None
        with self._lock:
            entry = self._entries.get((tenant, name))
            if entry is not None:
                entry.count += int(counted)
                entry.expires_at = expires
            else:
                refused = self._refusal(tenant, size)
                if refused is None:
                    entry = PinEntry(tenant, name, tuple(keys[:len(objs)]), size, int(counted), expires, objs)
                    self._entries[(tenant, name)] = entry
                    self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + size
                    self._bytes += size
                    for key in entry.keys:
                        self._key_pins[key] = self._key_pins.get(key, 0) + 1
                    release = []
            if expires is not None:
                self._next_expiry = min(self._next_expiry, expires)
        for obj in release:
            obj.ref_down()
        if refused is not None:
            metrics.inc("pins_refused", reason=refused.reason)
            raise refused
        assert entry is not None
        return entry

    def _refusal(self, tenant: str, size: int) -> Optional[PinRefused]:
        if not self.enabled:
            return PinRefused("off", "pins are off on this instance (extra_config.max_pinned_fraction is 0)")
        used = self._by_tenant.get(tenant, 0)
        if used + size > self.tenant_budget_bytes:
            return PinRefused("tenant_budget", f"the pins of cache_salt {tenant!r} would keep {used + size} bytes "
                              f"of L1, over its budget of {self.tenant_budget_bytes} "
                              f"(extra_config.max_pinned_fraction_per_salt); unpin first")
        if self._bytes + size > self.total_budget_bytes:
            return PinRefused("total_budget", f"all pins would keep {self._bytes + size} bytes of L1, over the "
                              f"budget of {self.total_budget_bytes} (extra_config.max_pinned_fraction)")
        return None

    def unpin(self, tenant: str, name: str) -> Optional[int]:
        """One unpin of (tenant, name): the count left (0: the pin ended), None when there was no such pin."""
        with self._lock:
            entry = self._entries.get((tenant, name))
            if entry is None:
                return None
            entry.count = max(0, entry.count - 1)
            if entry.count:
                return entry.count
            self._remove(entry)
        self._release([entry], "unpinned")
        return 0

    def drop_keys(self, keys: Iterable[str]) -> int:
        """Lets go every pin holding one of `keys` (a forced delete of them); how many ended."""
        wanted = set(keys)
        with self._lock:
            gone = [e for e in self._entries.values() if wanted.intersection(e.keys)]
            for entry in gone:
                self._remove(entry)
        self._release(gone, "dropped")
        return len(gone)

    def pinned(self, key: str) -> bool:
        return self._key_pins.get(key, 0) > 0

    # ------------------------------------------------------------------ expiry, listing
    def due(self) -> bool:
        """Whether some pin's expiry passed (one comparison: the worker asks every step)."""
        return self._next_expiry <= self._clock()

    def expire(self) -> int:
        """Lets go the pins whose expiry passed; how many."""
        now = self._clock()
        with self._lock:
            gone = [e for e in self._entries.values() if e.expires_at is not None and e.expires_at <= now]
            for entry in gone:
                self._remove(entry)
            self._next_expiry = min((e.expires_at for e in self._entries.values() if e.expires_at is not None),
                                    default=float("inf"))
        self._release(gone, "expired")
        return len(gone)

    def entries(self, tenant: Optional[str] = None) -> list[PinEntry]:
        with self._lock:
            return [e for e in self._entries.values() if tenant is None or e.tenant == tenant]

    def usage(self) -> dict[str, int]:
        """Bytes pinned per tenant."""
        with self._lock:
            return dict(self._by_tenant)

    def clear(self, reason: str = "reset") -> None:
        """Lets every pin go (a cache reset, shutdown)."""
        with self._lock:
            gone = list(self._entries.values())
            for entry in gone:
                self._remove(entry)
        self._release(gone, reason)

    def close(self) -> None:
        self.clear("shutdown")
        self._unregister()

    # ------------------------------------------------------------------ helpers
    def _remove(self, entry: PinEntry) -> None:
        """Under the lock: the entry leaves the books (its references are released outside the lock)."""
        del self._entries[(entry.tenant, entry.name)]
        left = self._by_tenant.get(entry.tenant, 0) - entry.nbytes
        if left > 0:
            self._by_tenant[entry.tenant] = left
        else:
            self._by_tenant.pop(entry.tenant, None)
        self._bytes -= entry.nbytes
        for key in entry.keys:
            n = self._key_pins.get(key, 0) - 1
            if n > 0:
                self._key_pins[key] = n
            else:
                self._key_pins.pop(key, None)

    @staticmethod
    def _release(entries: list[PinEntry], reason: str) -> None:
        for entry in entries:
            for obj in entry.objs:
                obj.ref_down()
            entry.objs = []
        if entries:
            metrics.inc("pins_released", len(entries), reason=reason)

    def _gauges(self) -> Iterator[tuple[str, dict[str, str], float]]:
        yield "pinned_prefixes", {}, len(self._entries)
        yield "pinned_bytes", {}, self._bytes
