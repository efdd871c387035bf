"""`Tier`: the kinds of storage a chunk can live in, named once for the whole package.

A tier's value is its name everywhere outside the code: metric labels (`tier="local_disk"`), lookup
answers, log lines and admin reports. `medium` is the name vLLM's KV cache events use for it (a router
sees `cpu`, `disk` or `redis`). Order is speed: L1 first, the shared pool last.
"""
from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    LOCAL_CPU = "local_cpu"  # L1: host memory of this process
    LOCAL_DISK = "local_disk"  # L2: a directory on this host, possibly shared by several processes
    REDIS = "redis"  # L3: the shared pool of a fleet

    @property
    def medium(self) -> str:
        return _MEDIUMS[self]


_MEDIUMS = {Tier.LOCAL_CPU: "cpu", Tier.LOCAL_DISK: "disk", Tier.REDIS: "redis"}
TIER_NAMES: tuple[str, ...] = tuple(t.value for t in Tier)
