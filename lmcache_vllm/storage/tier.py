"""`Tier`: the kinds of storage a chunk can live in, named once for the whole package.

A tier's value is its name everywhere outside the code: metric labels (`tier="local_disk"`), lookup answers, log
lines and admin reports. `event_names` (medium, locality, ownership) are what vLLM's KV cache events say of a copy
in it, in vLLM's own words (vllm/distributed/kv_events.py, v1/kv_offload: the medium `GPU`, `CPU` or `STORAGE`;
`LOCAL` or `REMOTE` to the publisher; `ownership` names a secondary tier shared beyond the instance): L1 is `CPU`,
the disk `STORAGE`, both `LOCAL` with no owner, like vLLM's own CPU and file tiers; a shared pool (Redis, Mooncake)
is `STORAGE`, `REMOTE`, owned by "redis" / "mooncake", like vLLM's external tiers (routers credit it as an external
copy: vLLM router's `--kv-penalty-external`). A tier without them (None) is not published: a peer's L1 (PD, P2P) is
published by that peer, as its own. docs/ROUTING.md says what each is worth to a router. Order is speed: L1 first,
the shared pool last; `PEER` (another vLLM instance's L1, pulled for one request in disaggregated prefill:
`transfer/client.py`) is never in a lookup answer; it and `P2P` (any other instance's L1 the P2P directory names:
`p2p/`) come last so the lookup wire's tier codes of the others stay as they were, and `MOONCAKE` (a Mooncake
Store, the shared pool in Redis' place: `mooncake/`) and `LOCAL_CPU_COLD` (L1's compressed cold part, read first of
the lower tiers; host memory to a router, like L1) after them, for the same reason. The order of reads is
`registry.LOWER_TIERS`' (P2P before Redis and Mooncake).
"""
from __future__ import annotations

import enum
from typing import NamedTuple


class Tier(enum.StrEnum):
    LOCAL_CPU = "local_cpu"  # L1: host memory of this process
    LOCAL_DISK = "local_disk"  # L2: a directory on this host, possibly shared by several processes
    REDIS = "redis"  # L3: the shared pool of a fleet
    PEER = "peer"  # a prefill instance's L1, read by its decode instance (disaggregated prefill)
    P2P = "p2p"  # other instances' L1 (or disk), found in the P2P directory and pulled (storage/p2p)
    MOONCAKE = "mooncake"  # L3 in a Mooncake Store: the shared pool of a fleet that runs one (storage/mooncake)
    LOCAL_CPU_COLD = "local_cpu_cold"  # L1's cold part, compressed (storage/local_cpu_cold.py)

    @property
    def event_names(self) -> "EventNames | None":
        """What vLLM's KV events say of a copy in this tier; None: its copies are not published."""
        return _EVENT_NAMES.get(self)

    @property
    def medium(self) -> str | None:
        names = _EVENT_NAMES.get(self)
        return names.medium if names else None


class EventNames(NamedTuple):
    medium: str  # vLLM's MEDIUM_CPU / MEDIUM_STORAGE (vllm/distributed/kv_events.py), written out: no vLLM here
    locality: str  # vLLM's Locality (v1/kv_offload/base.py)
    ownership: str | None  # the secondary tier's name (vLLM's kvcr tier says "kvcr")


_EVENT_NAMES = {Tier.LOCAL_CPU: EventNames("CPU", "LOCAL", None), Tier.LOCAL_DISK: EventNames("STORAGE", "LOCAL", None),
                Tier.REDIS: EventNames("STORAGE", "REMOTE", "redis"),
                Tier.MOONCAKE: EventNames("STORAGE", "REMOTE", "mooncake"),
                Tier.LOCAL_CPU_COLD: EventNames("CPU", "LOCAL", None)}
TIER_NAMES: tuple[str, ...] = tuple(t.value for t in Tier)
