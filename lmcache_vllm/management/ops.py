"""`RankOps`: what one tensor-parallel rank does for a management call, beside its `CacheEngine` and pin ledger.

The instance API (`instance.py`) sends each rank a small JSON-able call (`control.py` carries it: over the
worker's control socket, or directly in one process) and sums the answers. A call names chunks by their digests
in hex (the rank adds its own key template: `CacheEngine.keys`) or by token ids and a salt (the rank resolves
them with its own `KeyBuilder`, exactly as its requests do). Calls:

| op | body | answer |
|---|---|---|
| `info` | - | the rank's `KeySpace`, L1 and lower-tier usage, pins, quotas |
| `resolve` | token_ids, cache_salt | digests of the whole chunks |
| `where` | digests | the tiers holding each (L1, then lower tiers keeping payloads) |
| `delete` | digests, tier (l1/l2/all), force | deleted, skipped |
| `clear` | tier (l1/all) | ok |
| `warm` / `warm_status` | token_ids, cache_salt / job | a job id / pending, or which keys it brought |
| `pin` / `unpin` | token_ids, cache_salt | pinned / count left (a refused pin: its reason) |
| `pins` | cache_salt or none | the rank's pins |
| `quota_set` / `quota_delete` / `quotas` | cache_salt, limit_bytes | the tenants' limits and L1 usage |
| `keys` | offset, limit | L1's keys (digests) |

A non-forced delete skips chunks a pin, a load or a send holds. A warm-up keeps at most `MAX_JOBS` jobs;
a finished one is answered once and forgotten (LMCache's prefetch status is read once), an unread one after
`JOB_TTL_S`. Errors are answers (`{"error": reason, "detail": text}`), never exceptions across the channel.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from lmcache_vllm.extra_keys import for_salt
from lmcache_vllm.management.keys import KeySpace, shared_tier
from lmcache_vllm.storage.pins import PinLedger, PinRefused

if TYPE_CHECKING:
    from lmcache_vllm.engine import CacheEngine
    from lmcache_vllm.tokens import CacheKey

logger = logging.getLogger(__name__)

OP_PIN = "op:"  # a management pin's name (its prefix's last key follows): apart from requests' hint pins
MAX_JOBS = 256
JOB_TTL_S = 600.0
WARM_TIMEOUT_S = 120.0
WHERE_TIMEOUT_S = 5.0


class OpError(Exception):
    """A call this rank refuses: `reason` (a short tag the instance API maps to a status) and the detail."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


@dataclasses.dataclass
class _Job:
    keys: list[str]
    future: concurrent.futures.Future[list[bool]]
    started: float


class RankOps:
    """See the module docstring. `model_names`: the names clients use for the model (vLLM's served names)."""

    def __init__(self, engine: CacheEngine, ledger: Optional[PinLedger], *, model_names: Sequence[str] = (),
                 drain: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.ledger = ledger
        self.space = KeySpace.of_builder(engine.keys, model_names)
        self._drain = drain  # saves handed out so far land first (a delete or a lookup sees them)
        self._clock = clock
        self._jobs: dict[str, _Job] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.storage = engine.storage
        self.storage.l1.quota_batch = engine.config.extra_config.quota_evict_batch

    def handle(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """One call's answer; never raises (a refusal or a failure is `{"error": ..., "detail": ...}`)."""
        fn = getattr(self, f"op_{op}", None)
        if fn is None:
            return {"error": "unknown_op", "detail": f"unknown operation {op!r}"}
        try:
            answer: dict[str, Any] = fn(body)
            return answer
        except OpError as exc:
            return {"error": exc.reason, "detail": str(exc)}
        except (KeyError, TypeError, ValueError) as exc:
            return {"error": "bad_call", "detail": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # the channel must answer: a failing tier is a failed call, not a dead thread
            logger.warning("management call %s failed", op, exc_info=True)
            return {"error": "failed", "detail": f"{type(exc).__name__}: {exc}"}

    # ------------------------------------------------------------------ helpers
    def _keys(self, digests: Sequence[str]) -> list[CacheKey]:
        template = self.engine.keys.template
        return [dataclasses.replace(template, digest=bytes.fromhex(d)) for d in digests]

    def _tokens(self, body: dict[str, Any]) -> list[CacheKey]:
        return self.engine.chunk_keys([int(t) for t in body["token_ids"]], for_salt(str(body.get("cache_salt", ""))))

    def _pinned(self, key: str) -> bool:
        return self.ledger is not None and self.ledger.pinned(key)

    # ------------------------------------------------------------------ reads
    def op_info(self, body: dict[str, Any]) -> dict[str, Any]:
        l1 = self.storage.l1
        lower = [{"tier": t.name.value, "shared": shared_tier(t.name), **t.gauges()}
                 for t in self.storage.lower if t.holds_payloads]
        return {"space": self.space.to_json(), "rank": self.engine.keys.template.rank,
                "l1": {"used_bytes": l1.allocator.used_bytes, "capacity_bytes": l1.allocator.capacity,
                       "chunks": len(l1), "held_chunks": l1.held_count()},
                "lower": lower, "pinned_bytes": self.ledger.pinned_bytes if self.ledger is not None else 0,
                "pins": len(self.ledger) if self.ledger is not None else 0,
                "pins_enabled": self.ledger is not None and self.ledger.enabled,
                "tenant_bytes": l1.tenants.usage(), "quotas": l1.tenants.limits()}

    def op_resolve(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"digests": [k.digest.hex() for k in self._tokens(body)]}

    def op_where(self, body: dict[str, Any]) -> dict[str, Any]:
        self._drain()
        keys = self._keys(body["digests"])
        return {"tiers": self.storage.where(keys, WHERE_TIMEOUT_S), "chunk_bytes": self._chunk_bytes()}

    def _chunk_bytes(self) -> int:
        layout = self.engine.layout
        shape = layout.chunk_shape(self.engine.keys.chunk_size)
        n = 1
        for dim in shape:
            n *= int(dim)
        return n * layout.geometry.dtype.itemsize

    def op_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        total, keys = self.storage.l1.keys_page(int(body.get("offset", 0)), int(body.get("limit", 1000)))
        prefix = self.engine.keys.template.to_str()[:-len(self.engine.keys.template.digest.hex())]
        return {"total": total, "digests": [k[len(prefix):] for k in keys if k.startswith(prefix)]}

    # ------------------------------------------------------------------ writes
    def op_delete(self, body: dict[str, Any]) -> dict[str, Any]:
        tier, force = str(body.get("tier", "all")), bool(body.get("force", False))
        keys = [k.to_str() for k in self._keys(body["digests"])]
        self._drain()
        if force and tier in ("l1", "all") and self.ledger is not None:
            self.ledger.drop_keys(keys)
        deleted, skipped = self.storage.remove(keys, l1=tier in ("l1", "all"), lower=tier in ("l2", "all"),
                                               force=force, keep=self._pinned)
        return {"deleted": deleted, "skipped": skipped}

    def op_clear(self, body: dict[str, Any]) -> dict[str, Any]:
        tier = str(body.get("tier", "l1"))
        self._drain()
        if self.ledger is not None:
            self.ledger.clear()
        if tier not in ("l1", "all"):
            raise OpError("bad_tier", "a clear empties l1, or all tiers")
        return {"ok": self.engine.clear(lower_tiers=tier == "all")}

    def op_warm(self, body: dict[str, Any]) -> dict[str, Any]:
        keys = self._tokens(body)
        if not keys:
            return {"job": "", "keys": 0}
        self._expire_jobs()
        with self._lock:
            if len(self._jobs) >= MAX_JOBS:
                raise OpError("busy", f"{MAX_JOBS} warm-ups are waiting to be read")
            job_id = f"w{next(self._ids)}"
            future = self.engine.warm(keys, str(body.get("cache_salt", "")), WARM_TIMEOUT_S)
            self._jobs[job_id] = _Job([k.to_str() for k in keys], future, self._clock())
        return {"job": job_id, "keys": len(keys)}

    def op_warm_status(self, body: dict[str, Any]) -> dict[str, Any]:
        job_id = str(body["job"])
        if not job_id:
            return {"status": "none"}  # this rank's part was answered already
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise OpError("not_found", f"no warm-up {job_id!r} (finished ones are answered once)")
            if not job.future.done():
                return {"status": "pending"}
            del self._jobs[job_id]
        try:
            brought = job.future.result()
        except Exception as exc:
            logger.warning("a warm-up failed: %r", exc)
            brought = [False] * len(job.keys)
        return {"status": "completed", "brought": brought}

    def _expire_jobs(self) -> None:
        now = self._clock()
        with self._lock:
            for job_id in [j for j, job in self._jobs.items() if now - job.started > JOB_TTL_S]:
                self._jobs.pop(job_id).future.cancel()

    def op_pin(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.ledger is None or not self.ledger.enabled:
            raise OpError("off", "pins are off on this instance (extra_config.max_pinned_fraction is 0)")
        keys = [k.to_str() for k in self._tokens(body)]
        if not keys:
            return {"pinned": 0, "missing": 0, "count": 0}
        self._drain()
        objs = self.storage.pin_prefix(keys)
        if not objs:
            return {"pinned": 0, "missing": len(keys), "count": 0}
        try:
            entry = self.ledger.pin(str(body.get("cache_salt", "")), OP_PIN + keys[-1], keys, objs)
        except PinRefused as exc:
            raise OpError(exc.reason, str(exc)) from None
        return {"pinned": len(entry.keys), "missing": len(keys) - len(entry.keys), "count": entry.count}

    def op_unpin(self, body: dict[str, Any]) -> dict[str, Any]:
        keys = [k.to_str() for k in self._tokens(body)]
        if not keys or self.ledger is None:
            return {"unpinned": 0, "count": None}
        left = self.ledger.unpin(str(body.get("cache_salt", "")), OP_PIN + keys[-1])
        return {"unpinned": 0 if left is None else len(keys), "count": left}

    def op_pins(self, body: dict[str, Any]) -> dict[str, Any]:
        salt = body.get("cache_salt")
        entries = self.ledger.entries(None if salt is None else str(salt)) if self.ledger is not None else []
        prefix = len(self.engine.keys.template.to_str()) - len(self.engine.keys.template.digest.hex())
        return {"pins": [{"cache_salt": e.tenant, "digests": [k[prefix:] for k in e.keys], "count": e.count,
                          "bytes": e.nbytes, "hint": not e.name.startswith(OP_PIN)} for e in entries]}

    def op_quota_set(self, body: dict[str, Any]) -> dict[str, Any]:
        salt, limit = str(body["cache_salt"]), int(body["limit_bytes"])
        tenants = self.storage.l1.tenants
        tenants.set_limit(salt, limit)
        self.storage.watch_quotas()
        evicted = self.storage.l1.enforce_quota(salt, keep=self._pinned)
        return {"evicted": evicted}

    def op_quota_delete(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"removed": self.storage.l1.tenants.delete_limit(str(body["cache_salt"]))}

    def op_quotas(self, body: dict[str, Any]) -> dict[str, Any]:
        tenants = self.storage.l1.tenants
        return {"limits": tenants.limits(), "usage": tenants.usage()}

    def close(self) -> None:
        with self._lock:
            for job in self._jobs.values():
                job.future.cancel()
            self._jobs.clear()
