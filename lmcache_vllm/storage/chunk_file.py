"""Low-level I/O of one chunk file of the disk tier: full reads and writes, and O_DIRECT writes.

O_DIRECT needs the memory address, the file offset and the length in whole logical blocks
(`DIRECT_ALIGN`, 4 KiB covers every common device). A chunk file is a header padded to 4 KiB plus the
payload; the payload comes straight from the host arena, whose large objects start on a page (see
`memory.py`). A payload tail shorter than a block is written through the page cache.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os

from lmcache_vllm.storage import codec

DIRECT_ALIGN = 4096


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


def write_full(fd: int, buffers: list) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def pread_full(fd: int, dest: memoryview, offset: int) -> None:
    done, total = 0, len(dest)
    while done < total:
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n == 0:
            raise codec.CorruptEntry(f"file truncated: {done} of {total} payload bytes")
        done += n
