"""Crash-safe replacement of a file: what `kvref.state.save` writes through.

The bytes go to a temporary file beside the target, named ``.<name>.kvref-partial-<pid>-<random>`` so a
leftover says what it is; it is fsynced, given the mode the file had (or the mode a new file gets under the
umask), renamed over the target, and the directory is fsynced so the rename survives a crash. A symlink is
followed: its target is replaced and the link stays a link. On any error the temporary file is removed and the
target is untouched. Saving over the file an object was memory-mapped from is safe: the old inode stays mapped.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

PARTIAL_MARK = ".kvref-partial-"


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], int], *, durable: bool = True) -> int:
    """Replace ``path`` with what ``write(f)`` writes to ``f``; returns what ``write`` returns (the byte count).
    ``durable=False`` skips the two fsyncs (the replacement stays atomic, but not durable across a power loss)."""
    target = Path(os.path.realpath(path))
    try:
        mode: int | None = stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        mode = None  # a new file: the temporary file is created as open() would create it (0o666 & ~umask)
    tmp = target.with_name(f".{target.name}{PARTIAL_MARK}{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            n = write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        _fsync_dir(target.parent)
    return n


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
