"""The bearer token of the management API and the coordinator: read once from a file, compared in constant time,
never logged.

`read_token(path)` takes the file's first line without surrounding whitespace; a token shorter than
`MIN_TOKEN_CHARS` is refused (`lmcache-vllm keygen` prints one of 43). A file others can read is said once at
start. `check(header, token, write, peer)` is the rule of docs/SECURITY.md: every write needs
`Authorization: Bearer <token>` (401 without it or with another scheme, 403 with another token); a read
(status, lookups, listings: nothing returns KV) needs it too unless it comes from loopback. The token is held as
bytes and compared with `hmac.compare_digest` over bytes (a non-ASCII header cannot make it raise).
"""
from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import stat
from typing import Optional

from lmcache_vllm.config.redact import remember_secret

logger = logging.getLogger(__name__)

MIN_TOKEN_CHARS = 16
MAX_TOKEN_CHARS = 4096


class AuthError(Exception):
    """A request refused for its credentials: `status` 401 (none, or not a bearer token) or 403 (another one)."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status


def read_token(path: str) -> bytes:
    """The token in the file at `path`; ValueError naming the file (never the token) when it cannot be one."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_TOKEN_CHARS + 2)
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path!r}: {exc.strerror or exc}") from None
    lines = raw.splitlines()
    token = lines[0].strip() if lines else b""
    if len(raw) > MAX_TOKEN_CHARS + 1 or not MIN_TOKEN_CHARS <= len(token) <= MAX_TOKEN_CHARS:
        raise ValueError(f"the token file {path!r} must hold one token of {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} "
                         f"characters on its first line (lmcache-vllm keygen prints one)")
    if any(b < 0x21 or b > 0x7E for b in token):
        raise ValueError(f"the token in {path!r} must be printable ASCII without spaces")
    remember_secret(token.decode("ascii"))  # redacted from any text we show from now on
    if stat.S_IMODE(mode) & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("the token file %s can be read by other users (mode %o): chmod 600 it", path,
                       stat.S_IMODE(mode))
    return token


def is_loopback(peer: Optional[str]) -> bool:
    if not peer:
        return False
    try:
        address = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def check(header: Optional[str], token: bytes, *, write: bool, peer: Optional[str]) -> None:
    """Raises `AuthError` unless the request may go on (see the module docstring)."""
    if header is None:
        if not write and is_loopback(peer):
            return
        raise AuthError(401, "this call needs the header Authorization: Bearer <token>")
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise AuthError(401, "expected Authorization: Bearer <token>")
    given = value.strip().encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(given, token):
        raise AuthError(403, "the bearer token is not this server's")
