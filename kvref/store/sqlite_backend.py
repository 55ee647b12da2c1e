"""The embedded backend: an SQLite database in a directory, with the large values in files beside it.

Shared by every process of the machine. The database (WAL mode, ``<dir>/kvref-store.sqlite3``) holds the index:
every key with its size and last use, the small values themselves, the links and the counters. A value of
`INLINE_MAX` bytes or more (the store's K/V chunks, 0.1-8 MB) goes to its own file under ``<dir>/blobs/``, named
by a fresh random token, written in full *before* the row naming it commits: a reader only ever finds complete
files, and a writer killed at any point leaves at worst a file no row names (`sweep` removes those). Why the
split: `benchmarks/bench_store_backends.py` (its docstring has the numbers) -- a 1 MiB put into an SQLite blob
writes it twice (WAL, then checkpoint) and ran at a fifth of a plain file's speed, and larger pages, which fix
that, made every small write and every get's LRU mark several times slower.

Every change to the index is one transaction; a busy database is waited for (busy_timeout) and retried, never
reported as an error while another process holds it briefly.
"""

from __future__ import annotations

import functools
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

from kvref.errors import ArgumentError, StoreError
from kvref.store.backend import META, Backend

DB_NAME = "kvref-store.sqlite3"
BLOBS = "blobs"
# values this large go to files (see the module docstring); smaller ones, metadata records, stay in the database
INLINE_MAX = 64 * 1024
# how long one operation waits for other processes' transactions before it gives up (busy_timeout, then retries)
BUSY_SECONDS = 60.0
# keys removed per eviction transaction: a few large values at a time, so other writers are never held for long
EVICT_BATCH = 32

_T = TypeVar("_T")

# usage() reads the totals row, which triggers keep in step with `kv` inside each writing transaction (no SUM over
# the table per call); `used` is a nanosecond clock, so LRU order holds across processes without a shared counter
_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (
    key TEXT PRIMARY KEY,
    value BLOB NOT NULL,
    file TEXT,
    size INTEGER NOT NULL,
    meta INTEGER NOT NULL,
    used INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS kv_lru ON kv (used) WHERE meta = 0;
CREATE TABLE IF NOT EXISTS links (
    parent TEXT NOT NULL,
    child TEXT NOT NULL,
    PRIMARY KEY (parent, child)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS totals (
    id INTEGER PRIMARY KEY CHECK (id = 0),
    bytes INTEGER NOT NULL,
    n INTEGER NOT NULL
);
INSERT OR IGNORE INTO totals VALUES (0, 0, 0);
CREATE TRIGGER IF NOT EXISTS kv_insert AFTER INSERT ON kv WHEN NEW.meta = 0 BEGIN
    UPDATE totals SET bytes = bytes + NEW.size, n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS kv_delete AFTER DELETE ON kv WHEN OLD.meta = 0 BEGIN
    UPDATE totals SET bytes = bytes - OLD.size, n = n - 1;
END;
CREATE TRIGGER IF NOT EXISTS kv_resize AFTER UPDATE OF size ON kv WHEN NEW.meta = 0 BEGIN
    UPDATE totals SET bytes = bytes + NEW.size - OLD.size;
END;
"""


def _select(conn: sqlite3.Connection, keys: list[str]) -> list[tuple[str, bytes, str | None, int]]:
    rows: list[tuple[str, bytes, str | None, int]] = []
    # one statement per 500 keys stays under SQLite's bound-parameter limit
    for i in range(0, len(keys), 500):
        part = keys[i : i + 500]
        marks = ",".join("?" * len(part))
        sql = f"SELECT key, value, file, size FROM kv WHERE key IN ({marks})"
        rows += [(str(k), bytes(v), f, int(n)) for k, v, f, n in conn.execute(sql, part)]
    return rows


def _busy(e: sqlite3.OperationalError) -> bool:
    msg = str(e).lower()
    return "locked" in msg or "busy" in msg


class SQLiteBackend(Backend):
    """A store in the directory ``path`` (made if missing): values of ``inline_max`` bytes or more in files, the
    rest in ``<path>/kvref-store.sqlite3``."""

    def __init__(self, path: str | os.PathLike[str], *, inline_max: int = INLINE_MAX) -> None:
        self.dir = Path(path)
        self.inline_max = inline_max
        if self.dir.exists() and not self.dir.is_dir():
            raise ArgumentError(
                f"store path {str(self.dir)!r} is a file, not a directory: give the directory that holds (or will"
                f" hold) {DB_NAME}"
            )
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ArgumentError(
                f"store path {str(self.dir)!r} cannot be created ({e}): give a writable directory"
            ) from e
        self.db_path = self.dir / DB_NAME
        self.url = f"sqlite://{self.dir.resolve()}"  # what open_backend reads back
        self._lock = threading.RLock()
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._last_used = 0
        try:
            self._retry(self._create)
        except sqlite3.DatabaseError as e:
            raise ArgumentError(
                f"{str(self.db_path)!r} is not a kvref store database ({e}): point the store at another directory"
            ) from e

    # -- connection and transactions ----------------------------------------------------------------------------

    def _connection(self) -> sqlite3.Connection:
        # a connection must not cross a fork: a child process opens its own
        if self._conn is None or self._pid != os.getpid():
            conn = sqlite3.connect(self.db_path, timeout=BUSY_SECONDS, isolation_level=None, check_same_thread=False)
            # NORMAL in WAL mode: a killed process loses nothing committed, a power cut at most the last commits,
            # and the database stays consistent either way; FULL would fsync every put
            conn.execute("PRAGMA synchronous = NORMAL")
            self._conn, self._pid = conn, os.getpid()
        return self._conn

    def _retry(self, op: Callable[[sqlite3.Connection], _T]) -> _T:
        """Run ``op`` under this object's lock, again while SQLite reports the database busy: busy_timeout does not
        cover every case (a deferred transaction that needs to write, switching to WAL mode)."""
        deadline = time.monotonic() + BUSY_SECONDS
        delay = 0.001
        with self._lock:
            while True:
                conn = self._connection()
                try:
                    return op(conn)
                except sqlite3.OperationalError as e:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    if not _busy(e) or time.monotonic() > deadline:
                        raise StoreError(
                            f"the store's database {self.db_path} failed ({e}): a full disk or a file size limit? free "
                            f"space, or bound the store (capacity_bytes=, `kvref store gc {self.dir} --max-bytes N`)"
                        ) from e
                time.sleep(delay)
                delay = min(delay * 2, 0.1)

    def _write(self, op: Callable[[sqlite3.Connection], _T]) -> _T:
        """``op`` in one write transaction: taken at BEGIN IMMEDIATE (a deferred one could meet another writer
        halfway and fail at once), all of it committed or none of it."""

        def txn(conn: sqlite3.Connection) -> _T:
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = op(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
            return out

        return self._retry(txn)

    def _create(self, conn: sqlite3.Connection) -> None:
        # WAL persists in the file; switching needs a moment alone with the database (hence under _retry)
        if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(f"BEGIN IMMEDIATE; {_SCHEMA} COMMIT;")

    def _now(self) -> int:
        """The `used` stamp: wall-clock nanoseconds (comparable between processes), strictly increasing here."""
        self._last_used = max(time.time_ns(), self._last_used + 1)
        return self._last_used

    # -- the interface ---------------------------------------------------------------------------------------------

    def _blob(self, name: str) -> Path:
        return self.dir / BLOBS / name[:2] / name

    def _unlink(self, names: Iterable[str | None]) -> None:
        """Remove the files of rows already deleted or replaced (after the commit: a crash before it must leave
        the files the database still names)."""
        for name in names:
            if name:
                self._blob(name).unlink(missing_ok=True)

    def _read_blob(self, name: str, size: int) -> bytes | None:
        try:
            with open(self._blob(name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        # short only if the file was lost under a committed row (a power cut before the page cache reached disk)
        return data if len(data) == size else None

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        values = self.peek_many(keys)
        # marked in a short write after the read, so a large read never holds other writers back; a value
        # evicted in between is simply not marked
        self.touch([k for k, v in zip(keys, values, strict=True) if v is not None])
        return values

    def peek_many(self, keys: Sequence[str]) -> list[bytes | None]:
        found: dict[str, bytes] = {}
        todo = list(dict.fromkeys(keys))
        # a file can vanish between reading its row and opening it (another process replaced or evicted the value):
        # read such a key's row again, and take it as gone once its row names the same missing file twice
        missing: dict[str, str] = {}
        while todo:
            rows = self._retry(functools.partial(_select, keys=todo))
            todo = []
            for k, value, name, size in rows:
                if name is None:
                    found[k] = value
                    continue
                data = self._read_blob(name, size)
                if data is not None:
                    found[k] = data
                elif missing.get(k) != name:
                    missing[k] = name
                    todo.append(k)
        return [found.get(k) for k in keys]

    def touch(self, keys: Sequence[str]) -> None:
        if not keys:
            return

        def mark(conn: sqlite3.Connection) -> None:
            conn.executemany("UPDATE kv SET used = ? WHERE key = ? AND meta = 0", [(self._now(), k) for k in keys])

        self._write(mark)

    def put(self, key: str, value: bytes | bytearray, *, replace: bool = False) -> bool:
        name: str | None = None
        if len(value) >= self.inline_max:
            if not replace and self._exists(key):
                return False  # first write wins: no need to write the file
            name = secrets.token_hex(16)
            path = self._blob(name)
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(path, "xb") as f:  # a fresh name: nobody reads it before the row below commits
                    f.write(value)
            except OSError as e:
                path.unlink(missing_ok=True)
                raise StoreError(
                    f"the store {self.dir} cannot write {path.name} ({e.strerror}): free space, or bound the store "
                    f"(capacity_bytes=, `kvref store gc {self.dir} --max-bytes N`)"
                ) from e
        inline = b"" if name is not None else bytes(value)

        def write(conn: sqlite3.Connection) -> tuple[bool, str | None]:
            row = (key, inline, name, len(value), key.startswith(META), self._now())
            if not replace:
                return conn.execute("INSERT OR IGNORE INTO kv VALUES (?, ?, ?, ?, ?, ?)", row).rowcount == 1, None
            old = conn.execute("SELECT file FROM kv WHERE key = ?", (key,)).fetchone()
            conn.execute(
                "INSERT INTO kv VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE"
                " SET value = excluded.value, file = excluded.file, size = excluded.size, used = excluded.used",
                row,
            )
            return True, old[0] if old else None

        try:
            written, old_name = self._write(write)
        except BaseException:
            self._unlink([name])
            raise
        self._unlink([old_name] if written else [name])
        return written

    def _exists(self, key: str) -> bool:
        return self._retry(lambda c: c.execute("SELECT 1 FROM kv WHERE key = ?", (key,)).fetchone() is not None)

    def delete(self, keys: Iterable[str]) -> int:
        keys = list(keys)

        def write(conn: sqlite3.Connection) -> tuple[int, list[str | None]]:
            files: list[str | None] = []
            for k in keys:
                row = conn.execute("SELECT file FROM kv WHERE key = ?", (k,)).fetchone()
                if row is not None:
                    files.append(row[0])
                    conn.execute("DELETE FROM kv WHERE key = ?", (k,))
                conn.execute("DELETE FROM links WHERE parent = ?", (k,))
            return len(files), files

        if not keys:
            return 0
        n, files = self._write(write)
        self._unlink(files)
        return n

    def add_link(self, parent: str, child: str) -> None:
        self._retry(lambda c: c.execute("INSERT OR IGNORE INTO links VALUES (?, ?)", (parent, child)))

    def add_links(self, pairs: Sequence[tuple[str, str]]) -> None:
        if pairs:
            self._write(lambda c: c.executemany("INSERT OR IGNORE INTO links VALUES (?, ?)", list(pairs)))

    def links(self, parent: str) -> list[str]:
        return self._retry(
            lambda c: [str(r[0]) for r in c.execute("SELECT child FROM links WHERE parent = ?", (parent,))]
        )

    def prune_links(self, prefix: str, alive: Collection[str]) -> int:
        def prune(conn: sqlite3.Connection) -> int:
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS alive (key TEXT PRIMARY KEY) WITHOUT ROWID")
            conn.execute("DELETE FROM alive")
            conn.executemany("INSERT OR IGNORE INTO alive VALUES (?)", ((k,) for k in alive))
            like = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
            n = conn.execute(
                "DELETE FROM links WHERE parent LIKE ? ESCAPE '\\' AND child NOT IN (SELECT key FROM alive)", (like,)
            ).rowcount
            conn.execute("DELETE FROM alive")
            return int(n)

        return self._write(prune)

    def link_sample(self, parent: str, n: int = 1) -> list[str]:
        return self._retry(
            lambda c: [str(r[0]) for r in c.execute("SELECT child FROM links WHERE parent = ? LIMIT ?", (parent, n))]
        )

    def incr(self, name: str, n: int = 1) -> None:
        self._retry(
            lambda c: c.execute(
                "INSERT INTO counters VALUES (?, ?) ON CONFLICT (name) DO UPDATE SET n = n + excluded.n", (name, n)
            )
        )

    def counters(self) -> dict[str, int]:
        return self._retry(lambda c: {str(k): int(v) for k, v in c.execute("SELECT name, n FROM counters")})

    def usage(self) -> tuple[int, int]:
        row = self._retry(lambda c: c.execute("SELECT bytes, n FROM totals").fetchone())
        return int(row[0]), int(row[1])

    def evict(self, max_bytes: int) -> int:
        def batch(conn: sqlite3.Connection) -> tuple[int, list[str | None], bool]:
            held = int(conn.execute("SELECT bytes FROM totals").fetchone()[0])
            freed = 0
            files: list[str | None] = []
            oldest = conn.execute(
                "SELECT key, file, size FROM kv WHERE meta = 0 ORDER BY used LIMIT ?", (EVICT_BATCH,)
            ).fetchall()
            for k, name, size in oldest:
                if held - freed <= max_bytes:
                    break
                conn.execute("DELETE FROM kv WHERE key = ?", (k,))
                conn.execute("DELETE FROM links WHERE parent = ?", (k,))
                files.append(name)
                freed += int(size)
            return freed, files, bool(oldest) and held - freed > max_bytes

        total = 0
        more = True
        while more:
            freed, files, more = self._write(batch)
            self._unlink(files)
            total += freed
        return total

    def sweep(self, grace_seconds: float = 3600.0) -> int:
        """Remove value files that no row names, left by writers killed between writing a file and committing
        its row, once older than ``grace_seconds`` (younger ones may be a put still in flight); returns how many."""
        named = set(self._retry(lambda c: [str(r[0]) for r in c.execute("SELECT file FROM kv WHERE file IS NOT NULL")]))
        cutoff = time.time() - grace_seconds
        n = 0
        for path in (self.dir / BLOBS).glob("*/*"):
            try:
                if path.name not in named and path.stat().st_mtime < cutoff:
                    path.unlink()
                    n += 1
            except FileNotFoundError:
                pass
        return n

    def keys(self) -> list[str]:
        return self._retry(lambda c: [str(r[0]) for r in c.execute("SELECT key FROM kv")])

    def close(self) -> None:
        with self._lock:
            if self._conn is not None and self._pid == os.getpid():
                self._conn.close()
            self._conn = None


__all__ = ["DB_NAME", "SQLiteBackend"]
