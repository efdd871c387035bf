"""Helpers of the P2P tests: storage managers with P2P on a real redis-server, chunk keys and tensors, the
directory as Redis holds it, and a child process serving chunks (to SIGKILL)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lmcache_vllm.config import LMCacheConfig
from lmcache_vllm.config.remote_url import parse_remote_url
from lmcache_vllm.storage.base import InstanceIdentity
from lmcache_vllm.storage.manager import StorageManager
from lmcache_vllm.storage.p2p.directory import chunks_key, servers_key
from lmcache_vllm.storage.redis.client import ClientSettings, sync_client

ROOT = Path(__file__).resolve().parents[1]
CHUNK = (2, 2, 16, 64)  # 8 KiB of bf16
MiB = 1 << 20
LISTED = ["127.0.0.1:1024-65535"]  # these tests' peers: every port loopback has for them (nobody's by default)
S1, S2 = "p2p-test-secret-one-0123456789", "p2p-test-secret-two-0123456789"


def key(i: int, model: str = "m", tp: str = "tp1.0") -> str:
    return f"{model}@-@{tp}@pp1.0@bfloat16@v2@{i:032x}"


def config(url: str, prefix: str, *, l1_mib: float = 8, disk: Any = None, **extra: Any) -> LMCacheConfig:
    """P2P over the directory at `url`; lookups bounded by 5 s unless a test says otherwise (a loaded 2-core CI
    machine can take longer than the default 0.5 s for a round trip, which a test would read as a miss)."""
    tiers = {"local_disk": str(disk), "max_local_disk_size": 0.1} if disk is not None else {}
    extra.setdefault("p2p_lookup_timeout_secs", 5.0)
    extra.setdefault("pd_peers", LISTED)
    return LMCacheConfig(max_local_cpu_size=l1_mib * MiB / (1 << 30), enable_p2p=True, blocking_timeout_secs=5.0,
                         extra_config={"p2p_directory_url": url, "remote_key_prefix": prefix, "close_drain_secs": 1.0,
                                       **extra}, **tiers)


def manager(url: str, prefix: str, instance: str, *, rank: int = 0, tp: int = 1, **kw: Any) -> StorageManager:
    mgr = StorageManager(config(url, prefix, **kw))
    mgr.attach_instance(InstanceIdentity(instance, rank, tp))
    return mgr


def store(mgr: StorageManager, keys: list[str], first_value: int = 0, shape: tuple[int, ...] = CHUNK) -> None:
    """Stores one chunk per key, chunk i filled with the number first_value + i; each write-through done before
    the next (a chunk queued for one is not evictable)."""
    for i, k in enumerate(keys):
        obj = mgr.allocate(shape, torch.bfloat16)
        obj.tensor.fill_(first_value + i)
        mgr.put(k, obj)
        obj.ref_down()
        mgr.flush()


def on_loop(mgr: StorageManager, coro: Any, timeout: float = 10.0) -> Any:
    """Runs `coro` on `mgr`'s storage loop (where its tiers' clients live) and returns its result."""
    import asyncio

    return asyncio.run_coroutine_threadsafe(coro, mgr._loop).result(timeout)


def p2p_tier(mgr: StorageManager) -> Any:
    return next(t for t in mgr.lower if t.name == "p2p")


def client(url: str) -> Any:
    """A synchronous redis-py client of any URL form (a cluster's too)."""
    return sync_client(parse_remote_url(url), ClientSettings())


def entries(url: str, prefix: str, mgr: StorageManager) -> int:
    """How many chunks the directory lists for `mgr`'s rank."""
    c = client(url)
    try:
        return int(c.scard(chunks_key(f"{prefix}p2p:", p2p_tier(mgr).info.sid)))
    finally:
        c.close()


def servers(url: str, prefix: str) -> set[str]:
    c = client(url)
    try:
        return {s.decode() for s in c.smembers(servers_key(f"{prefix}p2p:"))}
    finally:
        c.close()


def wait_until(check: Callable[[], Any], timeout: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            assert result, f"timed out waiting for {what or check}"
            return result
        time.sleep(0.02)


def get_all(mgr: StorageManager, keys: list[str]) -> list[float]:
    """The value each chunk of the longest prefix found holds (chunks are filled with one number)."""
    objs = mgr.get(keys)
    try:
        return [float(o.tensor[0, 0, 0, 0]) for o in objs]
    finally:
        for o in objs:
            o.ref_down()


CHILD = """
import sys, time, torch
sys.path.insert(0, {tests!r})
import p2p_helpers as h
shape = tuple(int(x) for x in sys.argv[6].split(","))
n = int(sys.argv[4])
mgr = h.manager(sys.argv[1], sys.argv[2], sys.argv[3], l1_mib=n * 2 * torch.Size(shape).numel() / 2**20 + 1,
                p2p_lease_secs=float(sys.argv[5]))
keys = [h.key(i) for i in range(n)]
h.store(mgr, keys, shape=shape)
h.wait_until(lambda: h.entries(sys.argv[1], sys.argv[2], mgr) == len(keys))
print(h.p2p_tier(mgr).info.sid, flush=True)
time.sleep(600)
"""


def serve_in_child(url: str, prefix: str, instance: str, n: int, lease_s: float,
                   shape: tuple[int, ...] = CHUNK) -> tuple[subprocess.Popen, str]:
    """A process of its own holding chunks key(0..n-1) (values 0..n-1) of `shape` and listing them; (process,
    its sid)."""
    code = CHILD.format(tests=str(ROOT / "tests"))
    child = subprocess.Popen([sys.executable, "-c", code, url, prefix, instance, str(n), str(lease_s),
                              ",".join(map(str, shape))],
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert child.stdout is not None
    sid = child.stdout.readline().strip()
    assert sid, "the serving child did not start"
    return child, sid
