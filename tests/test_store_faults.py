"""kvref.store under concurrency and faults: several processes putting the same and different prefixes at once,
a writer killed with SIGKILL in the middle of its puts, and a disk that fills up. Nothing is served wrong and
nothing is lost but the interrupted put. Every state is llama.cpp's own (a golden sequence file, stored under
several token lists)."""

from __future__ import annotations

import multiprocessing
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from _redis import redis_url  # noqa: F401  (a fixture)
from _store_workers import SEQ_FILE, kill_after, labels, store_churner, store_put_limited, store_putter
from golden import tiny_model

import kvref
import kvref.store
from kvref.store.prefix import Store

MODEL = str(tiny_model("llama-tiny"))
N = len(kvref.state.load(SEQ_FILE).tokens)


@pytest.fixture(params=["embedded", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "embedded":
        return str(tmp_path / "store")
    return str(request.getfixturevalue("redis_url")) + f"?prefix=kvref-faults-{uuid.uuid4().hex}:"


def served_right(st: Store, prompt: int) -> int:
    """How many tokens of ``prompt`` the store serves; asserts the rows served are the golden file's."""
    want = kvref.state.load(SEQ_FILE)
    hit = st.get(labels(prompt, N), model=MODEL, kind="seq")
    if hit is None:
        return 0
    got = kvref.state.load(hit.data)
    assert list(got.tokens) == labels(prompt, N)[: hit.n_tokens]
    a, b = want.memory.kv_sections[0].streams[0], got.memory.kv_sections[0].streams[0]
    for x, y in zip(a.data.k, b.data.k, strict=True):
        assert np.array_equal(y.data, x.data[: hit.n_tokens])
    return hit.n_tokens


def test_processes_putting_the_same_and_different_prefixes_at_once(url: str) -> None:
    ctx = multiprocessing.get_context("spawn")
    jobs = [(url, MODEL, [p, (p + 1) % 4, 9]) for p in range(4)]  # prompt 9 by all, 0..3 by two each
    with ctx.Pool(4) as pool:
        pool.starmap(store_putter, jobs)
    with kvref.store.open(url) as st:
        for p in [0, 1, 2, 3, 9]:
            assert served_right(st, p) == N
        # the shared head (8 tokens = 2 chunks) once, and 2 own chunks per prompt
        assert st.backend.usage()[1] == 2 * (2 + 5 * 2)  # a meta and a part per chunk


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
@pytest.mark.parametrize("puts", [3, 25])
def test_a_put_killed_midway_leaves_the_store_consistent(url: str, tmp_path: Path, puts: int) -> None:
    kill_after(store_churner, (url, MODEL), tmp_path / "progress", puts)
    with kvref.store.open(url) as st:  # no capacity: gc only drops what nothing reaches
        served = [served_right(st, p) for p in range(40)]  # whatever is served is right
        assert max(served) == N
        st.gc()
        assert [served_right(st, p) for p in range(40)] == served  # gc drops only what nothing reaches
        st.put(SEQ_FILE, model=MODEL, tokens=labels(0, N))
        assert served_right(st, 0) == N


def test_a_full_disk_fails_the_put_clearly_and_keeps_what_was_stored(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    store_putter(url, MODEL, [0])
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        err = pool.apply(store_put_limited, (url, MODEL, 200_000))
    assert err.startswith("kvref.errors.") and ("disk" in err or "space" in err or "large" in err), err
    with kvref.store.open(url) as st:
        assert served_right(st, 0) == N
        for p in range(100, 140):
            served_right(st, p)  # partly stored prompts: whatever is served is right
