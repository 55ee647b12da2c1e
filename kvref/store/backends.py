"""`open_backend`: the backend a store URL or path names."""

from __future__ import annotations

import os
import re

from kvref.errors import ArgumentError
from kvref.store.backend import Backend, MemoryBackend

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
SQLITE_SCHEME = "sqlite://"
MEMORY = "memory:"


def open_backend(url_or_path: str | os.PathLike[str]) -> Backend:
    """The backend for ``url_or_path``:

    - ``redis://host:port/db``, ``rediss://...`` (TLS), ``unix:///socket?db=0``: `RedisBackend`; a ``prefix=``
      query parameter keeps several stores apart on one server (default ``kvref:``);
    - ``memory:``: a `MemoryBackend` of this process alone;
    - ``sqlite:///abs/dir`` or a plain path (a directory, made if missing): `SQLiteBackend`, the embedded default.
    """
    target = os.fspath(url_or_path)
    if target.startswith(REDIS_SCHEMES):
        from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

        from kvref.store.redis_backend import DEFAULT_PREFIX, RedisBackend

        parts = urlsplit(target)
        query = parse_qsl(parts.query, keep_blank_values=True)
        prefix = [v for k, v in query if k == "prefix"]
        rest = urlencode([(k, v) for k, v in query if k != "prefix"])
        return RedisBackend(urlunsplit(parts._replace(query=rest)), prefix=prefix[-1] if prefix else DEFAULT_PREFIX)
    if target == MEMORY:
        return MemoryBackend()
    if target.startswith(SQLITE_SCHEME):
        target = target[len(SQLITE_SCHEME) :]
        if not target:
            raise ArgumentError(f"store URL {url_or_path!r} names no directory: use sqlite:///path/to/dir")
    elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", target):
        # a scheme we do not know (a path with a colon in its first part would need ./ in front)
        raise ArgumentError(
            f"store URL {target!r} has an unknown scheme: use a directory path, sqlite:///path, memory:, "
            "redis://host:port/db, rediss://host:port/db or unix:///path/to/redis.sock"
        )
    from kvref.store.sqlite_backend import SQLiteBackend

    return SQLiteBackend(target)


__all__ = ["open_backend"]
