"""Crash-safe replacement of a file: what `kvref.state.save` (and the identity sidecar) writes through.

The bytes go to a temporary file beside the target, named ``.<name>.kvref-partial-<pid>-<random>`` so a
leftover says what it is and which process left it (``<name>`` is cut to fit the file system's name limit); it
is fsynced, given the mode and owner the file had (or what a new file gets), renamed over the target, and the
directory is fsynced so the rename survives a crash. On any error the temporary file is removed and the target
is untouched; the leftovers of saves of the same target whose process is gone (killed mid-save) are removed by
the next save. A target that exists but is not a regular file (``/dev/null``, a FIFO, a directory) is refused
before anything is written: a rename would replace it. A symlink is followed by default (its target is replaced
and the link stays a link); ``follow_symlinks=False`` replaces the link itself. Saving over the file an object
was memory-mapped from is safe: the old inode stays mapped.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ..errors import SaveTargetError

PARTIAL_MARK = ".kvref-partial-"
_KINDS = {
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
}


def atomic_write(
    path: str | os.PathLike[str],
    write: Callable[[BinaryIO], int],
    *,
    durable: bool = True,
    follow_symlinks: bool = True,
) -> int:
    """Replace ``path`` with what ``write(f)`` writes to ``f``; returns what ``write`` returns (the byte count).
    ``durable=False`` skips the two fsyncs (the replacement stays atomic, but not durable across a power loss)."""
    target = Path(os.path.realpath(path)) if follow_symlinks else Path(os.path.abspath(path))
    try:
        st: os.stat_result | None = os.stat(target, follow_symlinks=follow_symlinks)
    except FileNotFoundError:
        st = None  # a new file: the temporary file is created as open() would create it (0o666 & ~umask)
    if st is not None and not (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
        what = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise SaveTargetError(f"{path}: is {what}, not a regular file; kvref saves only to regular files (a new "
                              "path, or an existing file it may replace)")  # fmt: skip
    prefix = _partial_prefix(target)
    _remove_dead_partials(target.parent, prefix)
    tmp = target.with_name(f"{prefix}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            n = write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if st is not None and stat.S_ISREG(st.st_mode):
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
            if (st.st_uid, st.st_gid) != (os.getuid(), os.getgid()):
                with contextlib.suppress(PermissionError):  # only root (or the owner, for the group) may
                    os.chown(tmp, st.st_uid, st.st_gid)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(target.parent)
    return n


def _partial_prefix(target: Path) -> str:
    """``.<name>.kvref-partial-`` with ``<name>`` cut (at a character boundary) so that the whole temporary name,
    pid and random part included, fits the directory's name limit."""
    try:
        name_max = os.pathconf(target.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    room = name_max - len(f".{PARTIAL_MARK}{2**22}-{'0' * 8}")  # pids stay below 2**22 on Linux
    name = os.fsencode(target.name)
    if len(name) > room:
        name = name[: max(room, 0)].decode(errors="ignore").encode()  # no half of a UTF-8 character
    return f".{os.fsdecode(name)}{PARTIAL_MARK}"


def _remove_dead_partials(directory: Path, prefix: str) -> None:
    """Remove ``<prefix><pid>-<hex>`` files whose process no longer runs: saves of this target that were killed."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)-[0-9a-f]{8}")
    try:
        names = [e.name for e in os.scandir(directory) if e.name.startswith(prefix)]
    except OSError:
        return
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(directory / name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or a number no process can have): leave its file alone
    return True


def _fsync_dir(directory: Path) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows): the rename is as durable as it gets
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    finally:
        os.close(dfd)


__all__ = ["PARTIAL_MARK", "atomic_write"]
