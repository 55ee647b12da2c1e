"""Live: what kvref.store serves, the real llama.cpp loads and continues from bit for bit.

For each memory kind (plain KV, iSWA with and without ``swa_full``, recurrent, hybrid) two prompts sharing a long
prefix are prefilled by llama.cpp and saved (sequence files and session files); both go into one store (the
embedded backend and a real Redis server). A third prompt shares part of the first: the store serves what it can,
and llama.cpp, loading that, continues with logits identical to (a) llama.cpp's own truncation of the stored
state (load it, ``seq_rm(L, -1)``) and (b) a fresh prefill of the same tokens. What the state does not hold (an
SWA window a sequence save dropped, a recurrent state between checkpoints) is not served, another model's store
never hits, and chunks shared by the prompts are kept once.

Marked ``live``; skipped, with the reason, when llama-cpp-python cannot be imported.
"""

from __future__ import annotations

import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import kvref.store
from kvref.store.backends import open_backend
from kvref.store.prefix import Store

pytestmark = pytest.mark.live

from _llama_live import Ctx  # noqa: E402  (skips this module, with the reason, without llama-cpp-python)
from _redis import redis_url  # noqa: E402, F401  (a fixture)
from golden import tiny_model  # noqa: E402

N_CTX = 1024
SYSTEM = 300  # tokens both stored prompts start with
CHUNK = 64
NEXT = [5, 9, 11]


@pytest.fixture(params=["embedded", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "embedded":
        st = Store(open_backend(tmp_path / "store"), chunk_tokens=CHUNK)
    else:
        from kvref.store.redis_backend import RedisBackend

        be = RedisBackend(request.getfixturevalue("redis_url"), prefix=f"kvref-live-{uuid.uuid4().hex}:")
        st = Store(be, chunk_tokens=CHUNK)
    try:
        yield st
    finally:
        st.backend.delete(st.backend.keys())
        st.close()


def prompts(seed: int) -> tuple[list[int], list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(1, 128, SYSTEM).tolist()
    return system + rng.integers(1, 128, 50).tolist(), system + rng.integers(1, 128, 70).tolist()


def save(model: Path, tokens: list[int], path: Path, kind: str, swa_full: bool, n_ctx: int = N_CTX) -> None:
    with Ctx(model, n_ctx=n_ctx, swa_full=swa_full) as c:
        for i in range(0, len(tokens), 512):  # llama_decode takes at most n_batch (512) tokens a call
            c.decode(tokens[i : i + 512], 0)
        if kind == "seq":
            c.save_seq(path, 0, tokens)
        else:
            c.save_session(path, tokens)


def load(c: Ctx, path: Path, kind: str) -> None:
    if kind == "seq":
        c.load_seq(path, 0)
    else:
        c.load_session(path)


def continued(model: Path, swa_full: bool, rest: list[int], *, path: Path | None = None, kind: str = "seq",
              cut: int | None = None, prefill: list[int] | None = None) -> list[np.ndarray]:  # fmt: skip
    """The logits after each token of ``rest`` in a context that starts from ``path`` (truncated to ``cut``) or
    from a prefill of ``prefill``."""
    with Ctx(model, n_ctx=N_CTX, swa_full=swa_full) as c:
        if path is not None:
            load(c, path, kind)
            if cut is not None:
                assert c.seq_rm(0, cut, -1)
        if prefill:
            c.decode(prefill, 0)
        return [c.decode([t], 0) for t in rest]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


# (model, swa_full, kind, the cut a prompt leaving the first one at token 320 is served at)
CASES = [
    ("llama-tiny", False, "seq", 320),
    ("llama-tiny", False, "session", 320),
    ("gemma3-tiny", False, "seq", 0),  # a sequence save keeps only the SWA window of its last tokens
    ("gemma3-tiny", True, "seq", 0),
    ("gemma3-tiny", False, "session", 320),  # the whole SWA cache is saved (it holds every row here)
    ("gemma3-tiny", True, "session", 320),
    ("mamba-tiny", False, "seq", 0),  # recurrent: only where a state was saved
    ("jamba-tiny", False, "session", 0),
]


@pytest.mark.parametrize(("name", "swa_full", "kind", "served_at_320"), CASES)
def test_llama_cpp_continues_from_a_served_prefix_as_from_its_own_truncation(
    name: str, swa_full: bool, kind: str, served_at_320: int, store: Store, tmp_path: Path
) -> None:
    model = tiny_model(name)
    a, b = prompts(zlib.crc32(f"{name}-{swa_full}-{kind}".encode()))  # the same prompts every run
    for tag, toks in (("a", a), ("b", b)):
        save(model, toks, tmp_path / f"{tag}.bin", kind, swa_full)
        store.put(tmp_path / f"{tag}.bin", model=model)
    # token 0 is in no stored prompt (they draw from 1 .. 127): the first prompt leaves the stored one at 320
    for prompt, want in (([*a[:320], 0, 2, 3], served_at_320), ([*a, 4, 5], len(a)), (b, len(b))):
        look = store.lookup(prompt, model=model)
        assert look.n_tokens == want, look
        hit = store.get(prompt, model=model, kind=kind)
        if want == 0:
            assert hit is None
            assert look.why and look.matched > 0  # it says why the shared tokens cannot be served
            continue
        assert hit is not None and hit.n_tokens == want
        served = tmp_path / "served.bin"
        hit.save(served)
        src = tmp_path / ("a.bin" if prompt[SYSTEM] == a[SYSTEM] else "b.bin")
        rest = prompt[want:] + NEXT
        got = continued(model, swa_full, rest, path=served, kind=kind)
        assert same(got, continued(model, swa_full, rest, path=src, kind=kind, cut=want))
        assert same(got, continued(model, swa_full, rest, prefill=prompt[:want]))


def test_another_model_or_context_never_hits(store: Store, tmp_path: Path) -> None:
    llama, qwen = tiny_model("llama-tiny"), tiny_model("qwen3-tiny")
    a, _ = prompts(7)
    save(llama, a, tmp_path / "a.bin", "seq", False)
    store.put(tmp_path / "a.bin", model=llama)
    assert store.get(a, model=llama) is not None
    assert store.get(a, model=qwen) is None
    assert store.get(a, model=llama, flash_attn=True) is None  # saved without flash attention (V transposed)
    assert store.get(a, model=llama, type_k="q8_0") is None


def test_seven_prompts_sharing_a_long_prefix_are_kept_in_under_045_of_their_bytes(tmp_path: Path) -> None:
    model = tiny_model("llama-tiny")
    rng = np.random.default_rng(3)
    system = rng.integers(1, 128, 1500).tolist()
    st = kvref.store.open(tmp_path / "store")  # the default chunk size
    total = 0
    for i in range(7):
        toks = system + rng.integers(1, 128, 60).tolist()
        path = tmp_path / f"p{i}.bin"
        save(model, toks, path, "seq", False, n_ctx=2048)
        total += path.stat().st_size
        st.put(path, model=model)
    held = st.stats()["bytes"]
    assert isinstance(held, int)
    assert held <= 0.45 * total, (held, total)
    for i in range(7):  # and each comes back whole
        path = tmp_path / f"p{i}.bin"
        toks = kvref.state.load(path).tokens
        hit = st.get(toks, model=model, kind="seq")
        assert hit is not None and hit.data == path.read_bytes()
