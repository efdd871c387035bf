"""Which prefill instances a decode instance D connects to (docs/SECURITY.md, "kv_transfer_params").

vLLM's API server copies `kv_transfer_params` from any client's request body, so the host and ports in them
are a client's choice: without this check, a client could make D connect to any service D reaches and send
it bytes. `PeerTrust.admit(remote)` says whether D may pull from the prefill instance a checked
`RemotePrefill` (`params.parse_remote_prefill`) names, and from which address:

- with a chunk MAC key (`extra_config.chunk_mac_key` / `LMCACHE_VLLM_CHUNK_MAC_KEY`), the params must carry a
  valid signature of a prefill instance holding the same key, for this instance's key scope (the model's
  fingerprint, TP size and chunk size: a signature for another model does not pass), not expired. Trust
  "signed": every chunk is then verified with the MAC too;
- without a key, the peer must be on loopback or listed in `extra_config.pd_peers` (hosts, addresses,
  networks). Trust "listed", or "loopback": chunks from an unlisted loopback peer stay in L1 (the scheduler
  does not save the request: nothing it pulled reaches disk or Redis).
A host name is resolved here, once per `RESOLVE_TTL_S`, within `resolve_timeout_s` (on daemon threads: a
hung resolver never holds vLLM's step, nor its exit); the address it resolves to is what the allow-list is
checked against and what the workers connect to (no second lookup that could answer otherwise). Anything
refused is a `PDRefusal` naming the setting that would allow it; nothing is sent to a refused peer, not even
a RELEASE. `label` is the peer's metric label: its `pd_peers` entry, "loopback", or "other" (a bounded set).
"""
from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from lmcache_vllm.config.peers import IPAddress, PeerEntry, ip_literal, parse_peer
from lmcache_vllm.integration.vllm.pd.params import PDRefusal, RemotePrefill, sign

if TYPE_CHECKING:
    from lmcache_vllm.storage.codec import ChunkMac

RESOLVE_TTL_S = 30.0  # a name's address (or failure) is remembered this long
MAX_REMEMBERED = 256  # names remembered
MAX_LOOKUPS = 4  # resolver threads at once: past it (a hung resolver) names are refused at once
CLOCK_SKEW_S = 30.0  # signed params are taken this long past their expiry (clocks of P and D differ)
_ALLOW = ("list it in extra_config.pd_peers (hosts, addresses or networks such as 10.0.0.0/24), or set "
          "the same chunk_mac_key on both instances (then the prefill instance signs its params)")


def is_loopback(address: IPAddress) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


class Resolver:
    """Host names to one address, bounded in time and in threads (see the module docstring)."""

    def __init__(self, timeout_s: float, lookup: Callable[[str], str] | None = None):
        self.timeout_s = float(timeout_s)
        self._lookup = lookup or _first_address
        self._lock = threading.Lock()
        self._known: OrderedDict[str, tuple[float, Optional[str]]] = OrderedDict()
        self._running = 0

    def resolve(self, host: str) -> Optional[str]:
        """The address of `host` (an IP literal: itself), None when it does not resolve in time."""
        if ip_literal(host) is not None:
            return host
        now = time.monotonic()
        with self._lock:
            known = self._known.get(host)
            if known is not None and now - known[0] < RESOLVE_TTL_S:
                return known[1]
            if self._running >= MAX_LOOKUPS:
                return None
            self._running += 1
        box: list[Optional[str]] = [None]
        done = threading.Event()

        def run() -> None:
            try:
                box[0] = self._lookup(host)
            except (OSError, UnicodeError, ValueError):
                box[0] = None
            finally:
                with self._lock:
                    self._running -= 1
                    self._known[host] = (time.monotonic(), box[0])
                    self._known.move_to_end(host)
                    while len(self._known) > MAX_REMEMBERED:
                        self._known.popitem(last=False)
                done.set()

        threading.Thread(target=run, name="lmcache-pd-resolve", daemon=True).start()
        done.wait(self.timeout_s)
        return box[0] if done.is_set() else None


def _first_address(host: str) -> str:
    """`host`'s first IPv4 address, else its first one: a transfer server binds a name by its IPv4 address
    (so "localhost" is 127.0.0.1 here too, even where it resolves to ::1 first)."""
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"{host} has no address")
    ipv4 = [info for info in infos if info[0] == socket.AF_INET]
    return str((ipv4 or infos)[0][4][0])


class PeerTrust:
    """See the module docstring. `scope`: this instance's key scope (`pd_scope`); `clock`: Unix time."""

    def __init__(self, peers: Sequence[str] = (), mac: Optional[ChunkMac] = None, scope: str = "",
                 resolve_timeout_s: float = 1.0, resolver: Resolver | None = None,
                 clock: Callable[[], float] = time.time):
        self.peers: list[PeerEntry] = [parse_peer(p) for p in peers]
        self.mac = mac
        self.scope = scope
        self.resolver = resolver or Resolver(resolve_timeout_s)
        self.clock = clock

    def admit(self, remote: RemotePrefill) -> RemotePrefill:
        """`remote` with the address to connect to, its trust and label; `PDRefusal` when D may not pull."""
        if self.mac is not None:
            self._check_signature(remote)
        resolved = self.resolver.resolve(remote.host)
        address = ip_literal(resolved) if resolved is not None else None
        if address is None:
            raise PDRefusal("unresolved", f"the prefill instance's host {remote.host} did not resolve within "
                                          f"{self.resolver.timeout_s:g}s")
        entry = next((p for p in self.peers if p.matches(remote.host, address)), None)
        loopback = is_loopback(address)
        label = entry.text if entry is not None else "loopback" if loopback else "other"
        if self.mac is not None:
            trust = "signed"
        elif entry is not None:
            trust = "listed"
        elif loopback:
            trust = "loopback"
        else:
            raise PDRefusal("untrusted", f"kv_transfer_params name the prefill instance {remote.host} "
                                         f"({address}), which this decode instance does not trust: it pulls "
                                         f"only from loopback without a chunk MAC key; {_ALLOW}")
        return dataclasses.replace(remote, address=str(address), trust=trust, label=label)

    def _check_signature(self, remote: RemotePrefill) -> None:
        assert self.mac is not None
        if remote.sig is None or remote.expires is None:
            raise PDRefusal("unsigned", "kv_transfer_params without a signature: with chunk_mac_key set, this "
                                        "decode instance pulls only from prefill instances that sign their "
                                        "params with the same key")
        if not hmac.compare_digest(sign(remote, self.mac), remote.sig):
            raise PDRefusal("bad_signature", "the signature of the kv_transfer_params does not verify "
                                             "(another chunk_mac_key, or params changed on the way)")
        if remote.scope != self.scope:
            raise PDRefusal("bad_signature", "signed kv_transfer_params of another model, TP size or chunk "
                                             "size (their key scope differs from this instance's)")
        if self.clock() > remote.expires + CLOCK_SKEW_S:
            raise PDRefusal("expired", "signed kv_transfer_params past their expiry (the prefill instance's "
                                       "hold is over; pd_hold_secs)")


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
