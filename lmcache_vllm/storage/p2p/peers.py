"""What the P2P tier knows about other instances' servers, besides the directory: whom it trusts
(`PeerTrust`), whom it skips for a while after a failed pull (`Backoff`), the bounded `peer` label of its
metrics (`PeerLabels`), and which server each stretch of a hit is pulled from (`plan_pulls`).

Trust follows disaggregated prefill's rule: a peer is trusted when its chunks are authenticated by the chunk MAC
(a secret is set: every chunk is verified with it), or when `extra_config.pd_peers` lists its address and port
(addresses, networks in CIDR notation, or host names resolved once at start, each with its transfer ports: the
one allow-list of instances this one pulls from, disaggregated prefill's too). Loopback is nobody's by default.
The directory is a hint written by whoever can write that Redis: without a MAC, an address and port it names
is connected to only if listed here.
"""
from __future__ import annotations

import ipaddress
import socket
import threading
import time
from dataclasses import replace
from typing import Callable, Optional, Sequence

from lmcache_vllm.config.peers import IPAddress, PeerEntry, ip_literal, parse_peer
from lmcache_vllm.storage.p2p.directory import ServerInfo

MAX_LABELS = 16  # distinct peers named in metric labels; later ones are "other"


class PeerTrust:
    """Which peers are trusted without a MAC (see the module docstring): `pulls(host, port)`, whether to
    connect to the server the directory names; `serves(host)`, whether to serve chunks to a peer connecting
    from `host` (its source port says nothing: any port of a listed host or network). `host` is an address,
    as the directory or a socket names it; a name listed in `pd_peers` is resolved once, here: no DNS on the
    read path."""

    def __init__(self, peers: Sequence[str], *, resolve: Callable[[str], str] = socket.gethostbyname):
        self.entries: list[PeerEntry] = []
        for peer in peers:
            entry = parse_peer(peer)  # checked at config load: a bad entry never gets here
            if entry.name is None:
                self.entries.append(entry)
                continue
            try:
                address = ipaddress.ip_address(resolve(entry.name))
            except (OSError, ValueError):
                continue  # a name that does not resolve now trusts nothing
            self.entries.append(replace(entry, network=ipaddress.ip_network(address), name=None))

    @staticmethod
    def _address(host: str) -> Optional[IPAddress]:
        address = ip_literal(host)  # the directory names addresses; anything else is trusted by nobody
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            return address.ipv4_mapped
        return address

    def pulls(self, host: str, port: int) -> bool:
        address = self._address(host)
        return address is not None and any(entry.allows(host, address, port) for entry in self.entries)

    def serves(self, host: str) -> bool:
        address = self._address(host)
        return address is not None and any(entry.matches_host(host, address) for entry in self.entries)


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
