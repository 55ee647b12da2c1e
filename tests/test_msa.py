"""MiniMax-M3's llama_kv_cache_msa (kvref.memory.kv_cache_msa.KVCacheMSA) against what llama.cpp 0.3.36 built and
wrote for the tiny minimax-m3 model (conformance/golden/minimax-m3-msa*: the replay itself runs in
test_conformance.py); expected values are llama.cpp's (its memory log, its files) or follow from llama.cpp's code."""

from __future__ import annotations

import numpy as np
import pytest
from golden import ROOT, load_case

import kvref
from kvref.errors import KVRefError
from kvref.hparams import HParams
from kvref.jobs import conformance as C
from kvref.memory.factory import create_memory
from kvref.memory.kv_cache_msa import KVCacheMSA

MODEL = ROOT / "models" / "minimax-m3-tiny.gguf"
CASES = ("minimax-m3-msa", "minimax-m3-msa-fa", "minimax-m3-msa-fa-streams", "minimax-m3-msa-fa-unified")

pytestmark = pytest.mark.skipif(not MODEL.exists(), reason="no committed minimax-m3 tiny model")


def _hp() -> HParams:
    return HParams.from_gguf(MODEL)


def test_from_gguf_reads_the_msa_keys():
    hp = _hp()
    # llama_model_minimax_m3::load_arch_hparams: leading_dense_block_count 1, indexer key length 8, block 4, 1 local
    assert (hp.arch, hp.n_layer_dense_lead, hp.indexer_head_size) == ("minimax-m3", 1, 8)
    assert (hp.indexer_block_size, hp.indexer_local_blocks) == (4, 1)
    assert hp.memory_kind() == "msa"


@pytest.mark.parametrize("cid", CASES)
def test_create_memory_is_the_msa_pair_llama_cpp_logged(cid):
    case = load_case(cid)
    mem = C.create_memory_for(case, _hp())
    assert isinstance(mem, KVCacheMSA)
    C.check_memory_shape(case, mem)
    caches = case["observed_context"]["memory_log"]["caches"]
    # llama.cpp logs the base cache (3 layers) then the indexer cache (layers >= n_layer_dense_lead: 2)
    assert [(c["cells"], c["layers"]) for c in caches] == [(256, 3), (256, 2)]
    assert mem.base.get_layer_ids() == [0, 1, 2] and mem.idx.get_layer_ids() == [1, 2]
    # the indexer cache: one key head of the indexer length; V rows as the model's head (allocated, never written)
    assert mem.idx.layers[0].k.shape[-1] == 8 * 2  # f16: 8 elements
    assert mem.get_can_shift()


def test_state_sizes_match_llama_cpp():
    """The memory section llama.cpp wrote (the state blob less the arch string) has kvref's state_size."""
    case = load_case("minimax-m3-msa-fa")
    mem = C.create_memory_for(case, _hp())
    blob = (ROOT / "golden" / "minimax-m3-msa-fa" / "02-state.bin").read_bytes()
    n_arch = int.from_bytes(blob[:4], "little")
    section = blob[4 + n_arch :]
    read = mem.state_read(section)
    assert read == len(section) and mem.state_size() == len(section)
    assert mem.state_write() == section  # byte-identical, base then indexer section
    assert mem.seq_pos_max(0) == 12 and mem.base.get_cells(0).get_used() == mem.idx.get_cells(0).get_used() == 13


def test_inspect_labels_the_indexer_section():
    obj = kvref.state.load(ROOT / "golden" / "minimax-m3-msa-fa" / "01-session.ggsn")
    assert obj.memory.layout == "msa"  # the arch string says minimax-m3: not an iSWA pair
    from kvref.jobs.cli_jobs import SECTION_LABELS

    assert SECTION_LABELS["msa"][1].startswith("MSA indexer")
    idx = obj.memory.sections[1]
    st = idx.streams[0]
    assert [r.row_size for r in st.data.k] == [16, 16]  # 8 f16 indexer key elements per cell and layer


def test_restore_with_the_model_builds_the_msa_memory():
    f = ROOT / "golden" / "minimax-m3-msa-fa" / "03-seq-seq0.ggsq"
    res = kvref.restore(f, model=MODEL)
    assert isinstance(res.memory, KVCacheMSA)
    assert res.memory.seq_pos_max(0) == 12


def test_a_failing_indexer_section_leaves_the_base_restored():
    """llama_kv_cache_msa::state_read reads the base section, then the indexer one: when the second fails (here: cut
    short), llama.cpp has already restored the first, and the indexer cache loses the sequence (state_read's clear)."""
    hp = _hp()
    src = create_memory(hp, n_ctx=256, flash_attn=True)
    src.decode(kvref.Batch(tokens=list(range(5, 15)), seq_ids=[[0]] * 10))
    blob = src.state_write(0)
    dst = create_memory(hp, n_ctx=256, flash_attn=True)
    with pytest.raises(KVRefError):
        dst.state_read(blob[:-3], 0)  # atomic (kvref's default): nothing changes
    assert dst.seq_pos_max(0) == -1 and dst.idx.seq_pos_max(0) == -1
    with pytest.raises(KVRefError):
        dst.state_read(blob[:-3], 0, atomic=False)
    assert dst.base.seq_pos_max(0) == 9 and dst.idx.seq_pos_max(0) == -1


def test_msa_inputs_follow_llama_cpp_rules():
    """pos_slot / pos_mask / bias / cell_blk for 6 tokens at positions 0..5 (one sequence, block 4, 1 local block):
    what llama_kv_cache_msa_context's set_input_* and llm_graph_input_msa compute."""
    mem = create_memory(_hp(), n_ctx=256, flash_attn=True)
    ((ub, slot),) = mem.decode(kvref.Batch(tokens=list(range(5, 11)), seq_ids=[[0]] * 6))
    assert mem.get_n_pos() == 256 and mem.n_ps() == 256
    ps = mem.graph_input("msa_pos_slot", ub, slot, swa=False, f16=False, causal=True)
    assert ps[:6].tolist() == [0, 1, 2, 3, 4, 5] and not ps[6:].any()
    pm = mem.graph_input("kq_mask_msa_pos", ub, slot, swa=False, f16=False, causal=True)[0]
    assert pm.shape == (6, 256)
    assert all(np.isfinite(pm[i, : i + 1]).all() and np.isneginf(pm[i, i + 1 :]).all() for i in range(6))
    bias = mem.graph_input("kq_mask_msa_bias", ub, slot, swa=False, f16=False, causal=True)[0]
    assert bias.shape == (6, 64) and [int(np.flatnonzero(r)[0]) for r in bias] == [0, 0, 0, 0, 1, 1]
    cb = mem.graph_input("msa_cell_blk", ub, slot, swa=False, f16=False, causal=True)
    assert cb.tolist()[:6] == [0, 0, 0, 0, 1, 1]
    assert mem.graph_input("k_idxs_idx", ub, slot, swa=False, f16=False, causal=True).tolist() == list(range(6))
    assert mem.graph_input("kq_mask", ub, slot, swa=False, f16=False, causal=True) is None  # the base cache's


def test_an_msa_state_is_not_converted_to_an_older_layout():
    # minimax-m3 exists only in llama.cpp 0.3.36 (the 2026-10 layout): no older llama.cpp could load the file
    from kvref.errors import ConversionError
    from kvref.state.eras import to_era

    obj = kvref.state.load(ROOT / "golden" / "minimax-m3-msa" / "01-session.ggsn")
    with pytest.raises(ConversionError, match="msa memory exists only in the 2026-10 layout"):
        to_era(obj, "2026-08")
