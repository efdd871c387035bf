"""Which prefill instances a decode instance D connects to (docs/SECURITY.md, "kv_transfer_params").

vLLM's API server copies `kv_transfer_params` from any client's request body, so the host and ports in them
are a client's choice: without this check, a client could make D connect to any service D reaches and send
it bytes. `PeerTrust.admit(remote)` says whether D may pull from the prefill instance a checked
`RemotePrefill` (`params.parse_remote_prefill`) names, and from which address:

- with a chunk MAC key (`extra_config.chunk_mac_key` / `LMCACHE_VLLM_CHUNK_MAC_KEY`), the params must carry a
  valid signature of a prefill instance holding the same key (any key of the list D verifies with), for this
  instance's key scope (the model's fingerprint, TP size and chunk size: a signature for another model does
  not pass), not expired. Trust "signed": every chunk is then verified with the MAC too;
- without a key, every port must be one of an `extra_config.pd_peers` entry of that host or network (trust
  "listed"), or one of this instance's own transfer ports on an address of its own (trust "own"). Loopback
  is nobody's by default: any process on the host can listen there.
Host names: without a key, only names listed in `pd_peers` (by name) are resolved; any other name is refused
at once, unresolved. A name is resolved on a thread of its own (`Resolver`, at most `MAX_LOOKUPS` at once,
remembered for `RESOLVE_TTL_S`): `admit` never waits on it, it returns None ("pending") until the answer is
there, and the caller refuses the request as unresolved past `resolve_timeout_s`. The address a name
resolves to is what the allow-list is checked against and what the workers connect to (no second lookup
that could answer otherwise). Anything refused is a `PDRefusal` naming the setting that would allow it;
nothing is sent to a refused peer, not even a RELEASE. `label` is the peer's metric label: its `pd_peers`
entry, "own", or "other" (a bounded set).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from lmcache_vllm.config.peers import IPAddress, PeerEntry, ip_literal, parse_peer
from lmcache_vllm.integration.vllm.pd.params import PDRefusal, RemotePrefill, signed_bytes

if TYPE_CHECKING:
    from lmcache_vllm.storage.codec import ChunkMac

RESOLVE_TTL_S = 30.0  # a name's address (or failure) is remembered this long
MAX_REMEMBERED = 256  # names remembered
MAX_LOOKUPS = 4  # resolver threads at once: past it (hung resolvers) names are refused at once
CLOCK_SKEW_S = 30.0  # signed params are taken this long past their expiry (clocks of P and D differ)
_ALLOW = ("list its transfer ports in extra_config.pd_peers (HOST:PORT or HOST:FIRST-LAST; HOST an address, a "
          "network such as 10.0.0.0/24, or a name), or set the same chunk_mac_key on both instances (then the "
          "prefill instance signs its params)")


class Pending:
    def __repr__(self) -> str:
        return "PENDING"


PENDING = Pending()  # `Resolver.lookup`: the answer is not there yet


def is_loopback(address: IPAddress) -> bool:
    return plain(address).is_loopback


def plain(address: IPAddress) -> IPAddress:
    """`address` with an IPv4-mapped IPv6 address (::ffff:127.0.0.1) as the IPv4 address it reaches."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class Resolver:
    """Host names to one address, never waited on (see the module docstring). `lookup` and `start` (how a
    lookup is started: on a daemon thread of its own) are for tests."""

    def __init__(self, lookup: Callable[[str], str] | None = None,
                 start: Callable[[Callable[[], None]], None] | None = None):
        self._lookup = lookup or _first_address
        self._start = start or _on_a_thread
        self._lock = threading.Lock()
        self._known: OrderedDict[str, tuple[float, Optional[str]]] = OrderedDict()
        self._running: set[str] = set()

    def lookup(self, host: str) -> Optional[str] | Pending:
        """The address of `host` (an IP literal: itself), None when it did not resolve (or too many lookups
        hang), `PENDING` while it is being resolved on a thread of its own."""
        if ip_literal(host) is not None:
            return host
        now = time.monotonic()
        with self._lock:
            known = self._known.get(host)
            if known is not None and now - known[0] < RESOLVE_TTL_S:
                return known[1]
            if host in self._running:
                return PENDING
            if len(self._running) >= MAX_LOOKUPS:
                return None
            self._running.add(host)
        self._start(lambda: self._run(host))
        with self._lock:
            known = self._known.get(host)
        return known[1] if known is not None and host not in self._running else PENDING

    def _run(self, host: str) -> None:
        try:
            address: Optional[str] = self._lookup(host)
        except (OSError, UnicodeError, ValueError):
            address = None
        with self._lock:
            self._running.discard(host)
            self._known[host] = (time.monotonic(), address)
            self._known.move_to_end(host)
            while len(self._known) > MAX_REMEMBERED:
                self._known.popitem(last=False)


def _on_a_thread(run: Callable[[], None]) -> None:
    threading.Thread(target=run, name="lmcache-pd-resolve", daemon=True).start()


def _first_address(host: str) -> str:
    """`host`'s first IPv4 address, else its first one: a transfer server binds a name by its IPv4 address
    (so "localhost" is 127.0.0.1 here too, even where it resolves to ::1 first)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} has no address")
    ipv4 = [info for info in infos if info[0] == socket.AF_INET]
    return str((ipv4 or infos)[0][4][0])


def own_addresses(bind: str) -> frozenset[str]:
    """The addresses that reach a transfer server bound to `bind` (an address, a name bound by its IPv4
    address, or a wildcard: then loopback's)."""
    if bind in ("*", "0.0.0.0", "", "::"):
        return frozenset({"127.0.0.1", "::1"})
    literal = ip_literal(bind)
    if literal is not None:
        return frozenset({str(plain(literal))})
    try:
        return frozenset({socket.gethostbyname(bind)})  # at start-up, as the server binds it
    except OSError:
        return frozenset()


class PeerTrust:
    """See the module docstring. `scope`: this instance's key scope (`pd_scope`); `clock`: Unix time;
    `own_addresses` reach this instance's own transfer servers (`own_addresses(bind)`), `own_ports()` are
    their ports (None: it serves none, or does not know them yet; asked only for an address of its own)."""

    def __init__(self, peers: Sequence[str] = (), mac: Optional[ChunkMac] = None, scope: str = "",
                 resolve_timeout_s: float = 1.0, resolver: Resolver | None = None,
                 clock: Callable[[], float] = time.time, own_addresses: frozenset[str] = frozenset(),
                 own_ports: Callable[[], Sequence[int] | None] = lambda: None):
        self.peers: list[PeerEntry] = [parse_peer(p) for p in peers]
        self.mac = mac
        self.scope = scope
        self.resolve_timeout_s = float(resolve_timeout_s)
        self.resolver = resolver or Resolver()
        self.clock = clock
        self.own_addresses = own_addresses
        self.own_ports = own_ports
        for entry in self.peers:  # names listed: resolved now, on their threads, for the first request
            if entry.name is not None:
                self.resolver.lookup(entry.name)

    def admit(self, remote: RemotePrefill) -> RemotePrefill | None:
        """`remote` with the address to connect to, its trust and label; None while its host name is being
        resolved (ask again; refuse it as unresolved past `resolve_timeout_s`); `PDRefusal` when D may not
        pull. Never waits."""
        if self.mac is not None:
            self._check_signature(remote)
        elif ip_literal(remote.host) is None and not any(p.name == remote.host for p in self.peers):
            raise PDRefusal("untrusted", f"kv_transfer_params name the host {remote.host}, a name not listed in "
                                         f"extra_config.pd_peers: without a chunk MAC key this decode instance "
                                         f"resolves no other name; {_ALLOW}")
        resolved = self.resolver.lookup(remote.host)
        if resolved is PENDING:
            return None
        address = ip_literal(resolved) if isinstance(resolved, str) else None
        if address is None:
            raise PDRefusal("unresolved", f"the prefill instance's host {remote.host} did not resolve")
        address = plain(address)
        entries = [next((p for p in self.peers if p.allows(remote.host, address, port)), None)
                   for port in remote.ports]
        listed = all(e is not None for e in entries)
        is_own = False
        if not listed and str(address) in self.own_addresses:
            ports = self.own_ports()
            is_own = ports is not None and set(remote.ports) <= set(ports)
        if listed:
            label = entries[0].text if entries[0] is not None else "other"
        else:
            label = "own" if is_own else "other"
        if self.mac is not None:
            trust = "signed"
        elif listed:
            trust = "listed"
        elif is_own:
            trust = "own"
        else:
            raise PDRefusal("untrusted", f"kv_transfer_params name the prefill instance {remote.host} "
                                         f"({address}) at ports {_ports_text(remote.ports)}, which this decode "
                                         f"instance does not trust: without a chunk MAC key it pulls only from "
                                         f"the ports pd_peers lists (loopback included); {_ALLOW}")
        return dataclasses.replace(remote, address=str(address), trust=trust, label=label)

    def _check_signature(self, remote: RemotePrefill) -> None:
        if self.mac is None:
            raise RuntimeError("a signature is checked only with a chunk MAC key")
        if remote.sig is None or remote.expires is None:
            raise PDRefusal("unsigned", "kv_transfer_params without a signature: with chunk_mac_key set, this "
                                        "decode instance pulls only from prefill instances that sign their "
                                        "params with the same key")
        try:
            tag = bytes.fromhex(remote.sig)
        except ValueError:
            tag = b""
        if not self.mac.verify(signed_bytes(remote), b"", tag):
            raise PDRefusal("bad_signature", "the signature of the kv_transfer_params does not verify "
                                             "(another chunk_mac_key, or params changed on the way)")
        if remote.scope != self.scope:
            raise PDRefusal("bad_signature", "signed kv_transfer_params of another model, TP size or chunk "
                                             "size (their key scope differs from this instance's)")
        if self.clock() > remote.expires + CLOCK_SKEW_S:
            raise PDRefusal("expired", "signed kv_transfer_params past their expiry (the prefill instance's "
                                       "hold is over; pd_hold_secs)")


def _ports_text(ports: Sequence[int]) -> str:
    shown = ",".join(map(str, ports[:4]))
    return shown + (f",... ({len(ports)} ports)" if len(ports) > 4 else "")


def pd_scope(fingerprint: str, tp_size: int, chunk_size: int) -> str:
    """The key scope signed params are valid for: keys of another model, TP size or chunk size differ."""
    return f"{fingerprint}/tp{tp_size}/c{chunk_size}"


def host_warnings(host: str, resolve_timeout_s: float = 1.0) -> list[str]:
    """What makes a prefill instance advertising `host` unreachable to decode instances (said at start)."""
    literal = ip_literal(host)
    if host.lower() == "localhost" or (literal is not None and is_loopback(literal)):
        return [f"disaggregated prefill: this instance advertises {host} in its kv_transfer_params, so only "
                f"decode instances on this host can pull from it; set extra_config.pd_host (or "
                f"VLLM_NIXL_SIDE_CHANNEL_HOST) to an address they reach"]
    if literal is None:
        families: set[int] = set()

        def lookup() -> None:  # on a daemon thread: start-up waits for it at most `resolve_timeout_s`
            try:
                families.update(info[0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
            except (OSError, UnicodeError):
                pass

        thread = threading.Thread(target=lookup, name="lmcache-pd-resolve", daemon=True)
        thread.start()
        thread.join(resolve_timeout_s)
        if not thread.is_alive() and families == {socket.AF_INET6}:
            return [f"disaggregated prefill: pd_host {host} has IPv6 addresses only, and the transfer server "
                    f"binds names by their IPv4 address: set pd_host to the IPv6 address itself"]
    return []
