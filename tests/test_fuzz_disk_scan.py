"""Fuzzing the disk tier's directory handling (`storage/local_disk.py`, `storage/disk_dir.py`) and the admin
tools that read it (`admin/disk.py`): directories owned by another user or writable by others, and in
them chunk files, damaged files, symbolic links (to chunks elsewhere, dangling, to directories), FIFOs,
subdirectories, files of another owner or no permissions, temp files. The tier either refuses the
directory at start (ConfigError: unless shared, exactly when others can write it) or starts, answers
every lookup and read (a hit, or a miss), never follows a link nor blocks on a FIFO, and closes cleanly."""
from __future__ import annotations

import asyncio
import os
import shutil
import stat
import threading

import pytest
import torch
from disk_tier import open_disk
from fuzzing import bounded_run, examples
from hypothesis import given
from hypothesis import strategies as st

from lmcache_vllm.admin.disk import clear_disk, inspect_disk
from lmcache_vllm.config.fields import ConfigError
from lmcache_vllm.memory import AllocationError, HostAllocator
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.disk_budget import USAGE_FILE
from lmcache_vllm.storage.local_disk import (
    HEADER_ALIGN,
    TMP_PREFIX,
    filename_for,
)

pytestmark = pytest.mark.fuzz

OTHER_UID = 65534  # nobody: a real other owner (we run as root, which bypasses modes: the checks are ours)
KEYS = [f"m@1@0@bfloat16@v1@{i:064x}" for i in range(6)]
SHAPE = (2, 2, 8, 16)
ARENA = HostAllocator(4 << 20)
DIR_SETUPS = ("own_0700", "own_0755", "other_owner", "world_writable", "group_writable", "sticky_1777")
KINDS = ("chunk", "chunk_other_key", "damaged", "crafted", "symlink_chunk", "symlink_dangling", "symlink_dir",
         "fifo", "subdir", "other_owner_chunk", "mode_000_chunk", "empty", "tmp", "usage_symlink", "usage_fifo")


def chunk_bytes(key: str, seed: int) -> bytes:
    tensor = torch.full(SHAPE, float(seed), dtype=torch.bfloat16)
    header = codec.encode_header(key, tensor, align=HEADER_ALIGN)
    return header + bytes(codec.payload_view(tensor))


def alloc(shape, dtype):
    try:
        return ARENA.allocate(shape, dtype, timeout=0.0)
    except AllocationError:
        return None


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def plant(root: str, outside: str, kind: str, i: int, data: int) -> None:
    key = KEYS[i % len(KEYS)]
    path = os.path.join(root, filename_for(key))
    if os.path.lexists(path) and kind not in ("usage_symlink", "usage_fifo", "tmp"):
        return
    if kind == "chunk":
        _write(path, chunk_bytes(key, data))
    elif kind == "chunk_other_key":
        _write(path, chunk_bytes(KEYS[(i + 1) % len(KEYS)], data))
    elif kind == "damaged":
        raw = bytearray(chunk_bytes(key, data))
        raw[data % len(raw)] ^= 0xFF
        _write(path, bytes(raw))
    elif kind == "crafted":  # a header claiming an absurd shape, checksum valid
        from test_storage_codec import craft_chunk
        _write(path, craft_chunk(key, (0, 2**63 - data)))
    elif kind == "symlink_chunk":
        target = os.path.join(outside, f"target-{i}")
        _write(target, chunk_bytes(key, data))
        os.symlink(target, path)
    elif kind == "symlink_dangling":
        os.symlink(os.path.join(outside, "missing"), path)
    elif kind == "symlink_dir":
        os.symlink(outside, path)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "subdir":
        os.mkdir(path)
    elif kind == "other_owner_chunk":
        _write(path, chunk_bytes(key, data))
        os.chown(path, OTHER_UID, OTHER_UID)
    elif kind == "mode_000_chunk":
        _write(path, chunk_bytes(key, data))
        os.chmod(path, 0)
    elif kind == "empty":
        _write(path, b"")
    elif kind == "tmp":
        _write(os.path.join(root, f"{TMP_PREFIX}{i}"), b"x" * data)
    elif kind == "usage_symlink" and not os.path.lexists(os.path.join(root, USAGE_FILE)):
        victim = os.path.join(outside, "victim")
        _write(victim, b"precious")
        os.symlink(victim, os.path.join(root, USAGE_FILE))
    elif kind == "usage_fifo" and not os.path.lexists(os.path.join(root, USAGE_FILE)):
        os.mkfifo(os.path.join(root, USAGE_FILE), 0o600)


def set_up_directory(root: str, setup: str) -> bool:
    """Applies `setup` to the directory; True when others can write it."""
    if setup == "other_owner":
        os.chown(root, OTHER_UID, OTHER_UID)
    os.chmod(root, {"own_0700": 0o700, "own_0755": 0o755, "other_owner": 0o755, "world_writable": 0o777,
                    "group_writable": 0o770, "sticky_1777": 0o1777}[setup])
    return setup not in ("own_0700", "own_0755")


def release_fifos(root: str) -> None:
    """Opens every FIFO for writing once, so that a reader blocked on one (a regression) is let go."""
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if stat.S_ISFIFO(os.lstat(path).st_mode):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def run_bounded(fn, timeout: float = 20.0):
    """`fn()` on a thread; fails the example if it does not finish in `timeout` s (a FIFO read or open)."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn()
        except BaseException as exc:  # re-raised on the test's thread
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the disk tier blocked (a FIFO or a link followed?)"
    if "error" in result:
        raise result["error"]
    return result.get("value")


async def use_the_tier(root: str, shared: bool) -> None:
    disk = open_disk(root, 1 << 20, disk_io_threads=2, write_workers=1, local_disk_shared=shared)
    try:
        found = await disk.contains(KEYS)
        for key, _hit in zip(KEYS, found):
            obj = await disk.get(key, alloc)
            if obj is not None:  # (a get may find a file the contains did not: no assertion on `_hit`)
                assert tuple(obj.tensor.shape) == SHAPE
                obj.ref_down()
        src = ARENA.allocate(SHAPE, torch.bfloat16)
        src.tensor.fill_(3)
        await disk.put(KEYS[0] + "-new", src)
        src.ref_down()
    finally:
        await disk.close()


def test_disk_directories_and_what_stands_in_them(tmp_path):
    @examples(100)
    @given(st.sampled_from(DIR_SETUPS), st.booleans(),
           st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 5), st.integers(1, 5000)), max_size=10))
    def one_directory(setup, shared, plants):
        case = tmp_path / "case"
        root, outside = str(case / "cache"), str(case / "outside")
        os.makedirs(root)
        os.makedirs(outside)
        try:
            for kind, i, data in plants:
                plant(root, outside, kind, i, data)
            exposed = set_up_directory(root, setup)
            # Refused exactly when others can write the directory and it is not shared, or when a link or
            # FIFO (all that is ever planted there) stands in place of the usage count.
            must_refuse = (exposed and not shared) or os.path.lexists(os.path.join(root, USAGE_FILE))
            try:
                run_bounded(lambda: asyncio.run(use_the_tier(root, shared)))
            except ConfigError:
                assert must_refuse
            else:
                assert not must_refuse, "started on a directory it must refuse"
            run_bounded(lambda: inspect_disk(root))
            run_bounded(lambda: clear_disk(root, dry_run=True))
            if os.path.lexists(os.path.join(outside, "victim")):
                with open(os.path.join(outside, "victim"), "rb") as f:
                    assert f.read() == b"precious"
            assert ARENA.used_bytes == 0
        finally:
            release_fifos(root)
            shutil.rmtree(case)

    with bounded_run():
        one_directory()
