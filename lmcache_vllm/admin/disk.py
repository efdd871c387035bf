"""`inspect` and `clear` of an L2 chunk directory, without vLLM and without a running server.

Only headers are read (one `pread` of at most `codec.MAX_HEADER_SIZE` bytes per file); `verify=True` also
reads each payload into a `bytearray` and checks its checksum. Files are judged by the disk tier's own
rule (`chunk_file.check_file`); a valid header under another key's file name, which the tier leaves
alone, is reported (and cleared) as corrupt here, like anything else of our format that is not valid;
files of another format version or not ours are counted and left alone, by `clear` too. Stale temp files
are those the tier removes at start-up (`chunk_file.STALE_TMP_SECS`).
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

from lmcache_vllm.admin.report import TierReport, namespace_matches, namespace_of
from lmcache_vllm.storage import codec
from lmcache_vllm.storage.chunk_file import SUFFIX, TMP_PREFIX, check_file, is_stale_tmp
from lmcache_vllm.storage.disk_budget import SharedDiskBudget
from lmcache_vllm.storage.disk_dir import NotRegularFile, open_regular


@dataclass
class _File:
    name: str
    size: int
    mtime: float
    key: str | None = None  # set when the header is valid
    problem: str | None = None  # set when the file is ours but corrupt
    ours: bool = True  # False: another format version or not a chunk file at all


def _read_file(path: str, name: str, verify: bool) -> _File:
    try:  # as the disk tier opens it: no symbolic link followed, no FIFO waited on
        fd = open_regular(os.path.join(path, name))
    except NotRegularFile:
        return _File(name, 0, 0.0, problem="not a regular file", ours=False)
    st = os.fstat(fd)
    item = _File(name, st.st_size, st.st_mtime)
    with os.fdopen(fd, "rb") as f:
        head = f.read(codec.MAX_HEADER_SIZE)
        try:
            header = check_file(name, head, st.st_size)
        except codec.CorruptEntry as exc:
            item.problem = str(exc)
            return item
        if header is None:
            item.ours = False
            item.problem = "another format" if codec.read_format_version(head) is not None else "not a chunk"
            return item
        if verify:
            f.seek(header.header_len)
            payload = bytearray(header.payload_len)
            f.readinto(payload)
            try:
                codec.verify_stored(header, payload)
            except codec.CorruptEntry as exc:
                item.problem = str(exc)
                return item
    item.key = header.key
    return item


def _files(path: str, verify: bool):
    with os.scandir(path) as it:
        for entry in it:
            if not entry.is_file(follow_symlinks=False) or not entry.name.endswith(SUFFIX):
                continue
            try:
                yield _read_file(path, entry.name, verify)
            except FileNotFoundError:
                continue  # removed meanwhile (a live server evicting)


def _check_dir(path: str) -> str:
    path = path[len("file://"):] if path.startswith("file://") else path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: no such directory")
    return os.path.abspath(path)


def inspect_disk(path: str, *, verify: bool = False) -> TierReport:
    path = _check_dir(path)
    report = TierReport("disk", path, verified=verify, time_note=" (file modification times)")
    for item in _files(path, verify):
        if not item.ours:
            if item.problem == "another format":
                report.other_format += 1
            else:
                report.ignored += 1
        elif item.problem is not None:
            report.add_corrupt(item.name, item.problem)
        else:
            report.add_chunk(item.key, item.size, item.mtime)
    return report


def clear_disk(path: str, *, namespace: str | None = None, dry_run: bool = False) -> dict:
    """Removes our chunk files (of `namespace` only, when given; corrupt ones and stale temp files only
    without a namespace). Returns what was (or, with dry_run, would be) removed."""
    path = _check_dir(path)
    removed = {"files": 0, "bytes": 0, "corrupt_files": 0, "temp_files": 0}
    for item in _files(path, verify=False):
        if not item.ours:
            continue
        if item.problem is not None:
            if namespace is not None:
                continue
            removed["corrupt_files"] += 1
        elif not namespace_matches(namespace_of(item.key), namespace):
            continue
        if not dry_run and not _unlink(os.path.join(path, item.name)):
            continue
        removed["files"] += 1
        removed["bytes"] += item.size
    budget = None if dry_run else SharedDiskBudget.of_directory(path)
    if budget is not None:  # live disk tiers sharing the directory count its bytes there
        budget.release(removed["bytes"])
        budget.close()
    if namespace is None:
        now = time.time()
        with os.scandir(path) as it:
            stale = [e for e in it if e.name.startswith(TMP_PREFIX) and e.is_file(follow_symlinks=False)
                     and is_stale_tmp(e.name, e.stat().st_mtime, now)]
        for entry in stale:
            if dry_run or _unlink(entry.path):
                removed["temp_files"] += 1
    return removed


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
