"""gemma4-assistant's memory: llama_kv_cache_iswa built over another context's (ctx_other) iSWA cache
(kvref.memory.kv_cache_shared), checked against what llama.cpp 0.3.36 did in the goldens
conformance/golden/gemma4-assistant-ctx-other* (replayed in full by test_conformance.py) and against
src/llama-kv-cache.cpp's rules (TAG_KV_CACHE_SHARE_CELLS)."""

from __future__ import annotations

import pytest
from golden import ROOT, load_case

import kvref
from kvref.errors import KVRefError
from kvref.jobs import conformance as C
from kvref.memory.factory import create_memory
from kvref.memory.kv_cache_shared import KVCacheISWAShared

CID = "gemma4-assistant-ctx-other"
pytestmark = pytest.mark.skipif(not (ROOT / "golden" / CID).is_dir(), reason="no gemma4-assistant golden")


def _pair():
    case = load_case(CID)
    hp, hp_t = C.hparams_from_case(case), C.hparams_from_case(C.other_case(case))
    target = create_memory(hp_t, n_ctx=256, flash_attn=False)
    draft = create_memory(hp, n_ctx=256, flash_attn=False, mem_other=target)
    return case, target, draft


def test_the_draft_needs_ctx_other():
    case = load_case(CID)
    with pytest.raises(KVRefError, match="ctx_other"):  # llama_context's constructor throws
        create_memory(C.hparams_from_case(case), n_ctx=256)


def test_every_layer_and_cell_is_the_targets():
    case, target, draft = _pair()
    assert isinstance(draft, KVCacheISWAShared)
    # llama.cpp logged: non-SWA layer 1 shares the target's layer 3, SWA layer 0 its layer 2 (n_layer 4 - 1, - 2)
    assert [(lay.il, lay.k is target.base._layer(3).k) for lay in draft.base.layers] == [(1, True)]
    assert [(lay.il, lay.k is target.swa._layer(2).k) for lay in draft.swa.layers] == [(0, True)]
    assert draft.base.cells(0) is target.base.cells(0) and draft.swa.cells(0) is target.swa.cells(0)
    sizes = [c["cells"] for c in case["observed_context"]["memory_log"]["caches"]]
    assert [draft.base.get_size(), draft.swa.get_size()] == sizes == [256, 256]


def test_draft_decodes_place_nothing_and_its_state_is_empty():
    _, target, draft = _pair()
    target.decode(kvref.Batch(tokens=list(range(5, 14)), seq_ids=[[0]] * 9))
    before = target.state_write()
    for _ in range(2):  # the same positions every time: nothing was stored
        draft.decode(kvref.Batch(tokens=[20, 21, 22], pos=[9, 10, 11], seq_ids=[[0]] * 3))
    assert draft.seq_pos_max(0) == target.seq_pos_max(0) == 8
    assert target.state_write() == before
    # llama.cpp: the draft's state_write writes nothing (its session state is the arch string: 20 bytes)
    assert draft.state_write() == b"" and draft.state_size() == 0 and draft.state_write(0) == b""
    assert draft.state_read(b"", 0) == 0


def test_draft_sequence_ops_do_nothing_but_clear_empties_the_target():
    _, target, draft = _pair()
    target.decode(kvref.Batch(tokens=list(range(5, 14)), seq_ids=[[0]] * 9))
    before = target.state_write()
    assert draft.seq_rm(0, 2, 4) is True and draft.seq_rm(300, -1, -1) is True  # any id: true, nothing removed
    draft.seq_cp(0, 1, -1, -1)
    draft.seq_add(0, 4, -1, 3)
    draft.seq_keep(0)
    assert target.state_write() == before
    draft.clear()  # llama_kv_cache::clear is not guarded: the shared cells are reset
    assert target.seq_pos_max(0) == -1 and draft.seq_pos_max(0) == -1


# ---- dflash (a draft whose memory create_memory builds on its own: src/llama-model.cpp, case LLM_ARCH_DFLASH)


def _dflash_hp():
    return C.hparams_from_case(load_case("dflash-kv-injection"))


@pytest.mark.skipif(not (ROOT / "golden" / "dflash-kv-injection").is_dir(), reason="no dflash golden")
def test_dflash_without_hyper_connections_takes_the_default_path():
    from kvref.memory.kv_cache import KVCache

    case = load_case("dflash-kv-injection")
    mem = C.create_memory_for(case, _dflash_hp())
    assert type(mem) is KVCache and mem.get_layer_ids() == [0, 1]
    C.check_memory_shape(case, mem)


@pytest.mark.skipif(not (ROOT / "golden" / "dflash-kv-injection").is_dir(), reason="no dflash golden")
def test_dflash_with_hyper_connections_is_an_unfiltered_iswa_cache():
    import dataclasses

    from kvref.hparams import SWAType
    from kvref.memory.kv_cache_iswa import KVCacheISWA

    # DSpark: every stage a sliding-window layer; the NextN count does not filter (no trunk filter on this path)
    hp = dataclasses.replace(
        _dflash_hp(), dsv4_hc_mult=4, swa_type=SWAType.STANDARD, n_swa=8, swa_layers=True, n_layer_nextn=1
    )
    mem = create_memory(hp, n_ctx=256)
    assert isinstance(mem, KVCacheISWA)
    assert mem.base.get_layer_ids() == [] and mem.swa.get_layer_ids() == [0, 1]
    with pytest.raises(KVRefError, match="sliding window"):  # GGML_ASSERT(hparams.swa_type != NONE)
        create_memory(dataclasses.replace(_dflash_hp(), dsv4_hc_mult=4), n_ctx=256)


def test_inspect_reads_the_drafts_empty_state():
    """llama.cpp wrote the draft's session as header, tokens and the arch string only (32 bytes): it reads as
    layout none, noted."""
    from kvref.jobs.cli import main

    f = ROOT / "golden" / CID / "01-session.ggsn"
    assert f.stat().st_size == 32
    obj = kvref.state.load(f)
    assert obj.memory.layout == "none" and obj.memory.sections == [] and obj.arch == "gemma4-assistant"
    assert "no memory section" in (obj.note or "")
    assert main(["inspect", str(f)]) == 0
