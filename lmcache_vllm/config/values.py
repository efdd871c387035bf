"""Checks of single values that need more than a type: the L2 directory, the Redis URL (checked here so
that redis-py never sees a bad one), LMCache's spellings of values we implement under our own name
(resp://, "torch" serde, vLLM's hash names).

Each check returns what is wrong (None when nothing is); the translations return the value to use and a
note, or raise ValueError with the reason a value is refused.
"""

from __future__ import annotations

import os
from typing import Any, Optional
from urllib.parse import quote, urlsplit

from lmcache_vllm.config.lmcache import (
    CACHE_POLICIES,
    HASH_NAMES,
    MAPPED,
    REMOTE_SCHEME_DEFAULT,
    REMOTE_SCHEMES,
    REMOTE_SERDE,
)

SUPPORTED_REMOTE_SCHEMES = ("redis", "rediss", "unix")


def normalize_local_disk(value: str) -> tuple[str, Optional[str]]:
    """As LMCache: 'file://' is dropped, so 'file:///abs' is /abs and 'file://rel/' the relative rel/."""
    path = value[len("file://"):] if value.startswith("file://") else value
    if "," in path:
        return value, ("a single directory (LMCache's several comma-separated local_disk paths "
                       "are not supported)")
    if not path.strip():
        return value, "a directory path"
    return os.path.normpath(path), None


def remote_url_problem(url: str) -> Optional[str]:
    expected = ("a URL with scheme " + "/".join(SUPPORTED_REMOTE_SCHEMES)
                + " (e.g. redis://127.0.0.1:6379/0 or unix:///run/redis.sock), or null")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"not a valid URL ({exc}); expected {expected}"
    if parts.scheme not in SUPPORTED_REMOTE_SCHEMES:
        return f"expected {expected}"
    if parts.scheme == "unix":
        return None if parts.path else "expected unix:///path/to/redis.sock"
    if not parts.hostname:
        return "expected redis://HOST[:PORT][/DB] (no host given)"
    if port is not None and not 0 < port < 65536:
        return "the port must be 1 to 65535"
    db = parts.path.strip("/")
    if db and not db.isdigit():
        return f"the database ({db!r}) must be a number: redis://HOST:PORT/DB"
    return None


def translate_lmcache_value(key: str, value: Any) -> tuple[Any, Optional[str]]:
    """LMCache's spelling of a value of `key` -> (our value, a note saying so); unchanged values come back
    with no note. Raises ValueError with the reason for an LMCache value whose feature we lack."""
    if not isinstance(value, str):
        return value, None
    if key == "remote_url" and "://" in value:
        scheme, rest = value.split("://", 1)
        scheme = scheme.lower()
        if scheme in SUPPORTED_REMOTE_SCHEMES:
            return value, None
        reason = REMOTE_SCHEMES.get(scheme, REMOTE_SCHEME_DEFAULT.format(scheme=scheme))
        if reason != MAPPED:
            raise ValueError(f"not supported by lmcache-vllm: {reason}")
        return f"redis://{rest}", f"LMCache's {scheme}:// (RESP) is Redis: taken as redis://{rest}"
    if key == "remote_serde" and value.lower() in REMOTE_SERDE:
        reason = REMOTE_SERDE[value.lower()]
        if reason != MAPPED:
            raise ValueError(f"not supported by lmcache-vllm: {reason}")
        return "naive", f"LMCache v0's {value!r} serde stored raw tensors: taken as 'naive'"
    if key == "pre_caching_hash_algorithm" and value in HASH_NAMES:
        ours = HASH_NAMES[value]
        return ours, f"LMCache's (vLLM's) {value!r} taken as {ours!r}: our chunk keys are our own"
    if key == "cache_policy" and value.upper() in CACHE_POLICIES:
        raise ValueError(f"not supported by lmcache-vllm: L1 evicts the least recently used chunk "
                         f"(LRU), not {value.upper()}")
    return value, None


def with_credentials(url: str, username: str, password: str) -> str:
    """redis://host... with user and password put in (URL-quoted), unless the URL carries some already."""
    scheme, rest = url.split("://", 1)
    if "@" in rest.split("/", 1)[0] or not (username or password):
        return url
    userinfo = quote(username, safe="") + (":" + quote(password, safe="") if password else "")
    return f"{scheme}://{userinfo}@{rest}"
