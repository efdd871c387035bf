"""The wire format between a decode instance (D) pulling a request's KV and the transfer server of the
prefill instance (P) holding it (docs/DISAGGREGATED.md). Messages of a few parts on a TCP connection D opens;
no pickle, every field checked; the chunks themselves are our codec's header + payload, verified like a disk
file or a Redis value.

On the stream a message is `u32 LE part count, u64 LE length of each part, the parts` (`frame`,
`parse_lengths`): D learns a payload's length and the chunk's header before the payload's first byte, so it
receives the payload straight into its L1 arena (one kernel copy, as a raw socket copy makes), and a length
is checked against its part's bound before anything is read or allocated.

Requests (D -> P):

    [PROTOCOL, b"PULL",    request id (UTF-8), keys (UTF-8, joined by "\\n"), auth]
    [PROTOCOL, b"RELEASE", request id (UTF-8), b"",                          auth]
    [PROTOCOL, b"FETCH",   puller id (UTF-8),  keys (UTF-8, joined by "\\n"), auth]   P2P: by key from L1

A FETCH (P2P, `transfer/keyed.py`) is answered like a PULL from what the serving instance's L1 holds of the
keys, with no hold to name or release.

`auth` is b"" without a MAC secret, else the keyed BLAKE3 (`codec.ChunkMac`) of the other frames: with
`extra_config.chunk_mac_key` set, a transfer server answers only peers that share the secret.

Replies to a PULL (P -> D, on the same connection), in this order:

    [PROTOCOL, b"CHUNK", index u32 LE, codec header, payload]   one per key, from key 0, no gap
    [PROTOCOL, b"END",   count u32 LE]                          no more chunks: `count` were sent
    [PROTOCOL, b"ERR",   code (ASCII), detail (UTF-8)]           none (more) will come; see `ERRORS`

P sends the longest prefix of the asked keys it holds, then END; what it does not hold D recomputes.
"""
from __future__ import annotations

import hmac
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from lmcache_vllm.storage import codec
from lmcache_vllm.storage.codec import ChunkMac, CorruptEntry

if TYPE_CHECKING:  # the API server imports this through pd/params.py: it must not load the cache's memory
    from lmcache_vllm.memory import MemoryObj

PROTOCOL = b"LMVPD2"
PROTOCOL_VERSION = 2  # the number in kv_transfer_params; bump with PROTOCOL (2: TCP stream, was ZMQ)
PULL, RELEASE, FETCH = b"PULL", b"RELEASE", b"FETCH"
CHUNK, END, ERR = b"CHUNK", b"END", b"ERR"
# Error codes of ERR replies.
ERRORS = {
    b"unknown": "the prefill instance holds nothing for this request (never held, released or restarted)",
    b"expired": "the prefill instance's hold expired before the pull (extra_config.pd_hold_secs)",
    b"keys": "the prefill instance holds this request under other keys (model, TP size or rank, chunk "
             "size or stored format differ)",
    b"auth": "the request's MAC did not verify (extra_config.chunk_mac_key differs)",
    b"bad_request": "the prefill instance could not parse the request",
}
MAX_KEYS = 1 << 16  # keys in one PULL (a 16M-token prompt in 256-token chunks)
MAX_REQ_ID = 1024  # bytes
MAX_REQUEST_BYTES = 32 << 20  # one request a transfer server accepts (all its parts)
MAX_PARTS = 8  # parts of one message (the longest, CHUNK, has 5)
MAX_SMALL_PART = 1 << 17  # any part of a reply but a CHUNK's payload (a codec header is at most 64 KiB)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
COUNT_BYTES = _U32.size


class PeerProtocolError(ValueError):
    """A message that is not a valid message of this protocol (wrong frames, sizes or order)."""


@dataclass(frozen=True)
class PeerRequest:
    op: bytes  # PULL, RELEASE or FETCH
    req_id: str
    keys: tuple[str, ...]
    auth: bytes


@dataclass(frozen=True)
class PeerReply:
    kind: bytes  # CHUNK, END or ERR
    index: int = 0  # CHUNK: the key's index; END: the number of chunks sent
    header: bytes | memoryview = b""  # CHUNK
    payload: bytes | memoryview = b""  # CHUNK
    code: str = ""  # ERR
    detail: str = ""  # ERR


def frame(parts: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """A message as it goes on the stream: its prefix (part count and lengths), then the parts as they are
    (a payload stays a zero-copy view)."""
    lengths = b"".join(_U64.pack(memoryview(p).nbytes) for p in parts)
    return [_U32.pack(len(parts)) + lengths, *parts]


def frame_bytes(parts: Sequence[bytes | memoryview]) -> bytes:
    """`frame` joined into one buffer (small messages: requests, and replies in tests)."""
    return b"".join(bytes(p) for p in frame(parts))


def part_count(prefix: bytes | bytearray | memoryview) -> int:
    """The part count of a message from its first `COUNT_BYTES`; `PeerProtocolError` out of bounds."""
    (count,) = _U32.unpack(prefix)
    if not 1 <= count <= MAX_PARTS:
        raise PeerProtocolError(f"a message of {count} parts")
    return int(count)


def parse_lengths(buf: bytes | bytearray | memoryview, count: int, budget: int) -> list[int]:
    """The `count` part lengths of a message (`8 * count` bytes); their sum must stay within `budget`."""
    lengths = [int(_U64.unpack_from(buf, 8 * i)[0]) for i in range(count)]
    if sum(lengths) > budget:
        raise PeerProtocolError(f"a message of {sum(lengths)} bytes (at most {budget})")
    return lengths


def _signed(op: bytes, req_id: bytes, keys: bytes) -> bytes:
    return b"|".join((PROTOCOL, op, req_id, keys))


def request_auth(mac: Optional[ChunkMac], op: bytes, req_id: bytes, keys: bytes) -> bytes:
    return b"" if mac is None else mac.compute(_signed(op, req_id, keys), b"")


def encode_request(op: bytes, req_id: str, keys: Sequence[str] = (), mac: Optional[ChunkMac] = None) -> list[bytes]:
    rid = req_id.encode("utf-8")
    blob = "\n".join(keys).encode("utf-8")
    return [PROTOCOL, op, rid, blob, request_auth(mac, op, rid, blob)]


def parse_request(frames: Sequence[Any]) -> PeerRequest:  # bytes or memoryview parts
    """A request as the server received it (without the ROUTER's identity frame)."""
    parts = [bytes(f) for f in frames]
    if len(parts) != 5 or parts[0] != PROTOCOL or parts[1] not in (PULL, RELEASE, FETCH):
        raise PeerProtocolError(f"not a request of {PROTOCOL!r} ({len(parts)} frames)")
    _, op, rid, blob, auth = parts
    if not rid or len(rid) > MAX_REQ_ID:
        raise PeerProtocolError(f"request id of {len(rid)} bytes")
    try:
        req_id = rid.decode("utf-8")
        keys = tuple(blob.decode("utf-8").split("\n")) if blob else ()
    except UnicodeDecodeError:
        raise PeerProtocolError("request id or keys are not UTF-8") from None
    if len(keys) > MAX_KEYS or any(not k or len(k) > codec.MAX_KEY_BYTES for k in keys):
        raise PeerProtocolError(f"{len(keys)} keys, or an empty or oversized one")
    if op in (PULL, FETCH) and not keys:
        raise PeerProtocolError(f"a {op.decode()} without keys")
    return PeerRequest(op, req_id, keys, auth)


def verify_request(request: PeerRequest, mac: Optional[ChunkMac]) -> bool:
    """Whether the request carries our MAC (always true without a secret)."""
    if mac is None:
        return True
    blob = "\n".join(request.keys).encode("utf-8")
    expected = request_auth(mac, request.op, request.req_id.encode("utf-8"), blob)
    return hmac.compare_digest(expected, request.auth)


def chunk_header(key: str, tensor: torch.Tensor, mac: Optional[ChunkMac] = None) -> bytes:
    """The header a CHUNK message carries for `tensor` under `key` (its checksum is a pass over the bytes:
    a prefill instance makes it when it fills a hold, so that a pull only sends)."""
    return codec.encode_header(key, tensor, mac=mac)


def chunk_reply(index: int, key: str, tensor: torch.Tensor, mac: Optional[ChunkMac] = None,
                header: Optional[bytes] = None) -> list[bytes | memoryview]:
    """The CHUNK message of one held chunk; its last frame is a zero-copy view of the tensor's bytes."""
    if header is None:
        header = chunk_header(key, tensor, mac)
    return [PROTOCOL, CHUNK, _U32.pack(index), header, codec.payload_view(tensor)]


def end_reply(count: int) -> list[bytes]:
    return [PROTOCOL, END, _U32.pack(count)]


def error_reply(code: bytes, detail: str = "") -> list[bytes]:
    return [PROTOCOL, ERR, code, detail.encode("utf-8")[:4096]]


def _buffer(frame: Any) -> bytes | memoryview:
    """A part's bytes without a copy."""
    return frame if isinstance(frame, (bytes, memoryview)) else memoryview(frame)


def parse_reply(frames: Sequence[Any]) -> PeerReply:
    """One reply message as D received it; `PeerProtocolError` for anything else."""
    parts = [_buffer(f) for f in frames]
    if len(parts) < 3 or bytes(parts[0]) != PROTOCOL:
        raise PeerProtocolError(f"not a reply of {PROTOCOL!r} ({len(parts)} frames)")
    kind = bytes(parts[1])
    if kind == CHUNK and len(parts) == 5 and len(parts[2]) == _U32.size:
        return PeerReply(CHUNK, _U32.unpack(parts[2])[0], parts[3], parts[4])
    if kind == END and len(parts) == 3 and len(parts[2]) == _U32.size:
        return PeerReply(END, _U32.unpack(parts[2])[0])
    if kind == ERR and len(parts) == 4 and len(parts[2]) <= 64:
        return PeerReply(ERR, code=bytes(parts[2]).decode("ascii", "replace"),
                         detail=bytes(parts[3]).decode("utf-8", "replace")[:4096])
    raise PeerProtocolError(f"malformed {kind[:16]!r} reply ({len(parts)} frames)")


def check_chunk(reply: PeerReply, expected_index: int, expected_key: str, payload_len: int) -> codec.ChunkHeader:
    """The checked header of a CHUNK reply, before its payload is read: the index D expects next, D's own key
    for it, the header's checksum and length, shape against the payload's length. `CorruptEntry` or
    `PeerProtocolError` for anything wrong."""
    if reply.kind != CHUNK or reply.index != expected_index:
        raise PeerProtocolError(f"expected chunk {expected_index}, got {reply.kind!r} {reply.index}")
    header = codec.parse_header(reply.header, expected_key)
    if len(reply.header) != header.header_len:
        raise CorruptEntry(f"header part has {len(reply.header)} bytes, header says {header.header_len}")
    if payload_len != header.payload_len:
        raise CorruptEntry(f"payload has {payload_len} bytes, header says {header.payload_len}")
    return header


def decode_chunk(reply: PeerReply, expected_index: int, expected_key: str,
                 alloc: Callable[[tuple[int, ...], torch.dtype], Optional[MemoryObj]],
                 mac: Optional[ChunkMac] = None) -> Optional[MemoryObj]:
    """The chunk of a CHUNK reply whose payload is in hand: `check_chunk`, then the payload copied into memory
    from `alloc` and checked (checksums, MAC) as the decode instance does with a payload it receives straight
    into memory. None when `alloc` has no memory; `CorruptEntry` (or `PeerProtocolError`) for anything wrong,
    with nothing left allocated."""
    header = check_chunk(reply, expected_index, expected_key, memoryview(reply.payload).nbytes)
    return codec.alloc_and_fill(header, reply.payload, alloc, mac)


__all__ = ["PROTOCOL", "PROTOCOL_VERSION", "PULL", "RELEASE", "FETCH", "CHUNK", "END", "ERR", "ERRORS", "MAX_KEYS",
           "MAX_PARTS", "MAX_SMALL_PART", "COUNT_BYTES", "frame", "frame_bytes", "part_count", "parse_lengths",
           "PeerProtocolError", "PeerRequest", "PeerReply", "CorruptEntry", "encode_request", "parse_request",
           "verify_request", "chunk_header", "chunk_reply", "end_reply", "error_reply", "parse_reply", "check_chunk",
           "decode_chunk"]
