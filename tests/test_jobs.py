"""The jobs users bring (issue 13 part A), without llama.cpp: restore, save_memory, convert, diff, check, inspect.

The live twins (tests/test_live_jobs.py) prove with the real llama.cpp that what these write loads and continues.
"""

from __future__ import annotations

import glob
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

import kvref
from kvref import state
from kvref.jobs.cli import main
from kvref.jobs.conformance import hparams_from_case, save_ops
from kvref.jobs.restore import ContextMismatch
from kvref.jobs.save import save_memory, state_of
from kvref.state.eras import ConversionError, matching_eras

ROOT = Path(__file__).resolve().parent.parent / "conformance"
G = ROOT / "golden"
LLAMA = ROOT / "models" / "llama-tiny.gguf"


def golden_files() -> list[Path]:
    return sorted(Path(p) for p in glob.glob(str(G / "*" / "0*")))


def _case_arch(case_id: str) -> str:
    return str(json.loads((G / case_id / "case.json").read_text())["model"]["hparams"]["arch"])


def case_hp(case_id: str) -> kvref.HParams:
    return hparams_from_case(json.loads((G / case_id / "case.json").read_text()))


# ------------------------------------------------------------------------------------------- restore
@pytest.mark.parametrize(
    "case_id",
    ["llama-shared-prefix", "llama-f16-multistream", "gemma3-iswa", "mamba-seq-cp-rm", "jamba-hybrid",
     "lfm2-swa-hybrid-iswa", "qwen2vl-mrope", "legacy-0.3.12-llama-f16-single-seq", "legacy-0.3.16-mamba-seq-cp-rm",
     "legacy-0.3.35-qwen2vl-mrope", "llama-q8_0-fa-multistream"],
)  # fmt: skip
def test_restore_every_artefact_and_write_it_back(case_id: str) -> None:
    """Every artefact of the case restores into the memory `restore` builds, and that memory writes the file's
    memory sections back byte for byte (a sequence restored into the sequence it was saved from)."""
    hp = case_hp(case_id)
    case = json.loads((G / case_id / "case.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for file, op in save_ops(case).items():
            seq = op.get("seq_id")
            r = kvref.restore(G / case_id / file, hparams=hp, seq_id=seq if op["kind"] in ("seq", "seq_data") else None)
            mem, obj = r
            assert mem is r.memory and obj is r.state
            full = [st for sec in obj.memory.kv_sections for st in sec.streams if st.cells is not None]
            if r.seq_id == -1 and mem.profile.whole_restore_clear == "per_stream" and len(full) > 1:
                continue  # that llama.cpp keeps only the last stream of a whole restore (kvref reproduces it)
            want = state.section_bytes(*obj.memory.sections)
            got = mem.state_write(r.seq_id, r.flags)
            assert got == want, f"{file}: written back differently"


def test_restore_infers_the_context() -> None:
    r = kvref.restore(G / "llama-f16-multistream" / "01-session.ggsn", hparams=case_hp("llama-f16-multistream"))
    assert r.context["kv_unified"] is False and r.context["n_seq_max"] == 3
    assert r.context["flash_attn"] is False  # v_trans 1
    r = kvref.restore(G / "llama-q4_0-fa-single-seq" / "01-session.ggsn", model=LLAMA)
    assert r.context["flash_attn"] is True and r.context["type_k"] == "q4_0"
    r = kvref.restore(G / "legacy-0.3.16-llama-f16-single-seq" / "01-session.ggsn", model=LLAMA)
    assert r.memory.profile.name == "2025"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [({"flash_attn": True}, "flash_attn"), ({"type_k": "q8_0"}, "type_k"),
     ({"kv_unified": True}, "kv_unified"), ({"n_seq_max": 2}, "n_seq_max")],
)  # fmt: skip
def test_restore_names_the_parameter_that_cannot_work(kwargs: dict, param: str) -> None:
    path = G / "llama-f16-multistream" / "01-session.ggsn"
    if param in ("flash_attn", "type_k"):
        path = G / "llama-f16-single-seq" / "01-session.ggsn"
    with pytest.raises(ContextMismatch) as e:
        kvref.restore(path, model=LLAMA, **kwargs)
    assert e.value.param == param and param in str(e.value)


def test_restore_names_n_ctx_when_the_cells_do_not_fit(tmp_path: Path) -> None:
    hp = kvref.HParams.from_gguf(LLAMA)
    mem = kvref.create_memory(hp, n_ctx=512)
    mem.decode(kvref.Batch(tokens=[5] * 300, seq_ids=[[0]] * 300))
    save_memory(mem, tmp_path / "big.ggsn")
    with pytest.raises(ContextMismatch, match="n_ctx=300") as e:
        kvref.restore(tmp_path / "big.ggsn", hparams=hp, n_ctx=256)
    assert e.value.param == "n_ctx" and e.value.fix == 300
    assert kvref.restore(tmp_path / "big.ggsn", hparams=hp).memory.get_size() == 512


def test_restore_needs_the_model() -> None:
    with pytest.raises(kvref.KVRefError, match="model="):
        kvref.restore(G / "llama-f16-single-seq" / "01-session.ggsn")


@pytest.mark.parametrize("case_id", ["llama-shared-prefix", "gemma3-iswa", "mamba-seq-cp-rm", "jamba-hybrid"])
def test_restore_into_an_existing_memory_leaves_it_as_a_new_one(case_id: str) -> None:
    """``restore(into=mem)`` (llama_state_load_file into a context): a whole restore leaves a memory that held other
    cells as `restore` leaves the memory it builds; a sequence restore replaces that sequence and keeps the rest."""
    hp = case_hp(case_id)
    case = json.loads((G / case_id / "case.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for file, op in save_ops(case).items():
            seq = op.get("seq_id") if op["kind"] in ("seq", "seq_data") else None
            fresh = kvref.restore(G / case_id / file, hparams=hp, seq_id=seq)
            mem = kvref.create_memory(hp, **fresh.context)
            other = fresh.context["n_seq_max"] - 1 if seq is not None else 0
            if seq is None or other != fresh.seq_id:
                mem.decode(kvref.Batch(tokens=[7, 8, 9], seq_ids=[[other]] * 3))
            before = mem.seq_pos_max(other)
            r = kvref.restore(G / case_id / file, into=mem, seq_id=seq)
            assert r.memory is mem and r.context == {} and r.seq_id == fresh.seq_id
            assert mem.state_write(r.seq_id, r.flags) == fresh.memory.state_write(r.seq_id, r.flags), file
            if seq is not None and other != r.seq_id:
                assert mem.seq_pos_max(other) == before == 2, f"{file}: the other sequence changed"


def test_restore_into_refuses_a_model_or_context_and_another_architecture() -> None:
    hp = kvref.HParams.from_gguf(LLAMA)
    mem = kvref.create_memory(hp, n_ctx=256)
    path = G / "llama-f16-single-seq" / "01-session.ggsn"
    for kw in ({"model": LLAMA}, {"hparams": hp}, {"n_ctx": 256}, {"type_k": "f16"}, {"compat": "2026-10"}):
        with pytest.raises(kvref.KVRefError, match=f"drop {next(iter(kw))}"):
            kvref.restore(path, into=mem, **kw)  # type: ignore[arg-type]
    with pytest.raises(kvref.KVRefError, match="into= takes a kvref memory"):
        kvref.restore(path, into=hp)
    mem.decode(kvref.Batch(tokens=[5, 6], seq_ids=[[0]] * 2))
    with pytest.raises(ContextMismatch, match="'mamba' model") as e:
        kvref.restore(G / "mamba-seq-cp-rm" / "01-session.ggsn", into=mem)
    assert e.value.param == "model" and mem.seq_pos_max(0) == 1  # refused before anything changed


# ------------------------------------------------------------------------------------------- save
def _llama_mem(**kw: object) -> object:
    hp = kvref.HParams.from_gguf(LLAMA)
    mem = kvref.create_memory(hp, n_ctx=256, n_seq_max=2, **kw)  # type: ignore[arg-type]
    mem.decode(kvref.Batch(tokens=list(range(4, 14)), seq_ids=[[0]] * 10))
    mem.decode(kvref.Batch(tokens=list(range(20, 25)), seq_ids=[[1]] * 5))
    return mem


@pytest.mark.parametrize("kind", ["session", "seq", "state", "seq_state"])
@pytest.mark.parametrize("era", [None, "2026-08", "0.3.17", "2025", "2025-07"])
def test_save_memory_writes_each_kind_and_era(kind: str, era: str | None, tmp_path: Path) -> None:
    mem = _llama_mem()
    seq_id = 1 if kind in ("seq", "seq_state") else -1
    path = tmp_path / "out.bin"
    obj = save_memory(mem, path, kind=kind, seq_id=seq_id, tokens=[1, 2, 3], era=era)
    back = state.load(path)
    assert back.kind == kind and back.to_bytes() == path.read_bytes() == obj.to_bytes()
    assert (era or "2026-10") in matching_eras(back)
    r = kvref.restore(path, model=LLAMA, seq_id=1 if seq_id >= 0 else None)

    def now(m: object) -> bytes:  # the memory's state in the current layout, whatever its own era
        k = "seq_state" if seq_id >= 0 else "state"
        return state.section_bytes(*state_of(m, k, seq_id=seq_id, era="2026-10").memory.sections)

    assert now(r.memory) == now(mem)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_object_save_memory_returns_stays_what_it_wrote(arch: str, tmp_path: Path) -> None:
    """The rows go to the file straight from the memory's buffers; the object returned is the file's (read back),
    so changing the memory afterwards changes neither. Without a path the object holds copies."""
    hp = kvref.HParams.from_gguf(LLAMA) if arch == "llama" else case_hp("gemma3-iswa")
    mem = kvref.create_memory(hp, n_ctx=256, n_seq_max=2)
    mem.decode(kvref.Batch(tokens=list(range(4, 40)), seq_ids=[[0]] * 36))
    leaf = mem if isinstance(mem, kvref.KVCache) else mem.base
    leaf.layers[0].k[...] = 7
    (sec,) = leaf.state_sections(copy=False)
    assert np.shares_memory(sec.streams[0].data.k[0].data, leaf.layers[0].k)  # a view: nothing copied
    (sec,) = leaf.state_sections()
    assert not np.shares_memory(sec.streams[0].data.k[0].data, leaf.layers[0].k)
    path = tmp_path / "s.ggsn"
    obj = save_memory(mem, path, tokens=list(range(4, 40)), durable=False)
    kept = save_memory(mem)  # no path: copies
    written = path.read_bytes()
    leaf.layers[0].k[...] = 9
    mem.seq_rm(0, 10, -1)
    assert obj.to_bytes() == written and kept.memory.sections[0].streams[0].data.k[0].data.max() == 7
    assert state.section_bytes(*kept.memory.sections) == state.section_bytes(*obj.memory.sections)


def test_save_refuses_what_an_older_layout_cannot_hold(tmp_path: Path) -> None:
    r = kvref.restore(G / "qwen2vl-mrope" / "01-session.ggsn", hparams=case_hp("qwen2vl-mrope"))
    with pytest.raises(ConversionError, match="token ids in their 12-byte ext"):
        save_memory(r.memory, tmp_path / "x.ggsn", era="2026-08")
    mem = _llama_mem(kv_unified=False)
    with pytest.raises(ConversionError, match="2 streams"):
        save_memory(mem, tmp_path / "x.ggsn", era="2025-07")
    assert not (tmp_path / "x.ggsn").exists()


def test_save_sidecar(tmp_path: Path) -> None:
    mem = _llama_mem()
    save_memory(mem, tmp_path / "s.ggsn", tokens=[1], sidecar=True, model=LLAMA)
    doc = json.loads((tmp_path / "s.ggsn.kvref.json").read_text())
    assert doc["kvref_sidecar"] == 1 and doc["era"] == "2026-10" and doc["context"]["n_seq_max"] == 2
    from kvref.jobs.sidecar import verify_sidecar

    assert verify_sidecar(tmp_path / "s.ggsn", LLAMA) == []
    assert verify_sidecar(tmp_path / "s.ggsn", ROOT / "models" / "mamba-tiny.gguf")
    with open(tmp_path / "s.ggsn", "r+b") as f:
        f.seek(-1, 2)
        f.write(b"\x01")
    assert "sha256" in verify_sidecar(tmp_path / "s.ggsn")[0]


# ------------------------------------------------------------------------------------------- convert
def test_convert_upgrades_and_writes_every_era_back() -> None:
    """Every golden upgrades to the current layout and back to its own era byte for byte (the v9 output block
    excepted: its logits are not kept)."""
    n = 0
    for f in golden_files():
        o = state.load(f)
        producer = json.loads((f.parent / "case.json").read_text())["producer"]["llama_cpp_python"]
        era = kvref.state.eras.era(producer).name  # a file without arch and ext matches eras of other models too
        assert era in matching_eras(o), f
        # a sequence save names no arch: the writer's decides the current layout's cell ext (M-RoPE or not)
        up = kvref.convert(f, arch=_case_arch(f.parent.name))
        assert "2026-10" in matching_eras(up)
        if getattr(o, "outputs", None) is not None and len(o.outputs.output_pos):
            continue
        back = kvref.convert(up, era=era, arch=getattr(o, "arch", None))
        assert back.to_bytes() == f.read_bytes(), f
        n += 1
    assert n > 300


def test_convert_extracts_what_llama_cpp_saves_for_a_sequence() -> None:
    got = kvref.convert(G / "llama-shared-prefix" / "01-session.ggsn", seq=1)
    want = state.load(G / "llama-shared-prefix" / "05-seq-seq1.ggsq")
    assert state.section_bytes(*got.memory.sections) == state.section_bytes(*want.memory.sections)


def test_convert_merge_remap_streams(tmp_path: Path) -> None:
    s = G / "llama-f16-multistream" / "01-session.ggsn"
    orig = state.load(s)
    seqs = [kvref.convert(s, seq=i) for i in range(3)]
    merged = kvref.convert(seqs[0], merge=seqs[1:], arch="llama", streams="per-seq")
    assert merged.to_bytes()[12:] == kvref.convert(s).to_bytes()[12 + 4 * len(orig.tokens) :]
    unified = kvref.convert(s, streams="unified")
    assert unified.memory.sections[0].n_stream == 1
    again = kvref.convert(unified, streams="per-seq", n_stream=3)
    assert state.section_bytes(*again.memory.sections) == state.section_bytes(*kvref.convert(s).memory.sections)
    remapped = kvref.convert(s, seq_map="0:2,2:0")
    assert kvref.diff(remapped, kvref.convert(remapped, seq_map={0: 2, 2: 0})).total > 0
    assert kvref.diff(kvref.convert(remapped, seq_map={0: 2, 2: 0}), kvref.convert(s)).equal
    with pytest.raises(kvref.KVRefError, match="same id"):
        kvref.convert(s, seq_map="0:1")
    model = Path(__file__).resolve().parent.parent / "conformance" / "models" / "llama-tiny.gguf"
    retyped = kvref.convert(s, tmp_path / "x", type_k="q8_0", model=model)  # issue 13 part B: test_tensors.py
    assert {r.type_name for sec in retyped.memory.kv_sections for st in sec.streams if st.data for r in st.data.k} == {
        "q8_0"
    }


# ------------------------------------------------------------------------------------------- diff
def test_diff_reports_first_total_and_cell_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvref.jobs.edit import take_stream
    from kvref.state import KVSection

    a = G / "llama-f16-single-seq" / "01-session.ggsn"
    assert main(["diff", str(a), str(a)]) == 0
    o = kvref.convert(a)
    st = o.memory.sections[0].streams[0]
    o.memory.sections[0] = KVSection([take_stream(st, np.arange(st.cell_count)[::-1])], True)
    o.save(tmp_path / "rev.ggsn")
    capsys.readouterr()
    assert main(["diff", str(a), str(tmp_path / "rev.ggsn")]) == 1
    assert "differing only in cell order inside the stream" in capsys.readouterr().out
    k = take_stream(st, np.arange(st.cell_count))
    k.data.k[1].data[3, 7] ^= 0xFF
    o.memory.sections[0] = KVSection([k], True)
    o.save(tmp_path / "k.ggsn")
    assert main(["diff", "--json", str(a), str(tmp_path / "k.ggsn")]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == 1 and out["first"]["where"] == "section 0 stream 0 layer 1 cell 3"
    assert main(["diff", str(a), str(tmp_path / "missing")]) == 2


# ------------------------------------------------------------------------------------------- check
def test_check_answers_and_names_the_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    legacy = G / "legacy-0.3.16-llama-f16-single-seq" / "01-session.ggsn"
    res = kvref.check_file(legacy, LLAMA, flash_attn=False)
    assert not res.ok and res.option and "kvref convert" in res.option
    kvref.convert(legacy, tmp_path / "up.ggsn", sidecar=True, model=LLAMA)
    res = kvref.check_file(tmp_path / "up.ggsn", LLAMA)
    assert not res.ok and res.option == "--flash-attn" and res.fix == "off"
    assert kvref.check_file(tmp_path / "up.ggsn", LLAMA, flash_attn=False).ok
    res = kvref.check_file(tmp_path / "up.ggsn", LLAMA, flash_attn=False, n_ctx=8)
    assert res.ok  # n_ctx pads to 256 cells
    ms = G / "llama-f16-multistream" / "01-session.ggsn"
    res = kvref.check_file(ms, LLAMA, flash_attn=False)
    assert res.option == "--no-kv-unified --n-seq-max" and res.fix == 3
    res = kvref.check_file(tmp_path / "up.ggsn", ROOT / "models" / "mamba-tiny.gguf")
    assert not res.ok and "sidecar" in res.reason
    assert main(["check", str(tmp_path / "up.ggsn"), "--model", str(LLAMA), "--flash-attn", "off"]) == 0
    assert capsys.readouterr().out.startswith("yes")
    assert main(["check", str(tmp_path / "up.ggsn"), "--model", str(LLAMA)]) == 1
    assert "fix: --flash-attn off" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------- inspect
def test_inspect_shows_size_eras_labels_and_every_token(capsys: pytest.CaptureFixture[str]) -> None:
    f = G / "gemma3-iswa" / "01-session.ggsn"
    assert main(["inspect", str(f)]) == 0
    out = capsys.readouterr().out
    assert f"({f.stat().st_size} bytes)" in out and "layout of era: 2026-10" in out
    assert "base attention KV" in out and "SWA attention KV" in out and "stream(s)" not in out
    assert main(["inspect", "--json", str(f)]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["tokens"] == [int(t) for t in state.load(f).tokens]
    assert js["file_size"] == f.stat().st_size and js["eras"][0]["era"] == "2026-10"
    assert main(["inspect", str(G / "mamba-seq-cp-rm" / "01-session.ggsn")]) == 0
    out = capsys.readouterr().out
    assert "(1 cell)" in out and "1 cells" not in out


def test_an_iswa_state_has_no_era_before_the_swa_cache(tmp_path: Path) -> None:
    src = G / "gemma3-iswa" / "01-session.ggsn"
    with pytest.raises(ConversionError, match=r"2024-09 layout .* has no sliding-window cache"):
        kvref.convert(src, tmp_path / "x.ggsn", era="2024-09")
    assert not (tmp_path / "x.ggsn").exists()
    old = kvref.convert(src, era="2025-07")
    assert matching_eras(old) == ["2025-07"]  # the 0.3.0 .. 0.3.9 layout is the same bytes, but had no iSWA


def test_diff_says_which_sequences_lost_gained_and_changed(capsys: pytest.CaptureFixture[str]) -> None:
    """After seq_rm(1, 5, -1) and seq_rm(0, 2, 6) (llama-shared-prefix's trace between its two session saves) the
    cell counts differ; diff still says, per sequence, which positions went (and that nothing else changed)."""
    case = G / "llama-shared-prefix"
    res = kvref.diff(case / "01-session.ggsn", case / "09-session.ggsn")
    got = {(c.seq, tuple(c.lost), tuple(c.gained), tuple(c.changed)) for c in res.sequences}
    assert got == {(0, ((2, 5),), (), ()), (1, ((5, 9),), (), ())}  # seq 0 held 0..10 and seq 1 0..9
    assert main(["diff", str(case / "01-session.ggsn"), str(case / "09-session.ggsn")]) == 1
    assert "section 0 stream 0 seq 1: lost pos 5..9 (5 positions)" in capsys.readouterr().out
    # a context shift (llama-context-shift: seq_rm(0, 4, 12), seq_add(0, 12, -1, -8), then a decode): positions
    # 4..15 stay but their K rows were re-rotated, and the new token sits at 16
    shift = G / "llama-context-shift"
    (c,) = kvref.diff(shift / "01-session.ggsn", shift / "05-session.ggsn").sequences
    assert (c.seq, c.lost, c.gained, c.changed) == (0, [], [(16, 16)], [(4, 15)])
    assert c.first_change == "pos 4 layer 0 k"
    js = kvref.diff(shift / "01-session.ggsn", shift / "05-session.ggsn").to_json()
    assert js["sequences"][0]["gained"] == [[16, 16]]
