"""Tests for lmcache_vllm.tokens: stable prefix-chain digests, input types, keys and their strings."""

import hashlib
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from lmcache_vllm.tokens import SUPPORTED_HASH_ALGORITHMS, CacheKey, ChunkHasher, KeyBuilder, token_bytes

# Hard-coded digests of tokens 0..9 with chunk_size 4 (two full chunks and a partial one). If these
# change, stored caches written by earlier versions become unreachable: bump TOKEN_HASH_SCHEME.
EXPECTED = {
    "xxh3_128": ["e127ebc708f1edd4e102c308a4fe97f3", "364869315ffea93180ea9a64e8fd8d82",
                 "17a20d07c21a537111101226cdc760d3"],
    "sha256": ["6783e3bb2475428a7dc2bac441c9095823fbe71bfd56e05c28d7fe85911d27f3",
               "9a7d26ca82cb55682cb4d0d60112ff77f0098ee7670a153017e8fe91012fed66",
               "fcc88862d02061c51ef892f35f6343b50faa025082d31b756e278e45f293eee5"],
    "blake3": ["da1bf45819173843b72d9ef5510b2051015340bd06d8ef9a34ac4f8786468890",
               "4a16be9a5a0f5f5dfff24484f71b0e02d03d9c56c1c1a57deabb31a8bedf0f16",
               "27e2edc821df9050cf4dcb2bc41e784f04aa8561e48fab74b53546398717e2f1"],
}


@pytest.mark.parametrize("algorithm", SUPPORTED_HASH_ALGORITHMS)
def test_digests_are_the_documented_scheme(algorithm):
    hasher = ChunkHasher(4, algorithm)
    assert [d.hex() for d in hasher.digests(list(range(10)), include_partial=True)] == EXPECTED[algorithm]


def test_sha256_chain_matches_an_independent_computation():
    # Spelled out with hashlib and struct-free bytes so the scheme in the docstring is what runs.
    root = hashlib.sha256(b"lmcache-vllm/tokens/v1").digest()
    chunk0 = b"".join(i.to_bytes(8, "little", signed=True) for i in range(4))
    chunk1 = b"".join(i.to_bytes(8, "little", signed=True) for i in range(4, 8))
    d0 = hashlib.sha256(root + chunk0).digest()
    d1 = hashlib.sha256(d0 + chunk1).digest()
    assert ChunkHasher(4, "sha256").digests(range(10)) == [d0, d1]


def test_prefix_property():
    hasher = ChunkHasher(16)
    rng = np.random.default_rng(0)
    a = rng.integers(0, 50_000, 160)
    b = a.copy()
    b[70] += 1  # diverges inside chunk 4
    da, db = hasher.digests(a), hasher.digests(b)
    assert len(da) == len(db) == 10
    assert da[:4] == db[:4]
    assert all(x != y for x, y in zip(da[4:], db[4:]))
    # A longer prompt with the same start shares all of the shorter one's full-chunk digests.
    assert hasher.digests(np.concatenate([a, [1, 2, 3]])) == da


def test_list_numpy_tensor_give_same_keys():
    tokens = list(np.random.default_rng(1).integers(0, 128_000, 1000))
    builder = KeyBuilder("m", 1, 0, torch.bfloat16, 1, ChunkHasher(256))
    ref = builder.keys([int(t) for t in tokens], include_partial=True)
    for variant in (np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.int32),
                    torch.tensor(tokens), torch.tensor(tokens, dtype=torch.int32),
                    np.array(tokens)[::1]):
        assert builder.keys(variant, include_partial=True) == ref
    # Non-contiguous input works too.
    doubled = np.repeat(np.array(tokens), 2)[::2]
    assert builder.keys(doubled, include_partial=True) == ref


def test_bad_token_inputs_are_rejected():
    hasher = ChunkHasher(4)
    with pytest.raises(TypeError):
        hasher.digests(np.zeros(8, dtype=np.float32))
    with pytest.raises(TypeError):
        hasher.digests(torch.zeros(8))
    with pytest.raises(ValueError):
        hasher.digests(np.zeros((2, 4), dtype=np.int64))
    with pytest.raises(TypeError):
        hasher.digests([1, 2.5, 3, 4])
    with pytest.raises(TypeError):
        hasher.digests([1, 2 ** 64, 3, 4])  # does not fit the fixed-width encoding
    with pytest.raises(ValueError):
        ChunkHasher(0)
    with pytest.raises(ValueError, match="supported"):
        ChunkHasher(4, "md5")


def test_partial_chunks_and_spans():
    hasher = ChunkHasher(4)
    assert hasher.spans(10) == [(0, 4), (4, 8)]
    assert hasher.spans(10, include_partial=True) == [(0, 4), (4, 8), (8, 10)]
    assert hasher.spans(8, include_partial=True) == [(0, 4), (4, 8)]
    assert hasher.spans(3) == [] and hasher.spans(0, include_partial=True) == []
    assert hasher.digests([]) == [] and hasher.digests([1, 2, 3]) == []
    full = hasher.digests(range(10))
    partial = hasher.digests(range(10), include_partial=True)
    assert partial[:2] == full and len(partial) == 3
    # The partial digest depends on every token of the partial chunk.
    assert hasher.digests(list(range(9)), include_partial=True)[2] != partial[2]
    builder = KeyBuilder("m", 1, 0, "bfloat16", 1, hasher)
    assert [(s, e) for _, s, e in builder.keys(range(10), include_partial=True)] == [(0, 4), (4, 8), (8, 10)]
    assert [(s, e) for _, s, e in builder.keys(range(10))] == [(0, 4), (4, 8)]


def test_large_ids_and_token_bytes():
    assert bytes(token_bytes([1, 2 ** 40])) == (1).to_bytes(8, "little") + (2 ** 40).to_bytes(8, "little")
    hasher = ChunkHasher(2)
    assert hasher.digests([0, 2 ** 32]) != hasher.digests([0, 0])  # no 32-bit truncation


@pytest.mark.parametrize("model", ["llama", "org/m@rev:main", "a%2Fb", "weird@@::/ /"])
def test_cache_key_round_trip(model):
    key = CacheKey(model, 4, 3, "bfloat16", 2, bytes(range(16)), fingerprint="0f" * 16, pp_size=2,
                   pp_rank=1)
    s = key.to_str()
    assert "/" not in s and ":" not in s and s.count("@") == 6
    assert s.endswith("@tp4.3@pp2.1@bfloat16@v2@" + bytes(range(16)).hex())
    assert CacheKey.from_str(s) == key
    other = key.with_rank(1)
    assert other.rank == 1 and other.digest == key.digest and other != key
    assert CacheKey.from_str(other.to_str()) == other
    assert len({key, CacheKey.from_str(s)}) == 1  # hashable, equal keys collapse
    bare = CacheKey(model, 1, 0, "bfloat16", 2, b"\x01")  # no fingerprint, PP 1
    assert "@-@tp1.0@pp1.0@" in bare.to_str()
    assert CacheKey.from_str(bare.to_str()) == bare


def test_cache_key_validation():
    with pytest.raises(ValueError):
        CacheKey("m", 2, 2, "bf16", 1, b"x")  # rank out of range
    with pytest.raises(ValueError):
        CacheKey("m", 1, 0, "bf16", 1, b"x", pp_size=2, pp_rank=2)
    with pytest.raises(ValueError):
        CacheKey("", 1, 0, "bf16", 1, b"x")
    with pytest.raises(ValueError):
        CacheKey("m", 1, 0, "bf16", 1, b"")
    with pytest.raises(ValueError):
        CacheKey("m", 1, 0, "bf16", 1, b"x", fingerprint="not hex")
    for bad in ("", "m@1@0@bf16@v1@00",  # the scheme before fingerprints and PP: refused, not misread
                "m@-@tp1.0@pp1.0@bf16@v1", "m@-@tp1.0@pp1.0@bf16@1@00", "m@-@tpx.0@pp1.0@bf16@v1@00",
                "m@-@tp1.0@pp1.0@bf16@v1@zz", "m@-@tp1.1@pp1.0@bf16@v1@00", "m@XY@tp1.0@pp1.0@bf16@v1@00"):
        with pytest.raises(ValueError, match="not a CacheKey"):
            CacheKey.from_str(bad)


def test_keys_carry_context():
    a = KeyBuilder("m", 2, 0, torch.bfloat16, 1, ChunkHasher(4), fingerprint="ab").keys(range(8))
    b = KeyBuilder("m", 2, 1, torch.bfloat16, 1, ChunkHasher(4), fingerprint="ab").keys(range(8))
    assert [k.with_rank(1) for k, _, _ in a] == [k for k, _, _ in b]
    assert a[0][0].kv_dtype == "bfloat16" and a[0][0].fingerprint == "ab"
    c = KeyBuilder("m", 2, 0, torch.bfloat16, 1, ChunkHasher(4), fingerprint="ab", pp_size=2,
                   pp_rank=1).keys(range(8))
    assert [(k.pp_size, k.pp_rank) for k, _, _ in c] == [(2, 1)] * 2
    assert [k.digest for k, _, _ in c] == [k.digest for k, _, _ in a] and c[0][0] != a[0][0]


def test_keys_identical_across_interpreters_with_different_hash_seeds():
    code = textwrap.dedent("""
        import numpy as np
        from lmcache_vllm.extra_keys import ExtraKeys, ExtraSpan
        from lmcache_vllm.tokens import ChunkHasher, KeyBuilder
        tokens = np.random.default_rng(7).integers(0, 100_000, 1100)
        for algorithm in ("xxh3_128", "blake3", "sha256"):
            kb = KeyBuilder("org/model", 2, 1, "bfloat16", 1, ChunkHasher(256, algorithm))
            extra = ExtraKeys(b"lora:a", (ExtraSpan(300, 700, b"mm:img1"),))
            print(",".join(k.to_str() for k, _, _ in kb.keys(tokens, include_partial=True)))
            print(",".join(k.to_str() for k, _, _ in kb.keys(tokens, include_partial=True, extra=extra)))
        print(hash("same string"))  # proves the seeds really differed
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    outputs = []
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=root)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True, timeout=120).stdout.splitlines()
        outputs.append(out)
    assert outputs[0][-1] != outputs[1][-1]
    assert outputs[0][:-1] == outputs[1][:-1] and len(outputs[0]) == 7
    assert all(line.count(",") == 4 for line in outputs[0][:-1])  # 5 keys: 4 full + 1 partial


def test_the_default_digest_is_cryptographic():
    """Issue 39 #6: the default was xxh3_128, which anyone can collide, while one instance's tenants share L1
    (vLLM's prefix cache hashes with sha256 for this reason). Measured against xxh3_128 on the hit path by
    benchmarks/bench_chunk_digest.py."""
    from lmcache_vllm.config import LMCacheConfig

    assert LMCacheConfig().pre_caching_hash_algorithm == "sha256" == ChunkHasher(4).algorithm
    assert ChunkHasher(4).digests(list(range(10))) == [bytes.fromhex(d) for d in EXPECTED["sha256"][:2]]
