"""Chunk coders (`storage/coders.py`) through the codec's one entry point (`storage/codec.py`): every coder
round-trips (lossless exactly, fp8 within e4m3's precision), falls back where it does not apply or pay, the
header names the coder so any reader decodes it without a setting, format-2 chunks of earlier builds still
read (byte for byte what they wrote), and a damaged coded payload (even with a recomputed checksum) is
CorruptEntry with nothing left allocated."""

import math

import pytest
import torch
import xxhash

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.storage import codec, coders
from lmcache_vllm.storage.codec import CorruptEntry

KEY = "m@-@tp1.0@pp1.0@bfloat16@v2@00ff"
# Written by the build before format 3 (main at f7a9968): codec.encode(KEY, GOLDEN_TENSOR), and with
# ChunkMac("golden").
GOLDEN_TENSOR = (torch.arange(16) - 8).reshape(1, 2, 2, 4).to(torch.bfloat16)
GOLDEN = bytes.fromhex(
    "4c4d43560200030020000000040000008800000020000000000000007fd9588839cdeded0000000000000000000000000000"
    "0000000000000000000000000000000000002d54ce9d6d402d407470312e30407070312e304062666c6f6174313640763240"
    "30306666010000000000000002000000000000000200000000000000040000000000000000c1e0c0c0c0a0c080c040c000c0"
    "80bf0000803f004040408040a040c040e040")
GOLDEN_MAC = bytes.fromhex(
    "4c4d43560200030020000000040000008800000020000000000000007fd9588839cdeded84893e0b16cb257a4fea1c903849"
    "0ad69a9a4c15e93b99e92e25deac4a4fe0ea85ed2dae6d402d407470312e30407070312e304062666c6f6174313640763240"
    "30306666010000000000000002000000000000000200000000000000040000000000000000c1e0c0c0c0a0c080c040c000c0"
    "80bf0000803f004040408040a040c040e040")


def kv_like(shape=(4, 2, 32, 128), dtype=torch.bfloat16, seed=0) -> torch.Tensor:
    """Values shaped like KV: per-head scales that differ by orders of magnitude, a few outliers."""
    gen = torch.Generator().manual_seed(seed)
    heads = torch.exp(torch.randn(shape[:-1] + (shape[-1] // 64, 1), generator=gen) * 2)
    values = torch.randn(shape[:-1] + (shape[-1] // 64, 64), generator=gen) * heads
    return values.reshape(shape).to(dtype)


@pytest.fixture
def arena():
    allocator = HostAllocator(8 << 20)
    yield lambda shape, dtype: allocator.allocate(shape, dtype)
    assert allocator.used_bytes == 0


def decoded(buf, arena, key=KEY, mac=None) -> torch.Tensor:
    obj = codec.decode(bytes(buf), key, arena, mac)
    out = obj.tensor.clone()
    obj.ref_down()
    return out


def test_golden_format_2_chunks_of_earlier_builds_read_and_naive_writes_them_unchanged(arena):
    assert torch.equal(decoded(GOLDEN, arena), GOLDEN_TENSOR)
    assert torch.equal(decoded(GOLDEN_MAC, arena, mac=codec.ChunkMac("golden")), GOLDEN_TENSOR)
    assert bytes(codec.encode(KEY, GOLDEN_TENSOR)) == GOLDEN
    assert bytes(codec.encode(KEY, GOLDEN_TENSOR, mac=codec.ChunkMac("golden"))) == GOLDEN_MAC
    assert codec.read_format_version(GOLDEN) == codec.FORMAT_VERSION == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
def test_lossless_is_exact_smaller_and_named_in_the_header(dtype, arena):
    src = kv_like(dtype=torch.float32).to(dtype) if dtype != torch.uint8 else \
        (torch.arange(4 * 2 * 32 * 128) % 7).to(torch.uint8).reshape(4, 2, 32, 128)
    buf = codec.encode(KEY, src, coder="lossless")
    header = codec.parse_header(buf, KEY)
    assert codec.read_format_version(buf) == codec.CODED_FORMAT_VERSION == 3
    assert header.coder_name == "lossless" and header.payload_len < src.numel() * src.element_size()
    assert torch.equal(decoded(buf, arena).view(torch.uint8), src.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_halves_16_bit_kv_within_e4m3_precision(dtype, arena):
    src = kv_like(dtype=dtype)
    buf = codec.encode(KEY, src, coder="fp8")
    header = codec.parse_header(buf, KEY)
    assert header.coder_name == "fp8" and header.coder_arg == 6  # groups of 64 elements: one per head here
    assert header.payload_len == src.numel() + src.numel() // 64
    out = decoded(buf, arena)
    assert out.dtype == dtype and out.shape == src.shape
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (relative), or of its group's scale near 0
    groups, got = src.float().reshape(-1, 64), out.float().reshape(-1, 64)
    scale = groups.abs().amax(dim=1, keepdim=True)
    assert bool(((got - groups).abs() <= groups.abs() / 16 + scale / 448 * 2 ** -6 + 1e-30).all())
    assert not torch.equal(out, src)  # lossy, and says so


def test_fp8_scales_groups_apart_and_keeps_zeros_and_tiny_groups(arena):
    src = torch.zeros(2, 2, 4, 128, dtype=torch.bfloat16)
    src[0, 0, 0, :64] = 24576.0  # 1.5 * 2**14: a huge group beside tiny ones: its scale must not flatten the others
    src[0, 0, 0, 64:] = 1e-3
    src[1, 1, 3, :] = -2.5e-30
    out = decoded(codec.encode(KEY, src, coder="fp8"), arena)
    assert torch.equal(out[0, 0, 0, :64], src[0, 0, 0, :64])  # powers of two times e4m3 values: exact here
    assert torch.allclose(out[0, 0, 0, 64:].float(), src[0, 0, 0, 64:].float(), rtol=1 / 16)
    assert torch.allclose(out[1, 1, 3].float(), src[1, 1, 3].float(), rtol=1 / 16)
    assert not out[0, 1].any()


@pytest.mark.parametrize("width,group", [(128, 64), (576, 64), (80, 16), (96, 32), (112, 16), (6, 2)])
def test_fp8_group_stays_within_a_head_or_mla_part(width, group):
    assert coders.fp8_group(width) == group


@pytest.mark.parametrize("src,coder,expected", [
    (torch.zeros(4, 64, dtype=torch.uint8), "fp8", "lossless"),  # an fp8 KV cache's bytes: lossless
    (torch.full((4, 64), float("inf"), dtype=torch.bfloat16), "fp8", "lossless"),  # not finite: exact
    (torch.zeros(4, 6, dtype=torch.bfloat16), "fp8", "lossless"),  # rows too narrow to scale (groups of 2)
    (torch.randint(0, 256, (64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)),
     "lossless", "naive"),  # random bytes do not shrink
    (torch.zeros(0, 64, dtype=torch.bfloat16), "lossless", "naive"),
])
def test_a_coder_that_does_not_apply_or_pay_falls_back(src, coder, expected, arena):
    buf = codec.encode(KEY, src, coder=coder)
    header = codec.parse_header(buf, KEY)
    assert header.coder_name == expected
    assert codec.read_format_version(buf) == (2 if expected == "naive" else 3)
    if src.numel():
        assert torch.equal(decoded(buf, arena).view(torch.uint8), src.view(torch.uint8))


def test_unknown_coder_is_refused():
    with pytest.raises(ValueError, match="cachegen"):
        codec.encode(KEY, kv_like(), coder="cachegen")


CODER_AT = codec.FIXED_SIZE - 4  # format 3: coder u8, argument u8, reserved u16, then the header checksum


def resum(buf: bytearray, ndim: int = 4) -> None:
    """Recomputes a format-3 header's checksum after an edit (what anyone who writes a shared tier can do)."""
    sum_at = codec.FIXED_SIZE
    key_len = int.from_bytes(buf[8:12], "little")
    body = bytes(buf[sum_at + 4:sum_at + 4 + key_len + 8 * ndim])
    buf[sum_at:sum_at + 4] = xxhash.xxh32_intdigest(bytes(buf[:sum_at]) + body).to_bytes(4, "little")


@pytest.mark.parametrize("coder", ["lossless", "fp8"])
def test_mac_covers_the_coder_fields_and_the_stored_payload(coder, arena):
    mac = codec.ChunkMac("secret")
    src = kv_like()
    buf = bytearray(codec.encode(KEY, src, mac=mac, coder=coder))
    assert decoded(buf, arena, mac=mac).shape == src.shape
    buf[CODER_AT + 2] = 1  # the reserved field: refused as it is
    resum(buf)
    with pytest.raises(CorruptEntry, match="reserved"):
        codec.decode(bytes(buf), KEY, arena, mac)
    if coder == "fp8":
        buf[CODER_AT + 2], buf[CODER_AT + 1] = 0, 5  # another group size that fits no stored length
        resum(buf)
        with pytest.raises(CorruptEntry, match="does not match"):
            codec.decode(bytes(buf), KEY, arena, mac)


@pytest.mark.parametrize("coder", ["lossless", "fp8"])
@pytest.mark.parametrize("damage", ["payload", "payload_with_checksum", "truncated", "coder"])
def test_damaged_coded_chunks_are_corrupt_and_leave_nothing_allocated(coder, damage, arena):
    src = kv_like()
    buf = bytearray(codec.encode(KEY, src, coder=coder))
    header = codec.parse_header(buf, KEY)
    if damage.startswith("payload"):
        stored = bytearray(buf[header.header_len:])
        for i in range(8, len(stored), 97):  # scattered bytes of the stored payload
            stored[i] ^= 0x5A
        head = codec.encode_header(KEY, src, stored=(coders.CODERS[coder], header.coder_arg, bytes(stored))) \
            if damage == "payload_with_checksum" else buf[:header.header_len]
        buf = bytearray(head) + stored
    elif damage == "truncated":
        del buf[-3:]
    else:
        buf[CODER_AT] = 9
        resum(buf)
    if damage == "payload_with_checksum" and coder == "fp8":
        obj = codec.decode(bytes(buf), KEY, arena)  # every fp8 byte is a value: it decodes, to other KV
        assert obj is not None and not torch.equal(obj.tensor, decoded(codec.encode(KEY, src, coder="fp8"), arena))
        obj.ref_down()
        return
    with pytest.raises(CorruptEntry):
        codec.decode(bytes(buf), KEY, arena)


@pytest.mark.parametrize("coder", ["lossless", "fp8"])
def test_header_bounds_the_stored_length_of_each_coder(coder):
    src = kv_like()
    raw = src.numel() * 2
    sizes = {"lossless": (31, raw, raw + 1), "fp8": (raw // 2, src.numel() + src.numel() // 64 + 1)}[coder]
    for stored in sizes:
        header = codec.encode_header(KEY, src, stored=(coders.CODERS[coder], 6 if coder == "fp8" else 0,
                                                        bytes(stored)))
        with pytest.raises(CorruptEntry, match="does not match"):
            codec.parse_header(header, KEY)
    assert math.prod(src.shape) == src.numel()


def test_encode_parts_keeps_a_naive_payload_a_view_of_the_tensor():
    src = kv_like()
    parts = codec.encode_parts(KEY, src, align=4096)
    assert parts.coder == "naive" and len(parts.header) == 4096
    assert memoryview(parts.payload).obj is not None and bytes(parts.payload) == bytes(codec.payload_view(src))
    coded = codec.encode_parts(KEY, src, coder="lossless", align=4096)
    assert coded.coder == "lossless" and len(coded.header) == 4096 == codec.header_size(KEY, 4, 4096, coded=True)
