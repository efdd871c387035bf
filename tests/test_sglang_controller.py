"""Our tiers under SGLang 0.5.23's real cache controller: `HiCacheController` (and the `HybridCacheController` it
builds for dense models) attaches `LMCacheHiCacheStorage` through its factory from the extra config, and its
own backup and prefetch threads move the pages (v1 zero-copy calls, or the generic flat-page calls). The tests
play SGLang's scheduler (host slots, page hashes, SGLang's native hash) and compare pages bit for bit. Tiers:
a real directory, a real redis-server; faults: SGLang's own failure injector and a killed redis-server."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import sglang_support as S
import torch

S.import_sglang()

from lmcache_vllm.observability import metrics  # noqa: E402


@pytest.fixture(autouse=True)
def every_backend_closed():
    """A test that leaves a backend open (its storage thread, its share of the metrics export) fails."""
    from lmcache_vllm.integration.sglang import prometheus

    yield
    assert prometheus._export is None or prometheus._export.users == 0, "a backend was left open"


PAGES = 4


def prompt(seed: int, pages: int = PAGES) -> list[int]:
    return [(seed * 7919 + i) % 30000 + 1 for i in range(pages * S.PAGE)]


def disk(path, **more) -> dict:
    return {"local_cpu": False, "local_disk": str(path), "max_local_disk_size": 1, **more}


def redis(server, prefix, **more) -> dict:
    extra = {"remote_key_prefix": prefix, "remote_timeout_secs": 0.5, "remote_breaker_max_secs": 1,
             **more.pop("extra_config", {})}
    return {"local_cpu": False, "remote_url": server.url, "lookup_timeout_ms": 500, "blocking_timeout_secs": 2,
            "extra_config": extra, **more}


def round_trip(ctl: S.Controller, tokens: list[int], salt=None) -> tuple[int, int, bool]:
    """Backs the prompt's pages up, then prefetches them into fresh host slots: (tokens backed up, tokens
    read, whether every page read equals the page stored)."""
    pool = ctl.pool
    src = pool.alloc(len(tokens))
    want = S.pages_of(pool, src)
    backed = ctl.backup(src, S.page_hashes(tokens, salt=salt))
    read, dst = ctl.prefetch(tokens, salt=salt)
    got = S.pages_of(pool, dst)[:read // S.PAGE]
    same = all(torch.equal(a, b) for a, b in zip(want, got))
    pool.free(src)
    if dst.numel():
        pool.free(dst)
    return backed, read, same


CASES = [("mha", lay, True, False) for lay in S.MHA_LAYOUTS] + [
    ("mha", "page_first", False, False),  # SGLang's generic path: batch_set / batch_get of flat pages
    ("mha", "page_first", True, True),  # HybridCacheController over a one-entry HostPoolGroup
    ("mla", "page_first", True, False),
    ("mla", "layer_first", False, False),
]


@pytest.mark.parametrize("kind,layout,v1,hybrid", CASES)
def test_pages_round_trip_bit_exact_through_sglangs_backup_and_prefetch_threads(tmp_path, kind, layout, v1, hybrid):
    pool = (S.mha_pool if kind == "mha" else S.mla_pool)(layout, seed=11)
    ctl = S.Controller(pool, S.dynamic(disk(tmp_path), interface_v1=v1), hybrid=hybrid)
    try:
        assert type(ctl.backend).__name__ == "LMCacheHiCacheStorage"
        assert ctl.ctl.page_get_func.__name__ == ("_page_get_zero_copy" if v1 else "_generic_page_get")
        assert round_trip(ctl, prompt(1)) == (PAGES * S.PAGE, PAGES * S.PAGE, True)
        assert ctl.prefetch(prompt(2))[0] == 0  # a prompt never stored
    finally:
        ctl.close()
    assert ctl.ctl.storage_backend is None and not ctl.backend.manager._thread.is_alive()


def test_the_redis_tier_and_cache_salt(redis_server, redis_prefix):
    pool = S.mha_pool("page_first", seed=12)
    ctl = S.Controller(pool, S.dynamic(redis(redis_server, redis_prefix)))
    try:
        assert round_trip(ctl, prompt(3), salt="tenant-a") == (PAGES * S.PAGE, PAGES * S.PAGE, True)
        assert ctl.prefetch(prompt(3), rid="other-salt", salt="tenant-b")[0] == 0
        assert ctl.prefetch(prompt(3), rid="no-salt")[0] == 0
        assert metrics.value("chunk_hits", tier="redis") == PAGES
    finally:
        ctl.close()


_WRITER = textwrap.dedent("""
    import sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import json
    import sglang_support as S
    pool = S.mha_pool("page_head", seed=21)
    ctl = S.Controller(pool, S.dynamic(json.loads(sys.argv[2])))
    tokens = json.loads(sys.argv[3])
    src = pool.alloc(len(tokens))
    done = ctl.backup(src, S.page_hashes(tokens))
    np.save(sys.argv[4], np.stack([p.view(S.torch.int16).numpy() for p in S.pages_of(pool, src)]))
    ctl.close()
    print("stored", done)
""")


def test_a_second_process_reads_what_the_first_stored_on_disk_and_in_redis(tmp_path, redis_server, redis_prefix):
    import json

    both = {**disk(tmp_path / "l3"), **redis(redis_server, redis_prefix)}
    tokens = prompt(4)
    out = subprocess.run([sys.executable, "-c", _WRITER, os.path.dirname(__file__), json.dumps(both),
                          json.dumps(tokens), str(tmp_path / "pages.npy")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.returncode == 0 and f"stored {len(tokens)}" in out.stdout, out.stderr[-3000:]
    want = np.load(tmp_path / "pages.npy", allow_pickle=False)
    for extra in (disk(tmp_path / "l3"), redis(redis_server, redis_prefix)):
        pool = S.mha_pool("page_head", seed=99)  # other bytes everywhere until the read
        ctl = S.Controller(pool, S.dynamic(extra))
        try:
            read, dst = ctl.prefetch(tokens)
            assert read == len(tokens), extra
            got = np.stack([p.view(torch.int16).numpy() for p in S.pages_of(pool, dst)])
            assert np.array_equal(got, want)
        finally:
            ctl.close()


def test_sglangs_random_failure_injection_never_gives_a_wrong_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.3")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.01")
    pool = S.mha_pool("page_first", seed=13)
    ctl = S.Controller(pool, S.dynamic(disk(tmp_path)))
    outcomes = set()
    try:
        assert type(ctl.backend).__name__ == "HiCacheStorageFailureInjector"
        for round_ in range(16):
            backed, read, same = round_trip(ctl, prompt(100 + round_))
            assert same and read <= PAGES * S.PAGE, round_
            outcomes.add((backed == PAGES * S.PAGE, read == PAGES * S.PAGE))
        threads = (ctl.ctl.backup_thread, ctl.ctl.prefetch_thread, ctl.ctl.prefetch_io_aux_thread)
        assert all(t.is_alive() for t in threads)
    finally:
        ctl.close()
    assert (True, True) in outcomes and len(outcomes) > 1  # some rounds whole, some cut by injected failures


def test_a_killed_redis_server_is_a_bounded_miss_and_a_failed_backup(redis_server, redis_prefix):
    pool = S.mha_pool("page_first", seed=14)
    ctl = S.Controller(pool, S.dynamic(redis(redis_server, redis_prefix)))
    try:
        tokens = prompt(5)
        assert round_trip(ctl, tokens) == (PAGES * S.PAGE, PAGES * S.PAGE, True)
        redis_server.kill()
        t0 = time.monotonic()
        assert ctl.prefetch(tokens, rid="dead")[0] == 0
        src = pool.alloc(len(prompt(6)))
        assert ctl.backup(src, S.page_hashes(prompt(6))) == 0
        assert time.monotonic() - t0 < 10  # lookup_timeout_ms + blocking_timeout_secs, not a hang
        assert metrics.value("sglang_pages", op="set", outcome="failed") == PAGES
        redis_server.start()
        deadline = time.monotonic() + 30
        while ctl.backup(src, S.page_hashes(prompt(6))) != PAGES * S.PAGE:  # until the breaker lets calls by
            assert time.monotonic() < deadline, "the Redis tier was not used again after its restart"
            time.sleep(0.2)
    finally:
        redis_server.ensure_running()
        ctl.close()


def test_the_redis_cluster_tier(redis_cluster, redis_prefix):
    pool = S.mha_pool("page_first", seed=15)
    extra = {"local_cpu": False, "remote_url": redis_cluster.url, "extra_config": {"remote_key_prefix": redis_prefix}}
    ctl = S.Controller(pool, S.dynamic(extra))
    try:
        assert round_trip(ctl, prompt(7)) == (PAGES * S.PAGE, PAGES * S.PAGE, True)
        assert metrics.value("chunk_hits", tier="redis") == PAGES
    finally:
        ctl.close()


_PEER = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    import sglang_support as S
    pool = S.mha_pool("page_first", seed=31)
    ctl = S.Controller(pool, S.dynamic(json.loads(sys.argv[2])))
    tokens = json.loads(sys.argv[3])
    src = pool.alloc(len(tokens))
    done = ctl.backup(src, S.page_hashes(tokens))
    np.save(sys.argv[4], np.stack([p.view(S.torch.int16).numpy() for p in S.pages_of(pool, src)]))
    print("stored", done, flush=True)
    sys.stdin.read()  # serves its L1 to peers until the test closes stdin
    ctl.close()
""")


def test_p2p_pulls_the_pages_another_sglang_instance_holds_in_memory(tmp_path, redis_server, redis_prefix):
    import json

    # pd_peers: the peer's port, one the OS picks on loopback (which is nobody's unless listed)
    p2p = {"local_cpu": True, "max_local_cpu_size": 0.05, "enable_p2p": True,
           "extra_config": {"p2p_directory_url": redis_server.url, "remote_key_prefix": redis_prefix,
                            "pd_peers": ["127.0.0.1:1024-65535"]}}
    tokens = prompt(8)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, os.path.dirname(__file__), json.dumps(p2p),
                             json.dumps(tokens), str(tmp_path / "pages.npy")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = peer.stdout.readline()  # bounded by the test timeout; the child fails loudly otherwise
        assert line.strip() == f"stored {len(tokens)}", peer.stderr.read()[-3000:] if not line else line
        pool = S.mha_pool("page_first", seed=98)
        ctl = S.Controller(pool, S.dynamic(p2p))
        try:
            deadline = time.monotonic() + 30
            while (hit := ctl.prefetch(tokens, rid=f"p2p-{time.monotonic()}"))[0] == 0:
                assert time.monotonic() < deadline, "the peer's pages never showed up in the P2P directory"
                time.sleep(0.2)
            read, dst = hit
            assert read == len(tokens)
            got = np.stack([p.view(torch.int16).numpy() for p in S.pages_of(pool, dst)])
            assert np.array_equal(got, np.load(tmp_path / "pages.npy", allow_pickle=False))
            assert metrics.value("chunk_hits", tier="p2p") == PAGES  # pulled from the peer's memory
        finally:
            ctl.close()
    finally:
        peer.stdin.close()
        try:
            peer.wait(60)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait(10)
