"""kvref.store on llama.cpp's own files: what goes in comes back byte for byte, a prompt gets exactly the prefix it
shares (cut at the token where it leaves a stored one), chunks are kept once, and damaged, evicted or foreign
values are never served. Every state here was written by a real llama.cpp (conformance/golden); the live tests
(test_store_live.py) continue decoding from what the store serves."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _redis import redis_url  # noqa: F401  (a fixture)
from golden import tiny_model

import kvref
import kvref.store
from kvref.errors import ArgumentError, FormatError
from kvref.store.backend import Backend, MemoryBackend
from kvref.store.backends import open_backend
from kvref.store.chunks import ChunkMeta
from kvref.store.prefix import Store

ROOT = Path(__file__).resolve().parent.parent / "conformance"
GOLDEN = ROOT / "golden"


def _case_model(case: Path) -> str:
    model = json.loads((case / "case.json").read_text())["model"]
    return str(model["file"] if isinstance(model, dict) else model + ".gguf").removesuffix(".gguf")


# llama.cpp sequence files whose sequence sits at positions 0 .. n-1 in position order: one per memory kind
SEQ_FILES = [
    "llama-f16-single-seq/03-seq-seq0.ggsq",  # plain KV, V transposed
    "llama-f16-fa-single-seq/03-seq-seq0.ggsq",  # flash attention: V row-wise
    "llama-q8_0-fa-multistream/03-seq-seq0.ggsq",  # q8_0 rows, a multi-stream context
    "gemma3-iswa/03-seq-seq0.ggsq",  # iSWA: base + SWA sections
    "gemma3-iswa/06-seq-seq1.ggsq",  # ... of sequence 1
    "qwen2vl-mrope/03-seq-seq0.ggsq",  # M-RoPE: 12-byte cell ext
    "mamba-seq-cp-rm/03-seq-seq0.ggsq",  # recurrent
    "jamba-hybrid/03-seq-seq0.ggsq",  # hybrid
    "lfm2-swa-hybrid-iswa/03-seq-seq0.ggsq",  # hybrid iSWA
    "legacy-0.3.16-llama-f16-single-seq/03-seq-seq0.ggsq",  # the 2025 layout
]


def _seq_id(obj: object) -> int:
    ids = {int(s) for sec in obj.memory.kv_sections for st in sec.streams if st.cells is not None  # type: ignore[attr-defined]
           for s in st.cells.seq_id}  # fmt: skip
    return ids.pop() if len(ids) == 1 else 0


@pytest.fixture(params=["memory", "embedded", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """A store with chunks of 4 tokens on each backend (Redis: a real server, `_redis.redis_url`)."""
    backend: Backend
    if request.param == "memory":
        backend = MemoryBackend()
    elif request.param == "embedded":
        backend = open_backend(tmp_path / "store")
    else:
        from kvref.store.redis_backend import RedisBackend

        backend = RedisBackend(request.getfixturevalue("redis_url"), prefix=f"kvref-test-{uuid.uuid4().hex}:")
    st = Store(backend, chunk_tokens=4)
    try:
        yield st
    finally:
        backend.delete(backend.keys())
        st.close()


@pytest.mark.parametrize("name", SEQ_FILES)
def test_a_stored_sequence_file_comes_back_byte_for_byte(name: str, store: Store) -> None:
    f = GOLDEN / name
    model = tiny_model(_case_model(f.parent))
    obj = kvref.state.load(f)
    put = store.put(f, model=model)
    assert put.n_tokens == len(obj.tokens)
    n_stream = len(obj.memory.kv_sections[0].streams) if obj.memory.kv_sections else 1  # the context's streams
    hit = store.get(obj.tokens, model=model, kind="seq", seq_id=_seq_id(obj), n_stream=n_stream, type_k=None,
                    type_v=None)  # fmt: skip
    assert hit is not None and hit.n_tokens == len(obj.tokens) and hit.why == []
    assert hit.data == f.read_bytes()


def test_a_prompt_gets_the_prefix_it_shares_cut_at_the_token_where_it_leaves(store: Store) -> None:
    f = GOLDEN / "llama-f16-single-seq/03-seq-seq0.ggsq"
    model = tiny_model("llama-tiny")
    obj = kvref.state.load(f)
    toks = [int(t) for t in obj.tokens]
    store.put(f, model=model)
    for cut in range(1, len(toks)):  # mid-chunk and on chunk edges (chunks of 4)
        prompt = [*toks[:cut], (toks[cut] + 1) % 128, 5]
        hit = store.get(prompt, model=model, kind="seq")
        assert hit is not None and hit.n_tokens == cut, cut
        got = kvref.state.load(hit.data)
        assert list(got.tokens) == toks[:cut]
        want, have = obj.memory.kv_sections[0].streams[0], got.memory.kv_sections[0].streams[0]
        assert np.array_equal(have.cells.pos, want.cells.pos[:cut])
        for a, b in zip(want.data.k, have.data.k, strict=True):
            assert np.array_equal(b.data, a.data[:cut])
        for a, b in zip(want.data.v, have.data.v, strict=True):  # V transposed: each embedding row's first cut cells
            el = a.el_size
            assert np.array_equal(b.data, a.data[:, : cut * el])
    assert store.get([(toks[0] + 1) % 128], model=model) is None


def test_an_iswa_sequence_save_is_served_only_where_its_swa_cache_holds_the_window(store: Store) -> None:
    """gemma3-iswa's sequence 1 file holds SWA rows of positions 9 .. 12 only (window 4): a cut at 12 or 13 has its
    window, any shorter cut would need rows the file does not have."""
    f = GOLDEN / "gemma3-iswa/06-seq-seq1.ggsq"
    model = tiny_model("gemma3-tiny")
    obj = kvref.state.load(f)
    assert list(obj.memory.kv_sections[1].streams[0].cells.pos) == [9, 10, 11, 12]
    toks = [int(t) for t in obj.tokens]
    store.put(f, model=model)
    assert store.lookup(toks, model=model).n_tokens == 13
    assert store.lookup([*toks[:12], 0], model=model).n_tokens == 12  # needs 9 .. 11
    look = store.lookup([*toks[:10], 0], model=model)
    assert look.n_tokens == 0 and look.matched == 10
    assert any("SWA" in w and "window" in w for w in look.why), look.why
    assert store.get([*toks[:10], 0], model=model) is None


def test_a_recurrent_state_is_served_only_at_its_checkpoint(store: Store) -> None:
    f = GOLDEN / "mamba-seq-cp-rm/03-seq-seq0.ggsq"
    model = tiny_model("mamba-tiny")
    toks = [int(t) for t in kvref.state.load(f).tokens]
    assert store.put(f, model=model).checkpoint
    assert store.lookup([*toks, 1, 2], model=model).n_tokens == len(toks)
    shorter = store.lookup([*toks[:-1], (toks[-1] + 1) % 128], model=model)
    assert shorter.n_tokens == 0 and shorter.matched == len(toks) - 1
    assert any("recurrent" in w for w in shorter.why)


def test_shared_chunks_are_stored_once(store: Store) -> None:
    """Sequences 0 and 2 of llama-shared-prefix share their first tokens: the second put adds only what differs."""
    case = GOLDEN / "llama-shared-prefix"
    model = tiny_model(_case_model(case))
    files = sorted(case.glob("*-seq-seq*.ggsq"))
    first = store.put(files[0], model=model)
    again = store.put(files[0], model=model)
    assert first.new_chunks > 0 and again.new_chunks == 0 and again.new_bytes == 0
    held = store.stats()["bytes"]
    store.put(files[0], model=model)
    assert store.stats()["bytes"] == held


def test_another_model_or_another_cache_type_never_hits(store: Store, tmp_path: Path) -> None:
    f = GOLDEN / "llama-f16-single-seq/03-seq-seq0.ggsq"
    model = tiny_model("llama-tiny")
    toks = [int(t) for t in kvref.state.load(f).tokens]
    store.put(f, model=model)
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(model.read_bytes())
    assert store.get(toks, model=copy) is not None  # the weights, not the name
    other = tmp_path / "finetuned.gguf"
    data = bytearray(model.read_bytes())
    data[-1] ^= 1  # one weight byte
    other.write_bytes(bytes(data))
    assert store.get(toks, model=other) is None
    assert store.get(toks, model=model, type_k="q8_0", type_v="q8_0") is None
    assert store.get(toks, model=model, flash_attn=True) is None  # the file's V is transposed: no flash attention
    assert store.get(toks, model=model, flash_attn=False) is not None
    store.put(f, model=model, tokens=[t + 1 for t in toks], extra={"rope_freq_base": 20000.0})
    assert store.get([t + 1 for t in toks], model=model) is None  # put with a RoPE override: met only with it
    assert store.get([t + 1 for t in toks], model=model, extra={"rope_freq_base": 20000.0}) is not None
    assert store.get(toks, model=model, extra={"rope_freq_base": 20000.0}) is None


@pytest.mark.parametrize("victim", ["c:", "s0."])
def test_a_damaged_value_is_a_reported_miss_never_served(store: Store, victim: str) -> None:
    f = GOLDEN / "llama-f16-single-seq/03-seq-seq0.ggsq"
    model = tiny_model("llama-tiny")
    toks = [int(t) for t in kvref.state.load(f).tokens]
    store.put(f, model=model)
    be = store.backend
    # damage the value of the third chunk (positions 8 .. 11)
    third = None
    held = be.keys()
    for key in held:
        if key.startswith(victim):
            value = be.get(key)
            assert value is not None
            if key.startswith("c:"):
                from kvref.store.chunks import ChunkMeta

                if list(ChunkMeta.decode(value).tokens) == toks[8:12]:
                    third = key
            elif key.endswith(":" + _chunk_key_of(be, toks[8:12])):
                third = key
    assert third is not None
    bad = bytearray(be.get(third) or b"")
    bad[-3] ^= 0x40
    be.put(third, bytes(bad), replace=True)
    hit = store.get(toks, model=model, kind="seq")
    assert hit is not None and hit.n_tokens == 8  # the chunks before it, nothing of it
    assert store.stats()["corrupt"] == 1
    held = be.keys()
    assert third not in held  # dropped: the next put stores it again
    store.put(f, model=model)
    assert store.get(toks, model=model, kind="seq").data == f.read_bytes()  # type: ignore[union-attr]


def _chunk_key_of(be: Backend, tokens: list[int]) -> str:
    from kvref.store.chunks import ChunkMeta

    held = be.keys()
    for key in held:
        if key.startswith("c:"):
            value = be.get(key)
            assert value is not None
            if list(ChunkMeta.decode(value).tokens) == tokens:
                return key[2:]
    raise AssertionError(tokens)


def test_capacity_evicts_the_ends_of_chains_before_the_prefixes_they_share() -> None:
    """Three prompts sharing their first 8 tokens (the same llama.cpp rows stored under three token lists): with room
    for about two of them, the last put is whole and the shared head survives; the oldest tail went first."""
    f = GOLDEN / "llama-f16-single-seq/03-seq-seq0.ggsq"
    model = tiny_model("llama-tiny")
    n = len(kvref.state.load(f).tokens)
    head = list(range(1, 9))
    prompts = [head + [100 + i] * (n - 8) for i in range(3)]
    probe = Store(MemoryBackend(), chunk_tokens=4)
    probe.put(f, model=model, tokens=prompts[0])
    one = probe.stats()["bytes"]
    assert isinstance(one, int)
    cap = one * 17 // 10
    st = Store(MemoryBackend(), capacity_bytes=cap, chunk_tokens=4)
    for p in prompts:
        st.put(f, model=model, tokens=p)
        assert st.stats()["bytes"] <= cap  # type: ignore[operator]
    assert st.stats()["evicted_bytes"] > 0  # type: ignore[operator]
    hit = st.get(prompts[2], model=model, kind="seq")
    assert hit is not None and hit.n_tokens == n
    first = st.lookup(prompts[0], model=model)
    assert 8 <= first.n_tokens < n  # its own tail was evicted, the shared head was not


def test_gc_drops_what_no_prefix_reaches_and_the_index_entries_of_evicted_chunks(store: Store) -> None:
    f = GOLDEN / "llama-f16-single-seq/03-seq-seq0.ggsq"
    model = tiny_model("llama-tiny")
    n = len(kvref.state.load(f).tokens)
    prompts = [[*range(1, 9), *[100 + i] * (n - 8)] for i in range(3)]
    for p in prompts:
        store.put(f, model=model, tokens=p)
    be = store.backend
    # prompt 1's first own chunk goes (as eviction would take it): its tail is now unreachable
    metas = [k for k in be.keys() if k.startswith("c:")]  # noqa: SIM118  (a backend, not a dict)
    second = [k for k in metas if list(ChunkMeta.decode(be.get(k) or b"").tokens) == [101] * 4]
    assert len(second) == 1
    be.delete(second)
    held = len(be.keys())
    res = store.gc()
    assert res["evicted_bytes"] == 0 and res["dropped"] >= 2 and res["index_entries_dropped"] > 0
    assert len(be.keys()) == held - res["dropped"]
    for i, p in enumerate(prompts):
        look = store.lookup([*p, 7], model=model)
        assert look.n_tokens == (8 if i == 1 else n)
    assert store.gc()["dropped"] == 0  # nothing more to drop


def test_bad_arguments_get_clear_errors(store: Store, tmp_path: Path) -> None:
    f = GOLDEN / "llama-f16-single-seq/03-seq-seq0.ggsq"
    model = tiny_model("llama-tiny")
    with pytest.raises(ArgumentError, match="kind must be one of"):
        store.get([1, 2], model=model, kind="slot")
    with pytest.raises(ArgumentError, match="seq_id"):
        store.get([1, 2], model=model, seq_id=-1)
    with pytest.raises(ArgumentError, match="model="):
        store.put(f, model=tmp_path / "missing.gguf")
    with pytest.raises(ArgumentError, match="tokens="):
        store.put((GOLDEN / "llama-f16-single-seq/04-seqdata-seq0.bin").read_bytes(), model=model)
    with pytest.raises(ArgumentError, match="only 3 tokens"):
        store.put(f, model=model, tokens=[1, 2, 3])
    with pytest.raises(FormatError):
        store.put(b"\x00" * 7, model=model, tokens=[1])
    with pytest.raises(ArgumentError, match="chunk_tokens=4"):
        Store(store.backend, chunk_tokens=8)


def test_whole_context_files_are_stored_per_sequence(store: Store) -> None:
    """A session file holding several sequences: put stores the one asked for; get writes a session of it."""
    case = GOLDEN / "llama-f16-single-seq"
    model = tiny_model(_case_model(case))
    session = kvref.state.load(case / "01-session.ggsn")
    seqs = sorted({int(s) for st in session.memory.kv_sections[0].streams if st.cells is not None
                   for s in st.cells.seq_id})  # fmt: skip
    if len(seqs) > 1:
        with pytest.raises(ArgumentError, match="seq_id="):
            store.put(case / "01-session.ggsn", model=model)
    seq_file = kvref.state.load(case / "03-seq-seq0.ggsq")
    store.put(case / "01-session.ggsn", model=model, seq_id=0, tokens=seq_file.tokens)
    hit = store.get(seq_file.tokens, model=model, kind="seq", seq_id=0)
    assert hit is not None and hit.data == (case / "03-seq-seq0.ggsq").read_bytes()


def test_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvref.jobs.cli import main

    f = GOLDEN / "llama-f16-single-seq/03-seq-seq0.ggsq"
    model = str(tiny_model("llama-tiny"))
    url = str(tmp_path / "store")
    assert main(["store", "put", url, str(f), "--model", model, "--chunk-tokens", "4"]) == 0
    assert "15 tokens" in capsys.readouterr().out
    toks = [int(t) for t in kvref.state.load(f).tokens]
    (tmp_path / "prompt.json").write_text(json.dumps([*toks[:6], 127]))
    out = tmp_path / "slot.bin"
    assert main(["store", "get", url, "--model", model, "--tokens-from", str(tmp_path / "prompt.json"),
                 "-o", str(out), "--json"]) == 0  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["n_tokens"] == 6 and list(kvref.state.load(out).tokens) == toks[:6]
    (tmp_path / "other.txt").write_text("127 126")
    assert main(["store", "get", url, "--model", model, "--tokens-from", str(tmp_path / "other.txt"),
                 "-o", str(tmp_path / "none.bin")]) == 1  # fmt: skip
    assert not (tmp_path / "none.bin").exists()
    assert "servable: 0 of 2 tokens" in capsys.readouterr().out
    assert main(["store", "stats", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["hits"] == 1 and stats["misses"] == 1 and stats["chunk_tokens"] == 4
    assert main(["store", "gc", url, "--max-bytes", "0"]) == 0
    assert "evicted" in capsys.readouterr().out
    assert main(["store", "stats", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bytes"] == 0


def test_open_names_the_store_and_its_chunk_size(tmp_path: Path) -> None:
    st = kvref.store.open("memory:", chunk_tokens=16)
    assert st.chunk_tokens == 16 and st.stats()["url"] == "memory:"


def test_a_llama_server_slot_file_with_its_packed_prompt(store: Store) -> None:
    """llama-server 0.3.36 saves a slot's prompt packed (server_tokens::serialize): put reads the tokens out of it,
    and a prompt with media (positions that are not token indices) is refused, naming why."""
    from test_server_tokens import packed

    f = GOLDEN / "llama-f16-single-seq/03-seq-seq0.ggsq"
    model = tiny_model("llama-tiny")
    obj = kvref.state.load(f)
    toks = [int(t) for t in obj.tokens]
    obj.tokens = packed(toks, [])
    assert store.put(obj.to_bytes(), model=model).n_tokens == len(toks)
    hit = store.get(toks, model=model, kind="seq")
    assert hit is not None and hit.data == f.read_bytes()  # written back with the plain list llama-server also reads
    obj.tokens = packed([*toks[:3], -1, *toks[4:]], [(3, b"\x01" * 8)])
    with pytest.raises(ArgumentError, match="media"):
        store.put(obj.to_bytes(), model=model)


def test_a_models_identity_is_its_bytes_hashed_once_per_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import hashlib

    from kvref.store import model_id as mid

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights" * 1000)
    want = "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
    assert mid.model_id(f) == want
    assert want in (tmp_path / "cache/kvref/model-ids.json").read_text()  # kept for the next process
    calls = []
    monkeypatch.setattr(mid, "_sha256", lambda p: calls.append(p) or "0" * 64)
    assert mid.model_id(f) == want and calls == []  # not hashed again
    os.utime(f, ns=(1, 1))  # rewritten in place (same size): hashed again
    assert mid.model_id(f) == "sha256:" + "0" * 64 and len(calls) == 1
    assert mid.model_id(want) == want  # a known id passes through
    with pytest.raises(ArgumentError, match="sha256 model id"):
        mid.model_id("sha256:xyz")
