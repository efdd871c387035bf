"""Fuzz tests (`pytest -m fuzz`) of what others can put in front of P2P, with a real redis-server and sockets:

- the directory: whoever can write that Redis can write any server info and any chunk ids. A lookup and a
  read over such entries answer a prefix (usually nothing) as counted misses, never raise, never hang, and the
  instance still pulls a real peer's chunks afterwards;
- the serving side: any FETCH (random keys, sizes) to a P2P transfer server is answered with well-formed
  replies; the server keeps serving.

Derandomized (tests/fuzzing.py's `ci` profile).
"""
from __future__ import annotations

import socket
import uuid

import p2p_helpers as h
import pytest
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st

from lmcache_vllm.storage.p2p.directory import ServerInfo, chunk_id, chunks_key, info_key, servers_key
from lmcache_vllm.storage.tier import Tier
from lmcache_vllm.storage.transfer import wire
from lmcache_vllm.storage.transfer.server import send_message

pytestmark = pytest.mark.fuzz

SPACE = "m@-@tp1.0@pp1.0@bfloat16@v2"
_value = st.one_of(st.binary(max_size=40), st.sampled_from([b"127.0.0.1", b"1", b"0", b"-1", b"65536", b"9",
                                                            SPACE.encode(), b"", b"\xff\xfe", "é".encode() * 32,
                                                            b"00" * 32, b"99999999999", b"1" + b"0" * 40]))
# (sig and expires: the signature of a keyed fleet's entry and its end; issue 39 #5)
_info = st.dictionaries(st.sampled_from(["host", "port", "instance", "rank", "tp", "spaces", "sig", "expires", "x"]),
                        _value, max_size=9)


@pytest.fixture(scope="module", params=[None, h.S1], ids=["no_key", "key"])
def peers(redis_server, request):
    redis_server.ensure_running()
    prefix = f"fuzz-p2p-{uuid.uuid4().hex[:8]}:"
    keys = [h.key(i) for i in range(3)]
    key = {"chunk_mac_key": request.param} if request.param else {}
    # With a key the real peer MACs each chunk's header on its first send: a loaded machine needs longer than
    # the 0.3 s that makes a dead junk peer cheap (junk entries are not signed: never asked with a key).
    timeout = 2.0 if request.param else 0.3
    with h.manager(redis_server.url, prefix, "real", p2p_lookup_timeout_secs=2.0, **key) as real, \
            h.manager(redis_server.url, prefix, "B", p2p_pull_timeout_secs=timeout, p2p_peer_backoff_secs=0.01,
                      **key) as b:
        h.store(real, keys)
        h.wait_until(lambda: h.entries(redis_server.url, prefix, real) == 3)
        yield redis_server.url, prefix, b, keys


@examples(40)
@given(infos=st.lists(_info, min_size=1, max_size=3), ids=st.lists(st.binary(max_size=12), max_size=4),
       listed=st.booleans())
def test_any_directory_content_is_a_miss_or_a_verified_hit(peers, infos, ids, listed):
    url, prefix, b, keys = peers
    client = h.client(url)
    sids = [f"junk-{uuid.uuid4().hex[:8]}" for _ in infos]
    try:
        with bounded_run():
            for sid, info in zip(sids, infos):
                if info:
                    client.hset(info_key(f"{prefix}p2p:", sid), mapping=info)
                members = list(ids) + ([chunk_id(k) for k in keys] if listed else [])
                if members:
                    client.sadd(chunks_key(f"{prefix}p2p:", sid), *[m or b"\x00" for m in members])
                client.sadd(servers_key(f"{prefix}p2p:"), sid)
            b.l1.clear_sync()
            h.p2p_tier(b).directory._servers_at = -1e9  # see the new entries now
            tiers = b.prefix_tiers(keys)
            assert tiers == [Tier.P2P] * len(tiers)
            values = h.get_all(b, keys)
            assert values == [float(i) for i in range(len(values))]  # whatever came is the real peer's
    finally:
        for sid in sids:
            client.delete(info_key(f"{prefix}p2p:", sid), chunks_key(f"{prefix}p2p:", sid))
            client.srem(servers_key(f"{prefix}p2p:"), sid)
        client.close()
    b.l1.clear_sync()
    h.p2p_tier(b).directory._servers_at = -1e9
    h.wait_until(lambda: h.get_all(b, keys) == [0.0, 1.0, 2.0], what="the real peer after the junk")


@examples(40)
@given(scope=st.one_of(st.just(b"m@-@tp1.0@pp1.0@bfloat16@v2@"), st.binary(max_size=300)),
       suffixes=st.one_of(st.binary(max_size=300), st.lists(st.sampled_from([b"0" * 32, b"1" * 32, b"x"]),
                                                               max_size=8).map(lambda s: b" " + b"".join(s))),
       auth=st.binary(max_size=40))
def test_any_fetch_is_answered_and_the_server_keeps_serving(peers, scope, suffixes, auth):
    url, prefix, b, real_keys = peers
    server = next(s for s in h.servers(url, prefix) if s.startswith("real."))
    client = h.client(url)
    info = ServerInfo.parse(server, client.hgetall(info_key(f"{prefix}p2p:", server)))
    client.close()
    assert info is not None
    with bounded_run(), socket.create_connection((info.host, info.port), timeout=5) as sock:
        # Any scope and suffix parts (protocol 3 keys: a shared scope, then fixed-width suffixes), any MAC.
        parts = [wire.PROTOCOL, wire.FETCH, b"fuzz", scope, suffixes, auth]
        try:
            send_message(sock, parts)
            sock.shutdown(socket.SHUT_WR)  # no more requests: the server answers, then closes
            while sock.recv(1 << 16):
                pass
        except OSError:
            pass  # a malformed request may be dropped
    b.l1.clear_sync()
    assert h.get_all(b, real_keys) == [0.0, 1.0, 2.0]
