"""Fuzz tests (`pytest -m fuzz`) of the disaggregated-prefill transfer, over real TCP sockets, both ends:

- the prefill side: whatever reaches a transfer server — framed messages of random parts, valid requests
  damaged anywhere, raw bytes — ends in an answer of the protocol or a counted refusal (`probe`: exactly when
  the bytes call for one), the connection closed, no slot or buffered byte left taken; the server stays up
  and still serves a real pull afterwards with its hold untouched, and every chunk goes back to its arena;
- the decode side: whatever a prefill instance sends back to a PULL — valid chunks, then random messages or
  raw bytes, a damaged or truncated chunk, another key or index, an early END or an ERR, a closed connection
  — `PeerTier.get_many` returns a prefix of verified, bit-exact chunks, counts a pull failure when it is
  short (the rest is recomputed), and leaves nothing allocated.

Derandomized (tests/fuzzing.py's `ci` profile), so CI runs the same examples each time.
"""
from __future__ import annotations

import asyncio
import socket

import pytest
import torch
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st
from test_transfer_server import probe

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.codec import ExpectedAlloc
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.client import PeerSource, PeerTier, send_release
from lmcache_vllm.storage.transfer.holds import PeerHolds
from lmcache_vllm.storage.transfer.server import TransferServer

pytestmark = pytest.mark.fuzz

SHAPE = (2, 2, 8, 16)
FAILURE_REASONS = ("timeout", "unreachable", "refused", "missing", "corrupt", "no_memory")
_TOKENS = [wire.PROTOCOL, wire.PULL, wire.RELEASE, wire.CHUNK, wire.END, wire.ERR, b"", b"\x00\x00\x00\x00",
           b"\x01\x00\x00\x00", b"\xff" * 4, b"probe", b"m@", b"\x01k", b"\x20" + b"ab" * 16]
_frame = st.one_of(st.binary(max_size=64), st.sampled_from(_TOKENS))



def key(i: int) -> str:
    return f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"


def tensor(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


def failures() -> float:
    return sum(metrics.value("pd_pull_failures", reason=r) for r in FAILURE_REASONS)


@examples(500)
@given(frames=st.lists(_frame, max_size=8))
def test_request_parser_takes_any_frames(frames):
    try:
        request = wire.parse_request(frames)
    except wire.PeerProtocolError:
        return
    assert request.op in (wire.PULL, wire.RELEASE) and request.req_id


@st.composite
def _request(draw) -> bytes:
    """A valid request, then perhaps damaged: cut, a byte range replaced, or more bytes after it."""
    op = draw(st.sampled_from([wire.PULL, wire.RELEASE]))
    n = draw(st.integers(1, 4))
    keys = [key(i) for i in range(n)] if op == wire.PULL else []
    raw = bytearray(wire.frame_bytes(wire.encode_request(op, draw(st.sampled_from(["nobody", "x" * 300])), keys)))
    how = draw(st.sampled_from(["as is", "cut", "replace", "append"]))
    if how == "cut":
        del raw[draw(st.integers(0, len(raw) - 1)):]
    elif how == "replace":
        start = draw(st.integers(0, len(raw) - 1))
        end = draw(st.integers(start, min(len(raw), start + 16)))
        raw[start:end] = draw(st.binary(max_size=end - start + 4))
    elif how == "append":
        raw += draw(st.binary(min_size=1, max_size=32))
    return bytes(raw)


def test_transfer_server_answers_any_bytes_or_counts_a_refusal_and_still_serves():
    arena = HostAllocator(1 << 22)
    holds = PeerHolds(60.0)
    server = TransferServer(holds, host="127.0.0.1", port=0, unknown_grace_s=0.02)
    tensors = [tensor(i) for i in range(3)]
    objs = []
    for t in tensors:
        obj = arena.allocate(t.shape, t.dtype)
        obj.tensor.copy_(t)
        objs.append(obj)
    holds.expect("probe-request")
    assert holds.fill("probe-request", [key(i) for i in range(3)], objs)

    @examples(300)
    @given(messages=st.lists(st.one_of(st.lists(_frame, min_size=1, max_size=7).map(wire.frame_bytes),
                                       _request(), st.binary(max_size=64)), min_size=1, max_size=4))
    def send_garbage(messages):
        probe(server.port, b"".join(messages))

    try:
        with bounded_run():
            send_garbage()
        assert len(holds) == 1, "garbage ended the real hold"
        assert server._buffered == 0, "bytes of requests being read stayed reserved"
        # The server still serves the real request, bit-exact.
        got_arena = HostAllocator(1 << 22)
        try:
            tier = PeerTier(PeerSource("127.0.0.1", server.port, "probe-request"), timeout_s=5.0)
            got = asyncio.run(tier.get_many([key(i) for i in range(3)], got_arena.allocate))
            assert all(obj is not None and torch.equal(obj.tensor, t) for obj, t in zip(got, tensors))
            for obj in got:
                obj.ref_down()
            assert got_arena.used_bytes == 0
        finally:
            got_arena.close()
    finally:
        server.close()
        holds.close()
        assert arena.used_bytes == 0  # the hold gave its chunks back
        arena.close()


def _damaged(draw, index: int, t: torch.Tensor) -> bytes:
    """What comes in place of chunk `index`: a message of random parts, raw random bytes, the real chunk with
    some bytes replaced (in its framing, index, header or payload, truncation included), another key or
    index, a valid chunk of the right key claiming another shape or dtype (it must not be allocated), an early
    END, an ERR (with random code and text: logged escaped), or nothing more (the connection closes)."""
    kind = draw(st.sampled_from(["random", "raw", "bytes", "other_key", "other_index", "other_shape", "end", "err",
                                 "err_text", "close"]))
    if kind == "other_shape":
        shape = draw(st.sampled_from([(2, 2, 64, 16), (2, 2, 4, 16), (1, 2, 8, 16), (4, 2, 8, 16)]))
        dtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))
        other = torch.zeros(shape, dtype=dtype) if dtype != t.dtype or shape != SHAPE else t.float()
        return wire.frame_bytes(wire.chunk_reply(index, key(index), other))
    if kind == "err_text":
        # Any code a peer may send, not only ours (`error_reply` builds only known codes).
        code, text = draw(st.binary(max_size=64)), draw(st.text(max_size=64))
        return wire.frame_bytes([wire.PROTOCOL, wire.ERR, code, text.encode("utf-8")])
    if kind == "random":
        return wire.frame_bytes(draw(st.lists(_frame, min_size=1, max_size=7)))
    if kind == "raw":
        return draw(st.binary(min_size=1, max_size=96))
    if kind == "close":
        return b""
    if kind == "other_key":
        return wire.frame_bytes(wire.chunk_reply(index, key(index + 1000), t))
    if kind == "other_index":
        return wire.frame_bytes(wire.chunk_reply(index + draw(st.integers(1, 3)), key(index), t))
    if kind == "end":
        return wire.frame_bytes(wire.end_reply(draw(st.integers(0, 2**32 - 1))))
    if kind == "err":
        return wire.frame_bytes(wire.error_reply(draw(st.sampled_from(list(wire.ERRORS))), "fuzz"))
    raw = bytearray(wire.frame_bytes(wire.chunk_reply(index, key(index), t)))
    start = draw(st.integers(0, len(raw)))
    end = draw(st.integers(start, min(len(raw), start + 64)))
    raw[start:end] = draw(st.binary(max_size=end - start + 4))
    return bytes(raw)


async def _pull_from_scripted_peer(script: list[bytes], n_keys: int, alloc) -> list:
    """A fake prefill instance that answers the PULL with the bytes of `script` (an empty item: it closes the
    connection there), and the decode side's pull."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()

    async def peer():
        conn, _ = await loop.sock_accept(listener)
        with conn:
            await loop.sock_recv(conn, 1 << 16)  # the PULL
            for message in script:
                if not message:
                    return
                try:
                    await loop.sock_sendall(conn, message)
                except OSError:
                    return  # the decode side stopped reading and closed

    try:
        # Every script ends by closing the connection, so no case waits for this bound; it only has to outlast
        # a loaded CI machine's pauses (0.5 s once expired before the peer's first reply: a pull of 0 chunks).
        tier = PeerTier(PeerSource("127.0.0.1", port, "r"), timeout_s=10.0)
        serving = asyncio.ensure_future(peer())
        got = await tier.get_many([key(i) for i in range(n_keys)], alloc)
        await asyncio.wait_for(serving, 5.0)
        return got
    finally:
        listener.close()


def test_decode_side_takes_any_reply_as_verified_chunks_or_a_counted_miss():
    arena = HostAllocator(1 << 22)
    tensors = [tensor(i) for i in range(4)]

    @examples(250)
    @given(data=st.data())
    def pull_once(data):
        metrics.RECORDER.reset()
        n_keys = data.draw(st.integers(1, 4))
        good = data.draw(st.integers(0, n_keys))
        script = [wire.frame_bytes(wire.chunk_reply(i, key(i), tensors[i])) for i in range(good)]
        if good < n_keys or data.draw(st.booleans()):
            script.append(_damaged(data.draw, good, tensors[min(good, n_keys - 1)]))
        # Whatever follows the damage (a correct rest, then END) must not be taken any more.
        script += [wire.frame_bytes(wire.chunk_reply(i, key(i), tensors[i])) for i in range(good + 1, n_keys)]
        script.append(wire.frame_bytes(wire.end_reply(n_keys)))
        asked: list = []

        def allocate(shape, dtype):
            asked.append((tuple(shape), dtype))
            return arena.allocate(shape, dtype)

        expected = ExpectedAlloc(allocate, {key(i): (SHAPE, torch.bfloat16) for i in range(n_keys)})
        got = asyncio.run(_pull_from_scripted_peer(script, n_keys, expected))
        assert len(got) == n_keys
        n_got = next((i for i, obj in enumerate(got) if obj is None), n_keys)
        assert all(obj is None for obj in got[n_got:]), "chunks after a gap"
        assert n_got >= good
        for obj, t in zip(got[:n_got], tensors):
            assert torch.equal(obj.tensor, t), "a chunk that is not bit-exact got through"
            obj.ref_down()
        if n_got < n_keys:
            assert failures() == 1, "a short pull was not counted"
        assert arena.used_bytes == 0
        # Nothing but the expected chunk was ever allocated: a header alone cannot take more of the arena.
        assert all(a == (SHAPE, torch.bfloat16) for a in asked), asked

    # The release thread is one daemon for the process, started at its first RELEASE: not a thread a pull
    # leaves behind (without this the test failed when run alone).
    send_release(PeerSource("127.0.0.1", 9, "warm-up"))
    try:
        with bounded_run():
            pull_once()
    finally:
        arena.close()

