"""What the P2P tier knows about other instances' servers, besides the directory: whom it trusts
(`PeerTrust`), whom it skips for a while after a failed pull (`Backoff`), the bounded `peer` label of its
metrics (`PeerLabels`), and which server each stretch of a hit is pulled from (`plan_pulls`).

Trust follows disaggregated prefill's rule: a peer is trusted when its chunks are authenticated by the chunk MAC
(a secret is set: every chunk is verified with it), or when its address is loopback or in
`extra_config.pd_peers` (addresses, networks in CIDR notation, or host names resolved once at start: the one
allow-list of instances this one pulls from, disaggregated prefill's too). The directory is a hint written
by whoever can write that Redis: without a MAC, an address it names is connected to only if trusted here.
"""
from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Callable, Sequence

from lmcache_vllm.config.peers import PeerEntry, ip_literal, parse_peer
from lmcache_vllm.storage.p2p.directory import ServerInfo

MAX_LABELS = 16  # distinct peers named in metric labels; later ones are "other"


class PeerTrust:
    """`trust(host)`: whether chunks from (or requests of) `host` (an address, as the directory or a socket
    names it) may be used without a MAC: loopback, or an entry of `extra_config.pd_peers` (parsed by
    `config.peers.parse_peer`, the same rule disaggregated prefill applies; a host name is resolved once, here:
    no DNS on the read path)."""

    def __init__(self, peers: Sequence[str], *, resolve: Callable[[str], str] = socket.gethostbyname):
        self.entries: list[PeerEntry] = []
        for peer in peers:
            entry = parse_peer(peer)  # checked at config load: a bad entry never gets here
            self.entries.append(entry)
            if entry.name is not None:
                try:
                    self.entries.append(parse_peer(resolve(entry.name)))
                except (OSError, ValueError):
                    pass  # a name that does not resolve now trusts nothing

    def __call__(self, host: str) -> bool:
        address = ip_literal(host)
        if address is None:
            return False  # the directory names addresses; anything else is trusted by nobody
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback or any(entry.matches(host, address) for entry in self.entries)


class Backoff:
    """Servers not to ask until a while after their last failed pull (a dead, slow or lying peer)."""

    def __init__(self, secs: float, *, clock: Callable[[], float] = time.monotonic, max_entries: int = 4096):
        self.secs = secs
        self._clock = clock
        self._max = max_entries
        self._until: dict[str, float] = {}
        self._lock = threading.Lock()

    def failed(self, sid: str) -> None:
        with self._lock:
            if len(self._until) >= self._max:
                now = self._clock()
                self._until = {s: t for s, t in self._until.items() if t > now}
            self._until[sid] = self._clock() + self.secs

    def skipped(self, sid: str) -> bool:
        with self._lock:
            until = self._until.get(sid)
            if until is None:
                return False
            if self._clock() < until:
                return True
            del self._until[sid]
            return False


class PeerLabels:
    """The `peer` label of a server's metrics: its host:port for the first `MAX_LABELS` seen, "other" after."""

    def __init__(self) -> None:
        self._labels: dict[str, str] = {}

    def __call__(self, sid: str, host: str, port: int) -> str:
        label = self._labels.get(sid)
        if label is None:
            label = f"{host}:{port}" if len(self._labels) < MAX_LABELS else "other"
            if len(self._labels) < 4 * MAX_LABELS:
                self._labels[sid] = label
        return label


def plan_pulls(holders: Sequence[Sequence[ServerInfo]]) -> list[tuple[ServerInfo, int, int]]:
    """(server, start, end) stretches covering the longest run of keys some server holds, from key 0: at each
    key, the server holding the longest stretch from there (ties: the first named)."""
    plan: list[tuple[ServerInfo, int, int]] = []
    i = 0
    while i < len(holders) and holders[i]:
        best, best_end = holders[i][0], i + 1
        for server in holders[i]:
            end = i + 1
            while end < len(holders) and any(s.sid == server.sid for s in holders[end]):
                end += 1
            if end > best_end:
                best, best_end = server, end
        plan.append((best, i, best_end))
        i = best_end
    return plan
