"""The worker half's part of disaggregated prefill (docs/DISAGGREGATED.md), one per worker rank.

Prefill side: `PeerHolds` and this rank's `TransferServer` (on `bind_host(pd_host)`, port `pd_port + rank`
or one the OS picks: `port` is what the scheduler asks for). `hold(specs, saves)` registers each request's
hold at once (the step that completes its prompt, before vLLM answers) and fills it when the request's saves
are over, with the L1 chunks of its prompt; `unhold` drops the holds of aborted requests.
Decode side: `open_peer(spec)` is the `PeerTier` of this rank (rank r pulls from the prefill instance's rank
r), handed to the asynchronous load; `release(specs)` tells prefill instances this instance will not pull
(each decode rank tells the prefill ranks `j` with `j % tp_size == rank`, so every prefill rank hears it once,
whatever its TP size).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import TYPE_CHECKING, Iterable

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.integration.vllm.events import HoldReport
from lmcache_vllm.integration.vllm.metadata import PeerHoldSpec, PeerSpec
from lmcache_vllm.integration.vllm.pd.params import bind_host
from lmcache_vllm.integration.vllm.saves import SaveQueue
from lmcache_vllm.observability import logs
from lmcache_vllm.storage.codec import ChunkMac
from lmcache_vllm.storage.transfer.client import PeerSource, PeerTier, send_release
from lmcache_vllm.storage.transfer.holds import PeerHolds, max_held_bytes
from lmcache_vllm.storage.transfer.server import TransferServer

if TYPE_CHECKING:
    from lmcache_vllm.engine import CacheEngine

logger = logging.getLogger(__name__)


class PeerTransfer:
    """See the module docstring. `serve`: run the prefill side (a saving role)."""

    def __init__(self, config: LMCacheConfig, engine: CacheEngine, *, tp_rank: int, tp_size: int,
                 mac: ChunkMac | None, serve: bool):
        extra = config.extra_config
        self.engine = engine
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.mac = mac
        self.pull_timeout_s = extra.pd_pull_timeout_secs
        self.holds: PeerHolds | None = None
        self.server: TransferServer | None = None
        self._cap_reported = False
        self._cap_tokens = 0  # the cap on held bytes in tokens of this rank's KV (0: none), for `report`
        if serve:
            self.holds = PeerHolds(extra.pd_hold_secs, mac=mac, max_bytes=max_held_bytes(
                extra.pd_max_held_bytes, engine.storage.allocator.capacity), serde=extra.transfer_serde)
            if self.holds.max_bytes > 0:
                layout, chunk = engine.layout, engine.keys.chunk_size
                chunk_bytes = math.prod(layout.chunk_shape(chunk)) * layout.geometry.dtype.itemsize
                self._cap_tokens = max(1, self.holds.max_bytes * chunk // max(1, chunk_bytes))
            self.server = TransferServer(self.holds, host=bind_host(extra.pd_host),
                                         port=extra.pd_port + tp_rank if extra.pd_port else 0, mac=mac)

    @property
    def port(self) -> int:
        """This rank's transfer port (-1: it serves none)."""
        return self.server.port if self.server is not None else -1

    # ------------------------------------------------------------------ prefill side
    def hold(self, specs: Iterable[PeerHoldSpec], saves: SaveQueue, failed: set[str]) -> None:
        if self.holds is None:
            return
        for spec in specs:
            if spec.req_id in failed:
                continue  # its load failed this step: vLLM recomputes, the scheduler asks again after
            self.holds.expect(spec.req_id)
            saves.when_done([spec.req_id], functools.partial(self._fill, spec))

    def _fill(self, spec: PeerHoldSpec) -> None:
        if self.holds is None:
            return
        try:
            keys, objs = self.engine.hold_prefix(spec.token_ids, spec.extra)
            # fill makes the wire headers (a checksum pass over each chunk) here, on the save thread, so that
            # the decode instance's pull only sends; it owns the references whatever happens.
            self.holds.fill(spec.req_id, keys[:len(objs)], objs)
        except Exception:  # never a dead save thread: the decode instance recomputes
            logs.warn(logger, "pd_hold_failed", "request %s: holding its chunks failed", spec.req_id, exc_info=True)
            self.holds.fill(spec.req_id, [], [])

    def report(self) -> HoldReport | None:
        """For the scheduler half's ledger: the holds that ended since the last report, and this rank's cap
        in tokens (None: nothing new to say, or this rank holds nothing)."""
        if self.holds is None:
            return None
        ended = self.holds.take_ended()
        if self._cap_reported and not ended:
            return None
        self._cap_reported = True
        return HoldReport(ended, self._cap_tokens)

    def unhold(self, req_ids: Iterable[str]) -> None:
        if self.holds is not None:
            for req_id in req_ids:
                self.holds.release(req_id)

    # ------------------------------------------------------------------ decode side
    def open_peer(self, spec: PeerSpec) -> PeerTier | None:
        """The tier of this rank's prefill rank (None, logged, when the spec is not one to connect to: the
        scheduler admits only checked, trusted peers, so that is a bug, and the load then misses)."""
        try:
            port = spec.ports[self.tp_rank]  # the scheduler refuses other TP sizes
            source = PeerSource(spec.host, port, spec.req_id, spec.label)
        except (IndexError, ValueError) as exc:
            logs.warn(logger, "pd_bad_spec", "not pulling from %s: %s", logs.peer_text(spec.host), exc)
            return None
        return PeerTier(source, timeout_s=self.pull_timeout_s, mac=self.mac)

    def release(self, specs: Iterable[PeerSpec]) -> None:
        for spec in specs:
            for rank, port in enumerate(spec.ports):
                if rank % self.tp_size == self.tp_rank:
                    try:
                        source = PeerSource(spec.host, port, spec.req_id, spec.label)
                    except ValueError as exc:
                        logs.warn(logger, "pd_bad_spec", "no RELEASE to %s: %s", logs.peer_text(spec.host), exc)
                        continue
                    send_release(source, self.mac)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.holds is not None:
            self.holds.close()
