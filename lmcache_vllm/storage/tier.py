"""`Tier`: the kinds of storage a chunk can live in, named once for the whole package.

A tier's value is its name everywhere outside the code: metric labels (`tier="local_disk"`), lookup answers,
log lines and admin reports. `medium` and `locality` are what vLLM's KV cache events say of it
(vllm/distributed/kv_events.py: routers filter on the medium `GPU`, `CPU` or `STORAGE`): L1 is `CPU`, disk and
Redis are `STORAGE`, Redis (a fleet's pool) and a peer are `REMOTE` to the instance that reports them; the
tier itself goes into the events' `ownership`, vLLM's field for a secondary tier's name. Order is speed: L1
first, the shared pool last; `PEER` (another vLLM instance's L1, pulled for one request in disaggregated
prefill: `transfer/client.py`) is never in a lookup answer; it and `P2P` (any other instance's L1 the P2P
directory names: `p2p/`) come last so the lookup wire's tier codes of the others stay as they were, and
`MOONCAKE` (a Mooncake Store, the shared pool in Redis' place: `mooncake/`) after them, for the same reason.
The order of reads is `registry.LOWER_TIERS`' (P2P before Redis and Mooncake).
"""
from __future__ import annotations

import enum


class Tier(enum.StrEnum):
    LOCAL_CPU = "local_cpu"  # L1: host memory of this process
    LOCAL_DISK = "local_disk"  # L2: a directory on this host, possibly shared by several processes
    REDIS = "redis"  # L3: the shared pool of a fleet
    PEER = "peer"  # a prefill instance's L1, read by its decode instance (disaggregated prefill)
    P2P = "p2p"  # other instances' L1 (or disk), found in the P2P directory and pulled (storage/p2p)
    MOONCAKE = "mooncake"  # L3 in a Mooncake Store: the shared pool of a fleet that runs one (storage/mooncake)

    @property
    def medium(self) -> str:
        return _MEDIUMS[self]

    @property
    def locality(self) -> str:
        return "REMOTE" if self in (Tier.REDIS, Tier.PEER, Tier.P2P, Tier.MOONCAKE) else "LOCAL"


# vLLM's MEDIUM_CPU / MEDIUM_STORAGE (vllm/distributed/kv_events.py), written out: storage/ imports no vLLM.
_MEDIUMS = {Tier.LOCAL_CPU: "CPU", Tier.LOCAL_DISK: "STORAGE", Tier.REDIS: "STORAGE", Tier.PEER: "CPU",
            Tier.P2P: "CPU", Tier.MOONCAKE: "STORAGE"}
TIER_NAMES: tuple[str, ...] = tuple(t.value for t in Tier)
