"""Fuzzing the lookup channel's wire format (`integration/vllm/lookup.py`): any multipart message a local
peer could send. The server answers every message it can address (an error reply when it refuses one),
never raises, and its thread keeps serving: real lookups succeed after thousands of bad messages."""
from __future__ import annotations

import struct
import tempfile

import numpy as np
import pytest
import zmq
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st

from lmcache_vllm.extra_keys import ExtraKeys, ExtraSpan
from lmcache_vllm.integration.vllm.lookup import (
    _ANSWER,
    _CMD,
    _I64,
    LookupAnswer,
    LookupClient,
    LookupQuery,
    LookupServer,
    lookup_socket_path,
)

pytestmark = pytest.mark.fuzz
MAX_TOKENS = 4096


def like_the_worker(q: LookupQuery) -> LookupAnswer:
    """Answers as the worker does: the chunk-aligned start it was asked about, the tokens it got."""
    start = q.start // 256 * 256
    return LookupAnswer(len(q.token_ids), ("local_cpu",) * ((len(q.token_ids) - start + 255) // 256), start)


BOUNDARY = [0, 1, 255, 256, 999, 1000, 1001, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
VALID_EXTRA = ExtraKeys(b"lora", (ExtraSpan(3, 300, b"image"),)).to_bytes()


@st.composite
def messages(draw):
    """A multipart message from two draws of raw bytes (few draws keep hypothesis fast): mostly a lookup
    request or command with one field wrong, or anything at all."""
    raw = draw(st.binary(min_size=24, max_size=24))
    blob = draw(st.binary(max_size=1600))
    kind, seq_sel, start_sel, tok_sel, extra_sel, drop = raw[0] % 8, raw[1], raw[2], raw[3], raw[4], raw[5]
    seq = raw[8:16] if seq_sel % 8 else raw[8:8 + seq_sel % 12]
    if kind == 0:  # anything: up to 8 frames cut from the blob
        cuts = sorted(raw[16 + i] * 20 % (len(blob) + 1) for i in range(raw[6] % 8))
        return [b"peer"] + [blob[a:b] for a, b in zip([0] + cuts, cuts)]
    if kind == 1:
        name = [b"ok", b"fails", b"huge", b"nope", blob[:8]][raw[7] % 5]
        return [b"peer", seq, _CMD, name]
    start = int.from_bytes(raw[16:24], "little") if start_sel % 4 == 0 else BOUNDARY[start_sel % len(BOUNDARY)]
    tokens = (blob[:len(blob) // 8 * 8] if tok_sel % 8 else
              [blob[:100], bytes(8 * (MAX_TOKENS + 1))][tok_sel // 8 % 2])
    extra = [b"", VALID_EXTRA, blob[:64], VALID_EXTRA[:-1]][extra_sel % 4]
    req = blob[:raw[7] % 40] if raw[7] % 3 == 0 else b"request-1"
    frames = [b"peer", seq, req, struct.pack("<Q", start), tokens, extra]
    if drop % 8 == 0:  # one frame missing
        del frames[1 + drop // 8 % 5]
    return frames


def check_reply(frames: list, reply) -> None:
    if len(frames) < 2:
        assert reply is None
        return
    assert reply is not None and reply[0] == frames[0] and len(reply) == 3
    assert reply[1] == (frames[1] if len(frames[1]) == 8 else b"")
    if len(frames) == 4 and frames[2] == _CMD:  # a command (an error reply -1 when its seq is bad)
        assert len(reply[2]) == _I64.size
    else:
        answer = LookupAnswer.decode(reply[2])
        assert len(reply[2]) >= _ANSWER.size and answer.hit_tokens >= 0


def test_every_message_is_answered_and_the_server_survives():
    base = tempfile.mkdtemp(prefix="lkf")
    commands_ = {"ok": lambda: 1, "fails": lambda: 1 // 0, "huge": lambda: 2**80}
    with bounded_run():
        server = LookupServer(lookup_socket_path("fuzz", 0, base), like_the_worker, max_tokens=MAX_TOKENS,
                              commands=commands_)
        client = LookupClient([server.address], timeout_ms=5000, direct=False)
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        try:
            @examples(2000)
            @given(messages())
            def direct(frames):  # the server's own parsing, as its thread runs it
                check_reply(frames, server._answer(frames))

            @examples(300)
            @given(messages())
            def over_the_socket(frames):  # through ZMQ to the live server thread
                sent = frames[1:] or [b""]  # ZMQ sends at least one frame, and prepends the peer's identity
                raw.send_multipart(sent)
                assert raw.poll(5000), "no reply"
                check_reply([b"peer", *sent], [b"peer", *raw.recv_multipart()])
                assert server._thread.is_alive()

            direct()
            over_the_socket()
            tokens = np.arange(1000, dtype=np.int64)
            assert client.lookup(LookupQuery("r", tokens, 300)) == like_the_worker(LookupQuery("r", tokens, 300))
            assert server._thread.is_alive()
        finally:
            raw.close()
            client.close()
            server.close()
