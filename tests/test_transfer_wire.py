"""The disaggregated-prefill wire format (`storage/transfer/wire.py`): requests round-trip and carry their MAC;
whatever bytes arrive as a reply — random frames, a valid chunk truncated or with a flipped byte, another
key — decode to a verified chunk or raise one of the two errors the reader counts as a miss, and leave
nothing allocated."""
from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.storage.codec import ChunkMac, CorruptEntry
from lmcache_vllm.storage.transfer import wire

KEY = "m@-@tp1.0@pp1.0@bfloat16@v2@" + "ab" * 16
SHAPE = (2, 2, 16, 64)


@pytest.fixture(scope="module")
def arena():
    alloc = HostAllocator(1 << 22)
    yield alloc
    alloc.close()


def alloc_from(arena):
    return lambda shape, dtype: arena.allocate(shape, dtype)


def valid_reply(tensor: torch.Tensor, mac: ChunkMac | None = None, key: str = KEY) -> list[bytes]:
    return [bytes(f) for f in wire.chunk_reply(0, key, tensor, mac)]


def decode(frames, arena, mac=None, key=KEY):
    return wire.decode_chunk(wire.parse_reply(frames), 0, key, alloc_from(arena), mac)


def test_requests_round_trip_with_their_mac():
    mac = ChunkMac("s")
    key2 = KEY[:-2] + "cd"
    frames = wire.encode_request(wire.PULL, "req-1", [KEY, key2], mac)
    assert frames[3] == KEY[:KEY.rfind("@") + 1].encode()
    assert frames[4] == bytes([32]) + b"ab" * 16 + key2[-32:].encode()  # the width, then the digests
    request = wire.parse_request(frames)
    assert (request.op, request.req_id, request.keys, request.key_count) == (wire.PULL, "req-1", (KEY, key2), 2)
    assert wire.verify_request(request, mac)
    assert not wire.verify_request(request, ChunkMac("other"))
    release = wire.parse_request(wire.encode_request(wire.RELEASE, "req-1"))
    assert release.keys == () and wire.verify_request(release, None) and not wire.verify_request(release, mac)


def test_the_request_mac_covers_each_part_with_its_length():
    """Parts joined with a separator sign the same bytes for requests that split them differently: a MAC made
    for one request id and keys would verify another. Each part is signed with its length."""
    mac = ChunkMac("s")
    one = wire.parse_request(wire.encode_request(wire.PULL, "a|b", ["c@d"], mac))
    other = wire.parse_request(wire.encode_request(wire.PULL, "a", ["b|c@d"], mac))
    swapped = wire.PeerRequest(other.op, other.req_id, other.scope, other.suffixes, one.auth)
    assert not wire.verify_request(swapped, mac)
    moved = wire.PeerRequest(one.op, one.req_id + "@", "", one.suffixes, one.auth)  # the scope into the id
    assert not wire.verify_request(moved, mac)


@pytest.mark.parametrize("keys", [[KEY, KEY + "x"], [KEY, "n" + KEY], [KEY[:-1] + "/"], ["m@" + "a" * 65], []])
def test_keys_a_pull_cannot_carry_are_refused_when_encoded(keys):
    """A PULL's keys share their scope and their suffixes' width (one request's keys always do)."""
    with pytest.raises(wire.PeerProtocolError):
        if not keys:
            raise wire.PeerProtocolError("a PULL without keys")  # encoded fine, refused when parsed
        wire.encode_request(wire.PULL, "r", keys)
    if not keys:
        with pytest.raises(wire.PeerProtocolError):
            wire.parse_request(wire.encode_request(wire.PULL, "r", keys))


V3 = wire.PROTOCOL


@pytest.mark.parametrize("frames", [
    [], [V3], [b"LMVPD2", b"PULL", b"r", b"k", b""], [b"LMVPD2", b"PULL", b"r", b"m@", b"\x01k", b""],
    [V3, b"PULL", b"r", b"m@", b"", b""], [V3, b"PULL", b"", b"m@", b"\x01k", b""],
    [V3, b"PULL", b"r" * 2000, b"m@", b"\x01k", b""], [V3, b"PULL", b"\xc3", b"m@", b"\x01k", b""],
    [V3, b"PULL", b"r", b"m", b"\x01k", b""], [V3, b"PULL", b"r", b"m@", b"\x02abc", b""],
    [V3, b"PULL", b"r", b"m@", b"\x00", b""], [V3, b"PULL", b"r", b"m@", b"\x01@", b""],
    [V3, b"PULL", b"r", b"m@", b"\x01\n", b""], [V3, b"PULL", b"r", b"m@", bytes([65]) + b"a" * 65, b""],
    [V3, b"PULL", b"r", b"m@", b"\x01" + b"a" * (wire.MAX_KEYS + 1), b""], [V3, b"RELEASE", b"r", b"m@", b"", b""],
    [V3, b"NOPE", b"r", b"m@", b"\x01k", b""], [V3, b"PULL", b"r", b"m@", b"\x01k", b"a" * 65]])
def test_malformed_requests_are_refused(frames):
    with pytest.raises(wire.PeerProtocolError):
        wire.parse_request(frames)


def test_a_request_is_bounded_part_by_part_before_its_bytes_are_kept():
    assert wire.MAX_REQUEST_BYTES < 5 << 20  # the largest PULL: MAX_KEYS keys of 64-character digests
    for i, bound in enumerate(wire.REQUEST_BOUNDS):
        lengths = [0] * wire.REQUEST_PARTS
        lengths[i] = bound + 1
        reader = wire.RequestReader()
        with pytest.raises(wire.PeerProtocolError, match=f"part {i}"):
            reader.feed(struct.pack("<I6Q", 6, *lengths))
        assert reader.declared == 0  # nothing was taken for the parts
    reader = wire.RequestReader()
    with pytest.raises(wire.PeerProtocolError, match="5 parts"):
        reader.feed(struct.pack("<I", 5))  # refused before its lengths arrive
    # A valid request fed a byte at a time: never more is wanted than the message has left.
    frames = wire.encode_request(wire.PULL, "r", [KEY], ChunkMac("s"))
    data, reader, parts = wire.frame_bytes(frames), wire.RequestReader(), None
    for i in range(len(data)):
        assert parts is None and reader.want() >= 1
        parts = reader.feed(data[i:i + 1])
    assert parts == frames and reader.declared == sum(len(f) for f in frames)
    with pytest.raises(ValueError):
        reader.feed(b"x")


def test_a_key_mismatch_names_what_differs_never_a_key():
    held = "llama@ab12@tp1.0@pp1.0@bfloat16@v2@" + "cd" * 16
    for asked, says in [(held.replace("tp1.0", "tp2.1"), "differ in: TP size or rank"),
                        (held.replace("ab12", "ef34").replace("llama", "qwen"), "differ in: model, model fingerprint"),
                        (held[:-2] + "00", "other prefix digests"),
                        (held.replace("@v2@", "@v2@g-attn.0@"), "another form")]:
        text = wire.key_mismatch(held, asked)
        assert says in text
        for secret_part in ("cd" * 16, "ab12", "llama", "tp1.0"):
            assert secret_part not in text


def test_a_valid_chunk_decodes_bit_exact(arena, make_chunk):
    tensor = make_chunk(1, SHAPE)
    for mac in (None, ChunkMac("s")):
        obj = decode(valid_reply(tensor, mac), arena, mac)
        assert torch.equal(obj.tensor, tensor)
        obj.ref_down()
    assert arena.used_bytes == 0


def test_every_truncation_and_every_flipped_byte_is_rejected(arena, make_chunk):
    tensor = make_chunk(2, (1, 2, 4, 16))  # small: every position is tried
    frames = valid_reply(tensor, ChunkMac("s"))
    header, payload = frames[3], frames[4]
    for cut in range(len(header)):
        with pytest.raises((CorruptEntry, wire.PeerProtocolError)):
            decode(frames[:3] + [header[:cut], payload], arena, ChunkMac("s"))
    for cut in range(len(payload)):
        with pytest.raises((CorruptEntry, wire.PeerProtocolError)):
            decode(frames[:4] + [payload[:cut]], arena, ChunkMac("s"))
    for part in (3, 4):
        for pos in range(len(frames[part])):
            bad = bytearray(frames[part])
            bad[pos] ^= 0x01
            mutated = list(frames)
            mutated[part] = bytes(bad)
            with pytest.raises((CorruptEntry, wire.PeerProtocolError)):
                decode(mutated, arena, ChunkMac("s"))
    assert arena.used_bytes == 0


def test_a_chunk_under_another_key_or_out_of_order_is_rejected(arena, make_chunk):
    tensor = make_chunk(3, SHAPE)
    with pytest.raises(CorruptEntry):
        decode(valid_reply(tensor, key=KEY.replace("tp1.0", "tp2.0")), arena)
    with pytest.raises(wire.PeerProtocolError):
        wire.decode_chunk(wire.parse_reply(valid_reply(tensor)), 1, KEY, alloc_from(arena))
    assert arena.used_bytes == 0


def test_no_memory_is_none_not_an_error(make_chunk):
    tensor = make_chunk(4, SHAPE)
    assert wire.decode_chunk(wire.parse_reply(valid_reply(tensor)), 0, KEY, lambda s, d: None) is None


_frame = st.one_of(st.binary(max_size=96), st.sampled_from([b"LMVPD2", b"CHUNK", b"END", b"ERR",
                                                             b"\x00\x00\x00\x00", b"\x01\x00\x00\x00"]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=st.lists(_frame, max_size=7))
def test_random_replies_never_raise_anything_else(arena, frames):
    try:
        reply = wire.parse_reply(frames)
        if reply.kind == wire.CHUNK:
            obj = wire.decode_chunk(reply, 0, KEY, alloc_from(arena))
            if obj is not None:
                obj.ref_down()
    except (CorruptEntry, wire.PeerProtocolError):
        pass
    assert arena.used_bytes == 0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_valid_chunks_with_random_damage_are_rejected_or_exact(arena, data):
    tensor = torch.arange(2 * 2 * 8 * 16, dtype=torch.float32).reshape(2, 2, 8, 16).to(torch.bfloat16)
    frames = valid_reply(tensor)
    part = data.draw(st.sampled_from([3, 4]))
    raw = bytearray(frames[part])
    start = data.draw(st.integers(0, len(raw)))
    end = data.draw(st.integers(start, len(raw)))
    raw[start:end] = data.draw(st.binary(max_size=end - start + 8))
    frames[part] = bytes(raw)
    try:
        obj = decode(frames, arena)
    except (CorruptEntry, wire.PeerProtocolError):
        assert arena.used_bytes == 0
        return
    assert torch.equal(obj.tensor, tensor)  # only an unchanged chunk gets through
    obj.ref_down()
