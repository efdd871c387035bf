"""`TenantUsage`: the bytes of L1 each tenant's chunks take, and the quota of each tenant that has one.

A tenant is a `cache_salt` ("" for requests without one; LMCache's management API names it `_default`). L1
(`local_cpu.py`) tells `added(key, tenant, nbytes)` when it indexes a chunk and `removed(key)` when the chunk
leaves, whichever way; the engine passes the tenant of the request that stored or loaded the chunk. A quota
(`set_limit`) is the most bytes the tenant's chunks may take; `over(tenant)` says by how much a tenant is past
it, and L1 then evicts that tenant's least recently used chunks, and no one else's (`LocalCPUBackend.enforce_quota`).
A tenant without a quota is not limited (LMCache's IsolatedLRU evicts such a tenant entirely: not here).
Thread-safe.
"""
from __future__ import annotations

import threading
from typing import Optional


class TenantUsage:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._of: dict[str, tuple[str, int]] = {}  # key -> (tenant, bytes)
        self._keys: dict[str, set[str]] = {}  # tenant -> its keys in L1
        self._bytes: dict[str, int] = {}
        self._limits: dict[str, int] = {}

    def added(self, key: str, tenant: str, nbytes: int) -> None:
        with self._lock:
            if key in self._of:
                return
            self._of[key] = (tenant, nbytes)
            self._keys.setdefault(tenant, set()).add(key)
            self._bytes[tenant] = self._bytes.get(tenant, 0) + nbytes

    def removed(self, key: str) -> None:
        with self._lock:
            found = self._of.pop(key, None)
            if found is None:
                return
            tenant, nbytes = found
            keys = self._keys.get(tenant)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._keys[tenant]
            left = self._bytes.get(tenant, 0) - nbytes
            if left > 0:
                self._bytes[tenant] = left
            else:
                self._bytes.pop(tenant, None)

    def tenant(self, key: str) -> Optional[str]:
        found = self._of.get(key)
        return found[0] if found is not None else None

    def keys(self, tenant: str) -> set[str]:
        with self._lock:
            return set(self._keys.get(tenant, ()))

    def usage(self) -> dict[str, int]:
        """Bytes per tenant with chunks in L1."""
        with self._lock:
            return dict(self._bytes)

    # ------------------------------------------------------------------ quotas
    def set_limit(self, tenant: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"a quota of {nbytes} bytes")
        with self._lock:
            self._limits[tenant] = nbytes

    def delete_limit(self, tenant: str) -> bool:
        with self._lock:
            return self._limits.pop(tenant, None) is not None

    def limit(self, tenant: str) -> Optional[int]:
        return self._limits.get(tenant)

    def limits(self) -> dict[str, int]:
        with self._lock:
            return dict(self._limits)

    def over(self, tenant: str) -> int:
        """Bytes the tenant's chunks take beyond its quota (0: within it, or no quota)."""
        limit = self._limits.get(tenant)
        if limit is None:
            return 0
        return max(0, self._bytes.get(tenant, 0) - limit)
