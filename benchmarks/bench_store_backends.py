"""The embedded store backend: values in SQLite, in a directory of files, and the split kvref uses.

Run: ``python benchmarks/bench_store_backends.py [--mib 64] [--small 100000] [--dir DIR]``. Prints the CPU and a
table; only ratios measured in the same run mean anything.

  put / get 1 MiB, 4 MiB   throughput of whole values (the store's K/V chunks of 256 tokens are 0.1-8 MB), each
                           get marking the value used as the interface requires
  small get, N keys        median and 99th percentile latency of a get of a 200-byte value among N keys
                           (random order), after N puts (whose rate is printed too)

The file design is what a careful one would be: a value per file under two levels of hash-named folders, written
to a temp file and moved into place with os.replace (whole or not at all), LRU by the file's mtime (os.utime on
each get). Neither design fsyncs each put (SQLite: WAL with synchronous=NORMAL), so both survive a killed process
and neither pays for surviving a power cut per write.

"kvref" is the embedded default, SQLiteBackend: the index and small values in SQLite, values of 64 KiB or more
in files. Measured on an AMD EPYC (2 cores shared with other jobs, ext4), 64 MiB per large size, 10^5 small keys:

  workload                     sqlite       files       kvref
  put 1 MiB                  261 MB/s   1976 MB/s   1106 MB/s
  get 1 MiB                  875 MB/s   1708 MB/s   1749 MB/s
  put 4 MiB                  261 MB/s    501 MB/s    402 MB/s
  get 4 MiB                  590 MB/s   1754 MB/s   1919 MB/s
  small put, 10^5 keys      41 µs/put  585 µs/put   38 µs/put
  small get p50                 36 µs       21 µs       35 µs
  small get p99                 82 µs       34 µs       81 µs

Blobs in SQLite are written twice (WAL, then checkpoint) and read through 4 KiB overflow pages: 2-7x slower than
files for megabyte values (64 KiB pages closed most of that gap but made small puts ~5x and gets ~2.5x slower).
Files alone pay a directory entry per small value (puts 3-15x slower here, and 10^5 inodes) and need an index
for LRU and usage anyway. The split keeps each side's strength.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvref.store.backend import Backend
from kvref.store.sqlite_backend import SQLiteBackend


class FileStore:
    """The directory-of-files design, as far as the benchmark needs it (put, get with the LRU mark)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        h = hashlib.blake2b(key.encode(), digest_size=16).hexdigest()
        return self.root / h[:2] / h[2:4] / h

    def put(self, key: str, value: bytes, *, replace: bool = False) -> bool:
        path = self._path(key)
        if not replace and path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(value)
        os.replace(tmp, path)
        return True

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                value = f.read()
            os.utime(path)  # the LRU mark
        except FileNotFoundError:
            return None
        return value


Store = Backend | FileStore


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def large(store: Store, size: int, total: int) -> tuple[float, float]:
    """(put MB/s, get MB/s) for ``total`` bytes of ``size``-byte values."""
    n = max(1, total // size)
    values = [os.urandom(64) + bytes(size - 64) for _ in range(4)]
    keys = [f"k{size}-{i}" for i in range(n)]
    put = _timed(lambda: [store.put(k, values[i % 4]) for i, k in enumerate(keys)])
    got = _timed(lambda: [store.get(k) for k in keys])
    return n * size / put / 1e6, n * size / got / 1e6


def small(store: Store, n: int, probes: int = 3000) -> tuple[float, float, float]:
    """(µs per put, p50 µs per get, p99 µs per get) for ``n`` 200-byte values."""
    value = os.urandom(200)
    keys = [f"m{i:08d}" for i in range(n)]
    put = _timed(lambda: [store.put(k, value) for k in keys])
    lat = []
    for k in random.Random(0).sample(keys, min(probes, n)):
        t = time.perf_counter()
        store.get(k)
        lat.append(time.perf_counter() - t)
    q = statistics.quantiles(lat, n=100)
    return put / n * 1e6, q[49] * 1e6, q[98] * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB written per large value size (default 64)")
    ap.add_argument("--small", type=int, default=100_000, help="small keys (default 10^5)")
    ap.add_argument("--dir", type=Path, default=None, help="where the stores go (default: a temp dir)")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvref-bench-", dir=args.dir))
    rows: list[tuple[str, ...]] = []
    try:
        makers: dict[str, Callable[[Path], Store]] = {
            "sqlite": lambda p: SQLiteBackend(p, inline_max=1 << 62),  # every value a blob in the database
            "files": FileStore,
            "kvref": SQLiteBackend,  # the embedded default: the index in SQLite, values >= INLINE_MAX in files
        }
        results: dict[str, list[str]] = {}
        for name, make in makers.items():
            out: list[str] = []
            for size in (1 << 20, 4 << 20):
                store = make(base / f"{name}-{size}")
                p, g = large(store, size, args.mib << 20)
                out += [f"{p:.0f} MB/s", f"{g:.0f} MB/s"]
            store = make(base / f"{name}-small")
            put, p50, p99 = small(store, args.small)
            out += [f"{put:.0f} µs/put", f"{p50:.0f} µs", f"{p99:.0f} µs"]
            results[name] = out
            if isinstance(store, Backend):
                store.close()
        labels = ["put 1 MiB", "get 1 MiB", "put 4 MiB", "get 4 MiB", f"small put, {args.small} keys"]
        labels += ["small get p50", "small get p99"]
        rows = [(label, *(results[name][i] for name in makers)) for i, label in enumerate(labels)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"CPU: {cpu_name()} ({os.cpu_count()} cores), {args.mib} MiB per large size, {args.small} small keys")
    print(f"{'workload':<26}" + "".join(f"{name:>14}" for name in ("sqlite", "files", "kvref")))
    for label, *cells in rows:
        print(f"{label:<26}" + "".join(f"{c:>14}" for c in cells))


if __name__ == "__main__":
    main()
