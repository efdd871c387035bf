"""One chunk file of the disk tier: its name (`filename_for`), the one rule of whether it is valid
(`check_file`), and its I/O: full reads and writes, O_DIRECT writes, and a whole chunk file read
(`read_chunk`) or written atomically (`write_chunk`: a temp file renamed into place).

- File name: the key string with every byte outside `[A-Za-z0-9._@-]` percent-escaped, plus `.lmc`
  (keys too long for a file name use `h-<xxh3_128 of the key>.lmc`; the key is in the header anyway).
- Contents: `codec` header padded to 4 KiB (`HEADER_ALIGN`), then the payload: the raw bytes (naive), or
  as the tier's codec stored them (`codec.encode_parts`; read back through a buffer and decoded).
- Temp files (`.tmp-*`) hold a write in progress until it is renamed into place; one older than
  `STALE_TMP_SECS` is a crashed writer's and is removed (by the tier's start-up scan and by `clear`).

O_DIRECT needs the memory address, the file offset and the length in whole logical blocks
(`DIRECT_ALIGN`, 4 KiB covers every common device). A chunk file is a header padded to 4 KiB plus the
payload; the payload comes straight from the host arena, whose large objects start on a page (see
`memory/allocator.py`). A payload tail shorter than a block is written through the page cache.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
from typing import TYPE_CHECKING, Callable, Optional, Sequence
from urllib.parse import quote, unquote

import xxhash

from lmcache_vllm.memory import AllocFn, MemoryObj
from lmcache_vllm.observability import logs
from lmcache_vllm.storage import codec, disk_dir

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

logger = logging.getLogger(__name__)

DIRECT_ALIGN = 4096
SUFFIX = ".lmc"
TMP_PREFIX = ".tmp-"
HEADER_ALIGN = 4096
_MAX_NAME = 200
# A temp file lives for one chunk write: well under a second on a local disk, minutes at worst on a
# stalled or network file system (a chunk is up to ~130 MB, fsync-ed with disk_fsync). An hour is far
# beyond any live write, so removing older ones never pulls a file from under a live writer (another
# process sharing the directory included); what it leaves is at most an hour of a crashed writer's.
STALE_TMP_SECS = 3600.0


class MisnamedFile(codec.CorruptEntry):
    """A chunk file with a valid header whose key belongs under another file name."""


def filename_for(key: str) -> str:
    name = quote(key, safe="@") + SUFFIX
    if len(name) > _MAX_NAME:
        return "h-" + xxhash.xxh3_128_hexdigest(key.encode()) + SUFFIX
    return name


def key_from_filename(name: str) -> Optional[str]:
    """The key a chunk file's name spells; None for hashed names (the key is in the header) and others."""
    if name.startswith("h-") or not name.endswith(SUFFIX):
        return None
    return unquote(name[:-len(SUFFIX)])


def is_stale_tmp(name: str, mtime: float, now: float) -> bool:
    """A temp file a crashed writer left (see `STALE_TMP_SECS`)."""
    return name.startswith(TMP_PREFIX) and now - mtime > STALE_TMP_SECS


def check_file(name: str, head: bytes, size: int,
               accept: Optional[Callable[[str], bool]] = None) -> Optional[codec.ChunkHeader]:
    """The one rule of whether the file `name` in a disk tier's directory, `size` bytes starting with
    `head` (at least `codec.MAX_HEADER_SIZE` bytes, or the whole file), is a valid chunk file. Used by
    the tier's start-up scan and its lookups (`local_disk`), its reads (`read_chunk`) and the admin tools
    (`admin/disk.py`):

    - None: not ours to judge, left alone by everyone: another format version or not a chunk at all, or
      a key `accept` rejects (e.g. another model's chunk in a shared directory).
    - `MisnamedFile`: a valid header whose key belongs under another file name.
    - `codec.CorruptEntry`: ours, but damaged: the header does not parse or check (`codec.parse_header`),
      or the file is not exactly header + payload bytes (truncated or padded).
    - Else its header. The payload's checksum and MAC are checked once it is read (`codec.verify_payload`).
    """
    if codec.read_format_version(head) not in codec.READABLE_FORMATS:
        return None
    header = codec.parse_header(head)
    if filename_for(header.key) != name:
        raise MisnamedFile(f"file name does not match its key {header.key!r}")
    if accept is not None and not accept(header.key):
        return None
    codec.check_size(header, size)
    return header


def create(path: str, direct: bool) -> tuple[int, bool]:
    """Creates `path` (mode 0600, must not exist) for writing; returns (fd, whether O_DIRECT is on).
    A file system that refuses O_DIRECT (tmpfs) gets a plain file descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o600), False


def write_direct(fd: int, header: bytes, payload: memoryview) -> bool:
    """Writes header + payload to `fd` (opened with O_DIRECT, empty). Returns False, with the file left
    empty and O_DIRECT off, when the file system refuses an O_DIRECT write; the caller then writes
    through the page cache."""
    if len(header) % DIRECT_ALIGN:
        raise ValueError(f"header of {len(header)} bytes is not a multiple of {DIRECT_ALIGN}")
    body = len(payload) - len(payload) % DIRECT_ALIGN
    head = mmap.mmap(-1, len(header))  # page-aligned memory for the header
    try:
        head.write(header)
        write_full(fd, [head])
        if body:
            write_full(fd, [payload[:body]])
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _clear_direct(fd)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        return False
    finally:
        head.close()
    if body < len(payload):
        _clear_direct(fd)
        write_full(fd, [payload[body:]])
    return True


def _clear_direct(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def write_full(fd: int, buffers: Sequence[Buffer]) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    try:
        while views:
            n = os.writev(fd, views)
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]
    finally:
        # A failed write (ENOSPC) keeps this frame alive in its traceback: release the views now, or
        # the caller could not close an mmap they point into (BufferError instead of the OSError).
        for view in views:
            view.release()


def pread_full(fd: int, dest: memoryview, offset: int) -> None:
    done, total = 0, len(dest)
    while done < total:
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n == 0:
            raise codec.CorruptEntry(f"file truncated: {done} of {total} payload bytes")
        done += n


def read_chunk(path: str, key: str, alloc: AllocFn,
               mac: Optional[codec.ChunkMac] = None) -> Optional[MemoryObj]:
    """The chunk stored in file `path` under `key`, read straight into memory from `alloc(shape, dtype)`
    (None when `alloc` has none); `codec.CorruptEntry` when the file is not that chunk (or not signed
    with `mac`, a `codec.ChunkMac`, when given; `disk_dir.NotRegularFile`, one too, when a symbolic
    link, FIFO or anything but a regular file stands there)."""
    fd = disk_dir.open_regular(path)
    try:
        head = os.pread(fd, codec.MAX_HEADER_SIZE, 0)
        header = check_file(os.path.basename(path), head, os.fstat(fd).st_size, key.__eq__)
        if header is None:
            raise codec.CorruptEntry(f"{path} is not a chunk file of this format holding {key!r}")
        obj = codec.allocate(header, alloc)  # (an unexpected shape or dtype: refused before allocating)
        if obj is None:
            return None
        try:
            if header.coded:  # read into a buffer of its own, checked, decoded into the chunk's memory
                stored = codec.payload_buffer(header.payload_len)
                pread_full(fd, stored, header.header_len)
                codec.decode_payload_into(stored, header, obj.tensor, mac)
            else:  # straight into the chunk's memory, checked there
                dest = codec.payload_view(obj.tensor)
                pread_full(fd, dest, header.header_len)
                codec.verify_payload(header, dest, mac)
        except BaseException:
            obj.ref_down()
            raise
        return obj
    finally:
        os.close(fd)


def write_chunk(directory: str, name: str, tmp_name: str, header: bytes, payload: codec.ChunkBytes, direct: bool,
                fsync: bool, direct_refused: Optional[Callable[[str], None]] = None,
                commit: Optional[Callable[[str, str], bool]] = None) -> bool:
    """Writes header + payload to `directory/tmp_name` (O_DIRECT when `direct` and the file system
    allows; `direct_refused(what)` is told when it does not), then renames it to `name` (or has
    `commit(tmp path, final path)` do it; it may refuse), so a reader never sees half a file. False
    (temp file removed) when the write failed, e.g. on a full disk, or the commit refused."""
    tmp = os.path.join(directory, tmp_name)
    try:
        fd, opened_direct = create(tmp, direct)
    except OSError as exc:
        logs.warn(logger, "disk_write_failed", "cannot create a chunk file in %s: %s", directory, exc)
        return False
    if direct and not opened_direct and direct_refused is not None:
        direct_refused("open")
    try:
        try:
            if opened_direct and not write_direct(fd, header, memoryview(payload).cast("B")):
                if direct_refused is not None:
                    direct_refused("write")
                opened_direct = False
            if not opened_direct:
                write_full(fd, [header, payload])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        final = os.path.join(directory, name)
        if commit is None:
            os.rename(tmp, final)
        elif not commit(tmp, final):
            os.unlink(tmp)
            return False
        return True
    except OSError as exc:
        if exc.errno != errno.ENOSPC:  # a full disk is expected: counted (failed_writes), not logged
            logs.warn(logger, "disk_write_failed", "writing chunk file %s failed: %s", name, exc)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
