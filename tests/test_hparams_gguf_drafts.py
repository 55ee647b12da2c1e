"""HParams.from_gguf for glm5-next, gemma4, gemma4-assistant and dflash (issue 23): the tiny models the goldens were
recorded with give the hyper-parameters the real llama.cpp logged in the golden's case.json, and create_memory builds
from them the memory llama.cpp built; a file without a key llama.cpp requires is refused, naming the key."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import gguf
import pytest
from golden import load_case, tiny_model

from kvref.hparams import HParams, HParamsError, RopeType, SWAType
from kvref.jobs.conformance import (
    _hp_facts,
    check_memory_shape,
    create_memory_for,
    hparams_from_case,
    leaf_parts,
    other_case,
)
from kvref.memory.factory import create_memory

# every golden of the four archs that builds a memory (glm5-next-mtp-refused: llama.cpp refuses the MTP context)
CASES = [
    "glm5-next-hybrid-idx",
    "glm5-next-hybrid-idx-rs-rollback",
    "fuzz-glm5-next-seed21",
    "fuzz-glm5-next-ms-seed2",
    "gemma4-assistant-ctx-other",
    "gemma4-assistant-ctx-other-fa-ms",
    "gemma4-non-causal-swa-only",
    "dflash-kv-injection",
    "fuzz-dflash-seed15",
]

# hparams the memories of these archs read beyond _hp_facts (the k-pool indexer, MLA, KDA, mHC, shared KV layers)
EXTRA = (
    "n_layer_nextn", "n_layer_kv_from_start", "n_embd_head_k_mla", "n_embd_head_v_mla", "n_lora_kv",
    "indexer_head_size", "indexer_top_k", "indexer_kpool", "indexer_kpool_select_tail", "indexer_full_layers",
    "n_embd_head_kda", "dsv4_hc_mult", "causal_attn", "n_embd_head_k_swa", "n_embd_head_v_swa",
    "rope_freq_base_swa", "ssm_d_conv",
)  # fmt: skip


def _from_gguf(case: dict[str, Any]) -> HParams:
    return HParams.from_gguf(tiny_model(case["model"]["file"].removesuffix(".gguf")))


def _facts(hp: HParams) -> dict[str, object]:
    facts = _hp_facts(hp)
    for name in EXTRA:
        value = getattr(hp, name)
        facts[name] = tuple(value) if isinstance(value, (list, tuple)) else value
    return facts


def _shape(mem: Any) -> list[tuple[object, ...]]:
    """Each cache of the memory: its class, cells and layers (layer id, K and V buffer shapes)."""
    leaves = leaf_parts(mem, 0) or list(getattr(mem, "parts", []))
    out = []
    for leaf in leaves:
        layers = [
            (x.il, x.k.shape, None if x.v is None else x.v.shape) if hasattr(x, "il") else x
            for x in getattr(leaf, "layers", [])
        ]
        out.append((type(leaf).__name__, leaf.get_size(), layers))
    return out


@pytest.mark.parametrize("case_id", CASES)
def test_from_gguf_matches_the_golden(case_id: str) -> None:
    case = load_case(case_id)
    hp, recorded = _from_gguf(case), hparams_from_case(case)
    assert hp.arch == case["model"]["hparams"]["arch"]
    assert _facts(hp) == _facts(recorded)
    if "other" in case:  # the draft's target (gemma4) read from its own tiny model
        oc = other_case(case)
        assert _facts(_from_gguf(oc)) == _facts(hparams_from_case(oc))
    # the memory built from the file is the one llama.cpp logged (kind, streams, v_trans, sizes) ...
    mem = create_memory_for(case, hp)
    check_memory_shape(case, mem)
    # ... its KV caches have the cells and layer counts llama.cpp's caches logged, in construction order ...
    logged = [(c["cells"], c["layers"]) for c in case["observed_context"].get("memory_log", {}).get("caches", [])
              if c["module"] == "llama_kv_cache"]  # fmt: skip
    kv = [(size, len(layers)) for name, size, layers in _shape(mem) if name in ("KVCache", "SharedKVCache")]
    if logged:
        assert kv == logged
    # ... and every cache is laid out as the one from the recorded hparams
    assert _shape(mem) == _shape(create_memory_for(case, recorded))


def test_glm5_next_mtp_context_is_refused_from_the_file() -> None:
    from kvref.errors import KVRefError

    case = load_case("glm5-next-mtp-refused")
    with pytest.raises(KVRefError, match="NextN graph not implemented"):
        create_memory_for(case, _from_gguf(case))


def test_what_each_arch_reads() -> None:
    glm = HParams.from_gguf(tiny_model("glm5-next-tiny"))
    # KDA layers are the ones without KV heads (the NextN block too); V is the compressed latent
    assert glm.recurrent_layers == (True, False, False) and glm.n_embd_head_v == glm.n_lora_kv == 32
    assert glm.indexer_full_layers == (True, True, True) and glm.memory_kind() == "hybrid_idx"
    assert glm.rope_type == RopeType.NONE
    g4 = HParams.from_gguf(tiny_model("gemma4-tiny"))
    assert g4.swa_layers == (True, True, True, False) and g4.n_layer_kv_from_start == 4 and g4.non_causal_type == 1
    ga = HParams.from_gguf(tiny_model("gemma4-assistant-tiny"))
    assert ga.swa_type == SWAType.STANDARD and ga.n_layer_kv_from_start == -1 and ga.non_causal_type == 0
    df = HParams.from_gguf(tiny_model("dflash-tiny"))
    assert df.rope_type == RopeType.NEOX and df.swa_type == SWAType.NONE and not df.causal_attn


# ------------------------------------------------------------------ files llama.cpp refuses


def _rewrite(tmp_path: Path, model: str, drop: str = "", **changes: object) -> Path:
    """The tiny model's metadata (no tensors: from_gguf reads none) without key ``drop`` and with ``changes``
    (arch-relative suffixes)."""
    reader = gguf.GGUFReader(tiny_model(model))
    arch = str(reader.fields["general.architecture"].contents())
    out = tmp_path / f"{model}.gguf"
    w = gguf.GGUFWriter(str(out), arch)
    values: dict[str, object] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key == f"{arch}.{drop}":
            continue
        values[key] = field.contents()
    types = {key: field.types for key, field in reader.fields.items()}
    for suffix, value in changes.items():
        values[f"{arch}.{suffix}"] = value
    for key, value in values.items():
        t = types.get(key)
        if isinstance(value, list):
            sub = t[1] if t and len(t) > 1 else None
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
        elif t:
            w.add_key_value(key, value, t[0])
        else:
            w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize(
    ("model", "key"),
    [
        ("glm5-next-tiny", "attention.indexer.kpool"),
        ("glm5-next-tiny", "kda.head_dim"),
        ("glm5-next-tiny", "attention.kv_lora_rank"),
        ("glm5-next-tiny", "hyper_connection.sinkhorn_iterations"),
        ("gemma4-assistant-tiny", "attention.sliding_window"),
        ("gemma4-assistant-tiny", "attention.key_length_swa"),
        ("gemma4-tiny", "embedding_length_per_layer_input"),
        ("dflash-tiny", "attention.layer_norm_rms_epsilon"),
    ],
)
def test_a_required_key_missing_is_refused(tmp_path: Path, model: str, key: str) -> None:
    arch = model.removesuffix("-tiny")
    assert HParams.from_gguf(_rewrite(tmp_path, model)).arch == arch  # the copy itself loads
    with pytest.raises(HParamsError, match=re.escape(f"key not found in model: {arch}.{key}")):
        HParams.from_gguf(_rewrite(tmp_path, model, drop=key))


@pytest.mark.parametrize("model", ["gemma4-tiny", "gemma4-assistant-tiny"])
def test_gemma4_requires_the_pattern_array(tmp_path: Path, model: str) -> None:
    arch = model.removesuffix("-tiny")
    with pytest.raises(HParamsError, match=re.escape(f"{arch}.attention.sliding_window_pattern")):
        HParams.from_gguf(_rewrite(tmp_path, model, drop="attention.sliding_window_pattern"))


def test_dflash_requires_target_layers(tmp_path: Path) -> None:
    with pytest.raises(HParamsError, match=r"requires 'target_layers'.*dflash.target_layers"):
        HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", drop="target_layers"))


def test_glm5_next_asserts(tmp_path: Path) -> None:
    # load_arch_hparams asserts kpool > 1 dividing top_k, and mHC with 4 connections
    with pytest.raises(HParamsError, match=re.escape("glm5-next.attention.indexer.kpool = 3")):
        HParams.from_gguf(_rewrite(tmp_path, "glm5-next-tiny", **{"attention.indexer.kpool": 3}))
    with pytest.raises(HParamsError, match=re.escape("glm5-next.hyper_connection.count = 2")):
        HParams.from_gguf(_rewrite(tmp_path, "glm5-next-tiny", **{"hyper_connection.count": 2}))
    # an explicit indexer-types array decides the trunk layers (the NextN block keeps llama.cpp's fill of 1)
    hp = HParams.from_gguf(_rewrite(tmp_path, "glm5-next-tiny", **{"attention.indexer.types": [0, 0]}))
    assert hp.indexer_full_layers == (False, False, True)


def test_gemma4_shared_kv_layers(tmp_path: Path) -> None:
    hp = HParams.from_gguf(_rewrite(tmp_path, "gemma4-tiny", **{"attention.shared_kv_layers": 2}))
    assert hp.n_layer_kv_from_start == 2 and [hp.has_kv(il) for il in range(4)] == [True, True, False, False]


def test_dflash_window_and_dspark(tmp_path: Path) -> None:
    # an optional window with its (then required) pattern; the SWA layers rotate with the main rope
    window = {"attention.sliding_window": 8, "attention.sliding_window_pattern": [True, False]}
    hp = HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", **window))
    assert (hp.swa_type, hp.n_swa, hp.swa_layers) == (SWAType.STANDARD, 8, (True, False))
    assert hp.rope_freq_base_swa == hp.rope_freq_base and hp.memory_kind() == "iswa"
    with pytest.raises(HParamsError, match=re.escape("dflash.attention.sliding_window_pattern")):
        HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", **{"attention.sliding_window": 8}))
    # M-RoPE sections make the draft M-RoPE
    hp = HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", **{"rope.dimension_sections": [8, 0, 0, 0]}))
    assert hp.rope_type == RopeType.MROPE
    with pytest.raises(HParamsError, match="unsupported DFlash hidden activation: relu"):
        HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", **{"hidden_activation": "relu"}))
    # a DSpark draft (hyper-connections): its DSV4 keys are required, every stage is windowed, normal RoPE
    dspark: dict[str, object] = {
        "hyper_connection.count": 4, "attention.q_lora_rank": 16, "attention.sliding_window": 8,
        "expert_feed_forward_length": 16, "expert_shared_count": 1, "expert_weights_scale": 1.0,
        "expert_weights_norm": True, "expert_gating_func": 4, "swiglu_clamp_exp": 0.0,
        "attention.output_group_count": 1, "attention.output_lora_rank": 8,
        "hyper_connection.sinkhorn_iterations": 2, "hyper_connection.epsilon": 1e-6,
    }  # fmt: skip
    hp = HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", **dspark))
    assert hp.dsv4_hc_mult == 4 and [hp.is_swa(il) for il in range(2)] == [True, True]
    assert hp.rope_type == RopeType.NORM and hp.rope_freq_base_swa == hp.rope_freq_base
    # create_memory's DSpark case: an iSWA cache over every stage
    mem = create_memory(hp, n_ctx=256, n_seq_max=1)
    assert type(mem).__name__ == "KVCacheISWA" and [len(c[2]) for c in _shape(mem)] == [0, 2]  # all windowed
    with pytest.raises(HParamsError, match=re.escape("key not found in model: dflash.attention.output_lora_rank")):
        HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", **{k: v for k, v in dspark.items()
                                                               if k != "attention.output_lora_rank"}))  # fmt: skip
    with pytest.raises(HParamsError, match="sqrtsoftplus"):
        HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", **{**dspark, "expert_gating_func": 2}))
    with pytest.raises(HParamsError, match="uncompressed attention"):
        HParams.from_gguf(_rewrite(tmp_path, "dflash-tiny", **{**dspark, "attention.compress_ratios": [0, 4]}))


@pytest.mark.parametrize(
    ("case_id", "artefact"),
    [("glm5-next-hybrid-idx", "02-state.bin"), ("dflash-kv-injection", "02-state.bin"),
     ("gemma4-non-causal-swa-only", "02-state.bin"), ("gemma4-assistant-ctx-other", "other-02-state.bin")],
)  # fmt: skip
def test_check_with_the_model(case_id: str, artefact: str) -> None:
    # kvref check --model: the golden's state loads into the context its case.json describes
    from golden import ROOT

    from kvref.jobs.check import check_file

    case = load_case(case_id)
    ctx = (other_case(case) if artefact.startswith("other-") else case)["context"]
    model = (other_case(case) if artefact.startswith("other-") else case)["model"]["file"].removesuffix(".gguf")
    got = check_file(ROOT / "golden" / case_id / artefact, tiny_model(model), n_ctx=ctx["n_ctx"],
                     n_seq_max=ctx["n_seq_max"], kv_unified=ctx["kv_unified"], flash_attn=ctx["flash_attn"],
                     type_k=ctx["type_k"], type_v=ctx["type_v"], swa_full=ctx.get("swa_full", False))  # fmt: skip
    assert got.ok, got.reason
