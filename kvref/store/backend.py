"""Where the store keeps its bytes: a small interface, and the reference backend held in this process's memory.

A backend holds *values* (opaque bytes under string keys), *links* (parent key -> the keys of the chunks that
follow it: the store's radix index) and *counters*. It knows nothing of llama.cpp: checksums, chains and the
meaning of keys live in `kvref.store.prefix`. What every backend guarantees:

- a value is written whole or not at all (a killed writer leaves no partial value);
- ``put`` without ``replace`` keeps the first value written under a key (chunks are content-addressed);
- ``get`` marks the value as used, and ``evict`` removes least recently used values first, until the values
  hold at most ``max_bytes``; keys starting with ``META`` ("m:", the small records the store needs to read
  everything else) are never evicted and not counted by `usage`;
- several processes (and, for shared backends, several machines) may use one store at once.
"""

from __future__ import annotations

import itertools
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

META = "m:"


class Backend(ABC):
    """The interface the store is written against (`MemoryBackend`, `SQLiteBackend`, `RedisBackend`)."""

    url: str

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value under ``key`` (marked as just used), or None."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """`get` of each key (backends override it with one round trip)."""
        return [self.get(k) for k in keys]

    def peek_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values, without marking them used (``gc``'s walk must not reorder the LRU)."""
        raise NotImplementedError

    def touch(self, keys: Sequence[str]) -> None:
        """Mark these values as used, in this order (the last one the most recent), without reading them; keys
        that do not exist are ignored (backends override it without reading the values)."""
        self.get_many(keys)

    @abstractmethod
    def put(self, key: str, value: bytes | bytearray, *, replace: bool = False) -> bool:
        """Store ``value`` under ``key``; an existing value is kept unless ``replace``. True when written."""

    @abstractmethod
    def delete(self, keys: Iterable[str]) -> int:
        """Remove these values (and the links from them); returns how many existed."""

    @abstractmethod
    def add_link(self, parent: str, child: str) -> None:
        """Record that the chunk ``child`` follows ``parent`` (idempotent)."""

    def add_links(self, pairs: Sequence[tuple[str, str]]) -> None:
        """`add_link` of each (parent, child) (backends override it with one round trip)."""
        for parent, child in pairs:
            self.add_link(parent, child)

    @abstractmethod
    def links(self, parent: str) -> list[str]:
        """The children recorded for ``parent`` (in no particular order; may name evicted values)."""

    def link_sample(self, parent: str, n: int = 1) -> list[str]:
        """Up to ``n`` of ``parent``'s children, without listing them all (backends override it)."""
        return self.links(parent)[:n]

    @abstractmethod
    def incr(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name``."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """Every counter."""

    @abstractmethod
    def usage(self) -> tuple[int, int]:
        """(bytes held by values, number of values), ``META`` keys not counted."""

    @abstractmethod
    def evict(self, max_bytes: int) -> int:
        """Remove least recently used values (never a ``META`` key) until the others hold at most ``max_bytes``;
        returns the bytes freed."""

    def keys(self) -> list[str]:
        """Every value's key (for `kvref store gc` and tests; not used on the lookup path)."""
        raise NotImplementedError

    def prune_links(self, prefix: str, alive: Collection[str]) -> int:
        """In every link set whose parent starts with ``prefix``, drop the children not in ``alive`` (what
        ``gc`` does for the index entries of evicted chunks); returns how many it dropped."""
        raise NotImplementedError

    def close(self) -> None:  # noqa: B027  (most backends hold nothing to release)
        """Release connections and handles."""

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class MemoryBackend(Backend):
    """The interface's reading, in one process's memory (tests, and a store that lives as long as its process)."""

    def __init__(self) -> None:
        self.url = "memory:"
        self._values: OrderedDict[str, bytes] = OrderedDict()  # least recently used first
        self._links: dict[str, set[str]] = {}
        self._counters: dict[str, int] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def peek_many(self, keys: Sequence[str]) -> list[bytes | None]:
        with self._lock:
            return [self._values.get(k) for k in keys]

    def touch(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                if k in self._values:
                    self._values.move_to_end(k)

    def put(self, key: str, value: bytes | bytearray, *, replace: bool = False) -> bool:
        with self._lock:
            old = self._values.get(key)
            if old is not None and not replace:
                return False
            if not key.startswith(META):
                self._bytes += len(value) - (len(old) if old is not None else 0)
            self._values[key] = bytes(value)
            self._values.move_to_end(key)
            return True

    def delete(self, keys: Iterable[str]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                old = self._values.pop(k, None)
                self._links.pop(k, None)
                if old is not None:
                    self._bytes -= 0 if k.startswith(META) else len(old)
                    n += 1
        return n

    def add_link(self, parent: str, child: str) -> None:
        with self._lock:
            self._links.setdefault(parent, set()).add(child)

    def links(self, parent: str) -> list[str]:
        with self._lock:
            return list(self._links.get(parent, ()))

    def link_sample(self, parent: str, n: int = 1) -> list[str]:
        with self._lock:
            kids = self._links.get(parent, ())
            return list(itertools.islice(kids, n))

    def incr(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return self._bytes, sum(not k.startswith(META) for k in self._values)

    def evict(self, max_bytes: int) -> int:
        freed = 0
        with self._lock:
            for k in list(self._values):
                if self._bytes <= max_bytes:
                    break
                if k.startswith(META):
                    continue
                n = len(self._values.pop(k))
                self._links.pop(k, None)
                self._bytes -= n
                freed += n
        return freed

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._values)

    def prune_links(self, prefix: str, alive: Collection[str]) -> int:
        n = 0
        with self._lock:
            for parent in [p for p in self._links if p.startswith(prefix)]:
                dead = self._links[parent].difference(alive)
                n += len(dead)
                self._links[parent] -= dead
                if not self._links[parent]:
                    del self._links[parent]
        return n


__all__ = ["META", "Backend", "MemoryBackend"]
