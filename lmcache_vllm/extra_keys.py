"""`ExtraKeys`: what besides its token ids decides a request's KV, as canonical bytes per chunk.

vLLM serves requests whose KV depends on more than token ids: a LoRA adapter, multimodal items behind
identical placeholder tokens, a per-tenant `cache_salt`, prompt embeddings. The integration layer (which
sees vLLM's `Request`) describes that here without vLLM types; `tokens.ChunkHasher` mixes it into the
prefix-chain digests ("extras/v1", see `tokens.py`):
- `prefix`: request-level bytes (adapter identity, salt), mixed into chunk 0 and so into every chunk;
- `spans`: `ExtraSpan(start, end, data)` tied to token positions [start, end) (a multimodal item, the
  prompt embeddings of a range); each enters every chunk it overlaps, with its offsets relative to that
  chunk's start (the same item at another position gives other keys).

`to_bytes` / `from_bytes` is the pickle-free form that travels in lookup messages; `from_bytes` checks
every length and raises `ValueError` on anything malformed. An empty `ExtraKeys` (plain text) encodes to
b"" and changes no digest.

The request prefix is a run of tagged items (`prefix_item`: tag + u32 length + value): the LoRA adapter's
(`LORA_TAG`), then the cache salt's (`SALT_TAG`). `for_salt(salt)` is what a plain-text request with that
`cache_salt` gets (so a management API resolves tokens to the keys such a request loads), `tenant_of(extra)`
reads the salt back (the tenant a chunk's pins and quota count for).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

EXTRA_KEYS_SCHEME = "extras/v1"
TRAILER = b"LMX1"  # ends every non-empty per-chunk extra; as a little-endian int64 it is no token id
_U32 = struct.Struct("<I")
_SPAN_HEAD = struct.Struct("<qqI")  # start, end, data length
_WIRE_MAGIC = b"LMXK\x01"
MAX_EXTRA_BYTES = 1 << 20  # one request's description; bounds what a lookup message may carry
LORA_TAG = b"lora"
SALT_TAG = b"salt"


@dataclass(frozen=True)
class ExtraSpan:
    """Bytes that decide the KV of token positions [start, end) (and, through the chain, after)."""

    start: int
    end: int
    data: bytes

    def __post_init__(self) -> None:
        if not (isinstance(self.start, int) and isinstance(self.end, int) and 0 <= self.start < self.end):
            raise ValueError(f"ExtraSpan needs 0 <= start < end, got [{self.start!r}, {self.end!r})")
        if not isinstance(self.data, bytes):
            raise ValueError(f"ExtraSpan.data must be bytes, got {type(self.data).__name__}")


@dataclass(frozen=True)
class ExtraKeys:
    """A request's extra keys: `prefix` bytes for chunk 0 and `spans` for the chunks they overlap."""

    prefix: bytes = b""
    spans: tuple[ExtraSpan, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, bytes):
            raise ValueError(f"ExtraKeys.prefix must be bytes, got {type(self.prefix).__name__}")
        if not isinstance(self.spans, tuple) or not all(isinstance(s, ExtraSpan) for s in self.spans):
            raise ValueError("ExtraKeys.spans must be a tuple of ExtraSpan")

    def __bool__(self) -> bool:
        return bool(self.prefix or self.spans)

    def by_chunk(self, chunk_size: int, num_tokens: int) -> dict[int, bytes]:
        """extra(i) of every chunk of a `num_tokens`-long sequence that has one (chunk index -> bytes)."""
        items: dict[int, list[bytes]] = {}
        if self.prefix and num_tokens > 0:
            items[0] = [b"P" + _U32.pack(len(self.prefix)) + self.prefix]
        for span in self.spans:
            if span.start >= num_tokens:
                continue
            last = (min(span.end, num_tokens) - 1) // chunk_size
            for index in range(span.start // chunk_size, last + 1):
                chunk_start = index * chunk_size
                items.setdefault(index, []).append(
                    b"S" + _SPAN_HEAD.pack(span.start - chunk_start, span.end - chunk_start, len(span.data))
                    + span.data)
        out = {}
        for index, parts in items.items():
            body = b"".join(parts)
            out[index] = body + _U32.pack(len(body)) + TRAILER
        return out

    # ------------------------------------------------------------------ wire form (lookup messages)
    def to_bytes(self) -> bytes:
        """b"" for no extra keys, else magic | u32 len + prefix | u32 n | n x (i64 start, i64 end,
        u32 len, data)."""
        if not self:
            return b""
        parts = [_WIRE_MAGIC, _U32.pack(len(self.prefix)), self.prefix, _U32.pack(len(self.spans))]
        for span in self.spans:
            parts.append(_SPAN_HEAD.pack(span.start, span.end, len(span.data)))
            parts.append(span.data)
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, buf: bytes) -> "ExtraKeys":
        if not buf:
            return NO_EXTRA_KEYS
        if len(buf) > MAX_EXTRA_BYTES:
            raise ValueError(f"extra keys of {len(buf)} bytes exceed {MAX_EXTRA_BYTES}")
        view = memoryview(buf)
        if bytes(view[:len(_WIRE_MAGIC)]) != _WIRE_MAGIC:
            raise ValueError("extra keys: bad magic")
        pos = len(_WIRE_MAGIC)

        def take(n: int) -> bytes:
            nonlocal pos
            if n < 0 or pos + n > len(view):
                raise ValueError("extra keys: truncated")
            out = bytes(view[pos:pos + n])
            pos += n
            return out

        prefix = take(_U32.unpack(take(_U32.size))[0])
        count = _U32.unpack(take(_U32.size))[0]
        spans = []
        for _ in range(count):
            start, end, length = _SPAN_HEAD.unpack(take(_SPAN_HEAD.size))
            spans.append(ExtraSpan(start, end, take(length)))
        if pos != len(view):
            raise ValueError(f"extra keys: {len(view) - pos} trailing bytes")
        return cls(prefix, tuple(spans))


NO_EXTRA_KEYS = ExtraKeys()


def prefix_item(tag: bytes, value: bytes) -> bytes:
    """One item of a request prefix (or of a span's data): `tag`, u32 length, `value`."""
    return tag + _U32.pack(len(value)) + value


def for_salt(salt: str) -> ExtraKeys:
    """The extra keys of a plain-text request (no LoRA, no multimodal items) with this `cache_salt`."""
    return ExtraKeys(prefix_item(SALT_TAG, salt.encode("utf-8"))) if salt else NO_EXTRA_KEYS


def tenant_of(extra: ExtraKeys | None) -> str:
    """The `cache_salt` a request's extra keys carry ("" when none): the prefix items are the LoRA adapter's,
    then the salt's."""
    prefix = extra.prefix if extra else b""
    pos = 0
    while pos + len(SALT_TAG) + _U32.size <= len(prefix):
        tag = prefix[pos:pos + len(SALT_TAG)]
        (length,) = _U32.unpack_from(prefix, pos + len(tag))
        start = pos + len(tag) + _U32.size
        if tag == SALT_TAG:
            return prefix[start:start + length].decode("utf-8", "replace")
        if tag != LORA_TAG:
            return ""
        pos = start + length
    return ""
