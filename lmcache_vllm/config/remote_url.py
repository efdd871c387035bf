"""What a `remote_url` names: every form the L3 Redis tier accepts, parsed once into a `RedisTarget`, and
LMCache's `mooncakestore://` form, which names a Mooncake Store master instead (`MooncakeTarget`).

    redis://[user:pw@]host[:port][/db]       one server (valkey:// is the same); rediss:// / valkeys://: TLS
    unix:///path/redis.sock[?db=N]           one server on a Unix socket
    redis-cluster://[user:pw@]host:port[,host:port...]      a Redis Cluster: any node seeds the discovery
                                                           (valkey-cluster://; TLS: rediss-cluster://,
                                                           valkeys-cluster://)
    redis-sentinel://[user:pw@]host:port[,host:port...][/master_name[/db]]   the master a set of Sentinels
                                                           names (TLS: rediss-sentinel://)

    mooncakestore://host[:port][?device=NAME]               the master of a Mooncake Store (LMCache's form;
                                                           port 50051 by default; `device`: its RDMA devices)

The user and password authenticate at the data nodes (AUTH / ACL user), URL-quoted or not: the user info
ends at the last `@` (`redact.split_url`, the rule redaction shares, so a password with `/`, `#`, `?` or `@`
is taken, and masked, whole). A Sentinel URL
without `/master_name` takes it, as LMCache does, from the `REDIS_SERVICE_NAME` environment variable
(default `redismaster`). Lives in `config` (not in `storage`) because the configuration checks every URL
at start-up with this same parser; the storage tier builds its redis-py client from the result.
Credentials never appear in a `RedisTarget`'s repr or in `display()`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping, Optional
from urllib.parse import unquote

from lmcache_vllm.config.redact import UrlParts, redact_url, remember_url_secrets, split_url


class Topology(enum.Enum):
    SINGLE = "single"  # one server over TCP
    UNIX = "unix"  # one server on a Unix socket
    CLUSTER = "cluster"  # a Redis Cluster
    SENTINEL = "sentinel"  # the master a set of Sentinels names


# scheme -> (topology, TLS)
SCHEMES: dict[str, tuple[Topology, bool]] = {
    "redis": (Topology.SINGLE, False), "rediss": (Topology.SINGLE, True),
    "valkey": (Topology.SINGLE, False), "valkeys": (Topology.SINGLE, True),
    "unix": (Topology.UNIX, False),
    "redis-cluster": (Topology.CLUSTER, False), "rediss-cluster": (Topology.CLUSTER, True),
    "valkey-cluster": (Topology.CLUSTER, False), "valkeys-cluster": (Topology.CLUSTER, True),
    "redis-sentinel": (Topology.SENTINEL, False), "rediss-sentinel": (Topology.SENTINEL, True),
}
DEFAULT_PORT = {Topology.SINGLE: 6379, Topology.CLUSTER: 6379, Topology.SENTINEL: 26379}
SENTINEL_SERVICE_ENV = "REDIS_SERVICE_NAME"  # LMCache's name for the Sentinel master name
DEFAULT_SENTINEL_SERVICE = "redismaster"  # LMCache's default when REDIS_SERVICE_NAME is unset
MOONCAKE_SCHEME = "mooncakestore"  # LMCache's scheme of a Mooncake Store master
MOONCAKE_DEFAULT_PORT = 50051  # mooncake_master's default RPC port
MOONCAKE_ACCEPTED = "mooncakestore://host[:port][?device=NAME] (a Mooncake master; port 50051 by default)"
# No user:password@ inside the URL forms: error texts are redacted (config/redact.py), which would mask it.
ACCEPTED = ("redis://host:port[/db] (or rediss:// with TLS; valkey://, valkeys://), unix:///path/to/redis.sock, "
            "redis-cluster://host:port[,host:port...] (or rediss-cluster://, valkey-cluster://), "
            "redis-sentinel://host:port[,host:port...][/master_name] (or rediss-sentinel://); a user and "
            "password go before the host(s) as user:password@")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed `remote_url`. `nodes`: (host, port) of the server, the cluster's seed nodes or the
    Sentinels; `url`: the URL as given (with credentials: give it to redis-py only, never log it)."""

    scheme: str
    topology: Topology
    tls: bool
    nodes: tuple[tuple[str, int], ...] = ()
    username: Optional[str] = None
    password: Optional[str] = field(default=None, repr=False)
    db: int = 0
    master_name: Optional[str] = None  # Sentinel only; None: REDIS_SERVICE_NAME or the default
    unix_path: Optional[str] = None
    url: str = field(default="", repr=False)

    @property
    def multi_node(self) -> bool:
        return self.topology in (Topology.CLUSTER, Topology.SENTINEL)

    def display(self) -> str:
        """The URL without its password (for logs, errors, metric labels and reports; `redact.redact_url`)."""
        return redact_url(self.url)


def parse_remote_url(url: str) -> RedisTarget:
    """The `RedisTarget` of `url`; ValueError saying what is wrong and which forms are accepted."""
    parts = split_url(url)
    if parts is None:
        raise ValueError(f"expected {ACCEPTED}, or null")
    remember_url_secrets(url)  # redacted from any text from now on (an error below included)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"the scheme {redact_url(parts.scheme)}:// is not one of ours; expected {ACCEPTED}")
    topology, tls = SCHEMES[scheme]
    username, password = _credentials(parts)
    if topology is Topology.UNIX:
        return _parse_unix(url, parts, scheme, username, password)
    hostlist, _, path = parts.rest.partition("/")
    hostlist = hostlist.split("?", 1)[0]
    path = path.split("?", 1)[0]
    nodes = tuple(_parse_node(part, DEFAULT_PORT[topology], scheme) for part in hostlist.split(","))
    if topology is Topology.SINGLE:
        if len(nodes) > 1:
            raise ValueError(f"{scheme}:// names one server; for several nodes use redis-cluster://h1:p1,h2:p2 "
                             f"(a Redis Cluster) or redis-sentinel://h1:p1,h2:p2/master_name (Sentinel)")
        return RedisTarget(scheme, topology, tls, nodes, username, password, _db(path.strip("/"), scheme),
                           url=url)
    if topology is Topology.CLUSTER:
        if path.strip("/") not in ("", "0"):
            raise ValueError(f"a Redis Cluster has only database 0: {scheme}://host:port[,host:port...] "
                             f"(got the path /{path})")
        return RedisTarget(scheme, topology, tls, nodes, username, password, url=url)
    names = [p for p in path.split("/") if p]
    if len(names) > 2:
        raise ValueError(f"expected {scheme}://host:port[,host:port...][/master_name[/db]] (got the path /{path})")
    master = unquote(names[0]) if names else None
    db = _db(names[1], scheme) if len(names) == 2 else 0
    return RedisTarget(scheme, topology, tls, nodes, username, password, db, master, url=url)


@dataclass(frozen=True)
class MooncakeTarget:
    """A parsed `mooncakestore://` remote_url: the Mooncake master (`host`, `port`) and the RDMA devices the
    URL names (`device`, "" when it names none)."""

    host: str
    port: int
    device: str = ""

    @property
    def master_address(self) -> str:
        """host:port as Mooncake's `master_server_address` spells it ([::1]:port for IPv6)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def display(self) -> str:
        return f"{MOONCAKE_SCHEME}://{self.master_address}" + (f"?device={self.device}" if self.device else "")


def is_mooncake_url(url: str) -> bool:
    """Whether `url` names a Mooncake Store (LMCache's `mooncakestore://`), not a Redis form."""
    return url.split("://", 1)[0].lower() == MOONCAKE_SCHEME if "://" in url else False


def parse_mooncake_url(url: str) -> MooncakeTarget:
    """The `MooncakeTarget` of a `mooncakestore://host[:port][/][?device=NAME]` URL; ValueError saying what is
    wrong. No user information: Mooncake has no credentials."""
    parts = split_url(url)
    if parts is None or parts.scheme.lower() != MOONCAKE_SCHEME:
        raise ValueError(f"expected {MOONCAKE_ACCEPTED}")
    if parts.userinfo is not None:
        raise ValueError(f"a Mooncake master takes no user or password: expected {MOONCAKE_ACCEPTED}")
    rest, _, query = parts.rest.partition("?")
    hostport, _, path = rest.partition("/")
    if path or "," in hostport:
        raise ValueError(f"one master, no path: expected {MOONCAKE_ACCEPTED} (got {url!r})")
    host, port = _parse_node(hostport, MOONCAKE_DEFAULT_PORT, MOONCAKE_SCHEME)
    device = ""
    for item in filter(None, query.split("&")):
        name, _, value = item.partition("=")
        if name != "device":
            raise ValueError(f"unknown parameter {name!r}: expected {MOONCAKE_ACCEPTED}")
        device = unquote(value)
    return MooncakeTarget(host, port, device)


def _credentials(parts: UrlParts) -> tuple[Optional[str], Optional[str]]:
    if parts.userinfo is None:
        return None, None
    user, colon, pw = parts.userinfo.partition(":")
    return unquote(user) or None, unquote(pw) if colon else None


def _parse_unix(url: str, parts: UrlParts, scheme: str, username: Optional[str],
                password: Optional[str]) -> RedisTarget:
    path, _, query = parts.rest.partition("?")
    if not path:
        raise ValueError("expected unix:///path/to/redis.sock")
    db = 0
    for item in query.split("&"):
        name, _, value = item.partition("=")
        if name == "db":
            db = _db(value, scheme)
    return RedisTarget(scheme, Topology.UNIX, False, username=username, password=password, db=db, unix_path=path,
                       url=url)


def _parse_node(text: str, default_port: int, scheme: str) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):  # [IPv6]:port
        host, bracket, tail = text[1:].partition("]")
        if not bracket or not host or (tail and not tail.startswith(":")):
            raise ValueError(f"not a valid URL: {text!r} is no host[:port] (write an IPv6 address as [::1]:6379)")
        port_text = tail[1:]
    else:
        host, _, port_text = text.rpartition(":") if ":" in text else (text, "", "")
        if ":" in host:
            raise ValueError(f"not a valid URL: {text!r} is no host[:port] (write an IPv6 address as [::1]:6379)")
    if not host:
        raise ValueError(f"expected {scheme}://HOST[:PORT] (no host given)")
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"not a valid URL: the port of {text!r} must be a number from 1 to 65535")
    return host, int(port_text)


def _db(text: str, scheme: str) -> int:
    if not text:
        return 0
    if not text.isdigit():
        raise ValueError(f"the database ({text!r}) must be a number: {scheme}://HOST:PORT/DB")
    return int(text)


def sentinel_master_name(target: RedisTarget, environ: Mapping[str, str]) -> tuple[str, Optional[str]]:
    """(the Sentinel master name to ask for, a note when it did not come from the URL)."""
    if target.master_name:
        return target.master_name, None
    name = environ.get(SENTINEL_SERVICE_ENV)
    if name:
        return name, f"the Sentinel master name comes from {SENTINEL_SERVICE_ENV}={name!r} (as in LMCache)"
    return DEFAULT_SENTINEL_SERVICE, (f"no master name in the URL (…/master_name) nor in {SENTINEL_SERVICE_ENV}: "
                                      f"asking the Sentinels for {DEFAULT_SENTINEL_SERVICE!r} (LMCache's default)")
