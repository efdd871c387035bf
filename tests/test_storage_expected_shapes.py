"""A chunk's header alone must not make a read allocate: every tier (a prefill instance's transfer server, disk,
Redis) checks the header's shape and dtype against the chunk the key must hold before anything is allocated,
so a planted or forged header (right key, valid checksums, a shape 64 times too large) is a corrupt entry,
not an allocation that evicts L1 (issue 30 #6). A chunk of the wrong shape that reached L1 anyway is dropped
from it, not left as its key's most recently used entry (issue 30 #11)."""
from __future__ import annotations

import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.chunk_file import HEADER_ALIGN, filename_for
from lmcache_vllm.storage.codec import ExpectedAlloc
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.transfer.client import PeerSource, PeerTier

CHUNK = (2, 2, 16, 64)  # 8 KiB of bf16: what the key must hold
HUGE = (2, 2, 1024, 64)  # what a forged header claims: 64x that
SPEC = (CHUNK, torch.bfloat16)
MiB = 1 << 20


def key(i: int) -> str:
    return f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"


def config(extra: dict | None = None, **kw) -> LMCacheConfig:
    return LMCacheConfig(max_local_cpu_size=16 * MiB / (1 << 30), blocking_timeout_secs=5.0,
                         extra_config={"close_drain_secs": 1.0, **(extra or {})}, **kw)


class SpyAlloc:
    """The manager's L1 allocation, recording every shape asked for."""

    def __init__(self, mgr: StorageManager):
        self.shapes: list[tuple[int, ...]] = []
        self._inner = mgr.l1.try_allocate
        mgr.l1.try_allocate = self  # type: ignore[method-assign]

    def __call__(self, shape, dtype):
        self.shapes.append(tuple(shape))
        return self._inner(shape, dtype)


def test_a_disk_file_claiming_another_shape_allocates_nothing_and_is_dropped(tmp_path, make_chunk):
    huge = make_chunk(1, HUGE)
    header = codec.encode_header(key(0), huge, align=HEADER_ALIGN)  # valid checksums, the right key
    (tmp_path / filename_for(key(0))).write_bytes(header + codec.payload_view(huge).tobytes())
    with StorageManager(config(local_disk=str(tmp_path), max_local_disk_size=0.01)) as mgr:
        spy = SpyAlloc(mgr)
        assert mgr.get([key(0)], expected=[SPEC]) == []
        assert spy.shapes == []  # refused on its header
        assert not (tmp_path / filename_for(key(0))).exists()  # corrupt: removed
    assert metrics.value("corrupt_chunks", tier="local_disk") == 1


def test_a_redis_value_claiming_another_shape_allocates_nothing(redis_server, redis_prefix, make_chunk):
    import redis

    url = redis_server.url
    huge = make_chunk(2, HUGE)
    client = redis.Redis.from_url(url)
    try:
        client.set(f"{redis_prefix}{key(0)}", bytes(codec.encode(key(0), huge)))
    finally:
        client.close()
    with StorageManager(config({"remote_key_prefix": redis_prefix}, remote_url=url)) as mgr:
        spy = SpyAlloc(mgr)
        assert mgr.get([key(0)], expected=[SPEC]) == []
        assert spy.shapes == []
    assert metrics.value("corrupt_chunks", tier="redis") == 1


def test_a_peer_header_claiming_another_shape_allocates_nothing(make_chunk):
    from test_transfer import Prefill

    side = Prefill()
    try:
        side.hold("r1", [make_chunk(3, HUGE)], [key(0)])
        shapes: list = []

        def alloc(shape, dtype):
            shapes.append(shape)
            return None

        tier = PeerTier(PeerSource("127.0.0.1", side.server.port, "r1"), timeout_s=2.0)
        import asyncio

        assert asyncio.run(tier.get_many([key(0)], ExpectedAlloc(alloc, {key(0): SPEC}))) == [None]
        assert shapes == []
        assert metrics.value("pd_pull_failures", reason="corrupt") == 1
    finally:
        side.close()


def test_the_expected_chunk_still_reads(tmp_path, make_chunk):
    chunk = make_chunk(4, CHUNK)
    with StorageManager(config(local_disk=str(tmp_path), max_local_disk_size=0.01)) as mgr:
        obj = mgr.allocate(CHUNK, torch.bfloat16)
        obj.tensor.copy_(chunk)
        mgr.put(key(0), obj)
        obj.ref_down()
        assert mgr.flush()
        mgr.clear(lower_tiers=False)
        (got,) = mgr.get([key(0)], expected=[SPEC])
        assert torch.equal(got.tensor, chunk)
        got.ref_down()


def test_a_wrong_shape_in_l1_is_dropped_not_left_most_recently_used():
    from test_engine import CHUNK as E_CHUNK
    from test_engine import make_caches, make_engine

    engine = make_engine()
    try:
        caches = make_caches(True, seed=5)
        tokens = list(range(1000, 1000 + E_CHUNK))
        slots = torch.arange(E_CHUNK)
        (chunk_key,) = [c.key for c in engine._chunks(tokens, False, None)]
        wrong = engine.storage.allocate(engine.layout.chunk_shape(E_CHUNK // 2), engine.layout.geometry.dtype)
        engine.storage.put(chunk_key, wrong)  # e.g. written by a build with another geometry
        wrong.ref_down()
        assert engine.lookup(tokens) == E_CHUNK
        assert not engine.retrieve(tokens, caches, slots).any()  # a miss
        assert metrics.value("shape_mismatches") == 1
        assert engine.lookup(tokens) == 0  # gone: the prefix is computed and stored again, not failed forever
    finally:
        engine.close()
