"""Tests for lmcache_vllm.storage.codec: round trips per dtype, and every kind of damage is CorruptEntry."""

import struct

import pytest
import torch
import xxhash

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.codec import CorruptEntry

KEY = "model%2Fx@1@0@bfloat16@v1@00ff"


def _tensor(dtype=torch.bfloat16, shape=(2, 2, 8, 32)):
    return (torch.arange(int(torch.tensor(shape).prod())) % 251).reshape(shape).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                                   torch.float8_e4m3fn])
def test_round_trip_into_allocator_memory(dtype):
    alloc = HostAllocator(1 << 20)
    src = _tensor(dtype)
    buf = codec.encode(KEY, src)
    obj = codec.decode(bytes(buf), KEY, lambda shape, dt: alloc.allocate(shape, dt))
    assert obj.tensor.dtype == dtype and tuple(obj.tensor.shape) == tuple(src.shape)
    assert torch.equal(obj.tensor.view(torch.uint8), src.view(torch.uint8))
    obj.ref_down()
    assert alloc.used_bytes == 0


def test_header_padding_and_parse():
    src = _tensor()
    header = codec.encode_header(KEY, src, align=4096)
    assert len(header) == 4096
    parsed = codec.parse_header(header, KEY)
    assert parsed.header_len == 4096 and parsed.payload_len == src.numel() * 2
    assert parsed.shape == tuple(src.shape) and parsed.dtype == torch.bfloat16


def test_no_pickle_in_format():
    buf = bytes(codec.encode(KEY, _tensor()))
    assert buf.startswith(codec.MAGIC) and b"torch" not in buf[:200]


def test_wrong_key_is_corrupt():
    alloc = HostAllocator(1 << 20)
    with pytest.raises(CorruptEntry, match="expected"):
        codec.decode(bytes(codec.encode(KEY, _tensor())), KEY + "0",
                     lambda shape, dt: alloc.allocate(shape, dt))
    assert alloc.used_bytes == 0


@pytest.mark.parametrize("damage", ["magic", "version", "header_byte", "shape", "payload_byte",
                                    "truncated", "extra", "empty", "garbage"])
def test_damage_is_detected(damage):
    buf = bytearray(codec.encode(KEY, _tensor()))
    hlen = codec.parse_header(buf).header_len
    if damage == "magic":
        buf[0:4] = b"XXXX"
    elif damage == "version":
        struct.pack_into("<H", buf, 4, max(codec.READABLE_FORMATS) + 1)
    elif damage == "header_byte":
        buf[10] ^= 0x01  # key length: the header checksum catches it
    elif damage == "shape":
        buf[hlen - 1] ^= 0x40
    elif damage == "payload_byte":
        buf[hlen + 100] ^= 0x01
    elif damage == "truncated":
        del buf[-1:]
    elif damage == "extra":
        buf += b"\0"
    elif damage == "empty":
        buf = bytearray()
    elif damage == "garbage":
        buf = bytearray(b"hello world, definitely not a chunk" * 10)
    alloc = HostAllocator(1 << 20)
    with pytest.raises(CorruptEntry):
        codec.decode(bytes(buf), KEY, lambda shape, dt: alloc.allocate(shape, dt))
    assert alloc.used_bytes == 0  # the object allocated for a bad payload was released


def test_read_format_version():
    assert codec.read_format_version(bytes(codec.encode(KEY, _tensor()))) == codec.FORMAT_VERSION
    coded = codec.encode(KEY, _tensor(), coder="lossless")
    assert codec.read_format_version(bytes(coded)) == codec.CODED_FORMAT_VERSION
    assert codec.read_format_version(b"nope") is None


def test_unknown_dtype_and_long_key_refused():
    with pytest.raises(ValueError):
        codec.encode_header(KEY, torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(ValueError):
        codec.encode_header("k" * (codec.MAX_KEY_BYTES + 1), _tensor())


def test_keyed_mac_authenticates_header_and_payload():
    mac = codec.ChunkMac("tenant secret")
    tensor = _tensor()
    signed = bytes(codec.encode(KEY, tensor, mac=mac))
    arena = HostAllocator(1 << 20)
    alloc = lambda shape, dtype: arena.allocate(shape, dtype)  # noqa: E731
    for reader_mac in (mac, None):  # a reader without a secret ignores the MAC
        obj = codec.decode(signed, KEY, alloc, mac=reader_mac)
        assert torch.equal(obj.tensor, tensor)
        obj.ref_down()
    unsigned = bytes(codec.encode(KEY, tensor))
    other_secret = bytes(codec.encode(KEY, tensor, mac=codec.ChunkMac("another secret")))
    # A planted chunk with a valid checksum: payload replaced and both checksums recomputed.
    fake = _tensor() + 1
    planted = codec.encode_header(KEY, fake) + bytes(codec.payload_view(fake))
    for bad in (unsigned, other_secret, planted):
        with pytest.raises(codec.UnauthenticatedEntry):
            codec.decode(bad, KEY, alloc, mac=mac)
    assert metrics.value("unauthenticated_chunks") == 3 and arena.used_bytes == 0
    assert mac.key_id == codec.ChunkMac("tenant secret").key_id != codec.ChunkMac("another secret").key_id
    assert "tenant" not in mac.key_id
    with pytest.raises(ValueError):
        codec.ChunkMac("")


def craft_chunk(key: str, shape, *, dtype_code: int = 3, payload: bytes = b"", payload_len=None,
                header_len=None, fmt: int = codec.FORMAT_VERSION, coder: tuple[int, int, int] = (1, 0, 0)) -> bytes:
    """A chunk whose header says what we like, with a correct header checksum (what anyone who can
    write to a shared tier can produce): only the bounds on each field can refuse it. `fmt` 3 (or any
    other but 2) carries `coder` (code, argument, reserved) after the MAC."""
    key_bytes = key.encode()
    body = key_bytes + struct.pack(f"<{len(shape)}Q", *shape)
    extra = struct.pack("<BBH", *coder) if fmt != codec.FORMAT_VERSION else b""
    header_len = codec.FIXED_SIZE + len(extra) + len(body) if header_len is None else header_len
    payload_len = len(payload) if payload_len is None else payload_len
    fixed = struct.pack(f"<4sHHIIIQQ{codec.MAC_SIZE}s", codec.MAGIC, fmt, dtype_code, len(key_bytes),
                        len(shape), header_len, payload_len, codec.checksum(payload), bytes(codec.MAC_SIZE)) + extra
    header = fixed + struct.pack("<I", xxhash.xxh32_intdigest(fixed + body)) + body
    padding = header_len - len(header) if header_len <= 2 * codec.MAX_HEADER_LEN else 0  # (else: cut short)
    return header + bytes(max(0, padding)) + payload


@pytest.mark.parametrize("shape,payload_len", [
    ((0, 2**63), 0),  # zero elements: matches an empty payload, then fails to allocate
    ((2**62, 4), 0),  # product overflows to a multiple of 2**64 in C: must not wrap
    ((2**40, 2**40), 2**81),  # payload length itself out of range (u64 would not hold it)
    ((1 << 20, 1 << 20), 1 << 41),  # 2 TiB: no chunk is that large
])
def test_crafted_header_with_valid_checksum_is_corrupt(shape, payload_len):
    alloc = HostAllocator(1 << 20)
    buf = craft_chunk(KEY, shape, payload_len=payload_len % 2**64)
    with pytest.raises(CorruptEntry):
        codec.decode(buf, KEY, lambda shape, dt: alloc.allocate(shape, dt))
    assert alloc.used_bytes == 0
