"""Hosts and request ids between instances: the syntax of a host a prefill instance names (`check_host`), of
a request id it names (`check_request_id`), and the entries of `extra_config.pd_peers` (`PeerEntry`,
`parse_peer`), the instances (prefill instances, P2P peers) this one connects to without a chunk MAC key, each
with its transfer ports: no entry lets a client or a directory name any port of a host (docs/SECURITY.md).

A host is an IP literal (IPv4, or IPv6 without brackets or zone) or a DNS name (labels of letters, digits,
`-` and `_`, at most 63 characters each, 253 in all): no port, path, user, white space or anything a
resolver or a log line could take for something else. A `pd_peers` entry is such a host, or a network in
CIDR notation (`10.0.0.0/24`, `fd00::/64`), then `:` and a port or a range of ports (`10.0.0.0/24:5600-5607`,
`prefill-1.internal:5600`, IPv6 in brackets: `[fd00::/64]:5600`). Lives in `config` because the configuration
checks the entries at start-up with this same parser; the decode side and P2P match peers against them.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Optional, Union

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

MAX_HOST_CHARS = 253
MAX_REQUEST_ID_CHARS = 256
# Printable ASCII without white space: vLLM's ids (uuids, "cmpl-...") and nothing a line-based protocol, a
# resolver or a log line could take for a separator.
_REQUEST_ID = re.compile(r"[\x21-\x7e]+")
_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
HOST_RULE = ("an IP address (IPv6 without brackets) or a DNS name (letters, digits, '-', '_' and dots), "
             "without a port, path or white space")


def ip_literal(host: str) -> Optional[IPAddress]:
    """The address `host` spells (IPv4 dotted quad or IPv6 without zone), else None."""
    if not isinstance(host, str) or "%" in host or not host.isascii():
        return None
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def check_host(host: Any) -> str:
    """`host` as a prefill instance may name it (see the module docstring), lowercased; ValueError else."""
    if not isinstance(host, str) or not host or len(host) > MAX_HOST_CHARS:
        raise ValueError(f"expected {HOST_RULE}")
    if ip_literal(host) is not None:
        return host.lower()
    name = host[:-1] if host.endswith(".") else host
    if not name.isascii() or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise ValueError(f"expected {HOST_RULE}")
    if name.replace(".", "").isdigit():  # 10.1 or 127.1: what a resolver reads as an address, not a name
        raise ValueError(f"expected {HOST_RULE} (an IPv4 address has four numbers)")
    return name.lower()


def check_request_id(value: Any, what: str = "a request id", limit: int = MAX_REQUEST_ID_CHARS) -> str:
    """`value` if it is 1 to `limit` printable ASCII characters without white space; ValueError else."""
    if not isinstance(value, str) or not 0 < len(value) <= limit or not _REQUEST_ID.fullmatch(value):
        raise ValueError(f"{what} must be 1 to {limit} printable ASCII characters without white space")
    return value


@dataclass(frozen=True)
class PeerEntry:
    """One `pd_peers` entry: a network (an address is a /32 or /128) or a host name, and the transfer ports
    (`low`..`high`, inclusive) of the instances there; `text` as configured."""

    text: str
    network: Optional[IPNetwork] = None
    name: Optional[str] = None
    low: int = 0
    high: int = 0

    def matches_host(self, host: str, address: IPAddress) -> bool:
        """Whether an instance named `host` (as in its params or the directory), at `address`, is on this
        entry's host or network (any port: who may ask this instance, whose source port says nothing)."""
        if self.network is not None:
            return address.version == self.network.version and address in self.network
        return host == self.name

    def allows(self, host: str, address: IPAddress, port: int) -> bool:
        """Whether this instance may connect to `port` of `host` at `address`: its host and one of its ports."""
        return self.low <= port <= self.high and self.matches_host(host, address)


_ENTRY = re.compile(r"(?:\[(?P<v6>[^\]]+)\]|(?P<host>[^\[\]:]+)):(?P<low>[0-9]{1,5})(?:-(?P<high>[0-9]{1,5}))?")
ENTRY_RULE = ("HOST:PORT or HOST:FIRST-LAST, HOST an IP address, a DNS name or a network such as 10.0.0.0/24 "
              "(IPv6 in brackets: [fd00::/64]:5600-5607); the ports are the instances' KV transfer ports "
              "(pd_port + rank, p2p_init_ports)")


def parse_peer(text: Any) -> PeerEntry:
    """A `pd_peers` entry; ValueError saying what an entry may be."""
    match = _ENTRY.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"{text!r} is not HOST:PORT or HOST:FIRST-LAST")
    low = int(match["low"])
    high = int(match["high"]) if match["high"] is not None else low
    if not 0 < low <= high <= 65535:
        raise ValueError(f"{text!r} names ports {low}-{high}: expected ports from 1 to 65535, the first not "
                         f"above the last")
    host = match["v6"] or match["host"]
    if "/" in host:
        try:
            network = ipaddress.ip_network(host, strict=False)
        except ValueError:
            raise ValueError(f"{text!r}: {host!r} is no network: expected an address/prefix such as "
                             f"10.0.0.0/24") from None
        return PeerEntry(text, network=network, low=low, high=high)
    try:
        checked = check_host(host)
    except ValueError:
        raise ValueError(f"{text!r}: {host!r} is not a host: expected {HOST_RULE}") from None
    if match["v6"] is not None and not isinstance(ip_literal(checked), ipaddress.IPv6Address):
        raise ValueError(f"{text!r}: brackets are for IPv6 addresses and networks")
    address = ip_literal(checked)
    if address is not None:
        return PeerEntry(text, network=ipaddress.ip_network(address), low=low, high=high)
    return PeerEntry(text, name=checked, low=low, high=high)


def check_peers(values: Any) -> Optional[str]:
    """The configuration check of `pd_peers`: None, or every bad entry with what an entry may be."""
    problems = []
    for value in values or ():
        try:
            parse_peer(value)
        except ValueError as exc:
            problems.append(str(exc))
    return f"{'; '.join(problems)} (an entry: {ENTRY_RULE})" if problems else None
