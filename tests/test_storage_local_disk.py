"""Tests for lmcache_vllm.storage.local_disk with real files: round trips, permissions, re-index after a
restart, corrupt/truncated files, concurrency, size-capped LRU eviction and a full filesystem."""

import asyncio
import errno
import os
import stat
import subprocess

import pytest
import torch
from disk_tier import open_disk

from lmcache_vllm.config import ConfigError
from lmcache_vllm.memory import HostAllocator
from lmcache_vllm.observability import metrics
from lmcache_vllm.storage import codec, local_disk
from lmcache_vllm.storage.disk_budget import USAGE_FILE
from lmcache_vllm.storage.local_disk import filename_for

CHUNK = (2, 2, 16, 64)  # bf16: 8 KiB payload, 12 KiB on disk with the 4 KiB header
FILE_BYTES = 4096 + 2 * 2 * 16 * 64 * 2


def listing(path) -> list[str]:
    """The directory's files but the shared usage count every process keeps there (disk_budget.py)."""
    return [name for name in os.listdir(path) if name != USAGE_FILE]


def key(i: int, model: str = "m") -> str:
    return f"{model}@1@0@bfloat16@v1@{i:064x}"


@pytest.fixture
def alloc():
    allocator = HostAllocator(8 << 20)
    yield lambda shape, dtype: allocator.allocate(shape, dtype)
    assert allocator.used_bytes == 0, "a test leaked MemoryObjs"


def obj_of(tensor):
    allocator = HostAllocator(tensor.numel() * tensor.element_size() + 4096)
    obj = allocator.allocate(tensor.shape, tensor.dtype)
    obj.tensor.copy_(tensor)
    return obj


async def test_round_trip_permissions_and_names(tmp_path, alloc, make_chunk):
    root = tmp_path / "cache"
    disk = open_disk(f"file://{root}", 1 << 20)
    src = make_chunk(1, CHUNK)
    assert await disk.put(key(1), obj_of(src))
    assert await disk.contains([key(1), key(2)]) == [True, False]
    got = await disk.get(key(1), alloc)
    assert torch.equal(got.tensor, src)
    got.ref_down()
    assert await disk.get(key(2), alloc) is None
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
    (name,) = listing(root)
    assert name == filename_for(key(1)) and "/" not in name
    assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o600
    assert os.path.getsize(root / name) == FILE_BYTES
    await disk.close()


def test_filenames_are_safe_and_bounded():
    assert filename_for("a/b:c@d") == "a%2Fb%3Ac@d.lmc"
    long = filename_for("x" * 500)
    assert long.startswith("h-") and len(long) < 100


async def test_restart_reindexes_and_leaves_foreign_files_alone(tmp_path, alloc, make_chunk):
    disk = open_disk(str(tmp_path), 1 << 20)
    for i in range(3):
        assert await disk.put(key(i), obj_of(make_chunk(i, CHUNK)))
    assert await disk.put(key(9, model="other"), obj_of(make_chunk(9, CHUNK)))
    await disk.close()
    # a file of a future format version and an unrelated file: both must survive the restart
    future = bytearray(codec.encode_header(key(7), make_chunk(7, CHUNK), align=4096))
    future[4:6] = (max(codec.READABLE_FORMATS) + 1).to_bytes(2, "little")
    (tmp_path / filename_for(key(7))).write_bytes(bytes(future))
    (tmp_path / "notes.txt").write_text("keep me")

    disk2 = open_disk(str(tmp_path), 1 << 20, key_filter=lambda k: k.startswith("m@"))
    assert await disk2.contains([key(0), key(1), key(2), key(9, "other"), key(7)]) == \
        [True, True, True, False, False]
    got = await disk2.get(key(2), alloc)
    assert torch.equal(got.tensor, make_chunk(2, CHUNK))
    got.ref_down()
    assert disk2.used_bytes == 3 * FILE_BYTES
    await disk2.clear()
    assert sorted(listing(tmp_path)) == sorted(
        [filename_for(key(9, "other")), filename_for(key(7)), "notes.txt"])
    await disk2.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_corrupt_file_is_a_miss_and_removed(tmp_path, alloc, make_chunk, damage):
    disk = open_disk(str(tmp_path), 1 << 20)
    assert await disk.put(key(1), obj_of(make_chunk(1, CHUNK)))
    path = tmp_path / filename_for(key(1))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[5000] ^= 0xFF
    else:
        data = data[:6000]
    path.write_bytes(bytes(data))
    assert await disk.get(key(1), alloc) is None
    assert not path.exists() and metrics.value("corrupt_chunks", tier="local_disk") == 1
    assert await disk.contains([key(1)]) == [False]
    await disk.close()


async def test_truncated_file_is_removed_at_startup(tmp_path, make_chunk):
    disk = open_disk(str(tmp_path), 1 << 20)
    assert await disk.put(key(1), obj_of(make_chunk(1, CHUNK)))
    await disk.close()
    path = tmp_path / filename_for(key(1))
    path.write_bytes(path.read_bytes()[:5000])
    disk2 = open_disk(str(tmp_path), 1 << 20)
    assert await disk2.contains([key(1)]) == [False]
    assert not path.exists() and metrics.value("corrupt_chunks", tier="local_disk") == 1
    await disk2.close()


async def test_concurrent_stores_and_reads(tmp_path, alloc, make_chunk):
    disk = open_disk(str(tmp_path), 4 << 20, disk_io_threads=4, write_workers=2)
    chunks = {i: make_chunk(i, CHUNK) for i in range(24)}
    results = await asyncio.gather(*(disk.put(key(i), obj_of(t)) for i, t in chunks.items()),
                                   *(disk.put(key(i), obj_of(t)) for i, t in chunks.items()))
    assert all(results)
    assert len(listing(tmp_path)) == 24  # duplicates were not written twice
    for _ in range(2):
        got = await disk.get_many([key(i) for i in chunks], alloc)
        for i, obj in zip(chunks, got):
            assert torch.equal(obj.tensor, chunks[i])
            obj.ref_down()
    await disk.close()


async def test_size_cap_evicts_least_recently_used(tmp_path, alloc, make_chunk):
    disk = open_disk(str(tmp_path), 3 * FILE_BYTES)
    for i in range(3):
        assert await disk.put(key(i), obj_of(make_chunk(i, CHUNK)))
    (await disk.get(key(0), alloc)).ref_down()  # 0 becomes most recent; 1 is now the oldest
    assert await disk.put(key(3), obj_of(make_chunk(3, CHUNK)))
    assert await disk.contains([key(i) for i in range(4)]) == [True, False, True, True]
    assert len(listing(tmp_path)) == 3 and disk.used_bytes == 3 * FILE_BYTES
    big = obj_of(torch.zeros(4 * FILE_BYTES, dtype=torch.uint8))
    assert not await disk.put(key(99), big)  # larger than the whole cap: dropped, nothing evicted
    assert metrics.value("failed_writes", tier="local_disk") == 1 and len(listing(tmp_path)) == 3
    await disk.close()


@pytest.fixture
def tiny_fs(tmp_path, monkeypatch):
    """A 64 KiB tmpfs when this process may mount one (root, as in CI); otherwise ENOSPC is injected."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)],
                             capture_output=True).returncode == 0
    if not mounted:
        real_writev = os.writev
        written = {"bytes": 0}

        def writev_until_full(fd, buffers):
            n = real_writev(fd, buffers)
            written["bytes"] += n
            if written["bytes"] > 64 * 1024:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            return n
        monkeypatch.setattr(local_disk.os, "writev", writev_until_full)
    yield mnt
    if mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


async def test_full_disk_drops_stores_without_crashing(tiny_fs, alloc, make_chunk):
    disk = open_disk(str(tiny_fs / "cache"), 1 << 30)  # the cap is not what stops it
    results = [await disk.put(key(i), obj_of(make_chunk(i, CHUNK))) for i in range(10)]
    assert results[0] and not all(results)
    assert metrics.value("failed_writes", tier="local_disk") >= 1
    assert not [n for n in listing(tiny_fs / "cache") if n.startswith(".tmp-")]
    stored = [i for i, ok in enumerate(results) if ok]
    got = await disk.get_many([key(i) for i in stored], alloc)
    for i, obj in zip(stored, got):
        assert torch.equal(obj.tensor, make_chunk(i, CHUNK))
        obj.ref_down()
    await disk.close()


async def test_cancelled_read_frees_its_memory(tmp_path, make_chunk):
    allocator = HostAllocator(8 << 20)
    disk = open_disk(str(tmp_path), 8 << 20)
    big = make_chunk(5, (4, 2, 256, 512))  # 2 MiB
    assert await disk.put(key(5), obj_of(big))
    for _ in range(5):
        task = asyncio.ensure_future(disk.get(key(5), lambda s, d: allocator.allocate(s, d)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await disk.close()  # joins the read threads, whose done-callbacks release what they read
    assert allocator.used_bytes == 0


def _supports_direct_io(path) -> bool:
    probe = os.path.join(path, ".probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    return True


@pytest.mark.parametrize("where", ["tmp", "shm"])
async def test_direct_io_round_trip_with_unaligned_tail(tmp_path, where, alloc):
    root = tmp_path if where == "tmp" else "/dev/shm"
    if where == "shm" and not os.path.isdir(root):
        pytest.skip("no /dev/shm")
    root = os.path.join(root, f"lmv-direct-{os.getpid()}")
    disk = open_disk(root, 1 << 24)
    try:
        src = torch.arange(35_003, dtype=torch.float32).to(torch.bfloat16)  # 70,006 bytes: a short tail
        obj = obj_of(src)
        assert obj.tensor.data_ptr() % 4096 == 0
        assert await disk.put(key(1), obj)
        assert disk.direct_io == _supports_direct_io(root)  # tmpfs refuses O_DIRECT: page cache then
        (name,) = listing(root)
        assert os.path.getsize(os.path.join(root, name)) == 4096 + src.numel() * 2
        got = await disk.get(key(1), alloc)
        assert torch.equal(got.tensor, src)
        got.ref_down()
    finally:
        await disk.clear()
        await disk.close()
        os.unlink(os.path.join(root, USAGE_FILE))
        os.rmdir(root)


async def test_object_off_a_page_is_written_through_the_page_cache(tmp_path, alloc, make_chunk):
    disk = open_disk(str(tmp_path / "cache"), 1 << 20)
    allocator = HostAllocator(1 << 20)
    small = allocator.allocate((16,), torch.uint8)  # pushes the chunk 64 bytes past a page
    src = make_chunk(3, CHUNK)
    obj = allocator.allocate(src.shape, src.dtype)
    obj.tensor.copy_(src)
    assert obj.tensor.data_ptr() % 4096 != 0
    assert await disk.put(key(3), obj)
    got = await disk.get(key(3), alloc)
    assert torch.equal(got.tensor, src)
    got.ref_down()
    small.ref_down()
    await disk.close()


async def test_keyed_mac_files_of_another_writer_are_misses_and_deleted(tmp_path, alloc, make_chunk):
    mac = codec.ChunkMac("fleet secret")
    src = make_chunk(3, CHUNK)
    signed = open_disk(str(tmp_path), 1 << 20, mac=mac)
    unsigned = open_disk(str(tmp_path), 1 << 20)
    assert await signed.put(key(1), obj_of(src))
    assert await unsigned.put(key(2), obj_of(src))  # e.g. planted by someone without the secret
    got = await signed.get(key(1), alloc)
    assert torch.equal(got.tensor, src)
    got.ref_down()
    assert await signed.get(key(2), alloc) is None
    assert not (tmp_path / filename_for(key(2))).exists()
    assert metrics.value("unauthenticated_chunks") == 1
    assert metrics.value("corrupt_chunks", tier="local_disk") == 1
    for disk in (signed, unsigned):
        await disk.close()


# ---- directory trust: who owns and can write the directory, and what may stand in place of a chunk file
OTHER_UID = 65534  # nobody


@pytest.mark.parametrize("setup", ["other_owner", "world_writable", "group_writable"])
async def test_directory_others_can_write_is_refused_unless_shared(tmp_path, setup):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    if setup == "other_owner":
        os.chown(root, OTHER_UID, OTHER_UID)  # real ownership; root reads it anyway: the check is ours
    else:
        os.chmod(root, 0o777 if setup == "world_writable" else 0o770)
    mode = stat.S_IMODE(os.stat(root).st_mode)
    with pytest.raises(ConfigError, match="local_disk_shared") as refused:
        open_disk(str(root), 1 << 20)
    assert "local_disk" in str(refused.value) and str(root) in str(refused.value)
    owner = os.stat(root).st_uid
    disk = open_disk(str(root), 1 << 20, local_disk_shared=True)  # configured as shared: used as it is
    assert stat.S_IMODE(os.stat(root).st_mode) == mode and os.stat(root).st_uid == owner
    await disk.close()


async def test_directories_we_create_are_0700_and_the_users_own_is_left_alone(tmp_path):
    made = tmp_path / "a" / "b" / "cache"
    disk = open_disk(str(made), 1 << 20)
    await disk.close()
    for d in (tmp_path / "a", tmp_path / "a" / "b", made):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    os.chmod(mine, 0o755)
    disk = open_disk(str(mine), 1 << 20)  # ours, nobody else can write it: used, and not chmod-ed
    await disk.close()
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o755


def _finish_fifo_reads(path) -> None:
    """Lets a reader blocked opening the FIFO at `path` go (it would otherwise block its thread for ever)."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


async def test_fifo_in_place_of_a_chunk_is_a_miss_not_a_hang(tmp_path, alloc, make_chunk):
    disk = open_disk(str(tmp_path / "cache"), 1 << 20)
    assert await disk.put(key(1), obj_of(make_chunk(1, CHUNK)))
    path = tmp_path / "cache" / filename_for(key(1))
    os.unlink(path)
    os.mkfifo(path, 0o600)
    try:
        assert await asyncio.wait_for(disk.get(key(1), alloc), 5) is None
        assert metrics.value("corrupt_chunks", tier="local_disk") == 1 and not path.exists()
        os.mkfifo(tmp_path / "cache" / filename_for(key(2)), 0o600)  # planted under a key never written
        assert await asyncio.wait_for(disk.contains([key(2)]), 5) == [False]
        assert await asyncio.wait_for(disk.get(key(2), alloc), 5) is None
        restarted = await asyncio.wait_for(asyncio.to_thread(open_disk, tmp_path / "cache", 1 << 20), 5)
        await restarted.close()
    finally:
        for name in (filename_for(key(1)), filename_for(key(2))):
            _finish_fifo_reads(tmp_path / "cache" / name)
        await disk.close()


async def test_symlinks_are_never_followed(tmp_path, alloc, make_chunk):
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    src = make_chunk(1, CHUNK)
    outside = open_disk(str(elsewhere), 1 << 20)
    assert await outside.put(key(1), obj_of(src))
    await outside.close()
    disk = open_disk(str(cache), 1 << 20)
    os.symlink(elsewhere / filename_for(key(1)), cache / filename_for(key(1)))  # a valid chunk, behind a link
    assert await disk.contains([key(1)]) == [False]
    assert await disk.get(key(1), alloc) is None
    assert (elsewhere / filename_for(key(1))).exists()  # whatever we remove, never the link's target
    await disk.close()
    # The usage count file planted as a link to a file of someone else's: refused, the file untouched.
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o700)
    os.symlink(victim, plain / USAGE_FILE)
    with pytest.raises(ConfigError, match=USAGE_FILE):
        open_disk(str(plain), 1 << 20)
    assert victim.read_bytes() == b"precious"


async def test_hard_links_are_refused_and_never_counted(tmp_path, alloc, make_chunk):
    """A hard link in the directory (of a shared one, anyone's) is another name of a file elsewhere: read as a
    chunk, counted in the byte budget, or written as the usage count, it would redirect writes and drift the
    budget. It is a miss, its name (not the file) removed, its bytes never counted (issue 30 #11)."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    outside = open_disk(str(elsewhere), 1 << 20)
    assert await outside.put(key(1), obj_of(make_chunk(1, CHUNK)))
    await outside.close()
    disk = open_disk(str(cache), 1 << 20)
    os.link(elsewhere / filename_for(key(1)), cache / filename_for(key(1)))  # a valid chunk, under two names
    assert await disk.contains([key(1)]) == [False]
    assert await disk.get(key(1), alloc) is None
    assert (elsewhere / filename_for(key(1))).exists()  # the file itself untouched
    await disk.close()
    again = open_disk(str(cache), 1 << 20)
    assert again._budget.used() == 0  # a restart's recount skips such a name
    await again.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    plain = tmp_path / "plain"
    plain.mkdir(mode=0o700)
    os.link(victim, plain / USAGE_FILE)  # the usage count planted as a second name of someone's file
    with pytest.raises(ConfigError, match=USAGE_FILE):
        open_disk(str(plain), 1 << 20)
    assert victim.read_bytes() == b"precious"


async def test_a_key_rotation_reads_the_chunks_of_the_old_key_and_the_new(tmp_path, alloc, make_chunk):
    """Issue 39 #6: one key only made a rotation empty every cache (the key's id was in every key's fingerprint,
    and only one key verified). With a list, the fleet moves [old] -> [old, new] -> [new, old] -> [new]: at each
    step an instance reads what the previous step wrote, under the same keys."""
    old, new = "the-old-fleet-key-0123456789", "the-new-fleet-key-0123456789"
    src = make_chunk(5, CHUNK)
    steps = [codec.ChunkMac(old), codec.ChunkMac([old, new]), codec.ChunkMac([new, old]), codec.ChunkMac(new)]
    for i, (writer, reader) in enumerate(zip(steps, steps[1:])):
        write = open_disk(str(tmp_path), 1 << 20, mac=writer)
        assert await write.put(key(10 + i), obj_of(src))
        await write.close()
        read = open_disk(str(tmp_path), 1 << 20, mac=reader)
        got = await read.get(key(10 + i), alloc)
        assert got is not None and torch.equal(got.tensor, src), f"step {i + 1} did not read step {i}'s chunk"
        got.ref_down()
        await read.close()
    assert metrics.value("unauthenticated_chunks") == 0
    last = open_disk(str(tmp_path), 1 << 20, mac=codec.ChunkMac(new))  # the old key is gone: its chunks too
    write = open_disk(str(tmp_path), 1 << 20, mac=codec.ChunkMac(old))
    assert await write.put(key(20), obj_of(src))
    assert await last.get(key(20), alloc) is None
    assert metrics.value("unauthenticated_chunks") == 1
    for disk in (last, write):
        await disk.close()
