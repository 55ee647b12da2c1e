"""Live: `kvref.store.LlamaCache` as llama-cpp-python's prompt cache gives the completions a run without a cache
gives, serves the prefixes prompts share, never serves one model's states to another, survives being reopened and
keeps no ``scores``.

Marked ``live``; skipped, with the reason, when llama-cpp-python cannot be imported. Every prompt of a cached run
goes to a fresh ``Llama`` (an empty context, as a new process or another server would have), so a hit is really
loaded with ``Llama.load_state`` rather than served by the ``Llama``'s own prefix reuse.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import kvref.store
from kvref.errors import ArgumentError, BackendError

pytestmark = pytest.mark.live

import _llama_live  # noqa: E402, F401  (skips this module, with the reason, without llama-cpp-python)
import llama_cpp  # noqa: E402
from _redis import redis_url  # noqa: E402, F401  (a fixture)
from golden import tiny_model  # noqa: E402
from llama_cpp.llama_cache import BaseLlamaCache  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "conformance"
N_SHARED, N_TAIL, N_NEW = 300, 20, 8
ATTENTION = ["llama-tiny", "gemma3-tiny"]
RECURRENT = ["mamba-tiny", "jamba-tiny"]  # a recurrent state is served only at a length a state was saved at


def new_llama(path: Path, logits_all: bool = False) -> llama_cpp.Llama:
    return llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, seed=1234, verbose=False,
                           logits_all=logits_all)  # fmt: skip


class Recorder(BaseLlamaCache):
    """A cache that never hits and records what llama-cpp-python stores: the prompt + completion tokens of a run
    that behaves exactly as one without a cache (saving a state reads the context, changes nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[list[int]] = []

    @property
    def cache_size(self) -> int:
        return 0

    def __getitem__(self, key: Sequence[int]) -> llama_cpp.llama.LlamaState:
        raise KeyError("never")

    def __contains__(self, key: Sequence[int]) -> bool:
        return False

    def __setitem__(self, key: Sequence[int], value: llama_cpp.llama.LlamaState) -> None:
        self.keys.append(list(key))


def spy_cache(url: str, **kw: object) -> kvref.store.llama_cache._LlamaCache:
    """A LlamaCache that also records the keys it is given (prompt + completion tokens)."""
    base = kvref.store.LlamaCache

    class Spy(base):  # type: ignore[misc,valid-type]
        def __setitem__(self, key: Sequence[int], value: llama_cpp.llama.LlamaState) -> None:
            self.keys.append(list(key))
            super().__setitem__(key, value)

    cache = Spy(url, **kw)
    cache.keys = []
    return cache  # type: ignore[no-any-return]


def complete(llm: llama_cpp.Llama, prompt: list[int], **kw: object) -> dict[str, object]:
    # temperature 0: greedy; tiny gemma3 otherwise sits on </s> and <unk>, so bias them away
    out = llm.create_completion(prompt, max_tokens=N_NEW, temperature=0.0, logit_bias={0: -100.0, 2: -100.0}, **kw)
    assert isinstance(out, dict)
    return out["choices"][0]  # type: ignore[no-any-return]


def count_loads(llm: llama_cpp.Llama, loads: list[int]) -> llama_cpp.Llama:
    orig = llm.load_state

    def load_state(state: llama_cpp.llama.LlamaState) -> None:
        loads.append(state.n_tokens)
        orig(state)

    llm.load_state = load_state  # type: ignore[method-assign]
    return llm


def prompts(seed: int = 7) -> list[list[int]]:
    """Three prompts sharing N_SHARED random tokens, then distinct tails (ids 3 .. 127: no <s>, </s>)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 128, N_SHARED).tolist()
    return [shared + rng.integers(3, 128, N_TAIL).tolist() for _ in range(3)]


def dir_url(tmp_path: Path) -> str:
    return str(tmp_path / "store")


@pytest.mark.parametrize("backend", ["memory", "dir"])
@pytest.mark.parametrize("name", ATTENTION + RECURRENT)
def test_completions_same_as_without_cache(name: str, backend: str, tmp_path: Path) -> None:
    """Prompts sharing a 300-token prefix, the first again, and the first's prompt + completion extended: token for
    token the completions of a run without a cache, the hits loaded where the store has the prefix."""
    url = "memory:" if backend == "memory" else dir_url(tmp_path)
    path = tiny_model(name)
    ps = prompts()
    ref = Recorder()
    for p in ps:
        llm = new_llama(path)
        llm.set_cache(ref)
        complete(llm, p)
    extended = ref.keys[0] + [5, 6, 7, 8]  # P0, its completion, more
    for p in (ps[0], extended):
        llm = new_llama(path)
        llm.set_cache(ref)
        complete(llm, p)
    want = ref.keys

    cache = spy_cache(url)
    loads: list[int] = []
    hits = []
    for p in [*ps, ps[0], extended]:
        llm = count_loads(new_llama(path), loads)
        llm.set_cache(cache)
        complete(llm, p)
        hits.append(cache.store.stats()["hits"])
    assert cache.keys == want
    if name in ATTENTION:
        # P1, P2: the shared 300; P0 again: all of it; extended: P0 + completion but its last token (never decoded)
        assert loads == [N_SHARED, N_SHARED, N_SHARED + N_TAIL, N_SHARED + N_TAIL + N_NEW - 1]
        assert hits == [0, 1, 2, 3, 4]
    else:
        # the recurrent state exists only where a completion ended: only the extended prompt reaches one
        assert loads == [N_SHARED + N_TAIL + N_NEW - 1]
        assert hits == [0, 0, 0, 0, 1]
    # a read removes nothing (LlamaDiskCache pops what it serves)
    size = cache.cache_size
    assert extended in cache
    # its own completion was stored since: all of it (a recurrent state: still the one after P0's completion)
    served = len(extended) if name in ATTENTION else loads[-1]
    assert cache[extended].n_tokens == served
    assert cache[extended].n_tokens == served
    assert cache.cache_size == size


@pytest.mark.parametrize("name", ATTENTION)
def test_logprobs_identical(name: str) -> None:
    """With ``logits_all`` and ``logprobs``, the completion's log-probabilities after a hit are those of a run
    without a cache, bit for bit (the loaded K/V is the bytes the first run computed)."""
    path = tiny_model(name)
    ps = prompts(11)
    want = []
    for p in ps[1:]:
        want.append(complete(new_llama(path, logits_all=True), p, logprobs=3)["logprobs"])
    cache = kvref.store.LlamaCache("memory:")
    llm = new_llama(path, logits_all=True)
    llm.set_cache(cache)
    complete(llm, ps[0], logprobs=3)
    got = []
    loads: list[int] = []
    for p in ps[1:]:
        llm = count_loads(new_llama(path, logits_all=True), loads)
        llm.set_cache(cache)
        got.append(complete(llm, p, logprobs=3)["logprobs"])
    assert loads == [N_SHARED, N_SHARED]
    assert got == want


def _create_completion(self: llama_cpp.Llama, cache: object, prompt: list[int], echo: bool,
                       logprobs: int | None) -> object:  # fmt: skip
    """What llama-cpp-python's ``Llama._create_completion`` does with the cache, with its locals (its own echo
    path cannot take a token list, and the tiny models' vocabulary cannot tokenize text)."""
    return cache[prompt]  # type: ignore[index]


def test_prompt_logprobs_are_not_served() -> None:
    """``echo`` with ``logprobs`` on a ``logits_all`` Llama reads the prompt's scores, which a hit does not carry:
    the cache misses there, and serves the same prompt otherwise."""
    path = tiny_model("llama-tiny")
    ps = prompts(3)
    cache = kvref.store.LlamaCache("memory:")
    llm = new_llama(path, logits_all=True)
    llm.set_cache(cache)
    complete(llm, ps[0], logprobs=2)
    with pytest.raises(KeyError):
        _create_completion(llm, cache, ps[1], True, 2)
    assert _create_completion(llm, cache, ps[1], False, 2).n_tokens == N_SHARED  # type: ignore[attr-defined]
    assert _create_completion(llm, cache, ps[1], True, None).n_tokens == N_SHARED  # type: ignore[attr-defined]
    plain = new_llama(path)  # without logits_all, logprobs are refused by llama-cpp-python itself
    assert _create_completion(plain, cache, ps[1], True, 2).n_tokens == N_SHARED  # type: ignore[attr-defined]


def test_another_model_never_hits(tmp_path: Path) -> None:
    """A model of the same geometry with other weights (llama-tiny with its last tensor bytes changed) shares the
    store but never gets llama-tiny's states: the namespace is the weights' hash."""
    path = tiny_model("llama-tiny")
    other = tmp_path / "llama-tiny-other.gguf"
    shutil.copyfile(path, other)
    with other.open("r+b") as f:
        f.seek(-64, 2)
        f.write(bytes(64))  # f16 zeros in the last tensor's data
    ps = prompts()
    cache = kvref.store.LlamaCache("memory:")
    for p in ps:
        llm = new_llama(path)
        llm.set_cache(cache)
        complete(llm, p)
    assert all(cache.store.lookup(p, path).n_tokens > 0 for p in ps)
    assert all(cache.store.lookup(p, other).n_tokens == 0 for p in ps)
    hits = cache.store.stats()["hits"]
    loads: list[int] = []
    llm = count_loads(new_llama(other), loads)
    llm.set_cache(cache)
    complete(llm, ps[0])
    assert loads == []
    assert cache.store.stats()["hits"] == hits
    assert cache.store.stats()["models"] == 2
    llm = count_loads(new_llama(path), loads)  # llama-tiny still hits its own
    llm.set_cache(cache)
    complete(llm, ps[1])
    assert loads == [N_SHARED + N_TAIL]


@pytest.mark.parametrize("backend", ["dir", "redis"])
def test_reopened_cache_hits(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A new LlamaCache on the same store (a new process, another server) serves what an earlier one stored."""
    if backend == "dir":
        url = dir_url(tmp_path)
    else:
        url = f"{request.getfixturevalue('redis_url')}?prefix=kvref-llamacache-{uuid.uuid4().hex}:"
    path = tiny_model("llama-tiny")
    ps = prompts()
    first = kvref.store.LlamaCache(url, chunk_tokens=64)
    llm = new_llama(path)
    llm.set_cache(first)
    want = complete(new_llama(path), ps[1])
    complete(llm, ps[0])
    size = first.cache_size
    again = kvref.store.LlamaCache(url)  # chunk_tokens is the store's
    assert again.store.chunk_tokens == 64
    assert again.cache_size == size
    loads: list[int] = []
    llm = count_loads(new_llama(path), loads)
    llm.set_cache(again)
    assert complete(llm, ps[1]) == want
    assert loads == [N_SHARED]


def test_stored_bytes_far_below_scores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 300-token prompt of a model with an 8192-token vocabulary: LlamaRAMCache would keep its scores, 300 x 8192
    x 4 bytes (llama-cpp-python #1303); the store keeps the K/V only (the tiny models' 128-token vocabulary makes
    scores as small as K/V, so this test builds a llama-tiny with a larger vocabulary)."""
    sys.path.insert(0, str(ROOT))
    import tinymodels

    n_vocab = 8192

    def vocab() -> tuple[list[str], list[float], list[int]]:
        import gguf

        toks = ["<unk>", "<s>", "</s>", "<0x0A>"] + [f"\u2581t{i}" for i in range(n_vocab - 4)]
        types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.BYTE]
        types += [gguf.TokenType.NORMAL] * (n_vocab - 4)
        return toks, [0.0] * 4 + [-float(k) for k in range(n_vocab - 4)], [int(t) for t in types]

    monkeypatch.setattr(tinymodels, "N_VOCAB", n_vocab)
    monkeypatch.setattr(tinymodels, "_spm_vocab", vocab)
    dims = tinymodels._Dims(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, hd=32, n_ff=64)
    path = tinymodels._llama(tmp_path, "llama-bigvocab-tiny", dims, 1001).path
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, n_vocab, N_SHARED).tolist()
    cache = kvref.store.LlamaCache("memory:")
    llm = new_llama(path)
    llm.set_cache(cache)
    saved = []
    orig = llm.save_state

    def save_state() -> llama_cpp.llama.LlamaState:
        saved.append(orig())
        return saved[-1]

    llm.save_state = save_state  # type: ignore[method-assign]
    llm.create_completion(prompt, max_tokens=1, temperature=0.0)
    state = saved[0]
    assert state.n_tokens == N_SHARED
    scores = N_SHARED * n_vocab * 4
    assert state.scores.nbytes == scores  # what LlamaRAMCache would keep, on top of the state
    assert cache.cache_size < scores / 20
    assert cache.cache_size < state.llama_state_size * 1.5  # the state's K/V and the chunks' records, no more
    hit = cache[prompt]
    assert hit.scores.nbytes == n_vocab * 4


def test_capacity_evicts() -> None:
    """``capacity_bytes`` bounds the store: older chunks go (llama-cpp-python #1402: its caches outgrow theirs)."""
    path = tiny_model("llama-tiny")
    cache = kvref.store.LlamaCache("memory:", capacity_bytes=400_000, chunk_tokens=64)
    rng = np.random.default_rng(9)
    for _ in range(6):
        llm = new_llama(path)
        llm.set_cache(cache)
        complete(llm, rng.integers(3, 128, 320).tolist())
        assert cache.cache_size <= 400_000
    assert cache.store.stats()["evicted_bytes"] > 0


def test_used_directly() -> None:
    """Outside a completion the cache needs ``model=``; with it, ``cache[tokens]`` loads in a Llama by hand."""
    path = tiny_model("llama-tiny")
    ps = prompts()
    cache = kvref.store.LlamaCache("memory:", model=path)
    llm = new_llama(path)
    llm.set_cache(cache)
    want = complete(new_llama(path), ps[1])
    complete(llm, ps[0])
    assert ps[1] in cache
    assert [9, 9, 9] not in cache
    with pytest.raises(KeyError):
        cache[[9, 9, 9]]
    state = cache[ps[1]]
    assert state.n_tokens == N_SHARED and list(state.input_ids[:N_SHARED]) == ps[1][:N_SHARED]
    fresh = new_llama(path)
    fresh.load_state(state)
    assert complete(fresh, ps[1]) == want
    with pytest.raises(ArgumentError, match="model="):
        _ = ps[0] in kvref.store.LlamaCache("memory:")
    other = kvref.store.LlamaCache("memory:")
    llm = new_llama(path)
    llm.set_cache(other)
    complete(llm, ps[0])
    assert ps[1] in other  # as the last Llama that called it


def test_model_mismatch_is_an_error() -> None:
    """``model=`` that is not the calling Llama's model: an error, not states filed under the wrong model."""
    cache = kvref.store.LlamaCache("memory:", model=tiny_model("qwen3-tiny"))
    llm = new_llama(tiny_model("llama-tiny"))
    llm.set_cache(cache)
    with pytest.raises(ArgumentError, match="another model"):
        complete(llm, prompts()[0])


def test_without_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without llama-cpp-python, kvref.store imports and LlamaCache says what to install."""
    from kvref.store import llama_cache

    monkeypatch.setattr(llama_cache, "_built", None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    with pytest.raises(BackendError, match="pip install llama-cpp-python"):
        kvref.store.LlamaCache("memory:")


def test_flash_attn_states_kept_apart() -> None:
    """States of a context without flash attention (V transposed) are never served to one with it, whose
    llama_state_set_data would refuse them; llama.cpp's auto (-1) on a CPU-only model is served as enabled."""
    path = tiny_model("llama-tiny")
    ps = prompts(13)
    cache = kvref.store.LlamaCache("memory:")

    def run(p: list[int], flash_attn: bool, auto: bool = False) -> tuple[dict[str, object], list[int]]:
        loads: list[int] = []
        llm = count_loads(llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, seed=1, verbose=False,
                                          flash_attn=flash_attn), loads)  # fmt: skip
        if auto:  # as if the context had been made with auto (Llama() only makes enabled or disabled ones)
            llm.context_params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
        llm.set_cache(cache)
        return complete(llm, p), loads

    run(ps[0], False)
    out, loads = run(ps[1], True)
    assert loads == []
    assert out == complete(llama_cpp.Llama(model_path=str(path), n_ctx=1024, seed=1, verbose=False,
                                           flash_attn=True), ps[1])  # fmt: skip
    assert run(ps[2], True, auto=True)[1] == [N_SHARED]  # the flash-attention state of ps[1]
    assert run(ps[2], False)[1] == [N_SHARED]  # the one of ps[0]


def test_flash_attn_of() -> None:
    from kvref.store.llama_cache import flash_attn_of

    assert flash_attn_of(1, 99, True) is True and flash_attn_of(0, 0, False) is False
    assert flash_attn_of(-1, 0, True) is True and flash_attn_of(-1, 99, False) is True
    assert flash_attn_of(-1, 99, True) is None  # offloaded: learnt from the first state the context saves


def test_flash_attn_auto_learnt_from_first_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where auto cannot be told in advance (layers on a GPU), the Llama is served nothing until it saved a state,
    whose V layout says what auto resolved to; then it hits."""
    from kvref.store import llama_cache

    monkeypatch.setattr(llama_cache, "flash_attn_of", lambda *a: None)
    path = tiny_model("llama-tiny")
    ps = prompts(17)
    cache = kvref.store.LlamaCache("memory:")
    llm = new_llama(path)
    llm.set_cache(cache)
    loads: list[int] = []
    other = count_loads(new_llama(path), loads)  # another Llama, not yet resolved
    other.set_cache(cache)
    complete(llm, ps[0])  # stored; llm learns
    complete(other, ps[1])
    assert loads == []
    llm = count_loads(llm, loads)
    llm.reset()
    complete(llm, ps[2])
    assert loads == [N_SHARED]


def test_state_not_stored_is_a_warning() -> None:
    """A state the store cannot read is skipped with a CacheWarning: the completion that saved it must not fail."""
    from kvref.errors import CacheWarning

    cache = kvref.store.LlamaCache("memory:", model=tiny_model("llama-tiny"), capacity_bytes=None)
    bad = llama_cpp.llama.LlamaState(input_ids=np.arange(4, dtype=np.intc), scores=np.zeros((4, 128), np.single),
                                     n_tokens=4, llama_state=b"\x00" * 16, llama_state_size=16, seed=0)  # fmt: skip
    with pytest.warns(CacheWarning, match="not stored"):
        cache[[0, 1, 2, 3]] = bad
    assert cache.store.stats()["puts"] == 0
