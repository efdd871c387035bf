"""Fuzzing the Mooncake tier's zero-copy read with values anyone who reaches a Mooncake Store can plant under
our keys: random bytes, crafted headers with valid checksums (any shape, dtype, lengths), and a valid chunk
damaged (a byte changed, cut short, grown). Each is put in a real store by a client of our own and read by the
tier as the engine reads (`codec.ExpectedAlloc`): the answer is the exact chunk or a miss, never an exception,
never memory beyond the chunk's own, nothing leaked."""
from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import torch
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st
from mooncake_servers import MooncakeStore, raw_client
from test_storage_codec import craft_chunk

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.mooncake import MooncakeBackend

pytestmark = pytest.mark.fuzz

SHAPE = (2, 2, 8, 32)  # 2 KiB of bf16
CHUNK_BYTES = 2 * 2 * 8 * 32 * 2
PREFIX = "fuzz:"
_numbers = itertools.count()


def key(i: int) -> str:
    return f"m@-@tp1.0@pp1.0@bfloat16@v2@{i:032x}"


def good_chunk(k: str) -> bytes:
    gen = torch.Generator().manual_seed(7)
    return bytes(codec.encode(k, torch.randn(SHAPE, generator=gen).to(torch.bfloat16)))


@st.composite
def planted(draw) -> tuple[str, bytes]:
    """(the key read, the value planted under it)."""
    k = key(next(_numbers))
    good = good_chunk(k)
    kind = draw(st.sampled_from(["random", "crafted", "flip", "cut", "grow", "other_key"]))
    if kind == "random":
        return k, draw(st.binary(min_size=1, max_size=3 * CHUNK_BYTES))
    if kind == "crafted":
        shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 8, 16, 32, 64, 2**20, 2**31 - 1]), min_size=1,
                                    max_size=5)))
        payload = draw(st.binary(max_size=2 * CHUNK_BYTES))
        return k, craft_chunk(k, shape, dtype_code=draw(st.sampled_from([1, 2, 3, 5, 11])), payload=payload,
                              payload_len=draw(st.sampled_from([None, CHUNK_BYTES, len(payload) + 1])))
    if kind == "flip":
        at = draw(st.integers(0, len(good) - 1))
        return k, good[:at] + bytes([good[at] ^ draw(st.integers(1, 255))]) + good[at + 1:]
    if kind == "cut":
        return k, good[:draw(st.integers(1, len(good) - 1))]
    if kind == "grow":
        return k, good + draw(st.binary(min_size=1, max_size=4096))
    return k, good_chunk(key(10**9))  # a valid chunk of another key


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    deployment = MooncakeStore(tmp_path_factory.mktemp("fuzz_mooncake"), segment="128MB").start()
    config = LMCacheConfig(remote_url=deployment.url, extra_config={"remote_key_prefix": PREFIX,
                                                                    "global_segment_size": 0})
    backend = MooncakeBackend(config)
    raw = raw_client(deployment.port)

    async def start_every_thread() -> None:  # the tier's threads start on first use, not in an example
        await asyncio.gather(*(backend.client.call(lambda store: time.sleep(0.1), timeout=5)
                               for _ in range(backend.client.threads)))
    asyncio.run(start_every_thread())
    try:
        yield backend, raw
    finally:
        raw.close()
        asyncio.run(backend.close())
        deployment.stop()


ARENA = HostAllocator(1 << 20)


@examples(300)
@given(case=planted())
def test_planted_values_read_as_the_chunk_or_a_miss(setup, case):
    backend, raw = setup
    k, value = case
    with bounded_run():
        assert raw.put(PREFIX + k, value) == 0
        sizes = []

        def alloc(shape, dtype):
            sizes.append(torch.Size(shape).numel() * dtype.itemsize)
            return ARENA.allocate(shape, dtype, timeout=0.0)

        (obj,) = asyncio.run(backend.get_many([k], codec.ExpectedAlloc(alloc, {k: (SHAPE, torch.bfloat16)})))
        assert sizes == [CHUNK_BYTES]  # the chunk's own size, whatever the value claims
        if value == good_chunk(k):
            assert obj is not None and bytes(codec.payload_view(obj.tensor)) == value[-CHUNK_BYTES:]
            obj.ref_down()
        else:
            assert obj is None
            assert raw.is_exist(PREFIX + k) == 0  # removed as corrupt
        assert ARENA.used_bytes == 0
