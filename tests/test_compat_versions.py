"""Every llama-cpp-python release 0.3.12 .. 0.3.36 maps to a compat era (kvref.compat.for_llama_cpp_python).

One test per change point kvref models. Each expectation is read off that release's vendored llama.cpp
(/work/lcp-versions/<release>/: llama-kv-cache(-unified).cpp, llama-memory-recurrent.cpp, llama-context.cpp),
not off kvref's output; the C++ that decides it is quoted in the test's docstring. The change points judged to
be refactors (no behaviour kvref models changes) are listed in kvref.compat's docstring.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from golden import load_case
from recurrent_helpers import mamba_hparams, ubatch
from test_memory_factory import gemma2, llama

from kvref import compat
from kvref.errors import KVRefError, NoSlotError, SequenceError
from kvref.jobs.conformance import hparams_from_case
from kvref.memory.batch import Batch
from kvref.memory.factory import context_params, create_memory
from kvref.memory.kv_state import ext_size, has_cell_ext
from kvref.memory.recurrent import RecurrentMemory
from kvref.profile import Profile

ERA_MAP = {
    **dict.fromkeys(["0.3.12", "0.3.13", "0.3.14"], "2025-07"),
    "0.3.15": "0.3.15",
    "0.3.16": "2025",
    **dict.fromkeys([f"0.3.{i}" for i in range(17, 24)], "0.3.17"),
    **dict.fromkeys(["0.3.24", "0.3.25"], "0.3.24"),
    **dict.fromkeys([f"0.3.{i}" for i in range(26, 34)], "0.3.26"),
    "0.3.34": "0.3.34",
    "0.3.35": "2026-08",
    "0.3.36": "2026-10",
}


def test_every_release_maps_to_its_era():
    assert {r: compat.for_llama_cpp_python(r).compat for r in compat.RELEASES} == ERA_MAP
    for r in compat.RELEASES:  # every release is a compat value of its own, behaving as its era
        assert compat.check(r) == r
        assert all(compat.since(r, b) == compat.since(ERA_MAP[r], b) for b in compat.BEHAVIOURS)
        assert Profile.of(r) == Profile.of(ERA_MAP[r]) == compat.for_llama_cpp_python(r)
        assert Profile.of(r).compat == r
    assert compat.for_llama_cpp_python("0.3.16+cu121").compat == compat.for_llama_cpp_python("v0.3.16").compat == "2025"
    assert compat.for_llama_cpp_python("0.3.36.post1").compat == "2026-10"


def test_releases_outside_the_checked_range():
    assert compat.for_llama_cpp_python("0.3.40").compat == compat.for_llama_cpp_python("0.4.0").compat == compat.DEFAULT
    with pytest.warns(compat.CompatWarning, match="older than 0.3.12"):
        assert compat.for_llama_cpp_python("0.3.11").compat == "2025-07"
    with pytest.warns(compat.CompatWarning, match="version 7"):  # replayed by the legacy-0.2.83-* goldens
        assert compat.for_llama_cpp_python("0.2.83") == compat.profile_2024()
    with pytest.warns(compat.CompatWarning, match="version 6"):  # replayed by the legacy-0.2.82-* goldens
        assert compat.for_llama_cpp_python("0.2.82") == compat.profile_2024()
    with pytest.warns(compat.CompatWarning, match="version 5"):  # replayed by the legacy-0.2.67-* goldens
        assert compat.for_llama_cpp_python("0.2.67") == compat.profile_2024()
    with pytest.warns(compat.CompatWarning, match="no golden checks it"):  # session v6 from 0.2.68, not replayed
        assert compat.for_llama_cpp_python("0.2.68") == compat.profile_2024()
    with pytest.warns(compat.CompatWarning, match="older than 0.3.12"):  # session v4: not read
        assert compat.for_llama_cpp_python("0.2.57").compat == "2025-07"
    # 0.2.84 .. 0.2.90 (session v8, read for their state files): 2025-07 with the 2024 sequence saves
    with pytest.warns(compat.CompatWarning, match="kv_seq_save_ids=False"):
        p = compat.for_llama_cpp_python("0.2.90")
    assert p == compat.profile_2024() and p.compat == "custom" and not p.kv_seq_save_ids
    assert dataclasses.replace(p, kv_seq_save_ids=True) == compat.resolve("2025-07")
    for bad in ("", "0.3", "latest", "0.3.x"):
        with pytest.raises(KVRefError):
            compat.for_llama_cpp_python(bad)
    with pytest.raises(ValueError):
        create_memory(llama(), 256, compat="0.3.11")


def test_0_3_0_to_0_3_9_sequence_saves_without_ids():
    """0.3.0 (llama.cpp ea9c32b, src/llama.cpp) .. 0.3.9 (8733e0c, llama-kv-cache.cpp): ``write_kv_cache_meta``
    / ``state_write_meta`` writes ``n_seq_id = seq_id == -1 ? cell.seq_id.size() : 0`` and the sequence restore
    refuses ``n_seq_id != 0`` ("invalid seq_id-agnostic kv cell"), as 0.2.90 did; no rng string (session v9).
    0.3.10 (8846aac) llama_kv_cache_unified::state_write_meta writes the ids it holds of ``seq_id`` and
    state_read_meta requires ``n_seq_id == 1``: the 0.3.12 layout. 0.3.0 is checked by the legacy-0.3.0-* goldens."""
    import warnings

    from kvref import state
    from kvref.state.eras import era, matching_eras

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked by goldens: no warning
        p = compat.for_llama_cpp_python("0.3.0")
        assert compat.for_llama_cpp_python("0.3.8").compat == "0.3.8"
    assert p == compat.profile_2024() and not p.kv_seq_save_ids
    for r in ("0.3.1", "0.3.7", "0.3.9"):
        with pytest.warns(compat.CompatWarning, match="no golden checks it"):
            assert compat.for_llama_cpp_python(r) == p
    # named after the release, so that its files are checked against the 2024-09 layout (session version 9)
    assert p.compat == "0.3.0" and era(p).name == "2024-09" and era(compat.profile_2024()).name == "2024-08"
    for r in ("0.3.10", "0.3.11"):
        with pytest.warns(compat.CompatWarning, match="older than 0.3.12"):
            assert compat.for_llama_cpp_python(r) == compat.resolve("2025-07")
    eras = {r: era(r).name for r in ("0.2.90", "0.3.0", "0.3.9", "0.3.10", "0.3.11", "0.3.12")}
    assert eras == dict(zip(eras, ["2024-08", "2024-09", "2024-09", "2025-07", "2025-07", "2025-07"], strict=True))
    assert not era("0.3.0").rng and not era("0.3.0").seq_kv_ids and era("0.3.10").seq_kv_ids

    # kvref's sequence save of the 0.3.0 profile: one u32 n_seq_id 0 per cell where 0.3.12 writes 1 and the id
    hp = _llama_tiny()
    blobs = {}
    for c in (p, "2025-07"):
        mem = create_memory(hp, 256, compat=c)
        mem.decode(Batch(tokens=[1, 2, 3], seq_ids=[[0]] * 3))
        blobs[str(c)] = mem.state_write(0)
    assert len(blobs["2025-07"]) - len(blobs[str(p)]) == 3 * 4
    # what 0.3.0 wrote: a sequence save without ids (the 2024 layouts), a session without the rng (2024-09 on)
    case = load_case("legacy-0.3.0-llama-f16-single-seq")
    golden = Path(__file__).resolve().parents[1] / "conformance" / "golden" / case["id"]
    assert matching_eras(state.load(golden / "03-seq-seq0.ggsq")) == ["2024-08", "2024-09"]
    assert matching_eras(state.load(golden / "01-session.ggsn", outputs=True)) == ["2024-09", "2025-07"]


# --- 0.3.15: PR #14363 (streams) ----------------------------------------------------------------------------


def _llama_tiny():
    return hparams_from_case(load_case("llama-f16-single-seq"))


def test_0_3_15_streams_and_the_empty_section():
    """0.3.14 state_write: ``io.write(&cell_count); state_write_meta(...); state_write_data(...)`` for any
    cell_count, so an empty section still has v_trans, n_layer and each layer's type / row size; state_read_meta
    of a sequence then runs ``find_slot(ubatch, true)`` on a zero-token ubatch, whose empty result is "failed to
    find available cells" (the sequence was already removed). 0.3.15: ``io.write(&n_stream)`` first and "skip
    empty streams" (``if (cell_count == 0) continue``) in both directions. (llama-cpp-python 0.3.12 itself: a
    60-byte blob for llama-tiny's empty sequence, and llama_state_seq_set_data of it returns 0.)"""
    hp = _llama_tiny()
    sizes = {}
    for release in ("0.3.14", "0.3.15"):
        c = compat.for_llama_cpp_python(release)
        mem = create_memory(hp, 256, compat=c)
        empty = mem.state_write(0)
        sizes[release] = len(empty)
        mem.decode(Batch(tokens=[1, 2, 3], seq_ids=[[0]] * 3))
        if release == "0.3.14":
            with pytest.raises(NoSlotError):
                mem.state_read(empty, 0)
            assert mem.seq_pos_max(0) == 2  # kvref's default read is atomic
            with pytest.raises(NoSlotError):
                mem.state_read(empty, 0, atomic=False)  # as llama.cpp leaves it
            assert mem.seq_pos_max(0) == -1
        else:
            mem.state_read(empty, 0, atomic=False)
            assert mem.seq_pos_max(0) == 2
    n_layer = 2
    assert sizes == {"0.3.14": 4 + 4 + 4 + n_layer * 2 * (4 + 8), "0.3.15": 4 + 4}
    assert sizes["0.3.14"] == 60


def test_0_3_15_kv_seq_rm_of_every_sequence_asserts():
    """0.3.15 llama_kv_cache_unified::seq_rm begins with ``GGML_ASSERT(seq_id >= 0 && (size_t) seq_id <
    seq_to_stream.size())`` and only then branches on ``seq_id >= 0``: seq_rm(-1, ...) aborts. 0.3.14 had no
    assert (one cell table); 0.3.16 relaxed it to ``seq_id == -1 || ...`` and loops over the streams."""
    for release, aborts in (("0.3.14", False), ("0.3.15", True), ("0.3.16", False)):
        mem = create_memory(llama(), 256, compat=compat.for_llama_cpp_python(release))
        mem.decode(Batch(tokens=[1, 2, 3], seq_ids=[[0]] * 3))
        if aborts:
            with pytest.raises(SequenceError, match=r"0\.3\.15"):
                mem.seq_rm(-1, -1, -1)
            assert mem.seq_pos_max(0) == 2
            assert mem.seq_rm(0, -1, -1) is True
        else:
            assert mem.seq_rm(-1, -1, -1) is True
        assert mem.seq_pos_max(0) == -1


# --- 0.3.17 ---------------------------------------------------------------------------------------------------


def test_0_3_17_recurrent_seq_rm_tail_rule():
    """0.3.16: ``if ((0 < p0 && p0 <= cell.pos) || (0 < p1 && p1 <= cell.pos)) return false``; 0.3.17:
    ``if (0 < p0 && p0 <= cell.pos && p1 > cell.pos) return false`` (a removal that ends before the tail is
    accepted and leaves the state alone)."""
    got = {}
    for release in ("0.3.16", "0.3.17"):
        m = RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2, compat=compat.for_llama_cpp_python(release))
        m.apply_ubatch(ubatch((0, range(5))))  # tail pos 4
        got[release] = (m.seq_rm(0, 0, 3), m.seq_rm(0, 2, -1), m.pos[0])
    assert got == {"0.3.16": (False, False, 4), "0.3.17": (True, False, 4)}


def test_0_3_17_recurrent_equal_splits_become_sequential():
    """llama_memory_recurrent::init_batch: 0.3.16 ``balloc.split_equal(n_ubatch, false)``, 0.3.17
    ``balloc.split_equal(n_ubatch, true)``: sequences 0 and 2 (not consecutive) share a ubatch only before."""
    n_ubatches = {}
    for release in ("0.3.16", "0.3.17"):
        m = RecurrentMemory(mamba_hparams(), rs_size=3, n_seq_max=3, compat=compat.for_llama_cpp_python(release))
        out = m.decode(Batch(tokens=[1, 2, 3, 4], pos=[0, 1, 0, 1], seq_ids=[[0], [0], [2], [2]]))
        n_ubatches[release] = len(out)
        assert (m.seq_pos_max(0), m.seq_pos_max(2)) == (1, 1)
    assert n_ubatches == {"0.3.16": 1, "0.3.17": 2}


def test_0_3_17_recurrent_placement_checked_against_0_3_16_and_0_3_35():
    """The same split difference as seen in the cells: llama-cpp-python 0.3.16 and 0.3.35 themselves (mamba-tiny,
    n_seq_max 3, these two batches, whole state read back) left cells (pos, seqs) as pinned here."""
    hp = hparams_from_case(load_case("mamba-seq-cp-rm"))
    cells = {}
    for release in ("0.3.16", "0.3.35"):
        mem = create_memory(hp, 256, 3, compat=compat.for_llama_cpp_python(release))
        mem.decode(Batch(tokens=[1, 2, 3, 4, 5], pos=[0, 1, 0, 1, 0], seq_ids=[[0], [0], [2], [2], [1]]))
        mem.decode(Batch(tokens=[1, 2, 3, 4], pos=[2, 3, 2, 3], seq_ids=[[0], [0], [2], [2]]))
        (sec,) = mem.state_sections(-1)
        cells[release] = [(int(sec.cells.pos[i]), list(sec.cells.seq_ids(i))) for i in range(sec.cells.n)]
    assert cells == {"0.3.16": [(3, [0]), (3, [2]), (0, [1])], "0.3.35": [(3, [0]), (0, [1]), (3, [2])]}


def test_0_3_17_mrope_ext_and_k_shift():
    """0.3.17 state_write_meta: ``if (hparams.n_pos_per_embd() > 1) io.write(&ext, sizeof(ext))`` with
    ``struct llama_kv_cell_ext { llama_pos x, y; }``; get_can_shift: ``if (hparams.n_pos_per_embd() > 1) return
    false``. 0.3.16 wrote no ext and get_can_shift returned true; 0.3.36's ext adds ``tok`` (12 bytes)."""
    hp = hparams_from_case(load_case("qwen2vl-mrope"))
    got = {}
    for release in ("0.3.16", "0.3.17", "0.3.23", "0.3.36"):
        mem = create_memory(hp, 256, compat=compat.for_llama_cpp_python(release))
        got[release] = (has_cell_ext(mem), ext_size(mem), mem.get_can_shift())
    assert got == {
        "0.3.16": (False, 0, True),
        "0.3.17": (True, 8, False),
        "0.3.23": (True, 8, False),
        "0.3.36": (True, 12, False),
    }


def test_0_3_17_context_padding():
    """0.3.17 llama_context: ``cparams.n_ctx = GGML_PAD(cparams.n_ctx, 256)`` and, not unified,
    ``n_ctx_seq = GGML_PAD(n_ctx / n_seq_max, 256)``; 0.3.16 did not pad in the context (the cache padded)."""
    hp = llama()
    got = {r: context_params(hp, 256, 3, kv_unified=False, compat=compat.for_llama_cpp_python(r)).n_ctx
           for r in ("0.3.16", "0.3.17")}  # fmt: skip
    assert got == {"0.3.16": 288, "0.3.17": 768}


# --- 0.3.24: recurrent rollback ---------------------------------------------------------------------------------


def test_0_3_24_rollback_exists_from_0_3_24():
    """0.3.23 llama-context.cpp has no ``n_rs_seq``; 0.3.24: ``if (cparams.n_rs_seq > 0 &&
    !llm_arch_supports_rs_rollback(model.arch)) cparams.n_rs_seq = 0``, and seq_rm serves ``0 < p0 <= pos <
    p1`` from a snapshot when ``rollback = cell.pos - (p0 - 1)`` is in ``[1, n_rs_seq]``."""
    hp = mamba_hparams()
    hp.arch = "qwen35"
    got = {r: context_params(hp, 256, n_rs_seq=2, compat=compat.for_llama_cpp_python(r)).n_rs_seq
           for r in ("0.3.23", "0.3.24")}  # fmt: skip
    assert got == {"0.3.23": 0, "0.3.24": 2}
    with pytest.raises(ValueError, match="n_rs_seq"):
        RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2, n_rs_seq=2, compat="0.3.23")
    m = RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2, n_rs_seq=2, compat="0.3.24")
    m.apply_ubatch(ubatch((0, range(5))))
    assert m.seq_rm(0, 4, -1) is True and (m.pos[0], m.rs_idx[0]) == (3, 1)


def test_0_3_24_recurrent_state_rows_come_from_src():
    """0.3.23 state_write: ``state_write_data(io, cell_ranges)`` over the cells' own indices; 0.3.24:
    ``cell_id = rs_idx_cur * size + (cell.src >= 0 ? cell.src : i)`` into ``cell_ranges_data``."""
    rows = {}
    for release in ("0.3.23", "0.3.24"):
        m = RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2, compat=compat.for_llama_cpp_python(release))
        m.apply_ubatch(ubatch((0, range(2))))
        cell = m.tail[0]
        for il in m.layers:
            r, _, _ = m._rs(il)
            r[:] = np.arange(r.shape[0], dtype=np.uint8)[:, None]
        m.src[cell] = 1 - cell  # a state still to be copied in from the other cell
        (sec,) = m.state_sections(0)
        rows[release] = int(sec.r[0].data[0][0])
        expect_src = 1 - cell
        assert rows[release] == (cell if release == "0.3.23" else expect_src)


# --- 0.3.26: SWA-masked cells in sequence saves -------------------------------------------------------------------


def test_0_3_26_sequence_saves_skip_swa_masked_cells():
    """0.3.26 state_write: ``if (add_cell && seq_id != -1) add_cell = !llama_hparams::is_masked_swa(n_swa,
    swa_type, cells.pos_get(i), cells.seq_pos_max(seq_id))``; 0.3.25 wrote every non-empty cell of the sequence."""
    tokens = Batch(tokens=list(range(13)), seq_ids=[[0]] * 13)
    n_cells = {}
    for release in ("0.3.16", "0.3.17", "0.3.25", "0.3.26", "0.3.34"):
        mem = create_memory(gemma2(n_swa=4), 256, compat=compat.for_llama_cpp_python(release))
        mem.decode(tokens)
        base, swa = mem.state_sections(0)
        n_cells[release] = (base.streams[0].cells.n, swa.streams[0].cells.n)
    assert n_cells == {"0.3.16": (13, 13), "0.3.17": (13, 13), "0.3.25": (13, 13), "0.3.26": (13, 4),
                       "0.3.34": (13, 4)}  # fmt: skip


# --- 0.3.34: rollback splits ---------------------------------------------------------------------------------


def test_0_3_34_rollback_splits():
    """llama_memory_recurrent::init_batch with ``n_rs_seq > 0``: 0.3.24 .. 0.3.33 ``balloc.split_seq(n_ubatch)``
    (one sequence per ubatch); 0.3.34 ``balloc.split_equal(n_ubatch, true, n_rs_seq + 1)`` (sequences 0 and 1
    together). Without n_rs_seq both use ``split_equal(n_ubatch, true)``."""
    got = {}
    for release in ("0.3.33", "0.3.34"):
        for n_rs_seq in (0, 1):
            m = RecurrentMemory(
                mamba_hparams(), rs_size=2, n_seq_max=2, n_rs_seq=n_rs_seq, compat=compat.for_llama_cpp_python(release)
            )
            out = m.decode(Batch(tokens=[1, 2, 3, 4], pos=[0, 1, 0, 1], seq_ids=[[0], [0], [1], [1]]))
            got[release, n_rs_seq] = len(out)
    assert got == {("0.3.33", 0): 1, ("0.3.33", 1): 2, ("0.3.34", 0): 1, ("0.3.34", 1): 1}


# --- 0.3.35: K-shift of layers without rope ---------------------------------------------------------------------


def test_0_3_35_k_shift_skips_layers_without_rope():
    """0.3.35 build_graph_shift: ``if (!hparams.has_rope(il)) continue;`` -- 0.3.34 roped every layer's K."""
    changed = {}
    for release in ("0.3.34", "0.3.35"):
        mem = create_memory(llama(rope_layers=[True, False, True, True]), 256,
                            compat=compat.for_llama_cpp_python(release))  # fmt: skip
        mem.decode(Batch(tokens=list(range(8)), seq_ids=[[0]] * 8))
        rng = np.random.default_rng(0)
        for layer in mem.layers:
            k = rng.standard_normal(layer.k.size // 2).astype(np.float16)
            layer.k[...] = k.view(np.uint8).reshape(layer.k.shape)
        before = [layer.k.copy() for layer in mem.layers]
        mem.seq_add(0, 0, -1, 3)
        mem.update()
        changed[release] = [not np.array_equal(b, layer.k) for b, layer in zip(before, mem.layers, strict=True)]
    assert changed == {"0.3.34": [True, True, True, True], "0.3.35": [True, False, True, True]}
