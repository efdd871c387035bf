"""Fuzzing the chunk codec (`storage/codec.py`) and the disk tier's chunk reader (`chunk_file.read_chunk`)
with bytes anyone who can write a shared tier could store: crafted headers whose checksum is valid (every
field chosen, out-of-range values included), damaged encodings, and random bytes. Over 10,000 examples
in all. Every decode returns the chunk, None (no memory), or raises CorruptEntry; nothing leaks arena
memory, and a decoded chunk is exactly what its header says."""
from __future__ import annotations

import functools
import struct

import pytest
import torch
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st
from test_storage_codec import KEY, craft_chunk

from lmcache_vllm.memory import AllocationError, HostAllocator
from lmcache_vllm.storage import chunk_file, codec, coders
from lmcache_vllm.storage.codec import CorruptEntry

pytestmark = pytest.mark.fuzz

ARENA = HostAllocator(1 << 20)
MAC = codec.ChunkMac("fuzz secret")
U64 = 2**64 - 1
BOUNDARY_INTS = [0, 1, 2, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, U64]
DTYPE_CODES = sorted(codec._CODE_DTYPES)

def alloc(shape, dtype):
    try:
        return ARENA.allocate(shape, dtype, timeout=0.0)
    except AllocationError:  # as the tiers' allocation does: no memory is None
        return None


def check_decode(buf: bytes, key=KEY, mac=None) -> None:
    """decode must give a chunk matching its header, None, or CorruptEntry; never leak or raise else."""
    before = ARENA.used_bytes
    try:
        obj = codec.decode(buf, key, alloc, mac)
    except CorruptEntry:
        assert ARENA.used_bytes == before
        return
    if obj is None:
        return
    header = codec.parse_header(buf, key)
    assert tuple(obj.tensor.shape) == header.shape and obj.tensor.dtype == header.dtype
    if not header.coded:
        assert bytes(codec.payload_view(obj.tensor)) == bytes(buf[header.header_len:])
    obj.ref_down()
    assert ARENA.used_bytes == before


def _pick(selector: int, raw: int, small: int, valid: int) -> int:
    """A field's value from one selector byte: mostly valid or small, sometimes a boundary or anything."""
    mode = selector % 16
    if mode < 12:
        return valid
    if mode < 14:
        return raw % (small + 1)
    if mode == 14:
        return BOUNDARY_INTS[raw % len(BOUNDARY_INTS)]
    return raw


def _dim(selector: int, raw: int) -> int:
    """A dimension: mostly 1-6; often 0 (a product of 0 hides any other dimension) or a boundary value."""
    mode = selector % 10
    if mode < 5:
        return 1 + raw % 6
    if mode < 7:
        return 0
    if mode < 9:
        return BOUNDARY_INTS[raw % len(BOUNDARY_INTS)]
    return raw


@st.composite
def crafted(draw):
    """A chunk with a valid header checksum and every field chosen from one draw of raw bytes (few draws
    keep hypothesis fast): mostly near a valid chunk, each field sometimes small, a boundary or anything."""
    raw = draw(st.binary(min_size=112, max_size=112))
    words = struct.unpack("<14Q", raw)
    sel = raw[:14]
    ndim = sel[0] % (codec.MAX_NDIM + 3) if sel[1] % 4 == 0 else 1 + sel[0] % 4
    shape = [_dim(sel[2 + i], words[2 + i]) for i in range(ndim)]
    dtype_code = _pick(sel[12], words[0], 2**16 - 1, DTYPE_CODES[words[0] % len(DTYPE_CODES)]) % 2**16
    itemsize = codec._CODE_DTYPES[dtype_code].itemsize if dtype_code in codec._CODE_DTYPES else 1
    numel = 1
    for d in shape:
        numel *= d
    payload_len = _pick(sel[13], words[1], 4096, numel * itemsize) % 2**64
    payload = bytes(min(payload_len, 4096)) if words[12] % 3 else draw(st.binary(max_size=256))
    header_len = None if words[13] % 4 else _pick(sel[10], words[10], 2**16, 4096) % 2**32
    fmt = (codec.FORMAT_VERSION, codec.CODED_FORMAT_VERSION)[words[11] % 2] if words[11] % 16 > 1 else words[11] % 2**16
    key = KEY if words[9] % 8 else draw(st.text(max_size=40))
    # a coded chunk: a coder (mostly a real one), its argument and the reserved field, and a payload of the
    # length its header claims: random bytes for blosc2 and the fp8 decoder to chew on
    coder = (words[8] % 4, (words[8] >> 8) % 8 if words[8] % 3 else 6, 0 if words[8] % 11 else words[8] >> 32 & 0xFFFF)
    if fmt == codec.CODED_FORMAT_VERSION and payload_len <= 4096 and words[12] % 3 == 0:
        payload = draw(st.binary(min_size=payload_len, max_size=payload_len))
    return craft_chunk(key, shape, dtype_code=dtype_code, payload=payload, payload_len=payload_len,
                       header_len=header_len, fmt=fmt, coder=coder)


@examples(6000)
@given(crafted())
def _crafted_headers(buf):
    check_decode(buf)


def test_crafted_headers_with_valid_checksums():
    with bounded_run():
        _crafted_headers()


@functools.cache
def encoded(seed: int, shape: tuple, with_mac: bool, coder: str = "naive") -> bytes:
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randn(shape, generator=gen).to(torch.bfloat16)
    return bytes(codec.encode(KEY, tensor, mac=MAC if with_mac else None, coder=coder))


CODERS = ("naive", "lossless", "fp8")
DAMAGES = ("flip", "set", "insert", "delete", "truncate")
SHAPES = ((2, 2, 8, 16), (1, 64), (3,))


@examples(3000)
@given(st.binary(min_size=5, max_size=17))
def _damaged_encodings(spec):
    """`spec`: which encoding (seed, shape, MAC or not), then 1-4 damages of 4 bytes each (kind, position,
    value): one draw of bytes keeps hypothesis fast."""
    seed, shape, with_mac = spec[0] % 10, SHAPES[spec[0] // 10 % 3], spec[0] >= 128
    mac = MAC if with_mac else None
    original = encoded(seed, shape, with_mac, CODERS[spec[1] % 3])
    buf = bytearray(original)
    for j in range(1, len(spec) - 3, 4):
        kind, where, value = DAMAGES[spec[j] % 5], int.from_bytes(spec[j + 1:j + 3], "little"), spec[j + 3]
        i = where % max(1, len(buf))
        if kind == "flip" and buf:
            buf[i] ^= 1 << (value % 8)
        elif kind == "set" and buf:
            buf[i] = value
        elif kind == "insert":
            buf[i:i] = bytes([value])
        elif kind == "delete" and buf:
            del buf[i]
        elif kind == "truncate":
            del buf[i:]
    if bytes(buf) == original:
        check_decode(original, mac=mac)
        return
    with pytest.raises(CorruptEntry):  # every change is caught: checksums, MAC, lengths
        obj = codec.decode(bytes(buf), KEY, alloc, mac)
        if obj is not None:
            obj.ref_down()
    assert ARENA.used_bytes == 0


def test_damaged_encodings():
    with bounded_run():
        _damaged_encodings()


@examples(1200)
@given(st.binary(min_size=6, max_size=26))
def _damaged_coded_payloads(spec):
    """A coded chunk whose stored payload is damaged (1-5 bytes set, flipped or cut) behind a header rebuilt
    with its checksum (what anyone who writes a shared tier can do): the decoders themselves (blosc2, fp8)
    meet the damage. Each decode gives a chunk of the header's shape, or CorruptEntry; never a crash or a leak."""
    coder = ("lossless", "fp8")[spec[0] % 2]
    shape = ((2, 2, 16, 128), (1, 2, 8, 64), (4, 192))[spec[0] // 2 % 3]
    gen = torch.Generator().manual_seed(spec[1])
    tensor = torch.randn(shape, generator=gen).to(torch.bfloat16)
    original = codec.encode_parts(KEY, tensor, coder=coder)
    stored = bytearray(memoryview(original.payload).cast("B"))
    for j in range(2, len(spec) - 3, 4):
        where = int.from_bytes(spec[j:j + 3], "little") % max(1, 64 if spec[j + 3] % 2 else len(stored))
        if spec[j + 3] % 8 == 7:
            del stored[where:]
        elif stored:
            stored[where % len(stored)] ^= spec[j + 3] | 1
    header = codec.parse_header(original.header, KEY)
    try:
        header_bytes = codec.encode_header(KEY, tensor, stored=(coders.CODERS[coder], header.coder_arg, bytes(stored)))
    except ValueError:
        return
    check_decode(header_bytes + bytes(stored))


def test_damaged_coded_payloads():
    with bounded_run():
        _damaged_coded_payloads()


@examples(1000)
@given(st.one_of(st.binary(max_size=512), st.binary(max_size=64).map(lambda b: codec.MAGIC + b),
                 *(st.binary(max_size=200).map(lambda b, fmt=fmt: codec.MAGIC + struct.pack("<H", fmt) + b)
                   for fmt in codec.READABLE_FORMATS)))
def _random_bytes(buf):
    check_decode(buf)
    check_decode(buf, key=None)


def test_random_bytes():
    with bounded_run():
        _random_bytes()


def test_disk_reader_with_crafted_files(tmp_path):
    path = tmp_path / "chunk.lmc"

    @examples(400)
    @given(crafted())
    def read_back(buf):
        path.write_bytes(buf)
        try:
            obj = chunk_file.read_chunk(str(path), KEY, alloc)
        except CorruptEntry:
            assert ARENA.used_bytes == 0
            return
        if obj is not None:
            obj.ref_down()
        assert ARENA.used_bytes == 0

    with bounded_run():
        read_back()
