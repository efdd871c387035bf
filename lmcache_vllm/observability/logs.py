"""What lmcache-vllm writes to the log beyond single events: the start-up line with the resolved
configuration (`describe_config`), and `warn`, one WARNING per *kind* of failure per interval.

A systematic failure (a dead tier, a full arena, a corrupt directory) repeats every step; logging each one,
with a traceback, buries vLLM's own log. `warn(logger, kind, ...)` logs the first occurrence of a kind at
once (its traceback too, when there is one), then counts repeats silently and, at the next occurrence after
`interval` seconds, logs the message once more with how many were left out. The metrics count every one.
It remembers at most `MAX_KINDS` kinds (the least recently logged are forgotten): a kind may carry a
peer's text (an error code), so their number is not ours to bound.

`peer_text(value)` is what any text from the network (a request id, a peer's error detail) becomes before it
goes into a log line: control characters and line breaks escaped, length bounded, so a peer cannot forge
log lines or flood the log.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from lmcache_vllm.config.redact import redact_url

if TYPE_CHECKING:
    from lmcache_vllm.config import LMCacheConfig

DEFAULT_INTERVAL_S = 60.0
MAX_KINDS = 1024  # kinds remembered by `warn`
PEER_TEXT_CHARS = 200  # characters of a peer's text a log line shows

_lock = threading.Lock()
_last: dict[str, float] = {}  # kind -> when it was last logged
_suppressed: dict[str, int] = {}  # kind -> repeats not logged since


def warn(logger: logging.Logger, kind: str, msg: str, *args: object, exc_info: bool = False,
         interval: float = DEFAULT_INTERVAL_S) -> bool:
    """Logs `msg % args` as a WARNING unless `kind` was logged less than `interval` seconds ago;
    the traceback (`exc_info`) only with the first one. Returns whether it logged."""
    now = time.monotonic()
    with _lock:
        last = _last.get(kind)
        if last is not None and now - last < interval:
            _suppressed[kind] = _suppressed.get(kind, 0) + 1
            return False
        first = last is None
        _last.pop(kind, None)  # re-inserted last: `_last` is in order of logging, oldest first
        _last[kind] = now
        left_out = _suppressed.pop(kind, 0)
        while len(_last) > MAX_KINDS:
            oldest = next(iter(_last))
            del _last[oldest]
            _suppressed.pop(oldest, None)
    if left_out and last is not None:  # suppressed ones only follow a logged one
        msg += f" [{left_out} more like this in the last {now - last:.1f}s not logged]"
    logger.warning(msg, *args, exc_info=exc_info and first)
    return True


def peer_text(value: object, limit: int = PEER_TEXT_CHARS) -> str:
    """`value` (text or bytes from the network) as it may appear in a log line: every character that is not
    printable (CR, LF, ESC, Unicode line separators, ...) escaped as Python writes it, at most `limit`
    characters of it shown."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        text = bytes(value[:limit * 4]).decode("utf-8", "backslashreplace")
    else:
        text = str(value)
    cut = len(text) > limit
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return text + "...[cut]" if cut else text


def reset() -> None:
    """Forgets what was logged (tests)."""
    with _lock:
        _last.clear()
        _suppressed.clear()


def _gib(x: float) -> str:
    return f"{x:g} GiB"


def describe_config(config: LMCacheConfig, *, layout: object = None, world_size: int = 1, role: str = "") -> str:
    """One line: tiers and sizes, chunk size, layout, and what is off."""
    extra = config.extra_config
    tiers = []
    if config.local_cpu:
        tiers.append(f"L1 host memory {_gib(config.max_local_cpu_size)} (prefault {extra.prefault_local_cpu})")
    else:
        tiers.append(f"no L1 (staging {_gib(extra.staging_buffer_size)})")
    if config.local_disk:
        tiers.append(f"L2 disk {config.local_disk} {_gib(config.max_local_disk_size)}"
                     f"{' O_DIRECT' if extra.disk_direct_io else ''}{' fsync' if extra.disk_fsync else ''}")
    if config.remote_url:
        tiers.append(f"L3 {redact_url(config.remote_url)} prefix {extra.remote_key_prefix!r}")
    flags = {"layerwise": config.use_layerwise, "async save": extra.async_save and not config.use_layerwise,
             "save_unfull_chunk": config.save_unfull_chunk, "save_decode_cache": config.save_decode_cache,
             "kv events": config.enable_kv_events,
             "reset_lower_tiers": extra.reset_lower_tiers}
    on = [k for k, v in flags.items() if v]
    off = [k for k, v in flags.items() if not v]
    chunk = config.chunk_size if config.chunk_size is not None else "from vLLM's block size"
    parts = [f"chunk_size={chunk}", " + ".join(tiers)]
    if layout is not None:
        parts.append(f"layout {layout}")
    parts.append(f"tp={world_size}")
    if role:
        parts.append(f"role {role}")
    parts.append(f"hash {config.pre_caching_hash_algorithm}")
    parts.append(f"on: {', '.join(on) or '-'}; off: {', '.join(off) or '-'}")
    return "lmcache-vllm: " + ", ".join(parts)

