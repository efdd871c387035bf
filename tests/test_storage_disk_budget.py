"""One disk directory shared by several processes (TP ranks, several vLLM instances): one cap for all of
them, and a process never evicts another's files while the directory is under that cap. Real processes,
real files."""
from __future__ import annotations

import asyncio
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from disk_tier import open_disk

from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage.disk_budget import USAGE_FILE, SharedDiskBudget
from lmcache_vllm.storage.local_disk import SUFFIX, filename_for

REPO = Path(__file__).resolve().parents[1]
FILE_BYTES = 4096 + 2 * 2 * 16 * 64 * 2  # one chunk file: 4 KiB header + 8 KiB of bf16
CAP_FILES = 10

WRITER = textwrap.dedent('''
    import asyncio, json, sys, time
    import torch
    from lmcache_vllm.config import LMCacheConfig
    from lmcache_vllm.memory import HostAllocator
    from lmcache_vllm.storage.local_disk import LocalDiskBackend

    directory, cap, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    first, count, go = int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    allocator = HostAllocator(1 << 20)

    async def main():
        disk = LocalDiskBackend(LMCacheConfig(local_disk=directory, max_local_disk_size=cap / (1 << 30)))
        while go != "-" and not __import__("os").path.exists(go):  # start together with the other writer
            time.sleep(0.01)
        stored = []
        for i in range(first, first + count):
            obj = allocator.allocate((2, 2, 16, 64), torch.bfloat16)
            obj.tensor.fill_(i)
            if await disk.put(f"m@1@0@bfloat16@v1@{tag}{i:060x}", obj):
                stored.append(i)
            obj.ref_down()
        await disk.close()
        print(json.dumps(stored))

    asyncio.run(main())
''')


def key(tag: str, i: int) -> str:
    return f"m@1@0@bfloat16@v1@{tag}{i:060x}"


def write(directory: Path, tag: str, first: int, count: int, go: str = "-") -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(CAP_FILES * FILE_BYTES), tag,
                             str(first), str(count), go], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> list[int]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def chunk_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.name.endswith(SUFFIX))


def test_two_processes_writing_at_once_stay_under_one_cap(tmp_path):
    go = tmp_path / "go"
    writers = [write(tmp_path / "cache", tag, 0, 3 * CAP_FILES, str(go)) for tag in ("aaaa", "bbbb")]
    go.touch()
    stored = [finish(w) for w in writers]
    assert all(len(s) == 3 * CAP_FILES for s in stored)  # every write found room by evicting
    cache = tmp_path / "cache"
    assert chunk_bytes(cache) <= CAP_FILES * FILE_BYTES  # one cap, not one per process
    assert SharedDiskBudget(str(cache), CAP_FILES * FILE_BYTES).used() == chunk_bytes(cache)
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp-")]


async def test_another_process_files_survive_while_the_directory_is_under_its_cap(tmp_path):
    # Two backends on one directory, both started before any write (as TP ranks or instances started
    # together): each has its own open budget file, so flock separates them as it separates processes.
    cache = tmp_path / "cache"
    a, b = (open_disk(str(cache), CAP_FILES * FILE_BYTES) for _ in range(2))
    allocator = HostAllocator(1 << 20)

    async def put(disk, tag, i):
        obj = allocator.allocate((2, 2, 16, 64), torch.bfloat16)
        obj.tensor.fill_(i)
        ok = await disk.put(key(tag, i), obj)
        obj.ref_down()
        return ok

    for i in range(4):
        assert await put(a, "aaaa", i) and await put(b, "bbbb", i)  # 8 files <= 10: nothing evicted
    a_files = [cache / filename_for(key("aaaa", i)) for i in range(4)]
    assert all(p.exists() for p in a_files) and metrics.value("evictions", tier="local_disk") == 0
    for i in range(4, 8):  # B goes over the cap: it evicts its own least recently used files, not A's
        assert await put(b, "bbbb", i)
    assert all(p.exists() for p in a_files)
    assert [(cache / filename_for(key("bbbb", i))).exists() for i in range(8)] == [False] * 2 + [True] * 6
    assert chunk_bytes(cache) == CAP_FILES * FILE_BYTES
    await a.close()
    await b.close()


async def test_two_commits_of_the_same_key_count_once(tmp_path):
    """Two writers (processes, TP ranks) storing the same key at once both write a temp file; the second
    rename replaces the first file, so the directory holds one file, and the count must say one."""
    cache = tmp_path / "cache"
    a, b = (open_disk(str(cache), CAP_FILES * FILE_BYTES) for _ in range(2))
    allocator = HostAllocator(1 << 20)
    objs = [allocator.allocate((2, 2, 16, 64), torch.bfloat16) for _ in range(2)]
    for obj in objs:
        obj.tensor.fill_(7)
    # Hold the directory's budget lock: both writers get as far as their commit and wait there.
    lock_fd = os.open(cache / USAGE_FILE, os.O_RDWR)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        puts = [asyncio.ensure_future(disk.put(key("same", 1), obj)) for disk, obj in zip((a, b), objs)]
        deadline = time.monotonic() + 30
        while len([p for p in cache.iterdir() if p.name.startswith(".tmp-")]) < 2:
            assert time.monotonic() < deadline, "the writers did not reach their commits"
            await asyncio.sleep(0.01)
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)
    assert await asyncio.gather(*puts) == [True, True]
    assert chunk_bytes(cache) == FILE_BYTES
    assert SharedDiskBudget(str(cache), 0).used() == FILE_BYTES
    for obj in objs:
        obj.ref_down()
    await a.close()
    await b.close()


def test_a_restarted_process_makes_room_from_the_oldest_files(tmp_path):
    cache = tmp_path / "cache"
    assert finish(write(cache, "aaaa", 0, 4)) == [0, 1, 2, 3]
    assert finish(write(cache, "bbbb", 0, 4)) == [0, 1, 2, 3]
    # A new process found them all at start-up; nobody is known to use them: the oldest go first.
    assert finish(write(cache, "cccc", 0, 4)) == [0, 1, 2, 3]
    gone = [tag for tag in ("aaaa", "bbbb") for i in range(4) if not (cache / filename_for(key(tag, i))).exists()]
    assert gone == ["aaaa", "aaaa"]
    assert chunk_bytes(cache) == CAP_FILES * FILE_BYTES


def test_a_drifted_count_is_recounted(tmp_path):
    cache = tmp_path / "cache"
    assert finish(write(cache, "aaaa", 0, 4)) == [0, 1, 2, 3]
    budget = SharedDiskBudget(str(cache), CAP_FILES * FILE_BYTES)
    with budget.transaction() as usage:  # a writer that died in its commit: the count is far too high
        usage.used += 100 * FILE_BYTES
    assert budget.used() > CAP_FILES * FILE_BYTES
    assert finish(write(cache, "bbbb", 0, 2)) == [0, 1]  # starting re-counts the directory
    assert budget.used() == chunk_bytes(cache) == 6 * FILE_BYTES
    assert (cache / USAGE_FILE).stat().st_mode & 0o777 == 0o600
    budget.close()


def test_clearing_the_directory_from_the_cli_takes_its_bytes_off_the_count(tmp_path):
    from lmcache_vllm.admin.disk import clear_disk

    cache = tmp_path / "cache"
    assert finish(write(cache, "aaaa", 0, 4)) == [0, 1, 2, 3]
    budget = SharedDiskBudget(str(cache), CAP_FILES * FILE_BYTES)
    assert budget.used() == 4 * FILE_BYTES
    assert clear_disk(str(cache))["files"] == 4
    assert budget.used() == 0 == chunk_bytes(cache)
    budget.close()
