"""Checks of single values that need more than a type: the L2 directory, the Redis URL (parsed by
`remote_url.py`, so that redis-py never sees a bad one), LMCache's spellings of values we implement under our own name
(resp://, "torch" serde, vLLM's hash names).

Each check returns what is wrong (None when nothing is); the translations return the value to use and a
note, or raise ValueError with the reason a value is refused.
"""

from __future__ import annotations

import os
from typing import Any, Optional
from urllib.parse import quote

from lmcache_vllm.config.fields import Problem
from lmcache_vllm.config.lmcache import (
    CACHE_POLICIES,
    HASH_NAMES,
    MAPPED,
    REMOTE_SCHEME_DEFAULT,
    REMOTE_SCHEMES,
    REMOTE_SERDE,
)
from lmcache_vllm.config.remote_url import (
    MOONCAKE_SCHEME,
    SCHEMES,
    is_mooncake_url,
    parse_mooncake_url,
    parse_remote_url,
)

SUPPORTED_REMOTE_SCHEMES = (*SCHEMES, MOONCAKE_SCHEME)
TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")  # extra_config keys that need a TLS remote_url


def normalize_local_disk(value: str) -> tuple[str, Optional[str]]:
    """As LMCache: 'file://' is dropped, so 'file:///abs' is /abs and 'file://rel/' the relative rel/."""
    path = value[len("file://"):] if value.startswith("file://") else value
    if "," in path:
        return value, ("a single directory (LMCache's several comma-separated local_disk paths "
                       "are not supported)")
    if not path.strip():
        return value, "a directory path"
    return os.path.normpath(path), None


def remote_url_problem(url: str, *, redis_only: bool = False) -> Optional[str]:
    """What is wrong with a `remote_url` (every accepted form: `remote_url.ACCEPTED`, and with
    `redis_only` False a Mooncake master's `mooncakestore://`), or None."""
    try:
        if is_mooncake_url(url) and not redis_only:
            parse_mooncake_url(url)
        else:
            parse_remote_url(url)
    except ValueError as exc:
        return str(exc)
    return None


def tls_problems(remote_url: Optional[str], extra: Any) -> list[Problem]:
    """The TLS settings (`extra_config.ssl_*`) that contradict the URL: set for a URL without TLS, or a
    private key without its certificate."""
    problems: list[Problem] = []
    given = {name: getattr(extra, name) for name in TLS_FILES if getattr(extra, name) is not None}
    if given and remote_url is not None and not remote_url_problem(remote_url) \
            and (is_mooncake_url(remote_url) or not parse_remote_url(remote_url).tls):
        for name, value in given.items():
            problems.append(Problem(f"extra_config.{name}", value, "applies to a TLS remote_url only "
                                    "(rediss://, rediss-cluster://, rediss-sentinel://); remote_url has no TLS"))
    if extra.ssl_keyfile is not None and extra.ssl_certfile is None:
        problems.append(Problem("extra_config.ssl_keyfile", extra.ssl_keyfile,
                                "a private key needs its certificate: set extra_config.ssl_certfile too"))
    return problems


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
