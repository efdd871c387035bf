"""Secrets kept out of logs, error messages, reprs and the CLI's output: the one place that redacts them.

Secrets of ours: a password in `remote_url` (`redis://user:PASSWORD@host` or `?password=PASSWORD`) and the
chunk MAC secret (`extra_config.chunk_mac_key`, `LMCACHE_VLLM_CHUNK_MAC_KEY`). Everything that shows a
configuration value, a URL or an exception's text goes through here:

- `split_url(url)`: where a URL's user info ends, the one rule the URL parser (`remote_url.py`) and the
  redaction share: up to the last `@` after `://`, unless the user name before its first `:` holds a `/`, `?`
  or `#` (then that `@` is not in the authority and there is no user info). So a password may hold any
  character (`/`, `#`, `?`, `@` included) and is masked exactly where the parser takes it from.
- `redact_url(url)`: the URL with the password of its user info and every secret-named query parameter
  replaced by `***` (user names, hosts and databases stay: they are what one debugs with).
- `url_secrets(url)` / `remember_url_secrets(url)`: the URL's passwords as written and unquoted.
- `redact_value(key, value)`: a configuration value as it may be shown: `***` for a key whose name says
  secret (`is_secret_key`: password, secret, token, mac_key, ...), else the value with `redact_text`
  applied to its strings.
- `redact_text(text)`: any text (an exception's message, a JSON string, a log line): every URL in it
  redacted, every `secret_key=value` / `"secret_key": "value"` pair's value masked, and every secret this
  process has learnt (`remember_secret`, e.g. when a configuration or a MAC key is built) replaced, so
  that even a message that quotes one in an unforeseen way does not carry it.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import unquote

MASK = "***"
_SECRET_WORDS = ("password", "passwd", "secret", "token", "mac_key", "api_key", "apikey", "credential")
_MIN_REMEMBERED = 4  # shorter "secrets" would mask ordinary words and digits everywhere

_lock = threading.Lock()
_remembered: set[str] = set()

# scheme://userinfo@host...: the userinfo's password (after the first ':') up to the last '@' of the
# authority; and a URL anywhere in a text (up to white space or a quote/bracket).
_URL_START = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>\]\)}]+")
# key=value, key: value, "key": "value", 'key': 'value' where the key's name says secret.
_SECRET_NAME = r"""["']?[A-Za-z0-9_.-]*(?:""" + "|".join(_SECRET_WORDS) + r""")[A-Za-z0-9_.-]*["']?"""
_PAIR = re.compile(r"""(?P<key>""" + _SECRET_NAME + r"""\s*[:=]\s*)(?P<value>"[^"]*"|'[^']*'|[^\s,;&}\]\)]+)""",
                   re.IGNORECASE)


def is_secret_key(name: Any) -> bool:
    """Whether a configuration key or variable name says its value is a secret."""
    lowered = str(name).lower()
    return any(word in lowered for word in _SECRET_WORDS)


def remember_secret(secret: Any) -> None:
    """A secret this process uses (redacted from any text from now on); short or empty ones are not."""
    if isinstance(secret, str) and len(secret) >= _MIN_REMEMBERED:
        with _lock:
            _remembered.add(secret)


@dataclass(frozen=True)
class UrlParts:
    """A URL split at `://` and at the end of its user info (`split_url`); `rest`: hosts, path and query."""

    scheme: str
    userinfo: Optional[str]
    rest: str

    @property
    def password(self) -> Optional[str]:
        """The user info's password as written (quoted), None without one."""
        if self.userinfo is None or ":" not in self.userinfo:
            return None
        return self.userinfo.split(":", 1)[1]

    @property
    def query(self) -> str:
        return self.rest.partition("?")[2]


def split_url(url: str) -> Optional[UrlParts]:
    """`url` split as described in the module docstring; None without `://`."""
    if "://" not in url:
        return None
    scheme, rest = url.split("://", 1)
    at = rest.rfind("@")
    if at >= 0 and not any(c in rest[:at].split(":", 1)[0] for c in "/?#"):
        return UrlParts(scheme, rest[:at], rest[at + 1:])
    return UrlParts(scheme, None, rest)


def _query_secrets(query: str) -> list[str]:
    return [value for name, eq, value in (item.partition("=") for item in query.split("&"))
            if eq and value and is_secret_key(unquote(name))]


def url_secrets(url: str) -> list[str]:
    """Every password `url` carries (user info, secret-named query parameters), as written and unquoted."""
    parts = split_url(url)
    if parts is None:
        return []
    found = [p for p in [parts.password, *_query_secrets(parts.query)] if p]
    return found + [unquote(p) for p in found if unquote(p) != p]


def url_password(url: str) -> str | None:
    """The password a Redis URL carries (user info or `password=` query parameter), None if none."""
    secrets = url_secrets(url)
    return secrets[0] if secrets else None


def remember_url_secrets(url: Any) -> None:
    """Remembers every password of `url` (as written and unquoted) as a secret: redacted from any text."""
    if isinstance(url, str):
        for secret in url_secrets(url):
            remember_secret(secret)


def redact_url(url: str) -> str:
    """`url` with the password of its user info and secret-named query parameters replaced by ***."""
    parts = split_url(url)
    if parts is None:
        return url
    userinfo = parts.userinfo
    if userinfo is not None and parts.password is not None:
        userinfo = f"{userinfo.split(':', 1)[0]}:{MASK}"
    head, question, query = parts.rest.partition("?")
    query = _redact_query(query)
    return (f"{parts.scheme}://" + (f"{userinfo}@" if userinfo is not None else "") + head
            + (f"?{query}" if question else ""))


def _redact_query(query: str) -> str:
    items = []
    for item in query.split("&") if query else ():
        name, eq, value = item.partition("=")
        items.append(f"{name}={MASK}" if eq and value and is_secret_key(unquote(name)) else item)
    return "&".join(items)


def redact_text(text: str) -> str:
    """`text` with every URL redacted, every secret-named pair's value masked and every remembered
    secret replaced by ***."""
    text = _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), str(text))
    text = _PAIR.sub(_mask_pair, text)
    with _lock:
        remembered = sorted(_remembered, key=len, reverse=True)
    for secret in remembered:
        text = text.replace(secret, MASK)
    return text


def _mask_pair(match: re.Match[str]) -> str:
    value = match.group("value")
    quote = value[0] if value[:1] in ("'", '"') else ""
    return f"{match.group('key')}{quote}{MASK}{quote}"


def redact_value(key: Any, value: Any) -> Any:
    """A configuration value of `key` as it may be shown (see the module docstring)."""
    if is_secret_key(key) and value not in (None, "", False):
        return MASK
    if isinstance(value, str):
        # A whole value that is a URL is redacted as one (its password may hold what ends a URL in free text).
        return redact_text(redact_url(value) if _URL_START.match(value) else value)
    if isinstance(value, dict):
        return {k: redact_value(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(key, v) for v in value)
    return value
