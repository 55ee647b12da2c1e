"""HParams.from_gguf and create_memory against llama.cpp's own view of the committed tiny models.

Each golden records what llama.cpp 0.3.36 reported for the model it loaded (``observed_model``: the
``llama_model_*`` accessors) and for the memory it built (``observed_context.memory_log``: cells and
layer count of every cache it created, in creation order; ``memory``: the sizes). kvref must read the same
model file into hyper-parameters that give the same numbers, without looking at case.json's ``hparams``.
"""

from __future__ import annotations

import pytest
from golden import ALL_CASES, ROOT, load_case

from kvref.hparams import HParams, SWAType
from kvref.jobs import conformance as C


def _committed(cid: str) -> bool:
    case = load_case(cid)
    m = case["model"]
    return (
        bool(m.get("committed"))
        and m.get("path") is not None
        and (ROOT / m["path"]).exists()
        and case.get("observed_context") is not None
    )


CASES = [cid for cid in ALL_CASES if _committed(cid)]


def test_the_new_architectures_are_covered():
    archs = {load_case(cid)["model"]["hparams"]["arch"] for cid in CASES}
    assert {"gemma3", "qwen3", "llama4", "mamba2", "rwkv6", "lfm2", "glm-dsa", "dots3note", "qwen4exp"} <= archs


@pytest.mark.parametrize("cid", CASES)
def test_from_gguf_matches_llama_cpp(cid):
    case = load_case(cid)
    hp = HParams.from_gguf(ROOT / case["model"]["path"])
    om = case["observed_model"]
    # llama_model_n_layer counts the trunk (llama_hparams::n_layer(): without the NextN blocks)
    assert (hp.n_layer_trunk(), hp.n_embd, hp.n_head_l(0), hp.n_head_kv_l(0)) == (
        om["n_layer"],
        om["n_embd"],
        om["n_head"],
        om["n_head_kv"],
    )
    assert int(hp.rope_type) == om["rope_type"]
    assert hp.n_ctx_train == om["n_ctx_train"] and hp.n_vocab == om["n_vocab"]
    # llama_model_n_swa reports the window whenever the model has a swa_type
    assert (hp.n_swa if hp.swa_type != SWAType.NONE else 0) == om["n_swa"]
    if om.get("is_recurrent") is not None:
        assert hp.is_recurrent_arch() == om["is_recurrent"]
    if om.get("is_hybrid") is not None:
        assert hp.is_hybrid_arch() == om["is_hybrid"]
    # the recorded per-layer widths and recurrent row sizes (what the artefacts' row sizes use)
    rec = case["model"]["hparams"]
    n = hp.n_layer
    assert [hp.n_embd_k_gqa(il) for il in range(n)] == rec["n_embd_k_gqa"]
    assert [hp.n_embd_v_gqa(il) for il in range(n)] == rec["n_embd_v_gqa"]
    assert [hp.is_swa(il) for il in range(n)] == rec["swa_layers"]
    assert [hp.is_recurrent(il) for il in range(n)] == rec["recurrent_layers"]
    assert (hp.n_embd_r(), hp.n_embd_s()) == (rec["n_embd_r"], rec["n_embd_s"])


@pytest.mark.parametrize("cid", CASES)
def test_memory_log_layer_counts(cid):
    """The caches llama.cpp created (kv / iSWA base + SWA / recurrent) hold the layers kvref assigns them."""
    case = load_case(cid)
    hp = HParams.from_gguf(ROOT / case["model"]["path"])
    caches = case["observed_context"]["memory_log"]["caches"]
    kind = case["memory"]["type"]
    n = hp.n_layer
    kv = [c for c in caches if "recurrent" not in c["module"]]
    rs = [c for c in caches if "recurrent" in c["module"]]
    trunk = range(hp.n_layer_trunk())
    if kind == "kv" and case["context"].get("ctx_type") == "mtp":  # a draft context: the NextN blocks alone
        assert [c["layers"] for c in kv] == [hp.n_layer_nextn]
    elif kind == "kv":
        assert [c["layers"] for c in kv] == [sum(hp.has_kv(il) for il in range(n))]
    elif kind == "dsa":  # the MLA cache over the trunk, then the indexer cache over its layers with an indexer
        # (deepseek32: every trunk layer has one, its types are never read)
        n_lid = len(trunk) if hp.arch == "deepseek32" else sum(hp.is_indexer_full(il) for il in trunk)
        assert [c["layers"] for c in kv] == [len(trunk), n_lid]
    elif kind == "dsa_iswa":  # MLA and indexer caches over the full trunk layers, then the SWA cache
        full = [il for il in trunk if not hp.is_swa(il)]
        swa = [il for il in trunk if hp.is_swa(il)]
        assert [c["layers"] for c in kv] == [len(full), sum(hp.is_indexer_full(il) for il in full), len(swa)]
    elif kind == "iswa":  # the non-SWA cache is created first
        assert [c["layers"] for c in kv] == [
            sum(not hp.is_swa(il) for il in range(n)),
            sum(hp.is_swa(il) for il in range(n)),
        ]
    elif kind == "hybrid":
        assert [c["layers"] for c in kv] == [sum(hp.attn_layer_filter(il) for il in range(n))]
    elif kind == "msa":  # llama_kv_cache_msa: the base cache (every layer), then the indexer cache (sparse layers)
        assert [c["layers"] for c in kv] == [n, sum(il >= hp.n_layer_dense_lead for il in range(n))]
    elif kind == "hybrid_iswa":  # the iSWA part of the attention layers: base (may be empty), then SWA
        attn = [il for il in range(n) if hp.attn_layer_filter(il)]
        assert [c["layers"] for c in kv] == [sum(not hp.is_swa(il) for il in attn), sum(hp.is_swa(il) for il in attn)]
    elif kind == "hybrid_idx":  # the attention cache, then (after the recurrent memory) the indexer cache
        attn = sum(hp.attn_layer_filter(il) for il in range(n))
        # glm5-next: the attention layers with their own indexer; qwen4exp: every dense-attention layer
        glm = hp.arch == "glm5-next"
        idx = sum(hp.attn_layer_filter(il) and (not glm or hp.is_indexer_full(il)) for il in range(n))
        assert [c["layers"] for c in kv] == [attn, idx]
        assert [c["n_embd_head_k_all"] for c in kv][1] == hp.indexer_head_size * (3 if hp.indexer_kpool else 1)
        assert [c["n_embd_head_v_all"] for c in kv][1] == 0  # the indexer cache keeps no V
    if kind in ("recurrent", "hybrid", "hybrid_iswa", "hybrid_idx"):
        # the recurrent memory reports every model layer (it keeps R/S only for the filtered ones)
        assert [c["layers"] for c in rs] == [n]
        assert hp.memory_kind() == kind
    else:
        assert rs == []


@pytest.mark.parametrize("cid", CASES)
def test_create_memory_sizes_from_gguf(cid):
    """create_memory on the from_gguf hyper-parameters builds llama.cpp's memory (kind, streams, sizes)."""
    case = load_case(cid)
    mem = C.create_memory_for(case, HParams.from_gguf(ROOT / case["model"]["path"]))
    C.check_memory_shape(case, mem)
