"""Trust in the disk tier's directory and in what stands in it: `prepare_directory` (create it 0700, or
refuse one that another user owns or others can write unless it is configured as shared),
`others_can_write` (who else can plant files there) and `open_regular` (open a file in it without
following a symbolic link or blocking on a FIFO, accepting regular files of one name only).

Why: whoever can write the directory can plant chunk files, i.e. choose what the model reads unless
chunks carry a keyed MAC (see docs/SECURITY.md); a symbolic or hard link would make us read, or write the
usage count into, a file elsewhere (a hard link also counts one file's bytes twice in the budget); a FIFO
would block a reader thread for ever. A directory the user made is never chmod-ed: only the ones created
here get their mode set.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Optional

from lmcache_vllm.config.fields import ConfigError, Problem
from lmcache_vllm.storage.codec import CorruptEntry

SHARED_KEY = "extra_config.local_disk_shared"


class NotRegularFile(CorruptEntry):
    """A name the disk tier reads is a symbolic link, FIFO, directory or device, not a regular file."""


def others_can_write(st: os.stat_result) -> Optional[str]:
    """Who besides this user can create files in a directory with this status (None: nobody but root)."""
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & stat.S_IWOTH:
        return "everyone can write it"
    if st.st_mode & stat.S_IWGRP:
        return f"its group (gid {st.st_gid}) can write it"
    return None


def prepare_directory(path: str, shared: bool) -> bool:
    """Creates `path` and any missing parents with mode 0700 and returns True; or, when it exists, checks
    that nobody else can write it (unless `shared`) and returns False. Raises `ConfigError` naming the
    directory, why it is refused and the setting that accepts it."""
    missing = []
    head = path
    while not os.path.lexists(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    created = []
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:  # made meanwhile by someone else: checked below like any other
            continue
        os.chmod(directory, 0o700)  # ours: exactly 0700 whatever the umask
        created.append(directory)
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError([Problem("local_disk", path, "not a directory")])
    why = others_can_write(st)
    if why is not None and not shared:
        raise ConfigError([Problem(
            "local_disk", path, f"refused: {why}, so others could plant chunk files that the model reads. "
            f"Use a directory of this user's that only it can write, or set {SHARED_KEY}: true (then also "
            f"set a chunk MAC key, see docs/SECURITY.md)")])
    return path in created


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A file descriptor of the regular file at `path` (created with `mode` when `flags` has O_CREAT),
    opened without following a symbolic link in its last component and without blocking on a FIFO.
    Raises `NotRegularFile` (a `codec.CorruptEntry`) when anything else stands there."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotRegularFile(f"{path} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(f"{path} is not a regular file (mode {stat.filemode(st.st_mode)})")
    if st.st_nlink > 1:  # another name of a file elsewhere: writes would reach it, its bytes counted twice
        os.close(fd)
        raise NotRegularFile(f"{path} is a hard link ({st.st_nlink} names of one file)")
    return fd
