"""kvref.hparams against llama.cpp's src/llama-hparams.{h,cpp} and the GGUF loading of
src/llama-model.cpp (load_hparams) and src/models/<arch>.cpp (load_arch_hparams), October 2026.

The GGUF fixtures are written here with gguf.GGUFWriter (metadata only) under tmp_path; the keys are
spelled out as in llama-arch.cpp's LLM_KV names rather than through gguf-py's helpers.
"""

from __future__ import annotations

import gguf
import pytest

from kvref.errors import KVRefError
from kvref.hparams import (
    HParams,
    HParamsError,
    RopeType,
    SWAType,
    is_masked_swa,
    swa_pattern,
)

# ------------------------------------------------------------------------------ constructor


def test_defaults_follow_llama_cpp():
    hp = HParams(arch="llama", n_layer=3, n_embd=128, n_head=4)
    assert hp.n_head_kv_l(2) == 4  # n_head_kv defaults to n_head
    assert (hp.n_embd_head_k, hp.n_embd_head_v) == (32, 32)  # n_embd / n_head(0)
    assert hp.n_rot == 32 and hp.n_rot_l(1) == 32
    assert hp.n_embd_k_gqa(0) == hp.n_embd_v_gqa(2) == 128


def test_contract_example_and_gqa():
    hp = HParams(arch="llama", n_layer=3, n_embd=128, n_head=4, n_head_kv=2, n_embd_head_k=32, n_embd_head_v=32)
    assert [hp.n_embd_k_gqa(il) for il in range(3)] == [64, 64, 64]
    assert hp.n_gqa() == 2 and not hp.is_n_embd_k_gqa_variable()


def test_per_layer_heads_and_swa_head_sizes():
    hp = HParams(
        arch="gemma3", n_layer=4, n_embd=64, n_head=4, n_head_kv=[2, 1, 2, 0],
        n_embd_head_k=16, n_embd_head_v=8, n_embd_head_k_swa=32, n_rot_swa=8,
        swa_layers=[True, False, True, False], swa_type=SWAType.STANDARD, n_swa=16,
    )  # fmt: skip
    # n_embd_k_gqa(il) = n_embd_head_k(il) * n_head_kv(il), the head size SWA-dependent
    assert [hp.n_embd_k_gqa(il) for il in range(4)] == [64, 16, 64, 0]
    assert [hp.n_embd_v_gqa(il) for il in range(4)] == [16, 8, 16, 0]
    assert hp.is_n_embd_k_gqa_variable() and hp.n_embd_k_gqa_max() == 64 and hp.n_embd_v_gqa_max() == 16
    assert [hp.n_rot_l(il) for il in range(4)] == [8, 16, 8, 16]
    assert hp.n_gqa(3) == 0  # no KV heads: llama.cpp returns 0
    assert hp.n_head_kv == (2, 1, 2, 0)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"n_layer": 2, "n_head_kv": [1, 1, 1]}, "n_head_kv has 3 per-layer values, expected n_layer = 2"),
        ({"n_layer": 2, "swa_layers": [True]}, "swa_layers has 1"),
        ({"n_layer": 0}, "n_layer = 0"),
        ({"n_layer": 513}, "n_layer = 513"),
        ({"n_layer": 2, "swa_layers": [True, False]}, "swa_type is NONE"),
        ({"n_layer": 2, "swa_type": SWAType.CHUNKED}, "needs n_swa > 0"),
        ({"n_layer": 2, "n_layer_kv_from_start": 3}, "n_layer_kv_from_start = 3 > n_layer = 2"),
        ({"n_embd_head_k_mla": 192}, "both zero or both non-zero"),
        ({"n_layer": 2, "n_layer_nextn": 3}, "n_layer_nextn = 3"),
    ],
)
def test_invalid_values(kw, msg):
    with pytest.raises(HParamsError, match=msg):
        HParams(n_embd=64, n_head=4, **kw)
    assert issubclass(HParamsError, KVRefError) and issubclass(HParamsError, ValueError)


def test_layer_index_checked():
    hp = HParams(n_layer=2, n_embd=8, n_head=2)
    with pytest.raises(HParamsError, match="layer index 2"):
        hp.is_swa(2)


def test_is_masked_swa_rules():
    # STANDARD: masked when p1 - p0 >= n_swa
    assert not is_masked_swa(4, SWAType.STANDARD, 3, 6) and is_masked_swa(4, SWAType.STANDARD, 2, 6)
    # CHUNKED: masked when p0 < (p1 / n_swa) * n_swa
    assert is_masked_swa(4, SWAType.CHUNKED, 3, 4) and not is_masked_swa(4, SWAType.CHUNKED, 4, 7)
    assert not is_masked_swa(4, SWAType.CHUNKED, 0, 3)
    # SYMMETRIC: masked outside [-n_swa/2, n_swa/2]
    assert not is_masked_swa(5, SWAType.SYMMETRIC, 8, 6) and is_masked_swa(5, SWAType.SYMMETRIC, 9, 6)
    assert not is_masked_swa(5, SWAType.SYMMETRIC, 4, 6) and is_masked_swa(5, SWAType.SYMMETRIC, 3, 6)
    assert not is_masked_swa(1, SWAType.NONE, 0, 100)


def test_swa_pattern_examples_of_llama_hparams_h():
    assert swa_pattern(7, 3) == (True, True, False, True, True, False, True)
    assert swa_pattern(4, 2, dense_first=True) == (False, True, False, True)
    assert swa_pattern(3, 0) == (True, True, True)
    assert swa_pattern(3, 1) == (False, False, False)


def test_set_swa_pattern_keeps_mtp_blocks_dense():
    hp = HParams(n_layer=5, n_layer_nextn=1, n_embd=8, n_head=2, swa_type=SWAType.STANDARD, n_swa=4)
    hp.set_swa_pattern(2)
    assert hp.swa_layers == (True, False, True, False, False)
    hp.set_recr_pattern(0)
    assert hp.recurrent_layers == (True, True, True, True, False)


def test_n_pos_per_embd():
    assert HParams(rope_type=RopeType.MROPE).n_pos_per_embd() == 4
    assert HParams(rope_type=RopeType.IMROPE).n_pos_per_embd() == 4
    assert HParams(rope_type=RopeType.VISION).n_pos_per_embd() == 1  # not in llama.cpp's list
    assert HParams(rope_type=RopeType.NEOX).n_pos_per_embd() == 1


def test_has_kv_only_uses_n_layer_kv_from_start():
    hp = HParams(n_layer=4, n_embd=8, n_head=2, n_layer_kv_from_start=2, recurrent_layers=True)
    assert [hp.has_kv(il) for il in range(4)] == [True, True, False, False]
    assert all(HParams(n_layer=2, recurrent_layers=True).has_kv(il) for il in range(2))


def test_recurrent_sizes():
    # Mamba: r = (d_conv - 1) * (d_inner + 2*n_group*d_state), s = d_state * d_inner
    mamba = HParams(arch="mamba", n_embd=16, n_head=0, ssm_d_conv=4, ssm_d_inner=32, ssm_d_state=16)
    assert (mamba.n_embd_r(), mamba.n_embd_s()) == (96, 512)
    mamba2 = HParams(arch="mamba2", n_embd=16, n_head=0, ssm_d_conv=4, ssm_d_inner=32, ssm_d_state=16, ssm_n_group=2)
    assert (mamba2.n_embd_r(), mamba2.n_embd_s()) == (288, 512)
    # RWKV: r = token_shift_count * n_embd, s = n_embd * wkv_head_size
    rwkv = HParams(arch="rwkv6", n_embd=16, n_head=0, wkv_head_size=8)
    assert (rwkv.n_embd_r(), rwkv.n_embd_s()) == (32, 128)
    # LFM2 short conv: r = n_embd * (l_cache - 1)
    lfm2 = HParams(arch="lfm2", n_embd=16, n_head=4, n_shortconv_l_cache=3)
    assert (lfm2.n_embd_r(), lfm2.n_embd_s()) == (32, 0)
    # Kimi KDA: r = 3 * (d_conv - 1, or 3) * n_head * head_dim, s = head_dim^2 * n_head
    kda = HParams(arch="kimi-linear", n_embd=16, n_head=4, n_embd_head_kda=8)
    assert (kda.n_embd_r(), kda.n_embd_s()) == (288, 256)
    assert HParams(n_embd=16, n_head=4, n_embd_head_la=8).n_embd_s() == 256
    assert HParams(n_embd=16, n_head=4).n_embd_r() == 0


def test_memory_kind_and_hybrid_filters():
    assert HParams(arch="llama").memory_kind() == "kv"
    assert HParams(arch="gemma2", swa_layers=True, swa_type=1, n_swa=8).memory_kind() == "iswa"
    assert HParams(arch="mamba").memory_kind() == "recurrent"
    assert HParams(arch="jamba").memory_kind() == "hybrid"
    lfm2 = HParams(arch="lfm2", n_layer=2, swa_layers=[True, False], swa_type=1, n_swa=8)
    assert lfm2.memory_kind() == "hybrid_iswa"
    fh = HParams(arch="falcon-h1", n_layer=2, recurrent_layers=True)
    assert fh.attn_layer_filter(0) and fh.recr_layer_filter(1)
    nh = HParams(arch="nemotron_h", n_layer=3, recurrent_layers=[True, False, False], n_ff=[0, 0, 64])
    assert [nh.attn_layer_filter(il) for il in range(3)] == [False, True, False]
    assert [nh.recr_layer_filter(il) for il in range(3)] == [True, False, False]


def test_alibi_flag_from_bias():
    assert HParams(f_max_alibi_bias=8.0).use_alibi and not HParams().use_alibi


# --------------------------------------------------------------------------------- from_gguf


def write_gguf(path, arch, kv: dict) -> str:
    """Metadata-only GGUF; keys without a '.' prefix get '{arch}.'; ints are written as uint32."""
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in kv.items():
        key = k if k.startswith(("general.", "tokenizer.")) else f"{arch}.{k}"
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        else:
            w.add_array(key, list(v))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


BASE = {"context_length": 256, "embedding_length": 64, "block_count": 4, "attention.layer_norm_rms_epsilon": 1e-5}


def load(tmp_path, arch, **kv) -> HParams:
    return HParams.from_gguf(write_gguf(tmp_path / f"{arch}.gguf", arch, {**BASE, **kv}))


def test_llama(tmp_path):
    hp = load(tmp_path, "llama", **{"attention.head_count": 4, "attention.head_count_kv": 2, "rope.freq_base": 5e5})
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_ctx_train) == ("llama", 4, 64, 256)
    assert (hp.n_embd_head_k, hp.n_rot, hp.n_embd_k_gqa(3)) == (16, 16, 32)
    assert hp.rope_type == RopeType.NORM and hp.rope_freq_base == 5e5 and hp.rope_freq_scale == 1.0
    assert hp.swa_type == SWAType.NONE and not hp.is_swa_any() and hp.causal_attn
    assert hp.memory_kind() == "kv" and hp.n_pos_per_embd() == 1


def test_llama_rejects_partial_rope(tmp_path):
    with pytest.raises(HParamsError, match="invalid n_rot: 8, expected 16"):
        load(tmp_path, "llama", **{"attention.head_count": 4, "rope.dimension_count": 8})


def test_rope_scaling_and_head_count_kv_array(tmp_path):
    hp = load(tmp_path, "qwen2", **{"attention.head_count": 4, "attention.head_count_kv": [2, 2, 1, 1],
                                    "rope.scaling.factor": 4.0, "attention.key_length": 32,
                                    "attention.value_length": 24, "attention.causal": False})  # fmt: skip
    assert hp.n_head_kv == (2, 2, 1, 1) and hp.n_embd_k_gqa(2) == 32 and hp.n_embd_v_gqa(0) == 48
    assert hp.rope_freq_scale == 0.25 and hp.rope_type == RopeType.NEOX and not hp.causal_attn
    assert hp.n_rot == 32  # defaults to the key head size


def test_head_count_kv_array_wrong_length(tmp_path):
    with pytest.raises(HParamsError, match=r"qwen2.attention.head_count_kv has wrong array length; expected 4, got 3"):
        load(tmp_path, "qwen2", **{"attention.head_count": 4, "attention.head_count_kv": [2, 2, 1]})


def test_gemma2_defaults_and_overrides(tmp_path):
    hp = load(tmp_path, "gemma2", **{"attention.head_count": 4})
    # n_swa defaults to 4096, every 2nd layer dense, SWA rope base copied from the main one
    assert (hp.swa_type, hp.n_swa) == (SWAType.STANDARD, 4096)
    assert hp.swa_layers == (True, False, True, False)
    assert hp.rope_freq_base_swa == 10000.0 and hp.rope_type == RopeType.NEOX
    hp = load(tmp_path, "gemma2", **{"attention.head_count": 4, "attention.sliding_window": 64,
                                     "attention.sliding_window_pattern": 4, "rope.freq_base_swa": 1000.0})  # fmt: skip
    assert hp.n_swa == 64 and hp.swa_layers == (True, True, True, False) and hp.rope_freq_base_swa == 1000.0
    assert hp.memory_kind() == "iswa"


def test_gemma3_pattern_and_no_window(tmp_path):
    hp = load(tmp_path, "gemma3", **{"block_count": 7, "attention.head_count": 4, "attention.sliding_window": 32})
    assert hp.swa_layers == (True,) * 5 + (False, True)  # n_pattern 6
    pat = [True, False, False, True, False, False, True]
    hp = load(tmp_path, "gemma3", **{"block_count": 7, "attention.head_count": 4, "attention.sliding_window": 32,
                                     "attention.sliding_window_pattern": pat})  # fmt: skip
    assert hp.swa_layers == tuple(pat)
    hp = load(tmp_path, "gemma3", **{"attention.head_count": 4})
    assert hp.swa_type == SWAType.NONE and not hp.is_swa_any() and hp.memory_kind() == "kv"


LLAMA4 = {
    "attention.head_count": 4,
    "rope.freq_base": 5e5,
    "expert_count": 2,
    "expert_used_count": 1,
    "expert_feed_forward_length": 64,
    "interleave_moe_layer_step": 0,
}


def test_llama4_chunked_attention(tmp_path):
    # src/models/llama4.cpp load_arch_hparams: chunked attention with the chunk fixed at 8192 whatever the
    # window key says (only 0 turns it off), pattern 4 (3 chunked, 1 full), SWA rope base = the base
    hp = load(tmp_path, "llama4", **LLAMA4, **{"block_count": 5, "attention.sliding_window": 16})
    assert (hp.swa_type, hp.n_swa) == (SWAType.CHUNKED, 8192)
    assert hp.swa_layers == (True, True, True, False, True) and hp.rope_freq_base_swa == 5e5
    assert hp.memory_kind() == "iswa" and hp.rope_type == RopeType.NORM
    hp = load(tmp_path, "llama4", **LLAMA4, **{"rope.freq_base_swa": 1e4})
    assert hp.swa_type == SWAType.CHUNKED and hp.rope_freq_base_swa == 1e4
    hp = load(tmp_path, "llama4", **LLAMA4, **{"attention.sliding_window": 0})
    assert hp.swa_type == SWAType.NONE and hp.memory_kind() == "kv"


def test_llama4_refusals(tmp_path):
    # load_arch_tensors throws "model cannot have zero experts"; the MoE keys are required
    with pytest.raises(HParamsError, match="zero experts"):
        load(tmp_path, "llama4", **{**LLAMA4, "expert_count": 0})
    kv = {k: v for k, v in LLAMA4.items() if k != "interleave_moe_layer_step"}
    with pytest.raises(HParamsError, match=r"key not found in model: llama4.interleave_moe_layer_step"):
        load(tmp_path, "llama4", **kv)


SSM = {"ssm.conv_kernel": 4, "ssm.inner_size": 128, "ssm.state_size": 16, "ssm.time_step_rank": 4}


def test_mamba(tmp_path):
    hp = load(tmp_path, "mamba", **SSM)
    assert hp.n_head == 0 and hp.n_embd_head_k == 0 and hp.n_rot == 0
    assert (
        all(hp.is_recurrent(il) for il in range(4))
        and hp.memory_kind() == "recurrent"
        and hp.rope_type == RopeType.NONE
    )
    assert (hp.n_embd_r(), hp.n_embd_s()) == (3 * 128, 16 * 128)


def test_mamba2_requires_group_count(tmp_path):
    with pytest.raises(HParamsError, match=r"key not found in model: mamba2.ssm.group_count"):
        load(tmp_path, "mamba2", **SSM)
    hp = load(tmp_path, "mamba2", **SSM, **{"ssm.group_count": 2})
    assert hp.n_embd_r() == 3 * (128 + 2 * 2 * 16)


def test_granitehybrid_recurrent_where_no_kv_heads(tmp_path):
    hp = load(tmp_path, "granitehybrid", **SSM, **{"ssm.group_count": 1, "attention.head_count": 4,
                                                   "attention.head_count_kv": [0, 2, 0, 0]})  # fmt: skip
    assert hp.recurrent_layers == (True, False, True, True)
    assert [hp.attn_layer_filter(il) for il in range(4)] == [False, True, False, False]
    assert hp.memory_kind() == "hybrid" and hp.rope_type == RopeType.NORM and all(hp.has_rope(il) for il in range(4))
    assert hp.n_embd_k_gqa(1) == 32 and hp.n_embd_k_gqa(0) == 0


def test_jamba(tmp_path):
    hp = load(tmp_path, "jamba", **SSM, **{"attention.head_count": 4, "attention.head_count_kv": [0, 0, 0, 2]})
    assert hp.recurrent_layers == (True, True, True, False) and hp.rope_type == RopeType.NONE
    assert hp.n_embd_r() == 3 * 128  # no group count for jamba: n_group = 0


def test_falcon_h1_every_layer_both(tmp_path):
    hp = load(tmp_path, "falcon-h1", **SSM, **{"ssm.group_count": 1, "attention.head_count": 4})
    assert all(hp.is_recurrent(il) and hp.attn_layer_filter(il) for il in range(4))
    assert hp.rope_type == RopeType.NEOX


def test_nemotron_h(tmp_path):
    kv = {**SSM, "ssm.group_count": 1, "attention.head_count": 4, "attention.head_count_kv": [0, 2, 0, 0],
          "feed_forward_length": [0, 0, 256, 0], "attention.layer_norm_epsilon": 1e-5}  # fmt: skip
    hp = load(tmp_path, "nemotron_h", **kv)
    # recurrent: no KV heads and no FFN (layer 2 is an MLP block)
    assert hp.recurrent_layers == (True, False, False, True)
    assert [hp.attn_layer_filter(il) for il in range(4)] == [False, True, False, False]
    assert [hp.recr_layer_filter(il) for il in range(4)] == [True, False, False, True]


def test_lfm2_swa_on_attention_layers(tmp_path):
    kv = {"attention.head_count": 4, "attention.head_count_kv": [0, 2, 0, 2], "shortconv.l_cache": 3}
    hp = load(tmp_path, "lfm2", **kv)
    assert hp.recurrent_layers == (True, False, True, False) and hp.swa_type == SWAType.NONE
    assert hp.n_embd_r() == 64 * 2
    hp = load(tmp_path, "lfm2", **kv, **{"attention.sliding_window": 16})
    assert hp.swa_layers == (False, True, False, True) and hp.memory_kind() == "hybrid_iswa"


def test_qwen2vl_mrope(tmp_path):
    hp = load(tmp_path, "qwen2vl", **{"attention.head_count": 4, "rope.dimension_sections": [2, 3, 3, 0]})
    assert hp.rope_type == RopeType.MROPE and hp.n_pos_per_embd() == 4
    assert hp.rope_sections == (2, 3, 3, 0) and hp.use_mrope()
    with pytest.raises(HParamsError, match=r"key not found in model: qwen2vl.rope.dimension_sections"):
        load(tmp_path, "qwen2vl", **{"attention.head_count": 4})


def test_rwkv6(tmp_path):
    hp = load(tmp_path, "rwkv6", **{"wkv.head_size": 8, "token_shift_count": 2})
    assert (hp.n_embd_r(), hp.n_embd_s()) == (2 * 64, 64 * 8) and hp.memory_kind() == "recurrent"


def test_alibi_archs(tmp_path):
    assert load(tmp_path, "bloom", **{"attention.head_count": 4}).use_alibi
    hp = load(tmp_path, "mpt", **{"attention.head_count": 4, "attention.max_alibi_bias": 8.0})
    assert hp.use_alibi and hp.f_max_alibi_bias == 8.0 and hp.rope_type == RopeType.NONE
    assert not load(tmp_path, "mpt", **{"attention.head_count": 4}).use_alibi


def test_missing_required_keys(tmp_path):
    for missing in ("block_count", "context_length", "embedding_length", "attention.layer_norm_rms_epsilon"):
        kv = {k: v for k, v in BASE.items() if k != missing}
        path = write_gguf(tmp_path / "m.gguf", "llama", {**kv, "attention.head_count": 4})
        with pytest.raises(HParamsError, match=f"key not found in model: llama.{missing}"):
            HParams.from_gguf(path)


def test_unknown_or_unsupported_arch(tmp_path):
    with pytest.raises(HParamsError, match=r"'nosucharch' .* unknown to llama.cpp"):
        load(tmp_path, "nosucharch")
    with pytest.raises(HParamsError, match=r"'cohere2' .* not supported"):
        load(tmp_path, "cohere2", **{"attention.head_count": 4})
    with pytest.raises(HParamsError, match=r"general.architecture"):
        load(tmp_path, "")


def test_scalar_key_given_as_array(tmp_path):
    with pytest.raises(HParamsError, match=r"llama.block_count has wrong type array"):
        load(tmp_path, "llama", **{"block_count": [4], "attention.head_count": 4})


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(HParamsError, match="cannot read GGUF"):
        HParams.from_gguf(p)


def test_a_broken_gguf_import_shows_its_real_cause(monkeypatch):
    """gguf is a dependency; when importing it fails, the error says why (not just "needs gguf")."""
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` now raises ImportError
    cause = r"cannot import the 'gguf' package: ModuleNotFoundError: import of gguf halted.*gguf>=0.16"
    with pytest.raises(HParamsError, match=cause):
        HParams.from_gguf("conformance/models/llama-tiny.gguf")
