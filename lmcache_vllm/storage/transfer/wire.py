"""The wire format between a decode instance (D) pulling a request's KV and the transfer server of the
prefill instance (P) holding it (docs/DISAGGREGATED.md). Messages of a few parts on a TCP connection D opens;
no pickle, every field checked; the chunks themselves are our codec's header + payload, verified like a disk
file or a Redis value.

On the stream a message is `u32 LE part count, u64 LE length of each part, the parts` (`frame`,
`parse_lengths`): D learns a payload's length and the chunk's header before the payload's first byte, so it
receives the payload straight into its L1 arena (one kernel copy, as a raw socket copy makes), and a length
is checked against its part's bound before anything is read or allocated.

Requests (D -> P), of exactly `REQUEST_PARTS` parts:

    [PROTOCOL, b"PULL",    request id (UTF-8), key scope (UTF-8), suffix width u8 + key suffixes, auth]
    [PROTOCOL, b"RELEASE", request id (UTF-8), b"",              b"",                            auth]
    [PROTOCOL, b"FETCH",   puller id (UTF-8),  key scope (UTF-8), suffix width u8 + key suffixes, auth]

A FETCH (P2P, `transfer/keyed.py`) is answered like a PULL from what the serving instance's L1 holds of the
keys, with no hold to name or release.

The keys of one PULL (one request's chunks) share their scope, everything up to and including a key's last
"@" (model, fingerprint, TP/PP size and rank, dtype, format: `tokens.CacheKey`); only their suffixes (the
prefix digests: [0-9A-Za-z_.~-], all of one width up to `MAX_SUFFIX`) differ, so each key costs its digest
on the wire, with no separator to scan for. A PULL is at most `MAX_REQUEST_BYTES` (about 4.2 MB for
`MAX_KEYS` keys), each part bounded on its own (`REQUEST_BOUNDS`) before a byte of it is kept
(`RequestReader`); the server never turns more keys into strings than a hold matches, and refuses a key
named twice.

`auth` is b"" without a MAC secret, else the keyed BLAKE3 (`codec.ChunkMac`) of the other parts, each
preceded by its length (`request_auth`): with `extra_config.chunk_mac_key` set, a transfer server answers
only peers that share the secret, RELEASE included.

Replies to a PULL (P -> D, on the same connection), in this order:

    [PROTOCOL, b"CHUNK", index u32 LE, codec header, payload]   one per key, from key 0, no gap (the payload
                                                                as the header's codec stored it)
    [PROTOCOL, b"END",   count u32 LE]                          no more chunks: `count` were sent
    [PROTOCOL, b"ERR",   code (ASCII), detail (UTF-8)]           none (more) will come; see `ERRORS`

P sends the longest prefix of the asked keys it holds, then END; what it does not hold D recomputes. An
ERR's detail says what the asker can act on and nothing of other requests (no held key: a key mismatch
names the fields of the scope that differ, `key_mismatch`).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import torch

from lmcache_vllm.storage import codec, coders
from lmcache_vllm.storage.codec import ChunkMac, CorruptEntry

if TYPE_CHECKING:  # the API server imports this through pd/params.py: it must not load the cache's memory
    from lmcache_vllm.memory import MemoryObj

PROTOCOL = b"LMVPD3"
PROTOCOL_VERSION = 3  # the number in kv_transfer_params; bump with PROTOCOL (3: key scope + suffixes, a
# length-prefixed request MAC; 2: TCP stream; 1: ZMQ)
PULL, RELEASE, FETCH = b"PULL", b"RELEASE", b"FETCH"
CHUNK, END, ERR = b"CHUNK", b"END", b"ERR"
# Error codes of ERR replies.
ERRORS = {
    b"unknown": "the prefill instance holds nothing for this request (never held, released or restarted)",
    b"expired": "the prefill instance's hold expired before the pull (extra_config.pd_hold_secs)",
    b"keys": "the prefill instance holds this request under other keys (model, TP size or rank, chunk "
             "size or stored format differ)",
    b"full": "the prefill instance did not hold this request: its chunks held for decode instances were at "
             "extra_config.pd_max_held_bytes",
    b"auth": "the request's MAC did not verify (extra_config.chunk_mac_key differs)",
    b"busy": "every connection slot of the prefill instance's transfer server is serving a pull",
    b"bad_request": "the prefill instance could not parse the request",
}
MAX_KEYS = 1 << 16  # keys in one PULL (a 16M-token prompt in 256-token chunks)
MAX_SUFFIX = 64  # characters of a key's suffix (a 256-bit digest in hex)
MAX_SCOPE = codec.MAX_KEY_BYTES - MAX_SUFFIX  # bytes of the scope the keys share
MAX_REQ_ID = 1024  # bytes
MAX_AUTH = 64  # bytes of a request's MAC (BLAKE3: 32)
MAX_PARTS = 8  # parts of one message (the longest, a request, has 6)
REQUEST_PARTS = 6
# Each part of a request at most: protocol, op, request id, scope, suffixes, auth.
REQUEST_BOUNDS = (len(PROTOCOL), len(RELEASE), MAX_REQ_ID, MAX_SCOPE, 1 + MAX_KEYS * MAX_SUFFIX, MAX_AUTH)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
COUNT_BYTES = _U32.size
REQUEST_PREFIX = COUNT_BYTES + _U64.size * REQUEST_PARTS  # a request's part count and lengths
MAX_REQUEST_BYTES = REQUEST_PREFIX + sum(REQUEST_BOUNDS)  # one request, all of it (~4.2 MB)
MAX_SMALL_PART = 1 << 17  # any part of a reply but a CHUNK's payload (a codec header is at most 64 KiB)
_SUFFIX_CHARS = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz_.~-"
# The fields of a key's scope, in `tokens.CacheKey.to_str` order (to say which differ, never their values).
_SCOPE_FIELDS = ("model", "model fingerprint", "TP size or rank", "PP size or rank", "KV dtype", "stored format",
                 "KV cache group")


class PeerProtocolError(ValueError):
    """A message that is not a valid message of this protocol (wrong frames, sizes or order)."""


@dataclass(frozen=True)
class PeerRequest:
    """A request as the server parsed it: the keys stay in their wire form (scope and suffixes), each made
    into a string only when it is reached (`iter_keys`)."""

    op: bytes  # PULL, RELEASE or FETCH
    req_id: str
    scope: str
    suffixes: bytes | bytearray  # checked: the width (1 byte), then `key_count` suffixes of that width
    auth: bytes

    @property
    def key_count(self) -> int:
        return (len(self.suffixes) - 1) // self.suffixes[0] if self.suffixes else 0

    def iter_keys(self) -> Iterator[str]:
        """The keys in order (a PULL can name `MAX_KEYS`: no list of them is made)."""
        if not self.suffixes:
            return
        width = self.suffixes[0]
        for start in range(1, len(self.suffixes), width):
            yield self.scope + self.suffixes[start:start + width].decode("ascii")

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(self.iter_keys())

    @property
    def first_key(self) -> str:
        return next(self.iter_keys(), "")


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


def request_auth(mac: Optional[ChunkMac], op: bytes, req_id: bytes, scope: bytes,
                 suffixes: bytes | bytearray) -> bytes:
    """A request's MAC: over a tag no chunk header starts with and every other part, each preceded by its
    length (no two requests sign the same bytes; the suffixes are hashed where they are, not copied)."""
    if mac is None:
        return b""
    return mac.compute(_request_signed(op, req_id, scope, suffixes), suffixes)


def _request_signed(op: bytes, req_id: bytes, scope: bytes, suffixes: bytes | bytearray) -> bytes:
    fields = (b"lmcache-vllm transfer request", PROTOCOL, op, req_id, scope)
    return b"".join(_U64.pack(len(f)) + f for f in fields) + _U64.pack(len(suffixes))


def split_keys(keys: Sequence[str]) -> tuple[str, bytes]:
    """The scope the keys share and their suffixes as a PULL carries them; `PeerProtocolError` when they do not
    share one, or their suffixes are not of one width and of the characters a PULL can carry."""
    if not keys:
        return "", b""
    scope = keys[0][:keys[0].rfind("@") + 1]
    width = len(keys[0]) - len(scope)
    if any(len(k) != len(scope) + width or not k.startswith(scope) for k in keys):
        raise PeerProtocolError(f"the keys of one PULL share their scope ({scope!r}) and their suffixes' width")
    suffixes = "".join(k[len(scope):] for k in keys).encode("utf-8")
    if not 0 < width <= MAX_SUFFIX or len(keys) > MAX_KEYS or len(scope.encode("utf-8")) > MAX_SCOPE \
            or len(suffixes) != width * len(keys) or suffixes.translate(None, _SUFFIX_CHARS):
        raise PeerProtocolError(f"{len(keys)} keys of scope {scope!r} that a PULL cannot carry")
    return scope, bytes([width]) + suffixes


def encode_request(op: bytes, req_id: str, keys: Sequence[str] = (), mac: Optional[ChunkMac] = None) -> list[bytes]:
    rid = req_id.encode("utf-8")
    scope, suffixes = split_keys(keys)
    scope_bytes = scope.encode("utf-8")
    return [PROTOCOL, op, rid, scope_bytes, suffixes, request_auth(mac, op, rid, scope_bytes, suffixes)]


def _request_part_count(prefix: bytes | bytearray | memoryview) -> int:
    count = part_count(prefix[:COUNT_BYTES])
    if count != REQUEST_PARTS:
        raise PeerProtocolError(f"a request of {count} parts (a request of {PROTOCOL!r} has {REQUEST_PARTS})")
    return count


def request_lengths(prefix: bytes | bytearray | memoryview) -> list[int]:
    """The part lengths of a request from its `REQUEST_PREFIX` bytes, each checked against its part's bound
    (`PeerProtocolError` otherwise): nothing has been read or allocated for a part yet."""
    count = _request_part_count(prefix)
    lengths = [int(_U64.unpack_from(prefix, COUNT_BYTES + 8 * i)[0]) for i in range(count)]
    for i, (n, bound) in enumerate(zip(lengths, REQUEST_BOUNDS)):
        if n > bound:
            raise PeerProtocolError(f"part {i} of a request has {n} bytes (at most {bound})")
    return lengths


class RequestReader:
    """One request read from a stream as its bytes arrive: `buffer()` is where the next bytes go (received
    straight into it: never beyond the message), `advance(n)` says how many came and returns the parts once
    the message is whole (`feed(data)` does both). The part count and each part's length are checked
    (`request_lengths`) before a part's memory is taken; `declared` is then the size of the parts (0 before)."""

    def __init__(self) -> None:
        self._prefix = bytearray(REQUEST_PREFIX)
        self._parts: Optional[list[bytearray]] = None
        self._index = 0  # the part being read
        self._got = 0  # bytes of the prefix, then of the part being read
        self.declared = 0

    @property
    def started(self) -> bool:
        return self._got > 0 or self._parts is not None

    def _current(self) -> bytearray:
        if self._parts is None:
            return self._prefix
        return self._parts[self._index] if self._index < len(self._parts) else bytearray()  # whole: no more

    def want(self) -> int:
        return len(self._current()) - self._got

    def buffer(self) -> memoryview:
        return memoryview(self._current())[self._got:]

    def advance(self, n: int) -> Optional[list[bytearray]]:
        """`PeerProtocolError` for a prefix out of bounds."""
        if not 0 <= n <= self.want():
            raise ValueError(f"{n} bytes received, {self.want()} wanted")
        self._got += n
        if self._parts is None:
            if self._got >= COUNT_BYTES:
                _request_part_count(self._prefix)  # a wrong count is refused before its lengths arrive
            if self._got < REQUEST_PREFIX:
                return None
            lengths = request_lengths(self._prefix)
            self._parts, self._got, self.declared = [bytearray(n) for n in lengths], 0, sum(lengths)
        while self._index < len(self._parts) and self._got == len(self._parts[self._index]):
            self._index, self._got = self._index + 1, 0
        return self._parts if self._index == len(self._parts) else None

    def feed(self, data: bytes) -> Optional[list[bytearray]]:
        if len(data) > self.want():
            raise ValueError(f"{len(data)} bytes fed, {self.want()} wanted")
        self.buffer()[:len(data)] = data
        return self.advance(len(data))


def parse_request(frames: Sequence[Any]) -> PeerRequest:  # bytes, bytearray or memoryview parts
    """A request from its parts; `PeerProtocolError` for anything but a well-formed one."""
    if len(frames) != REQUEST_PARTS:
        raise PeerProtocolError(f"not a request of {PROTOCOL!r} ({len(frames)} parts)")
    protocol, op, rid, scope, auth = (bytes(frames[i]) for i in (0, 1, 2, 3, 5))
    suffixes = frames[4] if isinstance(frames[4], (bytes, bytearray)) else bytes(frames[4])
    if protocol != PROTOCOL or op not in (PULL, RELEASE, FETCH):
        raise PeerProtocolError(f"not a request of {PROTOCOL!r}")
    if not rid or len(rid) > MAX_REQ_ID or len(scope) > MAX_SCOPE or len(auth) > MAX_AUTH:
        raise PeerProtocolError(f"request id of {len(rid)} bytes, scope of {len(scope)} or MAC of {len(auth)}")
    try:
        req_id, scope_text = rid.decode("utf-8"), scope.decode("utf-8")
    except UnicodeDecodeError:
        raise PeerProtocolError("request id or key scope is not UTF-8") from None
    if scope_text and not scope_text.endswith("@"):
        raise PeerProtocolError("a key scope that does not end where a key's suffix begins")
    if suffixes:
        width, count = suffixes[0], len(suffixes) - 1
        others = suffixes.translate(None, _SUFFIX_CHARS)  # the width byte, or nothing if it is one of them
        if not 0 < width <= MAX_SUFFIX or count % width or not 0 < count // width <= MAX_KEYS \
                or others not in (b"", suffixes[:1]):
            raise PeerProtocolError(f"key suffixes of width {width} in {count} bytes, or of other characters")
    if op in (PULL, FETCH) and not suffixes:
        raise PeerProtocolError(f"a {op.decode()} without keys")
    if op == RELEASE and (scope or suffixes):
        raise PeerProtocolError("a RELEASE with keys")
    return PeerRequest(op, req_id, scope_text, suffixes, auth)


def verify_request(request: PeerRequest, mac: Optional[ChunkMac]) -> bool:
    """Whether the request carries our MAC (always true without a secret)."""
    if mac is None:
        return True
    signed = _request_signed(request.op, request.req_id.encode("utf-8"), request.scope.encode("utf-8"),
                             request.suffixes)
    return mac.verify(signed, request.suffixes, request.auth)


def key_mismatch(held_key: str, asked_key: str) -> str:
    """What differs between a key a hold has and one a PULL asked for, without either key's values: the
    scope's fields that differ (`_SCOPE_FIELDS`), or the digests alone (another prompt or chunk size)."""
    held, asked = held_key.split("@"), asked_key.split("@")
    if held[:-1] == asked[:-1]:
        return "the same model and layout, other prefix digests (another prompt, chunk size or hash algorithm)"
    if len(held) != len(asked):
        return "keys of another form (a KV cache group, or another key format)"
    differ = [_SCOPE_FIELDS[i] if i < len(_SCOPE_FIELDS) else f"field {i}"
              for i, (h, a) in enumerate(zip(held[:-1], asked[:-1])) if h != a]
    return "keys that differ in: " + ", ".join(differ)


def chunk_header(key: str, tensor: torch.Tensor, mac: Optional[ChunkMac] = None) -> bytes:
    """The header a CHUNK message carries for `tensor` under `key` (its checksum is a pass over the bytes:
    a prefill instance makes it when it fills a hold, so that a pull only sends)."""
    return codec.encode_header(key, tensor, mac=mac)


def chunk_parts(key: str, tensor: torch.Tensor, mac: Optional[ChunkMac] = None, coder: str = coders.NAIVE
                ) -> tuple[bytes, Optional[codec.ChunkBytes]]:
    """(header, coded payload) of a chunk sent with `coder` (or its fallbacks): the payload None when naive
    (the tensor's bytes are sent as they are: `chunk_reply`). Made where nothing waits for it (a hold's fill)."""
    parts = codec.encode_parts(key, tensor, mac, coder=coder)
    return parts.header, (parts.payload if parts.coder != coders.NAIVE else None)


def chunk_reply(index: int, key: str, tensor: torch.Tensor, mac: Optional[ChunkMac] = None,
                header: Optional[bytes] = None, payload: Optional[codec.ChunkBytes] = None
                ) -> list[bytes | memoryview]:
    """The CHUNK message of one held chunk; its last frame is a zero-copy view of the tensor's bytes, or the
    coded `payload` its `header` was made for."""
    if header is None:
        header = chunk_header(key, tensor, mac)
    body = memoryview(payload).cast("B") if payload is not None else codec.payload_view(tensor)
    return [PROTOCOL, CHUNK, _U32.pack(index), header, body]


def end_reply(count: int) -> list[bytes]:
    return [PROTOCOL, END, _U32.pack(count)]


def error_reply(code: bytes, detail: str = "") -> list[bytes]:
    if code not in ERRORS:
        raise ValueError(f"unknown error code {code!r}")
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
           "MAX_SUFFIX", "MAX_SCOPE", "MAX_PARTS", "MAX_REQUEST_BYTES", "MAX_SMALL_PART", "REQUEST_PARTS",
           "REQUEST_BOUNDS", "REQUEST_PREFIX", "COUNT_BYTES", "frame", "frame_bytes", "part_count", "parse_lengths",
           "PeerProtocolError", "PeerRequest", "PeerReply", "CorruptEntry", "RequestReader", "request_lengths",
           "split_keys", "encode_request", "parse_request", "verify_request", "key_mismatch", "chunk_header",
           "chunk_parts", "chunk_reply", "end_reply", "error_reply", "parse_reply", "check_chunk", "decode_chunk"]
