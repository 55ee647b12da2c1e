"""A model's identity for the store: the SHA-256 of its GGUF file, computed once per file version and cached.

K/V rows depend on the weights, so the identity is the bytes, not the file's name: two quantizations or two
fine-tunes of one model never share a chunk, and a renamed or copied file still hits. Hashing reads the whole file
(SHA-256 runs at ~1.7 GB/s on this project's CI machine, so ~0.2 s for a 300 MB model and ~4 s for 7 GB), so the
digest is kept in this process and in ``$XDG_CACHE_HOME/kvref/model-ids.json`` (``~/.cache`` by default), keyed
by the file's device, inode, size, mtime and ctime: any rewrite of the file, even in place, hashes it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

from ..errors import ArgumentError, ArgumentTypeError, KVRefError
from ..state.atomic import atomic_write

PREFIX = "sha256:"
_cache: dict[tuple[int, ...], str] = {}
_lock = threading.Lock()


def _cache_file() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvref" / "model-ids.json"


def _stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _read_disk_cache() -> dict[str, str]:
    try:
        data = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _write_disk_cache(stamp: tuple[int, ...], digest: str) -> None:
    entries = _read_disk_cache()
    entries[",".join(map(str, stamp))] = digest
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = json.dumps(entries, sort_keys=True).encode()
        atomic_write(path, lambda f: f.write(blob), durable=False)
    except (OSError, KVRefError):
        pass  # a read-only home only costs the next process its own hash


def _sha256(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def model_id(model: str | os.PathLike[str]) -> str:
    """``"sha256:<hex>"`` of the GGUF file ``model``; a string already of that form is returned as it is (a caller
    who knows the digest saves the hash)."""
    if isinstance(model, str) and model.startswith(PREFIX):
        digest = model[len(PREFIX) :]
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ArgumentError(f"model={model!r} is not a sha256 model id (sha256: and 64 lowercase hex digits)")
        return model
    if not isinstance(model, (str, os.PathLike)):
        raise ArgumentTypeError(f"model= takes the GGUF file's path or its 'sha256:...' id, not {type(model).__name__}")
    try:
        st = os.stat(model)
    except OSError as e:
        raise ArgumentError(f"model={os.fspath(model)!r}: {e.strerror}; pass the GGUF file the state came from") from e
    stamp = _stamp(st)
    with _lock:
        if stamp in _cache:
            return _cache[stamp]
    known = _read_disk_cache().get(",".join(map(str, stamp)))
    if known is None:
        known = PREFIX + _sha256(model)
        _write_disk_cache(stamp, known)
    with _lock:
        _cache[stamp] = known
    return known


__all__ = ["model_id"]
