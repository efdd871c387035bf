"""The byte format of a KV chunk outside process memory (disk files, Redis values, the transfer wire):
header + payload, the payload as one of the coders of `coders.py` wrote it.

Layout (little-endian):

    fixed part  magic b"LMCV" | format u16 | dtype code u16 | key length u32 | ndim u32 |
                header length u32 | payload length u64 | payload xxh3_64 u64 | MAC 32 bytes |
                [format 3: coder u8 | coder argument u8 | reserved u16 (0)] | header xxh32 u32
    key         UTF-8 bytes of the key string
    shape       ndim x u64 (the decoded tensor's, whatever the coder)
    padding     zeros up to `header length` (disk files pad to 4 KiB so payloads start page-aligned)
    payload     `payload length` stored bytes: the tensor's bytes in C order (`naive`), or its coder's

Format 3 names the payload's coder; format 2 (every chunk of earlier builds) is a `naive` chunk. Both are read;
a `naive` chunk is still written as format 2, byte for byte what earlier builds wrote and read, so instances of
both share a tier; only a coded chunk needs format 3 (an earlier build takes it for another format). Each coder
bounds the stored length it accepts for the header's shape (`PayloadCoder.stored_size_ok`) before anything is
read or allocated. The header checksum covers the header; the payload checksum (xxh3_64, ~19 GB/s on one core
here) the stored bytes. Decoding checks magic, format, dtype, key, coder, shape against the payload length, both
checksums and the bytes present, then decodes; any mismatch (a coded payload that does not decode included)
raises `CorruptEntry`, which callers turn into a miss plus removal of the entry. Nothing is unpickled.

One entry point for every tier: `encode(key, tensor, mac, coder=...)` (one buffer: Redis and tiers like it)
or `encode_parts` (header and payload apart: disk files, the wire), and `decode` / `decode_payload_into`,
which read every coder. A tier only chooses the coder's name (`coders.CODER_NAMES`); `fp8` falls back to
`lossless` for chunks it does not apply to, `lossless` to `naive` when it would not shrink a chunk.

Keyed MAC (optional, `ChunkMac`): a checksum only catches accidents; anyone who can write to a shared
Redis or disk directory can plant a chunk that validates. With a secret configured
(`extra_config.chunk_mac_key` or the `LMCACHE_VLLM_CHUNK_MAC_KEY` environment variable), writers fill
the MAC field with keyed BLAKE3 (key derived from the secret) over the header, MAC field zeroed, and
the stored payload; readers with a secret reject (`UnauthenticatedEntry`, a `CorruptEntry`: a counted miss,
the entry is deleted) any chunk whose MAC does not verify, all-zero MACs of writers without a secret
included. Readers without a secret ignore the field. Format-1 entries (before the field) are not read.

A reader that knows which shape and dtype each key's chunk must have (the engine does: `chunk_shape(T)` of
its layout and the KV dtype) hands the tiers an `ExpectedAlloc`; every tier allocates through `allocate`,
which refuses a header claiming anything else (`CorruptEntry`) before a byte is allocated, so a planted
header cannot make a read allocate more than the chunk it stands for (and evict L1 to find room).

`decode_into` copies a payload into a preallocated tensor with `ctypes.memmove` (a coded one: its coder
decodes it there) without the GIL, so decoding on a worker thread overlaps the event loop's socket reads;
`payload_view` exposes a tensor's bytes so readers (`os.preadv`) fill a `MemoryObj` without an intermediate
buffer (a coded payload is read into one of its own first, `payload_buffer`).
"""

from __future__ import annotations

import ctypes
import hmac
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import xxhash

from lmcache_vllm.config.redact import remember_secret
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.coders import BY_CODE, CODERS, NAIVE, BadPayload, PayloadCoder, encode_payload

if TYPE_CHECKING:
    from lmcache_vllm.memory import AllocFn, MemoryObj

# A chunk's bytes as the tiers hand them over (Redis values, file reads, views of a tensor).
ChunkBytes = Union[bytes, bytearray, memoryview]

MAGIC = b"LMCV"
# Format 2: naive chunks, as every earlier build wrote and reads them; also the "stored format" in chunk keys
# (`tokens.CacheKey`: what a decoded chunk holds, the same whatever its coder, so old files keep their keys).
FORMAT_VERSION = 2
CODED_FORMAT_VERSION = 3  # a chunk whose header names its coder (lossless, fp8)
READABLE_FORMATS = (FORMAT_VERSION, CODED_FORMAT_VERSION)
MAC_SIZE = 32
_NO_MAC = bytes(MAC_SIZE)
# magic, fmt, dtype, key_len, ndim, header_len, payload_len, xxh3, MAC (+ format 3: coder, argument, reserved)
_FIXED2 = struct.Struct(f"<4sHHIIIQQ{MAC_SIZE}s")
_CODER = struct.Struct("<BBH")
_FIXED = {FORMAT_VERSION: _FIXED2, CODED_FORMAT_VERSION: struct.Struct(f"<4sHHIIIQQ{MAC_SIZE}sBBH")}
_MAC_OFFSET = _FIXED2.size - MAC_SIZE
_HEADER_SUM = struct.Struct("<I")
FIXED_SIZE = _FIXED2.size + _HEADER_SUM.size  # of a format-2 header (a format-3 one: + _CODER.size)
# A key longer than this is refused on encode and treated as corrupt on decode (bounds header reads).
MAX_KEY_BYTES = 4096
MAX_NDIM = 8
# Readers fetch this many bytes first; every header with key <= MAX_KEY_BYTES fits.
MAX_HEADER_SIZE = FIXED_SIZE + _CODER.size + MAX_KEY_BYTES + 8 * MAX_NDIM
# Bounds on what a header may claim, checked before any of it is used (a header with a recomputed
# checksum is anyone's to write on a shared tier): padding up to 64 KiB (disk files pad to 4 KiB), each
# dimension below 2**31, and a payload of at most 64 GiB (a chunk of 256 tokens of a 400B model is
# ~130 MB). A claim beyond them is `CorruptEntry`, never an allocation of what it says.
MAX_HEADER_LEN = 1 << 16
MAX_DIM = (1 << 31) - 1
MAX_PAYLOAD_BYTES = 1 << 36

# Stable codes: never renumber, only append.
_DTYPE_CODES = {
    torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
    torch.uint8: 5, torch.int8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9,
}
for _name, _code in (("float8_e4m3fn", 10), ("float8_e5m2", 11), ("float8_e4m3fnuz", 12),
                     ("float8_e5m2fnuz", 13)):
    if hasattr(torch, _name):
        _DTYPE_CODES[getattr(torch, _name)] = _code
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}


ChunkSpec = tuple[tuple[int, ...], torch.dtype]  # the shape and dtype of the chunk a key must hold


@dataclass(frozen=True)
class ExpectedAlloc:
    """An allocation function (`alloc(shape, dtype)`) that also knows the `ChunkSpec` of each key a read may
    return (`expected`): `allocate` refuses any other before it allocates."""

    alloc: AllocFn
    expected: Mapping[str, ChunkSpec]

    def __call__(self, shape: tuple[int, ...], dtype: torch.dtype) -> Optional[MemoryObj]:
        return self.alloc(shape, dtype)


class CorruptEntry(ValueError):
    """Stored bytes are not a valid chunk for the expected key (bad header, checksum, or truncated)."""


class UnauthenticatedEntry(CorruptEntry):
    """A chunk whose keyed MAC does not verify (written without our secret, or altered)."""


class ChunkMac:
    """Keyed BLAKE3 over a chunk's header (MAC field zeroed) and payload. `secret`: one secret, or a list of
    them for a key rotation: chunks and messages are signed with the first, and a MAC of any of them verifies
    (`verify`), so instances with the old and the new key read each other's chunks while a fleet rotates."""

    def __init__(self, secret: str | bytes | Sequence[str | bytes]):
        import blake3

        secrets = [secret] if isinstance(secret, (str, bytes, bytearray)) else list(secret)
        if not secrets:
            raise ValueError("no chunk MAC secret")
        self._blake3 = blake3.blake3
        self._keys: list[bytes] = []
        self.key_ids: list[str] = []  # safe to show (in logs): names which secret, reveals nothing of it
        for one in secrets:
            material = one.encode() if isinstance(one, str) else bytes(one)
            remember_secret(one)  # redacted from any text we show from now on
            if not material:
                raise ValueError("the chunk MAC secret is empty")
            self._keys.append(blake3.blake3(material, derive_key_context="lmcache-vllm 2026 chunk mac v1").digest())
            self.key_ids.append(
                blake3.blake3(material, derive_key_context="lmcache-vllm 2026 chunk mac key id").hexdigest()[:16])
        self._key = self._keys[0]
        self.key_id = self.key_ids[0]  # the signing key's

    def compute(self, signed_header: bytes, payload: ChunkBytes) -> bytes:
        """The MAC with the signing key (the first)."""
        return self._mac(self._key, signed_header, payload)

    def _mac(self, key: bytes, signed_header: bytes, payload: ChunkBytes) -> bytes:
        h = self._blake3(signed_header, key=key)
        h.update(payload)
        return h.digest()

    def verify(self, signed_header: bytes, payload: ChunkBytes, tag: bytes) -> bool:
        """Whether `tag` is the MAC of these bytes with any of the keys (compared as bytes, in constant time;
        a chunk signed with an older key of the list costs one more pass)."""
        if len(tag) != MAC_SIZE:
            return False
        return any(hmac.compare_digest(self._mac(key, signed_header, payload), tag) for key in self._keys)


@dataclass(frozen=True)
class ChunkHeader:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    header_len: int
    payload_len: int  # stored bytes (the coded payload)
    checksum: int
    mac: bytes = _NO_MAC
    signed_header: bytes = b""  # the header bytes the MAC covers (fixed part with the MAC zeroed + body)
    coder: int = 0  # `coders.PayloadCoder.code` of the payload (format 2: naive)
    coder_arg: int = 0

    @property
    def coded(self) -> bool:
        """Whether the payload is not the tensor's bytes themselves (it is decoded, not copied)."""
        return self.coder != 0

    @property
    def coder_name(self) -> str:
        return BY_CODE[self.coder].name


@dataclass(frozen=True)
class Encoded:
    """A chunk ready to store: its header and its payload (a view of the tensor's bytes when naive)."""

    header: bytes
    payload: ChunkBytes
    coder: str

    @property
    def nbytes(self) -> int:
        return len(self.header) + memoryview(self.payload).nbytes


def payload_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (no copy)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("codec works on contiguous CPU tensors")
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def payload_buffer(nbytes: int) -> memoryview:
    """An uninitialised writable buffer of `nbytes` (a coded payload read apart from its tensor)."""
    return np.empty(nbytes, dtype=np.uint8).data.cast("B")


def checksum(data: ChunkBytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment if alignment > 1 else n


def header_size(key: str, ndim: int, align: int = 1, coded: bool = False) -> int:
    """Bytes `encode_header` produces for this key and number of dimensions (`coded`: a format-3 header)."""
    return _align_up(FIXED_SIZE + (_CODER.size if coded else 0) + len(key.encode("utf-8")) + 8 * ndim, align)


def encode_header(key: str, tensor: torch.Tensor, *, align: int = 1,
                  payload_checksum: Optional[int] = None, mac: Optional[ChunkMac] = None,
                  stored: Optional[tuple[PayloadCoder, int, ChunkBytes]] = None) -> bytes:
    """Header for `tensor` stored under `key`, padded to a multiple of `align` bytes; with `mac`, its MAC
    field authenticates header and payload. `stored`: the payload as `encode_payload` made it (None: naive,
    the tensor's bytes)."""
    if tensor.dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype {tensor.dtype} has no stored-format code")
    key_bytes = key.encode("utf-8")
    if len(key_bytes) > MAX_KEY_BYTES:
        raise ValueError(f"key is {len(key_bytes)} bytes, more than {MAX_KEY_BYTES}")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"tensor has {tensor.dim()} dims, more than {MAX_NDIM}")
    coder, arg, payload = stored if stored is not None else (CODERS[NAIVE], 0, payload_view(tensor))
    raw_len = tensor.numel() * tensor.element_size()
    if raw_len > MAX_PAYLOAD_BYTES or any(dim > MAX_DIM for dim in tensor.shape):
        raise ValueError(f"tensor {tuple(tensor.shape)} is beyond what a reader accepts "
                         f"({MAX_PAYLOAD_BYTES} bytes, dimensions up to {MAX_DIM})")
    nbytes = memoryview(payload).nbytes
    if payload_checksum is None:
        payload_checksum = checksum(payload)
    shape = tuple(tensor.shape)
    body = key_bytes + struct.pack(f"<{len(shape)}Q", *shape)
    fmt = CODED_FORMAT_VERSION if coder.code else FORMAT_VERSION
    extra = (coder.code, arg, 0) if coder.code else ()
    header_len = _align_up(_FIXED[fmt].size + _HEADER_SUM.size + len(body), align)
    fields = (MAGIC, fmt, _DTYPE_CODES[tensor.dtype], len(key_bytes), len(shape), header_len, nbytes,
              payload_checksum)
    fixed = _FIXED[fmt].pack(*fields, _NO_MAC, *extra)
    if mac is not None:
        fixed = _FIXED[fmt].pack(*fields, mac.compute(fixed + body, payload), *extra)
    header_sum = xxhash.xxh32_intdigest(fixed + body)
    header = fixed + _HEADER_SUM.pack(header_sum) + body
    return header + bytes(header_len - len(header))


def encode_parts(key: str, tensor: torch.Tensor, mac: Optional[ChunkMac] = None, *, coder: str = NAIVE,
                 align: int = 1) -> Encoded:
    """Header and payload of `tensor` under `key` with `coder` (or its fallbacks), apart: for writers that
    send them with one `writev` (disk files, the wire). A naive payload is a view of the tensor's bytes."""
    stored = encode_payload(tensor, coder)
    return Encoded(encode_header(key, tensor, align=align, mac=mac, stored=stored), stored[2], stored[0].name)


def encode(key: str, tensor: torch.Tensor, mac: Optional[ChunkMac] = None, *, coder: str = NAIVE) -> memoryview:
    """Header + payload in one buffer (one copy of the payload; for stores that take a single value, e.g.
    Redis), coded with `coder` (or its fallbacks). The payload is copied with `ctypes.memmove` into an
    uninitialised buffer, without the GIL."""
    parts = encode_parts(key, tensor, mac, coder=coder)
    payload = memoryview(parts.payload).cast("B")
    out = np.empty(len(parts.header) + payload.nbytes, dtype=np.uint8)
    out[:len(parts.header)] = np.frombuffer(parts.header, dtype=np.uint8)
    if payload.nbytes:
        src = np.frombuffer(payload, dtype=np.uint8)
        ctypes.memmove(out.ctypes.data + len(parts.header), src.ctypes.data, payload.nbytes)
    return out.data


def read_format_version(buf: ChunkBytes) -> Optional[int]:
    """The format version of a chunk's bytes when they start with our magic, else None."""
    if len(buf) < 6 or bytes(buf[:4]) != MAGIC:
        return None
    version: int = struct.unpack_from("<H", buf, 4)[0]
    return version


def parse_header(buf: ChunkBytes, expected_key: Optional[str] = None) -> ChunkHeader:
    """Parses and checks the header at the start of `buf` (which may hold more bytes after it)."""
    view = memoryview(buf).cast("B") if not isinstance(buf, (bytes, bytearray)) else buf
    if len(view) < FIXED_SIZE:
        raise CorruptEntry(f"{len(view)} bytes: shorter than a chunk header")
    fmt = read_format_version(view)
    if fmt not in _FIXED:
        raise CorruptEntry(f"bad magic or stored format version {fmt}: this build reads {READABLE_FORMATS}")
    fixed_struct = _FIXED[fmt]
    if len(view) < fixed_struct.size + _HEADER_SUM.size:
        raise CorruptEntry(f"{len(view)} bytes: shorter than a chunk header")
    magic, _, dtype_code, key_len, ndim, header_len, payload_len, payload_sum, mac, *extra = \
        fixed_struct.unpack_from(view, 0)
    coder_code, coder_arg, reserved = extra if extra else (0, 0, 0)
    if key_len > MAX_KEY_BYTES or ndim > MAX_NDIM or header_len > MAX_HEADER_LEN \
            or payload_len > MAX_PAYLOAD_BYTES:
        raise CorruptEntry(f"implausible header (key length {key_len}, ndim {ndim}, header length "
                           f"{header_len}, payload length {payload_len})")
    body_start = fixed_struct.size + _HEADER_SUM.size
    body_end = body_start + key_len + 8 * ndim
    if header_len < body_end or len(view) < body_end:
        raise CorruptEntry("truncated chunk header")
    (header_sum,) = _HEADER_SUM.unpack_from(view, fixed_struct.size)
    body = bytes(view[body_start:body_end])
    fixed = bytes(view[:fixed_struct.size])
    if xxhash.xxh32_intdigest(fixed + body) != header_sum:
        raise CorruptEntry("header checksum mismatch")
    dtype = _CODE_DTYPES.get(dtype_code)
    if dtype is None:
        raise CorruptEntry(f"unknown dtype code {dtype_code}")
    coder = BY_CODE.get(coder_code)
    if coder is None or reserved or (fmt == CODED_FORMAT_VERSION and not coder_code):
        raise CorruptEntry(f"unknown chunk coder {coder_code} (reserved field {reserved})")
    try:
        key = body[:key_len].decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptEntry("key is not UTF-8") from None
    if expected_key is not None and key != expected_key:
        raise CorruptEntry(f"entry holds key {key!r}, expected {expected_key!r}")
    shape = struct.unpack_from(f"<{ndim}Q", body, key_len)
    if any(dim > MAX_DIM for dim in shape) or math.prod(shape) * dtype.itemsize > MAX_PAYLOAD_BYTES:
        raise CorruptEntry(f"implausible shape {shape}")
    if not coder.stored_size_ok(coder_arg, tuple(shape), dtype, payload_len):
        raise CorruptEntry(f"shape {shape} x {dtype} does not match a {coder.name} payload of {payload_len} "
                           f"bytes (argument {coder_arg})")
    signed = fixed[:_MAC_OFFSET] + _NO_MAC + fixed[_FIXED2.size:] + body
    return ChunkHeader(key, dtype, tuple(shape), header_len, payload_len, payload_sum, mac, signed,
                       coder_code, coder_arg)


def check_size(header: ChunkHeader, size: int) -> None:
    """An entry of `size` bytes whose header is `header` must be exactly header + payload: fewer is a
    truncated entry, more a padded one (`CorruptEntry`)."""
    if size != header.header_len + header.payload_len:
        raise CorruptEntry(f"{size} bytes, header says {header.header_len + header.payload_len}"
                           " (truncated or padded)")


def verify_payload(header: ChunkHeader, payload: ChunkBytes, mac: Optional[ChunkMac] = None) -> None:
    """Checks a (stored) payload's length and checksum against its header and, with `mac`, the header's MAC."""
    if len(payload) != header.payload_len:
        raise CorruptEntry(f"payload has {len(payload)} bytes, header says {header.payload_len}")
    if checksum(payload) != header.checksum:
        raise CorruptEntry(f"payload checksum mismatch for {header.key!r}")
    if mac is not None and not mac.verify(header.signed_header, payload, header.mac):
        metrics.inc("unauthenticated_chunks")
        raise UnauthenticatedEntry(f"chunk {header.key!r} has no valid MAC for our secret")


def verify_stored(header: ChunkHeader, payload: ChunkBytes) -> None:
    """What a read checks of a payload, for tools that only inspect: checksum, and that a coded one decodes."""
    verify_payload(header, payload)
    if header.coded:
        decode_stored(header, payload, torch.empty(header.shape, dtype=header.dtype))


def decode_stored(header: ChunkHeader, stored: ChunkBytes, out: torch.Tensor) -> None:
    """Decodes a checked coded payload into `out` (`CorruptEntry` when it does not decode)."""
    try:
        BY_CODE[header.coder].decode_into(stored, header.coder_arg, out)
    except BadPayload as exc:
        raise CorruptEntry(f"{header.coder_name} payload of {header.key!r}: {exc}") from None


def decode_into(buf: ChunkBytes, header: ChunkHeader, out: torch.Tensor, mac: Optional[ChunkMac] = None) -> None:
    """Copies (or decodes) and checks the payload of `buf` (header + payload) into the preallocated `out`."""
    view = memoryview(buf).cast("B")
    decode_payload_into(view[header.header_len:], header, out, mac)


def decode_payload_into(payload: ChunkBytes, header: ChunkHeader, out: torch.Tensor,
                        mac: Optional[ChunkMac] = None) -> None:
    """Copies (or decodes) and checks a payload that arrived apart from its header (a network frame) into
    `out`. A naive payload is copied first and checked in place; a coded one is checked, then decoded."""
    if tuple(out.shape) != header.shape or out.dtype != header.dtype:
        raise ValueError(f"destination is {tuple(out.shape)}/{out.dtype}, chunk is "
                         f"{header.shape}/{header.dtype}")
    view = memoryview(payload).cast("B")
    if len(view) != header.payload_len:
        raise CorruptEntry(f"payload has {len(view)} bytes, header says {header.payload_len}")
    if header.coded:
        verify_payload(header, view, mac)
        decode_stored(header, view, out)
        return
    dest = payload_view(out)
    if header.payload_len:
        # numpy only supplies the source address (any buffer, read-only included); `src` keeps it alive.
        src = np.frombuffer(view, dtype=np.uint8, count=header.payload_len)
        ctypes.memmove(out.data_ptr(), src.ctypes.data, header.payload_len)
    verify_payload(header, dest, mac)


def decode(buf: ChunkBytes, expected_key: Optional[str],
           alloc: AllocFn, mac: Optional[ChunkMac] = None) -> Optional[MemoryObj]:
    """Parses `buf`, allocates with `alloc(shape, dtype)` (a MemoryObj or None) and fills it.

    Returns the MemoryObj, or None when `alloc` could not provide memory. The object is released again
    if the bytes turn out to be corrupt (then `CorruptEntry` propagates)."""
    header = parse_header(buf, expected_key)
    check_size(header, len(buf))
    return alloc_and_fill(header, memoryview(buf).cast("B")[header.header_len:], alloc, mac)


def allocate(header: ChunkHeader, alloc: AllocFn) -> Optional[MemoryObj]:
    """Memory from `alloc` for the chunk `header` describes (None: no memory). With an `ExpectedAlloc`, a
    header whose shape or dtype is not the one its key's chunk must have is `CorruptEntry`, before anything
    is allocated."""
    if isinstance(alloc, ExpectedAlloc):
        spec = alloc.expected.get(header.key)
        if spec is None:
            raise CorruptEntry(f"chunk {header.key!r} was not asked for")
        shape, dtype = tuple(spec[0]), spec[1]
        if header.shape != shape or header.dtype != dtype:
            raise CorruptEntry(f"chunk {header.key!r} claims {header.shape} {header.dtype}; this instance's "
                               f"chunk of that key is {shape} {dtype}")
    return alloc(header.shape, header.dtype)


def alloc_and_fill(header: ChunkHeader, payload: ChunkBytes, alloc: AllocFn,
                   mac: Optional[ChunkMac]) -> Optional[MemoryObj]:
    """A MemoryObj from `alloc` holding `payload`, checked against `header` (None: no memory; `allocate`
    checks it first); released again when the payload is corrupt."""
    obj = allocate(header, alloc)
    if obj is None:
        return None
    try:
        decode_payload_into(payload, header, obj.tensor, mac)
    except BaseException:
        obj.ref_down()
        raise
    return obj
