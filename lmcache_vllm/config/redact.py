"""Secrets kept out of logs, error messages, reprs and the CLI's output: the one place that redacts them.

Secrets of ours: a password in `remote_url` (`redis://user:PASSWORD@host` or `?password=PASSWORD`) and the
chunk MAC secret (`extra_config.chunk_mac_key`, `LMCACHE_VLLM_CHUNK_MAC_KEY`). Everything that shows a
configuration value, a URL or an exception's text goes through here:

- `redact_url(url)`: the URL with the password of its user info and every secret-named query parameter
  replaced by `***` (user names, hosts and databases stay: they are what one debugs with).
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
from typing import Any
from urllib.parse import parse_qsl, urlsplit

MASK = "***"
_SECRET_WORDS = ("password", "passwd", "secret", "token", "mac_key", "api_key", "apikey", "credential")
_MIN_REMEMBERED = 4  # shorter "secrets" would mask ordinary words and digits everywhere

_lock = threading.Lock()
_remembered: set[str] = set()

# scheme://userinfo@host...: the userinfo's password (after the first ':') up to the last '@' of the
# authority; and a URL anywhere in a text (up to white space or a quote/bracket).
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


def url_password(url: str) -> str | None:
    """The password a Redis URL carries (user info or `password=` query parameter), None if none."""
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return None
    if password:
        return password
    return next((v for k, v in parse_qsl(parts.query, keep_blank_values=True) if is_secret_key(k) and v), None)


def redact_url(url: str) -> str:
    """`url` with the password of its user info and secret-named query parameters replaced by ***."""
    if "://" not in url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:  # not parseable as a URL (e.g. a bad port): mask what looks like user info
        return re.sub(r"(://[^/@:]*:)[^/]*@", lambda m: m.group(1) + MASK + "@", url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{host}"
    query = _redact_query(parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    # Joined by hand: urlunsplit would drop the empty authority of unix:///path.
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def _redact_query(query: str) -> str:
    items = []
    for item in query.split("&") if query else ():
        name, eq, value = item.partition("=")
        items.append(f"{name}={MASK}" if eq and value and is_secret_key(name) else item)
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
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_value(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(key, v) for v in value)
    return value
