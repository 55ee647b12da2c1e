"""The store backends (kvref.store): one contract run against each backend, then what only the embedded one must
survive (several processes at once, a writer killed mid-put) and `open_backend`'s reading of URLs.

The Redis cases need a redis server (see tests/_redis.py: one is started when redis-server is installed) and the
redis client package; without them they skip with the reason.
"""

from __future__ import annotations

import multiprocessing
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _redis import redis_url  # noqa: F401  (a fixture)
from _store_workers import churner, kill_after, make_value, whole, writer

from kvref.errors import ArgumentError, BackendError
from kvref.store.backend import META, Backend, MemoryBackend
from kvref.store.backends import open_backend
from kvref.store.sqlite_backend import BLOBS, INLINE_MAX, SQLiteBackend

BIG = INLINE_MAX + 12345  # a value the embedded backend keeps in a file


@pytest.fixture(params=["memory", "sqlite", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "memory":
        store: Backend = MemoryBackend()
    elif request.param == "sqlite":
        store = SQLiteBackend(tmp_path / "store")
    else:
        from kvref.store.redis_backend import RedisBackend

        url = request.getfixturevalue("redis_url")
        store = RedisBackend(url, prefix=f"kvref-test-{uuid.uuid4().hex}:")  # tests share one server
    try:
        yield store
    finally:
        store.delete(store.keys())
        store.close()


# -- the contract ------------------------------------------------------------------------------------------------


def test_the_first_write_wins_unless_replace(backend: Backend) -> None:
    assert backend.get("a") is None
    assert backend.put("a", b"one") is True
    assert backend.put("a", b"two") is False
    assert backend.get("a") == b"one"
    assert backend.put("a", b"three", replace=True) is True
    assert backend.get("a") == b"three"
    assert backend.usage() == (5, 1)


def test_large_values_round_trip_and_replace_either_way(backend: Backend) -> None:
    big, bigger = make_value("big", BIG), make_value("bigger", 2 * BIG)
    assert backend.put("k", big)
    assert backend.put("k", bigger) is False
    assert backend.get("k") == big
    assert backend.put("k", b"small", replace=True)
    assert backend.get("k") == b"small"
    assert backend.put("k", bigger, replace=True)
    assert backend.get("k") == bigger
    assert backend.usage() == (len(bigger), 1)
    assert backend.delete(["k"]) == 1
    assert backend.get("k") is None and backend.usage() == (0, 0)


def test_delete_counts_what_existed_and_drops_its_links(backend: Backend) -> None:
    backend.put("a", b"1")
    backend.put("b", b"22")
    backend.add_link("a", "b")
    backend.add_link("b", "c")
    assert backend.delete(["a", "missing"]) == 1
    assert backend.get("a") is None and backend.get("b") == b"22"
    assert backend.links("a") == [] and backend.links("b") == ["c"]
    assert backend.usage() == (2, 1)
    assert backend.delete([]) == 0


def test_links_are_sets(backend: Backend) -> None:
    assert backend.links("p") == []
    for child in ("c1", "c2", "c1"):
        backend.add_link("p", child)
    assert sorted(backend.links("p")) == ["c1", "c2"]


def test_counters_add_up(backend: Backend) -> None:
    assert backend.counters() == {}
    backend.incr("hits")
    backend.incr("hits", 4)
    backend.incr("misses", -2)
    assert backend.counters() == {"hits": 5, "misses": -2}


def test_usage_leaves_out_meta(backend: Backend) -> None:
    backend.put(META + "index", b"x" * 1000)
    backend.put("v1", b"x" * 10)
    backend.put("v2", b"x" * BIG)
    assert backend.usage() == (10 + BIG, 2)
    backend.put(META + "index", b"y", replace=True)
    backend.put("v1", b"x" * 30, replace=True)
    assert backend.usage() == (30 + BIG, 2)
    assert sorted(backend.keys()) == sorted([META + "index", "v1", "v2"])


def test_evict_removes_the_least_recently_used_and_never_meta(backend: Backend) -> None:
    backend.put(META + "root", b"m" * 100)
    for k in "abcd":
        backend.put(k, k.encode() * 10)
    backend.add_link("b", "c")
    backend.get("a")  # now b is the oldest, then c, d, a
    assert backend.get_many(["c", "zz"]) == [b"c" * 10, None]  # get_many marks too: d, a, c
    assert backend.evict(40) == 0
    assert backend.evict(30) == 10
    assert backend.get("b") is None and backend.links("b") == []
    assert backend.evict(20) == 10  # d
    assert backend.get("d") is None and backend.get("a") == b"a" * 10
    assert backend.evict(0) == 20
    assert backend.usage() == (0, 0)
    assert backend.keys() == [META + "root"] and backend.get(META + "root") == b"m" * 100


def test_get_many_keeps_order_and_duplicates(backend: Backend) -> None:
    backend.put("x", b"1")
    backend.put("y", make_value("y", BIG))
    assert backend.get_many([]) == []
    assert backend.get_many(["y", "nope", "x", "x"]) == [make_value("y", BIG), None, b"1", b"1"]


def test_touch_orders_and_peek_does_not(backend: Backend) -> None:
    for k in "abc":
        backend.put(k, k.encode() * 10)
    backend.touch(["c", "b", "a", "gone"])  # a is now the newest, c the oldest
    assert backend.peek_many(["c", "zz"]) == [b"c" * 10, None]  # a peek is no use: c stays the oldest
    assert backend.evict(20) == 10
    assert backend.keys() and backend.get("c") is None and backend.get("a") == b"a" * 10


def test_batched_links_samples_and_pruning(backend: Backend) -> None:
    backend.add_links([("x:1", "a"), ("x:1", "b"), ("x:2", "a"), ("y:1", "a"), ("x:1", "a")])
    assert sorted(backend.links("x:1")) == ["a", "b"]
    assert backend.link_sample("x:1", 1)[0] in ("a", "b") and len(backend.link_sample("x:1", 5)) == 2
    assert backend.link_sample("none", 3) == []
    assert backend.prune_links("x:", ["b"]) == 2  # a from x:1 and x:2; y:1 is not under the prefix
    assert backend.links("x:1") == ["b"] and backend.links("x:2") == [] and backend.links("y:1") == ["a"]


# -- the embedded backend ------------------------------------------------------------------------------------------


def test_the_embedded_backend_keeps_nothing_behind(tmp_path: Path) -> None:
    """Files of replaced, deleted and evicted values go; a file no row names (a writer killed before its commit)
    goes with `sweep`; the database reopens with everything."""
    store = SQLiteBackend(tmp_path)
    for i in range(6):
        store.put(f"k{i}", make_value(f"k{i}", BIG))
    store.put("k0", make_value("k0'", BIG), replace=True)
    store.delete(["k1"])
    store.evict(3 * BIG)
    assert len(list((tmp_path / BLOBS).glob("*/*"))) == 3
    orphan = tmp_path / BLOBS / "ff" / ("ff" + "0" * 30)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"partial")
    assert store.sweep(grace_seconds=3600) == 0  # may be a put in flight
    assert store.sweep(grace_seconds=-1) == 1 and not orphan.exists()
    store.close()
    again = SQLiteBackend(tmp_path)
    assert sorted(again.keys()) == ["k0", "k4", "k5"]
    assert again.get("k0") == make_value("k0'", BIG) and again.usage() == (3 * BIG, 3)


def test_processes_writing_at_once_lose_nothing(tmp_path: Path) -> None:
    n, workers = 60, 4
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(workers) as pool:
        won = pool.starmap(writer, [(str(tmp_path), w, n) for w in range(workers)])
    assert sum(won) == n  # each shared key was written by exactly one process
    store = SQLiteBackend(tmp_path)
    keys = store.keys()
    assert len(keys) == n * (workers + 1)
    values = dict(zip(keys, store.get_many(keys), strict=True))
    assert all(v is not None and whole(v) for v in values.values())
    for w in range(workers):
        for i in range(n):
            assert values[f"w{w}-{i}"] == make_value(f"w{w}-{i}", len(values[f"w{w}-{i}"] or b""))
    assert store.usage() == (sum(len(v or b"") for v in values.values()), len(keys))
    assert store.counters() == {"puts": 2 * workers * (n // 5)}
    assert sorted(store.links("same-0")) == [f"w{w}-0" for w in range(workers)]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
@pytest.mark.parametrize("steps", [40, 300, 2000])
def test_a_writer_killed_mid_sequence_leaves_every_value_whole(tmp_path: Path, steps: int) -> None:
    kill_after(churner, (str(tmp_path / "store"),), tmp_path / "progress", steps)
    store = SQLiteBackend(tmp_path / "store")
    keys = store.keys()
    values = store.get_many(keys)
    assert keys and all(v is not None and whole(v) for v in values)
    assert store.usage() == (sum(len(v or b"") for v in values), len(keys))
    store.sweep(grace_seconds=-1)
    names = {p.name for p in (tmp_path / "store" / BLOBS).glob("*/*")}
    assert len(names) == sum(len(v or b"") >= INLINE_MAX for v in values)
    # and it goes on working
    assert store.put("after", b"x") and store.get("after") == b"x"


def test_the_embedded_backend_refuses_a_file_for_its_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("not a directory")
    with pytest.raises(ArgumentError, match="is a file, not a directory"):
        SQLiteBackend(tmp_path / "f")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "kvref-store.sqlite3").write_bytes(b"this is no database" * 100)
    with pytest.raises(ArgumentError, match="is not a kvref store database"):
        SQLiteBackend(tmp_path / "d")


# -- open_backend ----------------------------------------------------------------------------------------------


def test_open_backend_reads_paths_and_urls(tmp_path: Path) -> None:
    assert isinstance(open_backend("memory:"), MemoryBackend)
    plain = open_backend(tmp_path / "a")
    assert isinstance(plain, SQLiteBackend) and plain.dir == tmp_path / "a"
    by_url = open_backend(f"sqlite://{tmp_path / 'b'}")
    assert isinstance(by_url, SQLiteBackend) and by_url.dir == tmp_path / "b"
    again = open_backend(by_url.url)
    assert isinstance(again, SQLiteBackend) and again.db_path == by_url.db_path
    with pytest.raises(ArgumentError, match="unknown scheme"):
        open_backend("s3://bucket/store")
    with pytest.raises(ArgumentError, match="names no directory"):
        open_backend("sqlite://")


def test_open_backend_opens_redis(redis_url: str) -> None:  # noqa: F811
    from kvref.store.redis_backend import RedisBackend

    store = open_backend(redis_url)
    assert isinstance(store, RedisBackend) and store.url == redis_url
    store.close()


def test_an_unreachable_redis_is_named() -> None:
    pytest.importorskip("redis")
    with pytest.raises(
        ArgumentError, match=re.escape("cannot reach the Redis server of store URL 'redis://127.0.0.1:1/0'")
    ):
        open_backend("redis://127.0.0.1:1/0")


def test_without_the_redis_client_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "redis", None)  # import redis now raises ImportError
    with pytest.raises(BackendError, match=r"pip install 'kvref\[store\]'"):
        open_backend("redis://127.0.0.1:6379/0")
