"""Chunk codecs on the tiers that write bytes outside memory: the disk tier (`extra_config.local_disk_serde`),
Redis (`remote_serde`) and the transfer wire (`extra_config.transfer_serde`, PD holds and P2P fetches). Each
writes with its codec and reads every codec: a restart with another setting reads the files already there, and
instances with different settings share one Redis. A coded chunk that does not decode is a counted miss, deleted
where it is stored, never a crash or a leak. `auto` on the wire codes only when the link is slower than the
encoder (rates measured in this process)."""
from __future__ import annotations

import os

import pytest
import torch
from disk_tier import open_disk
from test_storage_coders import kv_like
from test_transfer import CHUNK, Prefill, assert_chunks, d_config, pull
from test_transfer import key as wire_key

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage import chunk_file, codec, coders
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.redis import RedisBackend
from lmcache_vllm.storage.transfer import serde

SHAPE = (2, 2, 16, 128)  # 16 KiB of bf16: KV-like values compress, as vLLM's do
RAW = 2 * 2 * 16 * 128 * 2


def key(i: int) -> str:
    return f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"


@pytest.fixture
def arena():
    allocator = HostAllocator(4 << 20)
    yield allocator
    assert allocator.used_bytes == 0, "a test leaked MemoryObjs"


def obj_of(arena: HostAllocator, t: torch.Tensor):
    obj = arena.allocate(t.shape, t.dtype)
    obj.tensor.copy_(t)
    return obj


async def put_all(tier, arena: HostAllocator, tensors: dict[int, torch.Tensor]) -> None:
    for i, t in tensors.items():
        obj = obj_of(arena, t)
        assert await tier.put(key(i), obj)
        obj.ref_down()


async def read_back(tier, arena: HostAllocator, i: int) -> torch.Tensor | None:
    obj = await tier.get(key(i), lambda shape, dtype: arena.allocate(shape, dtype))
    if obj is None:
        return None
    out = obj.tensor.clone()
    obj.ref_down()
    return out


async def test_disk_files_of_every_codec_read_after_a_restart_with_another_setting(tmp_path, arena):
    tensors = {i: kv_like(SHAPE, seed=i) for i in range(3)}
    for i, serde_name in enumerate(("naive", "lossless", "fp8")):  # one file per codec, one setting at a time
        disk = open_disk(tmp_path, 1 << 20, local_disk_serde=serde_name)
        await put_all(disk, arena, {i: tensors[i]})
        await disk.close()
    sizes = [os.path.getsize(tmp_path / chunk_file.filename_for(key(i))) - 4096 for i in range(3)]
    assert sizes[0] == RAW and sizes[1] < RAW / 1.2 and sizes[2] == RAW // 2 + RAW // 2 // 64
    assert metrics.value("coded_bytes", tier="local_disk", codec="lossless") == sizes[1]
    disk = open_disk(tmp_path, 1 << 20, local_disk_serde="naive")  # the restart re-indexes every codec's files
    assert len(disk) == 3
    assert torch.equal(await read_back(disk, arena, 0), tensors[0])
    assert torch.equal(await read_back(disk, arena, 1), tensors[1])
    fp8 = await read_back(disk, arena, 2)
    assert fp8 is not None and torch.allclose(fp8.float(), tensors[2].float(), rtol=1 / 16, atol=1e-3)
    await disk.close()


async def test_a_coded_disk_file_that_does_not_decode_is_a_counted_miss_and_removed(tmp_path, arena):
    disk = open_disk(tmp_path, 1 << 20, local_disk_serde="lossless")
    await put_all(disk, arena, {0: kv_like(SHAPE)})
    path = tmp_path / chunk_file.filename_for(key(0))
    data = bytearray(path.read_bytes())
    header = codec.parse_header(data)
    stored = bytearray(data[header.header_len:-100])  # blosc2's stream cut short, behind a header whose
    # checksum (over the shorter payload) is made again: only the decoder can tell
    forged = codec.encode_header(key(0), kv_like(SHAPE), align=4096,
                                 stored=(coders.CODERS["lossless"], 0, bytes(stored)))
    path.write_bytes(forged + stored)
    assert await read_back(disk, arena, 0) is None
    assert metrics.value("corrupt_chunks", tier="local_disk") == 1 and not path.exists()
    await disk.close()


async def test_redis_instances_with_different_serdes_read_each_others_chunks(redis_server, redis_prefix, arena):
    tensors = {i: kv_like(SHAPE, seed=i) for i in range(3)}
    tiers = {name: RedisBackend(LMCacheConfig(remote_url=redis_server.url, remote_serde=name,
                                              extra_config={"remote_key_prefix": redis_prefix}))
             for name in ("naive", "lossless", "fp8")}
    try:
        for i, name in enumerate(tiers):
            await put_all(tiers[name], arena, {i: tensors[i]})
        assert metrics.value("coded_bytes", tier="redis", codec="naive") == RAW
        assert metrics.value("coded_bytes", tier="redis", codec="lossless") < RAW / 1.2
        for reader in tiers.values():
            assert torch.equal(await read_back(reader, arena, 0), tensors[0])
            assert torch.equal(await read_back(reader, arena, 1), tensors[1])
            got = await read_back(reader, arena, 2)
            assert got is not None and torch.allclose(got.float(), tensors[2].float(), rtol=1 / 16, atol=1e-3)
    finally:
        for tier in tiers.values():
            await tier.close()


def test_defaults_code_where_it_paid_and_fp8_is_never_one():
    cfg = LMCacheConfig()
    assert cfg.remote_serde == "lossless" and cfg.extra_config.transfer_serde == "auto"
    assert cfg.extra_config.local_disk_serde == "naive"


@pytest.mark.parametrize("setting", ["lossless", "fp8"])
def test_a_pd_pull_of_coded_chunks_decodes_them_on_the_decode_side(setting):
    side = Prefill()
    side.holds.serde = setting
    tensors = [kv_like(CHUNK, seed=i) for i in range(3)]
    try:
        keys = side.hold("r1", tensors)
        checked = side.holds.checkout("r1", keys)
        headers = [codec.parse_header(h) for h in checked.headers]
        side.holds.sent(checked.objs)
        with StorageManager(d_config()) as mgr:
            objs = pull(mgr, keys, side.source("r1"))
            if setting == "lossless":
                assert_chunks(objs, tensors)
            else:
                for obj, t in zip(objs, tensors):
                    assert torch.allclose(obj.tensor.float(), t.float(), rtol=1 / 16, atol=1e-3)
                    obj.ref_down()
        assert {h.coder_name for h in headers} == {setting}
        assert metrics.value("pd_pulled_chunks", peer="loopback") == 3
        assert metrics.value("pd_pull_failures", reason="corrupt") == 0
    finally:
        side.close()


def test_a_coded_chunk_from_a_peer_that_does_not_decode_is_a_counted_miss_with_nothing_leaked():
    side = Prefill()
    side.holds.serde = "lossless"
    tensors = [kv_like(CHUNK, seed=i) for i in range(3)]
    try:
        keys = side.hold("r2", tensors)
        hold = side.holds._holds["r2"]
        stored = bytearray(memoryview(hold.payloads[1]).cast("B"))[:-100]  # cut short, a checksum made again:
        # only the decoder can tell
        hold.headers[1] = codec.encode_header(keys[1], tensors[1], stored=(coders.CODERS["lossless"], 0,
                                                                           bytes(stored)))
        hold.payloads[1] = bytes(stored)
        with StorageManager(d_config()) as mgr:
            objs = pull(mgr, keys, side.source("r2"))
            assert len(objs) == 1  # the prefix before the bad chunk
            assert_chunks(objs, tensors[:1])
        assert metrics.value("pd_pull_failures", reason="corrupt") == 1
        assert metrics.value("corrupt_chunks", tier="peer") == 1
    finally:
        side.close()


def test_auto_codes_only_when_the_link_is_slower_than_the_encoder():
    link = serde.LinkRate()
    assert serde.wire_coder("auto", link) == "naive"  # nothing sent yet: the first send measures the link
    assert serde.wire_coder("fp8", link) == "fp8" and serde.wire_coder("naive", link) == "naive"
    codec.encode(key(0), kv_like((4, 2, 64, 256)), coder="lossless")  # 512 KiB: this process's encode rate
    encode_rate = coders.encode_rate("lossless")
    assert encode_rate is not None and encode_rate > 0
    link.observe(1 << 20, (1 << 20) / (encode_rate * 4))  # a link 4x faster than the encoder: raw
    assert serde.wire_coder("auto", link) == "naive"
    slow = serde.LinkRate()
    slow.observe(1 << 20, (1 << 20) / (encode_rate / 4))  # 4x slower (a 1 GbE link against ~0.45 GB/s)
    assert serde.wire_coder("auto", slow) == "lossless"
    slow.observe(1000, 1.0)  # a small send measures latency, not bandwidth: ignored
    assert slow.rate is not None and slow.rate > 1000


def test_p2p_fetches_code_with_the_setting_and_keep_no_coded_copy():
    from lmcache_vllm.storage.transfer.keyed import KeyedChunks

    arena = HostAllocator(1 << 20)
    t = kv_like(CHUNK)
    held = obj_of(arena, t)
    keyed = KeyedChunks(lambda k: (held.ref_up(), held)[1] if k == wire_key(0) else None, mac=None,
                        trusted=lambda host: True, serde="lossless")
    out = keyed.checkout([wire_key(0)], "127.0.0.1")
    assert codec.parse_header(out.headers[0]).coder_name == "lossless" and out.payloads[0] is not None
    assert not keyed._headers  # coded per send: nothing kept beside L1
    for obj in out.objs:
        obj.ref_down()
    held.ref_down()
    arena.close()
