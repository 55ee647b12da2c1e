"""tensors / export of a DeepSeek-V4 state (llama_kv_cache_dsv4) on the committed deepseek4 goldens.

Expected values come from the golden files themselves: the shapes from each case's hparams and context, the values
from the state file's bytes, walked here from the offset where the DSV4 tail starts (kvref.state.dsv4's parse
gives only that start), with this file's own struct reads.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

import kvref
from kvref.jobs import export as kexport
from kvref.jobs import tensors
from kvref.jobs.conformance import hparams_from_case
from kvref.state.dsv4 import DSV4Section

GOLD = Path(__file__).resolve().parent.parent / "conformance" / "golden"
CASES = ["deepseek4-dsv4-single-seq", "deepseek4-dsv4-multiseq", "deepseek4-dsv4-rollback"]
FILES = [(c, p.name) for c in CASES for p in sorted((GOLD / c).iterdir()) if p.name != "case.json"]
PARTS = [("csa", 4), ("hca", 128), ("lid", 4)]


def _hadamard(n: int) -> np.ndarray:
    """Sylvester's normalized Hadamard matrix of order n (a power of two)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def _walk_tail(buf: bytes, at: int, partial: bool) -> tuple[list, list]:
    """The compressed K caches and compressor states from ``at``: per part (n_rows, n_stream, [(il, type, ne0, rows,
    row_size, data offset)]) and per state (ratio, state_size, n_embd_state, n_stream, [(il, kv, score)])."""

    def tensor(at: int, ns: int) -> tuple[tuple[int, int, int, int, int], int]:
        t, ne0, rows, rs = struct.unpack_from("<iQQQ", buf, at)
        return (t, ne0, rows, rs, at + 28), at + 28 + rows * rs * ns

    ks = []
    for _ in range(0 if partial else 3):
        _ver, n_rows, ns, n_layer = struct.unpack_from("<IIII", buf, at)
        at += 16
        layers = []
        for _ in range(n_layer):
            (il,) = struct.unpack_from("<I", buf, at)
            t, at = tensor(at + 4, ns)
            layers.append((il, *t))
        ks.append((n_rows, ns, layers))
    ss = []
    for _ in range(3):
        _ver, ratio, size, n_embd, ns, n_layer = struct.unpack_from("<IIIIII", buf, at)
        at += 24
        layers = []
        for _ in range(n_layer):
            (il,) = struct.unpack_from("<I", buf, at)
            kv, at = tensor(at + 4, ns)
            sc, at = tensor(at, ns)
            layers.append((il, kv, sc))
        ss.append((ratio, size, n_embd, ns, layers))
    return ks, ss


def _f16_rows(buf: bytes, off: int, n: int, width: int) -> np.ndarray:
    return np.frombuffer(buf, np.float16, n * width, off).reshape(n, width).astype(np.float32)


@pytest.mark.parametrize(("case", "name"), FILES)
def test_dsv4_export_shapes_and_bytes(case: str, name: str) -> None:
    path = GOLD / case / name
    info = json.loads((GOLD / case / "case.json").read_text())
    hp = hparams_from_case(info)
    n_seq_max = info["context"]["n_seq_max"]
    n_ctx_seq = info["observed_context"]["n_ctx_seq"]
    ratios = info["model"]["hparams"]["dsv4_compress_ratios"]
    head, lid_head = info["model"]["hparams"]["n_embd_head_k"], info["model"]["hparams"]["indexer_head_size"]
    buf = path.read_bytes()
    obj = kvref.state.load(path)
    (sec,) = obj.memory.sections
    assert isinstance(sec, DSV4Section)
    tail = sec.states[0].offset if sec.partial else sec.k_caches[0].offset
    ks, ss = _walk_tail(buf, tail, sec.partial)
    whole = "seq" not in name  # a whole-state save (every stream, every compressed row)

    arrays, meta = kexport.export_arrays(path, hparams=hp, unrotate=False)
    assert meta["layout"] == "dsv4"
    # the raw K-only sections: base (no layer) then SWA, or SWA alone when partial
    raw_names = [f"kv.{i}" for i in range(len(sec.raw))]
    swa = raw_names[-1]
    assert not any(k.startswith(f"{raw_names[0]}.") and ".l" in k for k in arrays) or sec.partial  # base: no layer
    for s, st in enumerate(sec.raw[-1].streams):
        if st.cells is None:
            continue
        n = st.cells.n
        assert [int(x) for x in arrays[f"{swa}.s{s}.layer"]] == list(range(hp.n_layer))  # every layer is SWA
        assert np.array_equal(arrays[f"{swa}.s{s}.pos"], np.asarray(st.cells.pos, np.int32))
        for li, rows in enumerate(st.data.k):
            k = arrays[f"{swa}.s{s}.l{li}.k"]
            assert k.shape == (n, hp.n_head_kv_l(li), head)
            assert np.array_equal(k.reshape(n, -1), np.asarray(rows.data).view(np.float16).astype(np.float32))
            assert f"{swa}.s{s}.l{li}.v" not in arrays  # K only
    # the compressed K caches: rows per stream from the context, one layer per layer of the ratio
    for pi, (part, ratio) in enumerate([] if sec.partial else PARTS):
        n_rows, ns, layers = ks[pi]
        si = len(sec.raw) + pi
        want_il = [il for il in range(hp.n_layer) if ratios[il] == ratio]
        assert [il for il, *_ in layers] == want_il
        assert [int(x) for x in arrays[f"dsv4.{part}.{si}.layer"]] == want_il
        if whole:
            pad = -(-max(1, -(-n_ctx_seq // ratio)) // 256) * 256
            assert n_rows == pad and ns == n_seq_max
        width = lid_head if part == "lid" else head
        for li, (_il, t, ne0, rows, rs, off) in enumerate(layers):
            assert (t, ne0, rows, rs) == (1, width, n_rows, 2 * width)  # f16 rows of one layer's n_embd_k_gqa
            for s in range(ns):
                k = arrays[f"dsv4.{part}.{si}.s{s}.l{li}.k"]
                n_head = 1 if part == "lid" else hp.n_head_kv_l(_il)
                assert k.shape == (n_rows, n_head, width // n_head)
                assert np.array_equal(k.reshape(n_rows, width), _f16_rows(buf, off + s * rows * rs, rows, width))
                assert np.array_equal(arrays[f"dsv4.{part}.{si}.s{s}.row"], np.arange(n_rows))
    # the compressor states: f32 kv and score planes (state_size x n_embd_state) per stream and layer
    sizes = {"csa": (8, 2 * head), "hca": (128, head), "lid": (8, 2 * lid_head)}
    first = len(sec.raw) + (0 if sec.partial else 3)
    for pi, (part, ratio) in enumerate(PARTS):
        r, size, n_embd, ns, layers = ss[pi]
        si = first + pi
        assert (r, size, n_embd) == (ratio, *sizes[part])
        assert ns == (n_seq_max if whole else 1)
        assert [int(x) for x in arrays[f"dsv4.{part}_state.{si}.layer"]] == [il for il, *_ in layers]
        for li, (_il, kv, sc) in enumerate(layers):
            for plane, (t, ne0, rows, rs, off) in (("kv", kv), ("score", sc)):
                assert (t, ne0, rows, rs) == (0, n_embd, size, 4 * n_embd)
                for s in range(ns):
                    x = arrays[f"dsv4.{part}_state.{si}.s{s}.l{li}.{plane}"]
                    want = np.frombuffer(buf, np.float32, size * n_embd, off + s * rows * rs).reshape(size, n_embd)
                    assert x.shape == (size, n_embd) and np.array_equal(x, want)


def test_dsv4_indexer_rows_are_unrotated_and_without_model() -> None:
    """llama.cpp rotates the lightning indexer's K whatever its type: un-rotated by default (H_n of the test's own
    Sylvester matrix gives the stored rows back); without a model the rows keep their width."""
    path = GOLD / "deepseek4-dsv4-single-seq" / "02-state.bin"
    hp = hparams_from_case(json.loads((GOLD / "deepseek4-dsv4-single-seq" / "case.json").read_text()))
    raw = tensors.state_tensors(path, hparams=hp, unrotate=False)
    un = tensors.state_tensors(path, hparams=hp)
    (lid_raw,) = [t for t in raw.compressed if t.part == "lid"]
    (lid,) = [t for t in un.compressed if t.part == "lid"]
    assert lid.unrotated_k and not lid_raw.unrotated_k
    n = hp.indexer_head_size  # 128: the largest power of two >= 64 dividing the head
    back = lid.k.reshape(-1, n).astype(np.float64) @ _hadamard(n)
    assert np.allclose(back, lid_raw.k.reshape(-1, n), atol=1e-4)
    for a, b in zip(raw.compressed, un.compressed, strict=True):  # f16 CSA / HCA rows are never rotated
        if a.part != "lid":
            assert not b.unrotated_k and np.array_equal(a.k, b.k)
    bare = tensors.state_tensors(path, unrotate=False)
    assert [t.k.shape[1:] for t in bare.compressed] == [(1, 64), (1, 64), (1, 128)]
    assert [t.k.shape[1:] for t in bare.kv] == [(1, 64)] * hp.n_layer
    assert all(t.il is None for t in bare.kv)
    with pytest.raises(kvref.errors.KVRefError, match="does not fit"):
        tensors.state_tensors(path, hparams=hparams_from_case(json.loads(
            (GOLD / "gemma2-non-causal-swa" / "case.json").read_text())))  # fmt: skip


def test_dsv4_memory_tensors_match_the_state() -> None:
    """memory_tensors of a memory restored from a golden gives the file's tensors."""
    from kvref.memory.factory import create_memory

    d = GOLD / "deepseek4-dsv4-multiseq"
    info = json.loads((d / "case.json").read_text())
    hp = hparams_from_case(info)
    c = info["context"]
    mem = create_memory(hp, n_ctx=c["n_ctx"], n_seq_max=c["n_seq_max"], flash_attn=True, type_k="f16",
                        type_v="f16", n_ubatch=c["n_ubatch"])  # fmt: skip
    data = (d / "02-state.bin").read_bytes()
    obj = kvref.state.load(data)
    (sec,) = obj.memory.sections
    assert isinstance(sec, DSV4Section)
    mem.state_read(kvref.state.section_bytes(sec))
    got = tensors.memory_tensors(mem, unrotate=False)
    want = tensors.state_tensors(obj, hparams=hp, unrotate=False)
    assert len(got.kv) == len(want.kv) and len(got.compressed) == len(want.compressed) == 3 * c["n_seq_max"]
    for a, b in zip(got.kv, want.kv, strict=True):
        assert a.il == b.il and np.array_equal(a.k, b.k) and np.array_equal(a.pos, b.pos)
    for x, y in zip(got.compressed, want.compressed, strict=True):
        assert (x.part, x.stream, x.il) == (y.part, y.stream, y.il) and np.array_equal(x.k, y.k)
    for p, q in zip(got.comp_states, want.comp_states, strict=True):
        assert np.array_equal(p.kv, q.kv) and np.array_equal(p.score, q.score)


def test_dsv4_export_cli_npz(tmp_path: Path) -> None:
    """``kvref export`` writes a DSV4 state's arrays with their metadata (types, rotation undone per tensor)."""
    from kvref.jobs.cli import main

    path = GOLD / "deepseek4-dsv4-single-seq" / "05-seqdata-seq0-flags1.bin"  # partial: raw SWA and the states
    out = tmp_path / "x.npz"
    assert main(["export", str(path), str(out), "--no-unrotate"]) == 0
    with np.load(out) as z:
        meta = json.loads(str(z["__kvref__"]))
        names = set(z.files)
        assert meta["layout"] == "dsv4" and meta["unrotate"] is False
        assert "kv.0.s0.l3.k" in names and not any(n.startswith(("kv.1.", "dsv4.csa.", "dsv4.lid.")) for n in names)
        assert {"dsv4.csa_state.1.s0.l0.kv", "dsv4.hca_state.2.s0.l0.score", "dsv4.lid_state.3.s0.l0.kv"} <= names
        assert meta["tensors"]["dsv4.hca_state.2.s0.l0.score"]["type"] == "f32"
        assert meta["tensors"]["kv.0.s0.l0.k"] == {"type": "f16", "unrotated": False}
        assert z["dsv4.hca_state.2.s0.l0.kv"].shape == (128, 64)


@pytest.mark.parametrize("name", ["02-state.bin", "05-seqdata-seq0-flags1.bin"])
def test_dsv4_section_layer_ids(name: str) -> None:
    """The model layers of each part `kvref inspect` lists (the raw base cache has none: every layer is SWA)."""
    d = GOLD / "deepseek4-dsv4-single-seq"
    info = json.loads((d / "case.json").read_text())
    hp = hparams_from_case(info)
    ratios = info["model"]["hparams"]["dsv4_compress_ratios"]
    csa = [il for il, r in enumerate(ratios) if r == 4]
    hca = [il for il, r in enumerate(ratios) if r == 128]
    obj = kvref.state.load(d / name)
    raw = [[], list(range(hp.n_layer))] if "flags1" not in name else [list(range(hp.n_layer))]
    comp = [] if "flags1" in name else [csa, hca, csa]
    assert tensors.section_layer_ids(obj, hp) == raw + comp + [csa, hca, csa]
    assert len(tensors.section_layer_ids(obj, hp)) == len(kvref.state.summarize(obj)["sections"])
