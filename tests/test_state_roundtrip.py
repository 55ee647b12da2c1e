"""Round trips: hand-built objects of every layout and variant, written, read back and written again."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _state_factory import CASES, load_options, make

import kvref.state as S
from kvref.errors import FormatError


def _case_id(case: tuple) -> str:
    kind, layout, kw = case
    return "-".join([kind, layout, *(f"{k}={v}" for k, v in kw.items())])


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_explicit(case: tuple, seed: int) -> None:
    kind, layout, kw = case
    obj = make(kind, layout, seed, **kw)
    blob = obj.to_bytes()
    back = S.load(blob, **load_options(kind, layout, **kw))
    assert back.kind == kind
    assert back.memory.layout == layout
    assert back.to_bytes() == blob


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_round_trip_auto(case: tuple) -> None:
    """With nothing said, load() either finds the one reading or says it cannot decide, never a wrong one."""
    kind, layout, kw = case
    obj = make(kind, layout, 3, **kw)
    blob = obj.to_bytes()
    opts: dict = {"ple": True} if kw.get("ple") else {}
    if layout == "none":
        opts["layout"] = "none"  # a memoryless state is never guessed (see kvref.state.load)
    try:
        back = S.load(blob, **opts)
    except FormatError as e:
        assert e.field == "layout", e
        assert "cannot decide" in str(e)
        return
    assert back.to_bytes() == blob
    assert back.kind == kind


def test_fields_survive(tmp_path) -> None:
    obj = make("session", "hybrid", 5, outputs=True, ext_size=12, v_trans=1)
    path = tmp_path / "s.bin"
    n = S.save(obj, path)
    assert n == path.stat().st_size
    back = S.load(path, **load_options("session", "hybrid", outputs=True, ext_size=12, v_trans=1))
    assert back.version == obj.version and back.arch == obj.arch
    assert np.array_equal(back.tokens, obj.tokens)
    assert np.array_equal(back.outputs.logits, obj.outputs.logits)
    kv0, kv1 = obj.memory.sections[0], back.memory.sections[0]
    for a, b in zip(kv0.streams, kv1.streams, strict=True):
        assert a.cells == b.cells
        if a.data is not None:
            assert a.data.v_trans == b.data.v_trans == 1
            for x, y in zip(a.data.k + a.data.v, b.data.k + b.data.v, strict=True):
                assert np.array_equal(x.data, y.data)
    rec = back.memory.sections[1]
    assert rec.n_layer == 4 and len(rec.r) == 2
    assert rec.offsets["cell_count"] > 0  # the reader remembers where each field was


def test_mmap_views_and_save_over_source(tmp_path) -> None:
    obj = make("session", "kv", 7)
    path = tmp_path / "a.bin"
    obj.save(path)
    blob = path.read_bytes()
    back = S.load(path, **load_options("session", "kv"))
    k = back.memory.sections[0].streams[0].data.k[0].data
    assert not k.flags.owndata and not k.flags.writeable  # a view into the read-only mapping
    back.save(path)  # over the file it is mapped from
    assert path.read_bytes() == blob


def test_edit_and_write(tmp_path) -> None:
    """Objects are plain data: change a cell position and the bytes change exactly there."""
    obj = make("seq", "kv", 2)
    blob = obj.to_bytes()
    back = S.load(blob, **load_options("seq", "kv"))
    st = back.memory.sections[0].streams[0]
    at = st.offsets["cells"]
    st.cells.pos[0] += 1000
    new = back.to_bytes()
    assert len(new) == len(blob)
    diff = [i for i in range(len(blob)) if blob[i] != new[i]]
    assert diff and diff[0] >= at and diff[-1] < at + 4


def test_accessors() -> None:
    cells = S.Cells.from_lists([0, 1, 2, 7], [[0], [0, 1], [1], [2]])
    assert cells.seq_set(1) == {0, 1}
    assert cells.seq_ids(3) == (2,)
    seqs = cells.sequences()
    assert seqs[0] == S.SeqRange(0, 1, 2) and seqs[1] == S.SeqRange(1, 2, 2) and seqs[2] == S.SeqRange(7, 7, 1)
    assert list(cells.n_seq_id) == [1, 2, 1, 1]


def test_summary_is_json() -> None:
    obj = make("session", "iswa", 1, outputs=True)
    s = obj.summary()
    json.dumps(s)
    assert s["format"] == "session" and s["layout"] == "iswa" and len(s["sections"]) == 2
    assert s["sections"][0]["streams"][0]["layers"][0]["k"]["type"] == "f16"


def test_mixed_seq_counts_use_the_walk() -> None:
    """Tables with different n_seq_id per cell take the per-cell path; uniform ones the vectorised one."""
    for seqs in ([[0]] * 4, [[0], [0, 1, 2], [], [5]]):
        cells = S.Cells.from_lists(range(4), seqs)
        sec = S.KVSection([S.KVStream(cells, S.KVData(0, [S.LayerRows(0, 4, np.zeros((4, 4), np.uint8))], []))])
        blob = S.section_bytes(sec)
        back, end = (
            S.read_kv_section(blob, S.KVSpec(1, 8, 8, False, (S.KVLayerSpec(0, 4),)), seq_id=-1)
            if all(seqs)
            else (None, None)
        )
        if back is not None:
            assert back.streams[0].cells == cells and end == len(blob)
        obj = S.StateBlob("llama", None, S.MemorySections("kv", [sec]))
        assert S.load(obj.to_bytes(), kind="state", layout="kv", has_v=False, ext_size=0).to_bytes() == obj.to_bytes()
