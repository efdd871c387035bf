"""Hosts and request ids between instances: the syntax of a host a prefill instance names (`check_host`), of
a request id it names (`check_request_id`), and the entries of `extra_config.pd_peers` (`PeerEntry`,
`parse_peer`), the prefill instances a decode instance trusts without a chunk MAC key (docs/SECURITY.md).

A host is an IP literal (IPv4, or IPv6 without brackets or zone) or a DNS name (labels of letters, digits,
`-` and `_`, at most 63 characters each, 253 in all): no port, path, user, white space or anything a
resolver or a log line could take for something else. A `pd_peers` entry is such a host, or a network in
CIDR notation (`10.0.0.0/24`, `fd00::/64`). Lives in `config` because the configuration checks the entries
at start-up with this same parser; the decode side matches prefill instances against them.
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
    """One `pd_peers` entry: a network (an address is a /32 or /128) or a host name; `text` as configured."""

    text: str
    network: Optional[IPNetwork] = None
    name: Optional[str] = None

    def matches(self, host: str, address: IPAddress) -> bool:
        """Whether a prefill instance named `host` (as in its params), resolved to `address`, is this entry."""
        if self.network is not None:
            return address.version == self.network.version and address in self.network
        return host == self.name


def parse_peer(text: Any) -> PeerEntry:
    """A `pd_peers` entry; ValueError saying what an entry may be."""
    if isinstance(text, str) and "/" in text:
        try:
            network = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise ValueError(f"{text!r} is no network: expected an address/prefix such as 10.0.0.0/24") from None
        return PeerEntry(text, network=network)
    try:
        host = check_host(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a host: expected {HOST_RULE}, or a network such as "
                         f"10.0.0.0/24") from None
    address = ip_literal(host)
    if address is not None:
        return PeerEntry(text, network=ipaddress.ip_network(address))
    return PeerEntry(text, name=host)


def check_peers(values: Any) -> Optional[str]:
    """The configuration check of `pd_peers`: None, or every bad entry with what an entry may be."""
    problems = []
    for value in values or ():
        try:
            parse_peer(value)
        except ValueError as exc:
            problems.append(str(exc))
    return "; ".join(problems) or None
