"""Token ids and LMCache's object keys to our chunk keys (`management/keys.py`): a key space rebuilt from what an
engine reports resolves a prompt to exactly the keys that engine stores for a request with that salt (the keys
the next request loads), in LMCache's order (chunk-major, then rank) and kv_rank packing; a salt travels the
same way as the connector's request keys put it; and a key space read back from Redis cannot be anything else."""
from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine import CHUNK, make_caches, make_engine, slots_for

from lmcache_vllm.extra_keys import ExtraKeys, for_salt, prefix_item, tenant_of
from lmcache_vllm.management.keys import KeySpace, pack_rank, unpack_rank
from lmcache_vllm.management.schemas import BadRequest, EncodedObjectKey
from lmcache_vllm.tokens import ChunkHasher, KeyBuilder

PROMPT = list(range(500, 500 + 3 * CHUNK + 9))


def test_a_rebuilt_key_space_resolves_to_the_keys_the_engine_stores_and_loads():
    engine = make_engine()
    try:
        space = KeySpace.from_json(KeySpace.of_builder(engine.keys, ["served-name"]).to_json())
        for salt in ("", "tenant-7"):
            engine.store(PROMPT, make_caches(True), slots_for(len(PROMPT), seed=3), extra=for_salt(salt))
            stored = set(engine.storage.l1.keys_page(0, 1000)[1])
            resolved = [k.to_str() for k in space.resolve(PROMPT, salt)]
            assert len(resolved) == 3 and set(resolved) <= stored
            assert resolved == [k.to_str() for k in engine.chunk_keys(PROMPT, for_salt(salt))]
            assert engine.lookup(PROMPT, for_salt(salt)) == 3 * CHUNK  # what the next request loads
        assert space.resolve(PROMPT, "") != space.resolve(PROMPT, "tenant-7")
        assert space.resolve(PROMPT[:CHUNK - 1]) == []  # a partial chunk has no key
        assert space.accepts("served-name", 1) and space.accepts("test/model", 1)
        assert not space.accepts("served-name", 2) and not space.accepts("other", 1)
    finally:
        engine.close()


def test_the_salt_is_keyed_as_the_connectors_request_keys_key_it():
    from lmcache_vllm.integration.vllm.request_keys import RequestKeys

    request = SimpleNamespace(lora_request=None, cache_salt="tenant-7", mm_features=None, prompt_embeds=None)
    assert RequestKeys(CHUNK).extra_keys(request) == for_salt("tenant-7")
    assert tenant_of(for_salt("tenant-7")) == "tenant-7" and tenant_of(None) == "" and tenant_of(for_salt("")) == ""
    lora_first = ExtraKeys(prefix_item(b"lora", b"adapter") + prefix_item(b"salt", "s\u00e9".encode()))
    assert tenant_of(lora_first) == "s\u00e9"


def test_tensor_parallel_keys_come_chunk_major_then_rank_with_lmcaches_kv_rank():
    builder = KeyBuilder("llama", 2, 0, "bfloat16", 2, ChunkHasher(CHUNK, "blake3"), fingerprint="ab12")
    space = KeySpace.of_builder(builder, ["m"])
    keys = space.resolve(PROMPT, "s")
    assert [(k.rank, k.digest == keys[2 * (i // 2)].digest) for i, k in enumerate(keys)] == \
        [(0, True), (1, True)] * 3  # one digest per chunk, a key per rank
    assert keys[1] == dataclasses.replace(keys[0], rank=1)
    encoded = space.encode(keys[3], "m", "s")
    assert encoded["kv_rank"] == pack_rank(2, 1) == (2 << 24) | (1 << 16) | (2 << 8) | 1
    assert unpack_rank(encoded["kv_rank"]) == (2, 1)
    assert space.key_of(EncodedObjectKey(**encoded)) == keys[3]
    for bad in (dict(encoded, kv_rank=pack_rank(1, 0)), dict(encoded, model_name="x"),
                dict(encoded, chunk_hash_hex="ab" * 16), dict(encoded, object_group_id=1)):
        with pytest.raises(BadRequest):
            space.key_of(EncodedObjectKey(**bad))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["model", "fingerprint", "world_size", "kv_dtype", "fmt_version",
                                        "chunk_size", "hash_algorithm", "pp_size", "model_names", "x"]),
                       st.one_of(st.none(), st.integers(-5, 5), st.text(max_size=8), st.lists(st.text(), max_size=2))))
def test_a_key_space_from_redis_is_a_valid_one_or_refused(fields):
    try:
        space = KeySpace.from_json(json.dumps(fields))
    except ValueError:
        return
    space.builder(0)  # a space that parsed builds keys
    assert space.world_size >= 1 and space.chunk_size >= 1
