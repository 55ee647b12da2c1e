"""The shared backend: a Redis server, so several machines can use one store.

Every key lives under a prefix (``kvref:`` unless told), so a store can share a server (or a db) with others:

  <prefix>v:<key>      the value (a string)
  <prefix>lru          sorted set: each non-META key scored by its last use (<prefix>clock, INCR'd on the server,
                       so every client orders uses alike without trusting its own clock)
  <prefix>size         hash: each non-META key's value size (what evict frees)
  <prefix>usage        hash: ``bytes`` and ``n``, the totals `usage` reads
  <prefix>l:<parent>   set: the children linked from ``parent``
  <prefix>counters     hash: the counters

Each change that touches more than one of these runs as one Lua script, which Redis runs atomically, so the totals
stay exact with any number of clients. The scripts name value keys they compute, which Redis Cluster refuses: use a
single server (or a primary with replicas). Its ``maxmemory-policy`` should be ``noeviction``: a value Redis drops
by itself would stay counted in ``usage``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar, cast

from kvref.errors import ArgumentError, BackendError, StoreError
from kvref.store.backend import META, Backend

if TYPE_CHECKING:
    import redis

DEFAULT_PREFIX = "kvref:"

_PUT = """
if ARGV[3] == '0' and redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
if ARGV[4] == '0' then
    local n = string.len(ARGV[2])
    local old = redis.call('HGET', KEYS[3], ARGV[1])
    if old then
        redis.call('HINCRBY', KEYS[4], 'bytes', n - tonumber(old))
    else
        redis.call('HINCRBY', KEYS[4], 'bytes', n)
        redis.call('HINCRBY', KEYS[4], 'n', 1)
    end
    redis.call('HSET', KEYS[3], ARGV[1], n)
    redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[5]), ARGV[1])
end
return 1
"""

# XX: a key evicted (or META, never in the set) since the read is not brought back
_TOUCH = """
for _, k in ipairs(ARGV) do
    redis.call('ZADD', KEYS[1], 'XX', redis.call('INCR', KEYS[2]), k)
end
return 0
"""

# KEYS: lru, size, usage, then the value key and link key of each ARGV key
_DELETE = """
local n = 0
for i, k in ipairs(ARGV) do
    n = n + redis.call('UNLINK', KEYS[2 + 2 * i])
    redis.call('UNLINK', KEYS[3 + 2 * i])
    local s = redis.call('HGET', KEYS[2], k)
    if s then
        redis.call('HDEL', KEYS[2], k)
        redis.call('ZREM', KEYS[1], k)
        redis.call('HINCRBY', KEYS[3], 'bytes', -tonumber(s))
        redis.call('HINCRBY', KEYS[3], 'n', -1)
    end
end
return n
"""

# ARGV: max_bytes, prefix; the value and link keys are computed (hence single-server only)
_EVICT = """
local held = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
local max = tonumber(ARGV[1])
local freed = 0
while held - freed > max do
    local oldest = redis.call('ZRANGE', KEYS[1], 0, 63)
    if #oldest == 0 then break end
    for _, k in ipairs(oldest) do
        if held - freed <= max then break end
        local s = tonumber(redis.call('HGET', KEYS[2], k) or '0')
        redis.call('UNLINK', ARGV[2] .. 'v:' .. k)
        redis.call('UNLINK', ARGV[2] .. 'l:' .. k)
        redis.call('HDEL', KEYS[2], k)
        redis.call('ZREM', KEYS[1], k)
        redis.call('HINCRBY', KEYS[3], 'bytes', -s)
        redis.call('HINCRBY', KEYS[3], 'n', -1)
        freed = freed + s
    end
end
return freed
"""


def _import_redis() -> None:
    try:
        import redis  # noqa: F401
    except ImportError as e:
        raise BackendError(
            "the Redis store backend needs the redis client package: pip install 'kvref[store]' (or pip install redis)"
        ) from e


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _guarded(method: Callable[Concatenate[RedisBackend, _P], _R]) -> Callable[Concatenate[RedisBackend, _P], _R]:
    """Redis failures after the connection was made (a server gone, one out of memory) as a `StoreError`."""

    @functools.wraps(method)
    def call(self: RedisBackend, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        import redis

        try:
            return method(self, *args, **kwargs)
        except redis.RedisError as e:
            raise StoreError(
                f"the Redis server of store {self.url!r} failed ({e}): is it running, and does it have room "
                "(maxmemory; bound the store with capacity_bytes=)?"
            ) from e

    return call


class RedisBackend(Backend):
    """A store on the Redis server at ``url`` (``redis://host:port/db``, ``rediss://`` for TLS, or
    ``unix:///path/to/socket?db=0``), every key under ``prefix``."""

    def __init__(self, url: str, *, prefix: str = DEFAULT_PREFIX) -> None:
        _import_redis()
        import redis

        self.url = url
        self.prefix = prefix
        try:
            self._r: redis.Redis = redis.Redis.from_url(url)
            self._r.ping()
        except ValueError as e:  # a malformed URL
            raise ArgumentError(f"store URL {url!r} is not a Redis URL ({e}): use redis://host:port/db") from e
        except redis.RedisError as e:
            raise ArgumentError(
                f"cannot reach the Redis server of store URL {url!r} ({e}): is redis-server running there?"
            ) from e
        self._lru, self._size, self._usage = prefix + "lru", prefix + "size", prefix + "usage"
        self._clock, self._counters = prefix + "clock", prefix + "counters"
        self._put = self._r.register_script(_PUT)
        self._touch = self._r.register_script(_TOUCH)
        self._delete = self._r.register_script(_DELETE)
        self._evict = self._r.register_script(_EVICT)

    def _v(self, key: str) -> str:
        return self.prefix + "v:" + key

    def _l(self, key: str) -> str:
        return self.prefix + "l:" + key

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    @_guarded
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        # one round trip: the values, then the LRU mark of those that are tracked
        pipe = self._r.pipeline(transaction=False)
        pipe.mget([self._v(k) for k in keys])
        self._touch(keys=[self._lru, self._clock], args=list(keys), client=pipe)
        values, _ = pipe.execute()
        return [cast("bytes | None", v) for v in values]

    @_guarded
    def peek_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        return [cast("bytes | None", v) for v in self._r.mget([self._v(k) for k in keys])]

    @_guarded
    def touch(self, keys: Sequence[str]) -> None:
        if keys:
            self._touch(keys=[self._lru, self._clock], args=list(keys))

    @_guarded
    def put(self, key: str, value: bytes | bytearray, *, replace: bool = False) -> bool:
        keys = [self._v(key), self._lru, self._size, self._usage, self._clock]
        args: list[bytes | str | int] = [key, bytes(value), int(replace), int(key.startswith(META))]
        return bool(self._put(keys=keys, args=args))

    @_guarded
    def delete(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        if not keys:
            return 0
        names = [self._lru, self._size, self._usage]
        for k in keys:
            names += [self._v(k), self._l(k)]
        return int(cast(int, self._delete(keys=names, args=keys)))

    @_guarded
    def add_link(self, parent: str, child: str) -> None:
        self._r.sadd(self._l(parent), child)

    @_guarded
    def add_links(self, pairs: Sequence[tuple[str, str]]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for parent, child in pairs:
            pipe.sadd(self._l(parent), child)
        pipe.execute()

    @_guarded
    def links(self, parent: str) -> list[str]:
        members = cast("set[bytes]", self._r.smembers(self._l(parent)))
        return [m.decode() for m in members]

    @_guarded
    def link_sample(self, parent: str, n: int = 1) -> list[str]:
        members = cast("list[bytes]", self._r.srandmember(self._l(parent), n))
        return [m.decode() for m in members]

    @_guarded
    def incr(self, name: str, n: int = 1) -> None:
        self._r.hincrby(self._counters, name, n)

    @_guarded
    def counters(self) -> dict[str, int]:
        raw = cast("dict[bytes, bytes]", self._r.hgetall(self._counters))
        return {k.decode(): int(v) for k, v in raw.items()}

    @_guarded
    def usage(self) -> tuple[int, int]:
        held, n = cast("list[bytes | None]", self._r.hmget(self._usage, ["bytes", "n"]))
        return int(held or 0), int(n or 0)

    @_guarded
    def evict(self, max_bytes: int) -> int:
        return int(cast(int, self._evict(keys=[self._lru, self._size, self._usage], args=[max_bytes, self.prefix])))

    @_guarded
    def keys(self) -> list[str]:
        start = len(self._v(""))
        found = self._r.scan_iter(match=_glob_escape(self._v("")) + "*", count=1000)
        return [cast(bytes, k)[start:].decode() for k in found]

    @_guarded
    def prune_links(self, prefix: str, alive: Collection[str]) -> int:
        keep = set(alive)
        n = 0
        for name in self._r.scan_iter(match=_glob_escape(self._l(prefix)) + "*", count=1000):
            members = cast("set[bytes]", self._r.smembers(name))
            dead = [m for m in members if m.decode() not in keep]
            if dead:
                n += int(cast(int, self._r.srem(name, *dead)))
        return n

    def close(self) -> None:
        self._r.close()


__all__ = ["DEFAULT_PREFIX", "RedisBackend"]
