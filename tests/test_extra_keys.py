"""Tests for lmcache_vllm.extra_keys and the "extras/v1" part of the digest chain in tokens.py."""

import hashlib
import struct

import numpy as np
import pytest

from lmcache_vllm.extra_keys import NO_EXTRA_KEYS, ExtraKeys, ExtraSpan
from lmcache_vllm.tokens import ChunkHasher, KeyBuilder

TOKENS = list(range(100, 110))  # chunk_size 4: chunks [0,4) [4,8) and the partial [8,10)


def test_empty_extra_keys_leave_plain_digests_alone():
    hasher = ChunkHasher(4)
    plain = hasher.digests(TOKENS, include_partial=True)
    assert hasher.digests(TOKENS, include_partial=True, extra=NO_EXTRA_KEYS) == plain
    assert hasher.digests(TOKENS, include_partial=True, extra=ExtraKeys()) == plain
    assert not ExtraKeys() and ExtraKeys().to_bytes() == b""


def test_extras_chain_is_the_documented_scheme():
    # Spelled out with hashlib so the docstring's byte layout is what runs.
    extra = ExtraKeys(b"salt", (ExtraSpan(2, 6, b"img"),))
    h = lambda b: hashlib.sha256(b).digest()  # noqa: E731
    tok = lambda ids: b"".join(i.to_bytes(8, "little", signed=True) for i in ids)  # noqa: E731

    def framed(body: bytes) -> bytes:
        return body + struct.pack("<I", len(body)) + b"LMX1"

    e0 = framed(b"P" + struct.pack("<I", 4) + b"salt" + b"S" + struct.pack("<qqI", 2, 6, 3) + b"img")
    e1 = framed(b"S" + struct.pack("<qqI", -2, 2, 3) + b"img")  # offsets relative to chunk 1's start
    d0 = h(h(b"lmcache-vllm/tokens/v1") + tok(TOKENS[0:4]) + e0)
    d1 = h(d0 + tok(TOKENS[4:8]) + e1)
    d2 = h(d1 + tok(TOKENS[8:10]))  # the span does not reach chunk 2: nothing added there
    assert ChunkHasher(4, "sha256").digests(TOKENS, include_partial=True, extra=extra) == [d0, d1, d2]


def digests(extra, tokens=TOKENS):
    return ChunkHasher(4).digests(tokens, include_partial=True, extra=extra)


def test_prefix_bytes_change_every_chunk_and_only_for_other_bytes():
    plain = digests(None)
    a, b = digests(ExtraKeys(b"tenant-a")), digests(ExtraKeys(b"tenant-b"))
    assert all(x != y for x, y in zip(a, plain)) and all(x != y for x, y in zip(a, b))
    assert digests(ExtraKeys(b"tenant-a")) == a


def test_span_changes_the_chunks_it_overlaps_and_everything_after():
    plain = digests(None)
    in_chunk1 = digests(ExtraKeys(spans=(ExtraSpan(5, 7, b"x"),)))
    assert in_chunk1[0] == plain[0] and in_chunk1[1] != plain[1] and in_chunk1[2] != plain[2]
    # Same item, other data (another image behind the same placeholder tokens): other keys.
    other = digests(ExtraKeys(spans=(ExtraSpan(5, 7, b"y"),)))
    assert other[0] == plain[0] and other[1] != in_chunk1[1]
    # Same data at another position inside the chunk: other keys (the offset is part of the key).
    moved = digests(ExtraKeys(spans=(ExtraSpan(4, 6, b"x"),)))
    assert moved[1] != in_chunk1[1]
    # A span beyond the sequence changes nothing; a prefix of a longer request keeps its keys.
    assert digests(ExtraKeys(spans=(ExtraSpan(20, 30, b"x"),))) == plain
    longer = ChunkHasher(4).digests(TOKENS + [1, 2, 3, 4], extra=ExtraKeys(spans=(ExtraSpan(5, 7, b"x"),)))
    assert longer[:2] == in_chunk1[:2]


def test_no_collision_between_extras_and_more_tokens():
    # A partial chunk plus extra bytes never hashes like a longer plain chunk: the trailer is no token id.
    extra = ExtraKeys(spans=(ExtraSpan(8, 9, b""),))
    with_extra = digests(extra)[2]
    body = b"S" + struct.pack("<qqI", 0, 1, 0)
    framed = body + struct.pack("<I", len(body)) + b"LMX1"
    words = framed + bytes(-len(framed) % 8)
    as_tokens = [int.from_bytes(words[i:i + 8], "little", signed=True) for i in range(0, len(words), 8)]
    assert digests(None, TOKENS + as_tokens)[2] != with_extra
    assert struct.unpack("<q", (struct.pack("<I", 0) + b"LMX1"))[0] > 3 * 10 ** 18


def test_by_chunk_maps_spans_to_every_overlapped_chunk():
    extra = ExtraKeys(b"p", (ExtraSpan(3, 9, b"a"), ExtraSpan(9, 10, b"b")))
    chunks = extra.by_chunk(4, 10)
    assert sorted(chunks) == [0, 1, 2]
    assert b"P" in chunks[0][:1] and chunks[2].count(b"S") == 2
    assert sorted(extra.by_chunk(4, 8)) == [0, 1]  # the last span starts beyond 8 tokens
    assert ExtraKeys(spans=(ExtraSpan(0, 1, b"a"),)).by_chunk(4, 0) == {}


def test_wire_round_trip_and_malformed_input():
    extra = ExtraKeys(b"lora\x00name", (ExtraSpan(0, 576, b"mm" * 20), ExtraSpan(600, 610, b"")))
    wire = extra.to_bytes()
    assert ExtraKeys.from_bytes(wire) == extra
    assert ExtraKeys.from_bytes(b"") == NO_EXTRA_KEYS
    for bad in (b"junk", wire[:-1], wire + b"\x00", b"LMXK\x01" + b"\xff" * 8,
                b"LMXK\x01" + struct.pack("<II", 0, 1) + struct.pack("<qqI", 5, 2, 0)):
        with pytest.raises(ValueError):
            ExtraKeys.from_bytes(bad)


def test_invalid_descriptions_are_rejected():
    for args in ((-1, 3, b""), (3, 3, b""), (0, 2, "text")):
        with pytest.raises(ValueError):
            ExtraSpan(*args)
    with pytest.raises(ValueError):
        ExtraKeys("text")
    with pytest.raises(ValueError):
        ExtraKeys(b"", [ExtraSpan(0, 1, b"")])  # a list is not the canonical (hashable) tuple


def test_key_builder_passes_extras_and_keeps_spans():
    builder = KeyBuilder("m", 1, 0, "bfloat16", 2, ChunkHasher(4))
    tokens = np.arange(10)
    plain = builder.keys(tokens, include_partial=True)
    salted = builder.keys(tokens, include_partial=True, extra=ExtraKeys(b"salt"))
    assert [(s, e) for _, s, e in salted] == [(s, e) for _, s, e in plain]
    assert all(a.digest != b.digest for (a, _, _), (b, _, _) in zip(plain, salted))
