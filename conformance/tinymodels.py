"""Tiny random-weight GGUF models for the conformance goldens.

Each model is written with the ``gguf`` package from a fixed NumPy seed, so the same
gguf version writes the same bytes every time.  The weights are meaningless; what matters
is that llama.cpp loads the file and builds the memory module we want to record
(attention KV cache, recurrent cache, iSWA, hybrid, M-RoPE KV cache).

Every builder returns the hyper-parameters that decide the memory layout, in the form
recorded under ``model.hparams`` in case.json, so kvref can rebuild the same memory
without the model file.

The tensor lists mirror what llama.cpp's per-architecture ``load_arch_tensors`` asks for
(src/models/<arch>.cpp in the vendored tree); shapes below are written NumPy-style
(outermost first), i.e. reversed with respect to ggml's ``ne``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

# a small SentencePiece ("llama") vocabulary: <unk>, <s>, </s>, the newline byte token
# (so llama.cpp finds its linefeed token) and word pieces; every id is a valid token.
N_VOCAB = 128


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>", "<0x0A>"]
    types = [
        gguf.TokenType.UNKNOWN,
        gguf.TokenType.CONTROL,
        gguf.TokenType.CONTROL,
        gguf.TokenType.BYTE,
    ]
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < N_VOCAB:
        a, b = letters[i % 26], letters[(i // 26) % 26]
        tokens.append("\u2581" + a + b if i % 2 == 0 else b + a)
        types.append(gguf.TokenType.NORMAL)
        i += 1
    scores = [0.0, 0.0, 0.0, 0.0] + [-float(k) for k in range(N_VOCAB - 4)]
    return tokens, scores, [int(t) for t in types]


@dataclass
class TinyModel:
    name: str               # file stem, e.g. "llama-tiny"
    arch: str               # general.architecture
    hparams: dict           # what case.json records (see case.schema.json, $defs/hparams)
    path: Path | None = None
    sha256: str | None = None
    size: int = 0
    tensors: list = field(default_factory=list)
    committed: bool = False


class _Builder:
    """Collects metadata and tensors, then writes one GGUF file."""

    def __init__(self, arch: str, seed: int):
        self.arch = arch
        self.rng = np.random.default_rng(seed)
        self.tensors: list[tuple[str, np.ndarray]] = []

    def mat(self, name: str, *shape: int, scale: float = 0.05, dtype=np.float16):
        a = (self.rng.standard_normal(shape) * scale).astype(dtype)
        self.tensors.append((name, a))

    def vec(self, name: str, n: int, value: float | None = None, scale: float = 0.05):
        if value is None:
            a = (self.rng.standard_normal(n) * scale).astype(np.float32)
        else:
            a = np.full(n, value, dtype=np.float32)
        self.tensors.append((name, a))

    def raw(self, name: str, a: np.ndarray):
        self.tensors.append((name, a))

    def write(self, path: Path, meta) -> None:
        w = gguf.GGUFWriter(str(path), self.arch)
        w.add_name("kvref conformance tiny " + self.arch)
        meta(w)
        toks, scores, types = _spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_token_list(toks)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(False)
        for name, a in self.tensors:
            w.add_tensor(name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()


def _finish(m: TinyModel, path: Path, b: _Builder) -> TinyModel:
    data = path.read_bytes()
    m.path = path
    m.sha256 = hashlib.sha256(data).hexdigest()
    m.size = len(data)
    m.tensors = [n for n, _ in b.tensors]
    return m


def _attn_hparams(arch, n_layer, n_embd, n_head, n_head_kv, head_dim, n_ff, rope_type,
                  freq_base=10000.0, **extra) -> dict:
    n_head_kv_l = list(n_head_kv) if isinstance(n_head_kv, (list, tuple)) else [n_head_kv] * n_layer
    hp = {
        "arch": arch,
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_vocab": N_VOCAB,
        "n_ff": n_ff,
        "n_head": [n_head] * n_layer,
        "n_head_kv": n_head_kv_l,
        "n_embd_head_k": head_dim,
        "n_embd_head_v": head_dim,
        "n_embd_k_gqa": [head_dim * h for h in n_head_kv_l],
        "n_embd_v_gqa": [head_dim * h for h in n_head_kv_l],
        "n_rot": head_dim,
        "rope_type": rope_type,
        "rope_freq_base": freq_base,
        "rope_freq_scale": 1.0,
        "rope_sections": None,
        "n_pos_per_embd": 1,
        "causal_attn": True,
        "n_swa": 0,
        "swa_type": "none",
        "swa_layers": [False] * n_layer,
        "recurrent_layers": [False] * n_layer,
        "n_embd_r": 0,
        "n_embd_s": 0,
        "ssm": None,
        "n_ctx_train": 4096,
        "has_cell_ext": False,
    }
    hp.update(extra)
    return hp


# ---------------------------------------------------------------- llama (GQA)

def build_llama(out: Path) -> TinyModel:
    """2 layers, n_embd 64, 4 query heads of dim 32 over 2 KV heads (GQA 2:1)."""
    n_layer, n_embd, n_head, n_head_kv, hd, n_ff = 2, 64, 4, 2, 32, 64
    b = _Builder("llama", seed=1001)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        b.mat(p + "attn_q.weight", n_head * hd, n_embd)
        b.mat(p + "attn_k.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_v.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_output.weight", n_embd, n_head * hd)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(N_VOCAB)

    path = out / "llama-tiny.gguf"
    b.write(path, meta)
    hp = _attn_hparams("llama", n_layer, n_embd, n_head, n_head_kv, hd, n_ff, rope_type="norm")
    return _finish(TinyModel("llama-tiny", "llama", hp), path, b)


# ---------------------------------------------------------------- mamba (recurrent)

def build_mamba(out: Path) -> TinyModel:
    """2 Mamba-1 layers: n_embd 32, d_inner 64, d_state 8, d_conv 4, dt_rank 4."""
    n_layer, n_embd, d_inner, d_state, d_conv, dt_rank = 2, 32, 64, 8, 4, 4
    b = _Builder("mamba", seed=1002)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        _mamba1_layer(b, p, n_embd, d_inner, d_state, d_conv, dt_rank, jamba=False)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(dt_rank)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(N_VOCAB)

    path = out / "mamba-tiny.gguf"
    b.write(path, meta)
    hp = {
        "arch": "mamba",
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_vocab": N_VOCAB,
        "n_ff": 0,
        "n_head": [0] * n_layer,
        "n_head_kv": [0] * n_layer,
        "n_embd_head_k": 0,
        "n_embd_head_v": 0,
        "n_embd_k_gqa": [0] * n_layer,
        "n_embd_v_gqa": [0] * n_layer,
        "n_rot": 0,
        "rope_type": "none",
        "rope_freq_base": 10000.0,
        "rope_freq_scale": 1.0,
        "rope_sections": None,
        "n_pos_per_embd": 1,
        "causal_attn": True,
        "n_swa": 0,
        "swa_type": "none",
        "swa_layers": [False] * n_layer,
        "recurrent_layers": [True] * n_layer,
        # llama_hparams::n_embd_r(): (d_conv - 1) * (d_inner + 2*n_group*d_state), n_group = 0 for Mamba-1
        "n_embd_r": (d_conv - 1) * d_inner,
        # llama_hparams::n_embd_s(): d_state * d_inner
        "n_embd_s": d_state * d_inner,
        "ssm": {"d_conv": d_conv, "d_inner": d_inner, "d_state": d_state, "dt_rank": dt_rank,
                "n_group": 0},
        "n_ctx_train": 4096,
        "has_cell_ext": False,
    }
    return _finish(TinyModel("mamba-tiny", "mamba", hp), path, b)


def _mamba1_layer(b: _Builder, p, n_embd, d_inner, d_state, d_conv, dt_rank, jamba):
    b.vec(p + "attn_norm.weight", n_embd, 1.0)
    b.mat(p + "ssm_in.weight", 2 * d_inner, n_embd)
    b.mat(p + "ssm_conv1d.weight", d_inner, d_conv, scale=0.2, dtype=np.float32)
    b.vec(p + "ssm_conv1d.bias", d_inner)
    b.mat(p + "ssm_x.weight", dt_rank + 2 * d_state, d_inner)
    if jamba:
        b.vec(p + "ssm_dt_norm.weight", dt_rank, 1.0)
    b.mat(p + "ssm_dt.weight", d_inner, dt_rank, scale=0.2, dtype=np.float32)
    b.vec(p + "ssm_dt.bias", d_inner, scale=0.1)
    if jamba:
        b.vec(p + "ssm_b_norm.weight", d_state, 1.0)
        b.vec(p + "ssm_c_norm.weight", d_state, 1.0)
    # A = -exp(A_log) with A_log = log(1..d_state), as the HF converters store it
    a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
    b.raw(p + "ssm_a", a.astype(np.float32))
    b.vec(p + "ssm_d", d_inner, 1.0)
    b.mat(p + "ssm_out.weight", n_embd, d_inner)


# ---------------------------------------------------------------- gemma2 (iSWA)

def build_gemma2(out: Path, n_swa: int = 4) -> TinyModel:
    """2 layers, layer 0 sliding-window (n_swa tokens), layer 1 full attention."""
    n_layer, n_embd, n_head, n_head_kv, hd, n_ff = 2, 64, 4, 2, 32, 64
    b = _Builder("gemma2", seed=1003)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 0.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 0.0)
        b.mat(p + "attn_q.weight", n_head * hd, n_embd)
        b.mat(p + "attn_k.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_v.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_output.weight", n_embd, n_head * hd)
        b.vec(p + "post_attention_norm.weight", n_embd, 0.0)
        b.vec(p + "ffn_norm.weight", n_embd, 0.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)
        b.vec(p + "post_ffw_norm.weight", n_embd, 0.0)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_sliding_window(n_swa)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
        w.add_vocab_size(N_VOCAB)

    path = out / "gemma2-tiny.gguf"
    b.write(path, meta)
    # gemma2 uses set_swa_pattern(2): layer il is SWA when il % 2 < 1
    hp = _attn_hparams("gemma2", n_layer, n_embd, n_head, n_head_kv, hd, n_ff, rope_type="neox",
                       n_swa=n_swa, swa_type="standard",
                       swa_layers=[il % 2 < 1 for il in range(n_layer)],
                       swa_pattern=2)
    return _finish(TinyModel("gemma2-tiny", "gemma2", hp), path, b)


# ---------------------------------------------------------------- jamba (hybrid)

def build_jamba(out: Path) -> TinyModel:
    """3 layers: Mamba-1, attention (n_head 2 x dim 32, 1 KV head), Mamba-1; dense FFN."""
    n_layer, n_embd, n_head, hd, n_ff = 3, 64, 2, 32, 64
    n_head_kv = [0, 1, 0]
    d_inner, d_state, d_conv, dt_rank = 2 * n_embd, 8, 4, 4
    b = _Builder("jamba", seed=1004)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        if n_head_kv[i] == 0:
            _mamba1_layer(b, p, n_embd, d_inner, d_state, d_conv, dt_rank, jamba=True)
        else:
            b.vec(p + "attn_norm.weight", n_embd, 1.0)
            b.mat(p + "attn_q.weight", n_embd, n_embd)
            b.mat(p + "attn_k.weight", n_head_kv[i] * hd, n_embd)
            b.mat(p + "attn_v.weight", n_head_kv[i] * hd, n_embd)
            b.mat(p + "attn_output.weight", n_embd, n_embd)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(dt_rank)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_vocab_size(N_VOCAB)

    path = out / "jamba-tiny.gguf"
    b.write(path, meta)
    hp = _attn_hparams("jamba", n_layer, n_embd, n_head, n_head_kv, hd, n_ff, rope_type="none",
                       recurrent_layers=[h == 0 for h in n_head_kv],
                       n_embd_r=(d_conv - 1) * d_inner,
                       n_embd_s=d_state * d_inner,
                       ssm={"d_conv": d_conv, "d_inner": d_inner, "d_state": d_state,
                            "dt_rank": dt_rank, "n_group": 0})
    hp["n_rot"] = hd
    return _finish(TinyModel("jamba-tiny", "jamba", hp), path, b)


# ---------------------------------------------------------------- qwen2vl (M-RoPE)

def build_qwen2vl(out: Path) -> TinyModel:
    """2 layers, n_embd 64, 2 query heads of dim 32 over 1 KV head, M-RoPE sections [4,6,6,0]."""
    n_layer, n_embd, n_head, n_head_kv, hd, n_ff = 2, 64, 2, 1, 32, 64
    sections = [4, 6, 6, 0]
    b = _Builder("qwen2vl", seed=1005)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        b.mat(p + "attn_q.weight", n_embd, n_embd)
        b.vec(p + "attn_q.bias", n_embd)
        b.mat(p + "attn_k.weight", n_head_kv * hd, n_embd)
        b.vec(p + "attn_k.bias", n_head_kv * hd)
        b.mat(p + "attn_v.weight", n_head_kv * hd, n_embd)
        b.vec(p + "attn_v.bias", n_head_kv * hd)
        b.mat(p + "attn_output.weight", n_embd, n_embd)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(1000000.0)
        w.add_rope_dimension_sections(sections)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_vocab_size(N_VOCAB)

    path = out / "qwen2vl-tiny.gguf"
    b.write(path, meta)
    hp = _attn_hparams("qwen2vl", n_layer, n_embd, n_head, n_head_kv, hd, n_ff, rope_type="mrope",
                       freq_base=1000000.0, rope_sections=sections, n_pos_per_embd=4,
                       has_cell_ext=True)
    return _finish(TinyModel("qwen2vl-tiny", "qwen2vl", hp), path, b)


BUILDERS = {
    "llama": build_llama,
    "mamba": build_mamba,
    "gemma2": build_gemma2,
    "jamba": build_jamba,
    "qwen2vl": build_qwen2vl,
}


# ---------------------------------------------------------------- gemma3 (iSWA, dual rope base)

def build_gemma3(out: Path) -> TinyModel:
    """6 layers (gemma 3's default SWA pattern 6: layers 0-4 SWA, layer 5 full), n_embd 32,
    4 query heads of dim 16 (key_length != n_embd / n_head) over 1 KV head, window 4,
    rope base 1e6 for full layers and 1e4 for SWA layers."""
    n_layer, n_embd, n_head, n_head_kv, hd, n_ff, n_swa = 6, 32, 4, 1, 16, 32, 4
    b = _Builder("gemma3", seed=1006)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 0.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 0.0)
        b.mat(p + "attn_q.weight", n_head * hd, n_embd)
        b.mat(p + "attn_k.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_v.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_output.weight", n_embd, n_head * hd)
        b.vec(p + "post_attention_norm.weight", n_embd, 0.0)
        b.vec(p + "attn_k_norm.weight", hd, 0.0)
        b.vec(p + "attn_q_norm.weight", hd, 0.0)
        b.vec(p + "ffn_norm.weight", n_embd, 0.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)
        b.vec(p + "post_ffw_norm.weight", n_embd, 0.0)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_sliding_window(n_swa)
        w.add_rope_freq_base(1000000.0)
        w.add_rope_freq_base_swa(10000.0)
        w.add_vocab_size(N_VOCAB)

    path = out / "gemma3-tiny.gguf"
    b.write(path, meta)
    # load_swa_pattern(6) with no pattern key: layer il is SWA when il % 6 < 5
    hp = _attn_hparams("gemma3", n_layer, n_embd, n_head, n_head_kv, hd, n_ff, rope_type="neox",
                       freq_base=1000000.0, n_swa=n_swa, swa_type="standard",
                       swa_layers=[il % 6 < 5 for il in range(n_layer)], swa_pattern=6,
                       rope_freq_base_swa=10000.0)
    return _finish(TinyModel("gemma3-tiny", "gemma3", hp), path, b)


# ---------------------------------------------------------------- qwen3 (GQA 4:1, head dim != n_embd/n_head)

def build_qwen3(out: Path) -> TinyModel:
    """2 layers, n_embd 32, 4 query heads of dim 16 (not 32/4) over 1 KV head; q/k norms."""
    n_layer, n_embd, n_head, n_head_kv, hd, n_ff = 2, 32, 4, 1, 16, 32
    b = _Builder("qwen3", seed=1007)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        b.mat(p + "attn_q.weight", n_head * hd, n_embd)
        b.mat(p + "attn_k.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_v.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_output.weight", n_embd, n_head * hd)
        b.vec(p + "attn_k_norm.weight", hd, 1.0)
        b.vec(p + "attn_q_norm.weight", hd, 1.0)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_freq_base(1000000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_vocab_size(N_VOCAB)

    path = out / "qwen3-tiny.gguf"
    b.write(path, meta)
    hp = _attn_hparams("qwen3", n_layer, n_embd, n_head, n_head_kv, hd, n_ff, rope_type="neox",
                       freq_base=1000000.0)
    return _finish(TinyModel("qwen3-tiny", "qwen3", hp), path, b)


# ---------------------------------------------------------------- llama4 (chunked SWA)

def build_llama4(out: Path) -> TinyModel:
    """4 layers (pattern 4: layers 0-2 chunked attention, layer 3 full), 2 x 16 over 1 KV head;
    llama.cpp fixes the chunk at 8192 whatever the file says; dense FFNs (no MoE layer, but
    llama4 refuses n_expert 0)."""
    n_layer, n_embd, n_head, n_head_kv, hd, n_ff = 4, 32, 2, 1, 16, 32
    b = _Builder("llama4", seed=1008)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        b.mat(p + "attn_q.weight", n_head * hd, n_embd)
        b.mat(p + "attn_k.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_v.weight", n_head_kv * hd, n_embd)
        b.mat(p + "attn_output.weight", n_embd, n_head * hd)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(500000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_expert_count(2)
        w.add_expert_used_count(1)
        w.add_expert_feed_forward_length(n_ff)
        w.add_interleave_moe_layer_step(0)
        w.add_vocab_size(N_VOCAB)

    path = out / "llama4-tiny.gguf"
    b.write(path, meta)
    hp = _attn_hparams("llama4", n_layer, n_embd, n_head, n_head_kv, hd, n_ff, rope_type="norm",
                       freq_base=500000.0, n_swa=8192, swa_type="chunked",
                       swa_layers=[il % 4 < 3 for il in range(n_layer)], swa_pattern=4,
                       rope_freq_base_swa=500000.0)
    return _finish(TinyModel("llama4-tiny", "llama4", hp), path, b)


def _recurrent_hparams(arch, n_layer, n_embd, n_ff, recurrent_layers, n_embd_r, n_embd_s, **extra) -> dict:
    hp = _attn_hparams(arch, n_layer, n_embd, 0, 0, 0, n_ff, rope_type="none",
                       recurrent_layers=list(recurrent_layers), n_embd_r=n_embd_r, n_embd_s=n_embd_s)
    hp["n_rot"] = 0
    hp.update(extra)
    return hp


# ---------------------------------------------------------------- mamba2 (recurrent, n_group)

def build_mamba2(out: Path) -> TinyModel:
    """2 Mamba-2 layers: n_embd 32, d_inner 64, d_state 8, n_group 2, d_conv 4, 4 heads
    (dt_rank) of dim 16: n_embd_r = 3 * (64 + 2*2*8) = 288, n_embd_s = 512."""
    n_layer, n_embd, d_inner, d_state, n_group, d_conv, dt_rank = 2, 32, 64, 8, 2, 4, 4
    conv_dim = d_inner + 2 * n_group * d_state
    d_in_proj = d_inner + conv_dim + dt_rank
    b = _Builder("mamba2", seed=1009)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        b.mat(p + "ssm_in.weight", d_in_proj, n_embd)
        b.mat(p + "ssm_conv1d.weight", conv_dim, d_conv, scale=0.2, dtype=np.float32)
        b.vec(p + "ssm_conv1d.bias", conv_dim)
        b.vec(p + "ssm_dt.bias", dt_rank, scale=0.1)
        b.raw(p + "ssm_a", -np.arange(1, dt_rank + 1, dtype=np.float32).reshape(dt_rank, 1))
        b.raw(p + "ssm_d", np.ones((dt_rank, 1), dtype=np.float32))
        b.raw(p + "ssm_norm.weight", np.ones((n_group, d_inner // n_group), dtype=np.float32))
        b.mat(p + "ssm_out.weight", n_embd, d_inner)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(dt_rank)
        w.add_ssm_group_count(n_group)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(N_VOCAB)

    path = out / "mamba2-tiny.gguf"
    b.write(path, meta)
    hp = _recurrent_hparams("mamba2", n_layer, n_embd, 0, [True] * n_layer,
                            n_embd_r=(d_conv - 1) * conv_dim, n_embd_s=d_state * d_inner,
                            ssm={"d_conv": d_conv, "d_inner": d_inner, "d_state": d_state,
                                 "dt_rank": dt_rank, "n_group": n_group})
    return _finish(TinyModel("mamba2-tiny", "mamba2", hp), path, b)


# ---------------------------------------------------------------- rwkv6 (recurrent, token shift + wkv)

def build_rwkv6(out: Path) -> TinyModel:
    """2 RWKV-6 layers: n_embd 32, wkv head size 16 (2 heads), token_shift_count 2:
    n_embd_r = 2 * 32 = 64, n_embd_s = 32 * 16 = 512."""
    n_layer, n_embd, hs, n_ff, mix, decay = 2, 32, 16, 64, 4, 4
    f32 = np.float32
    b = _Builder("rwkv6", seed=1010)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("token_embd_norm.weight", n_embd, 1.0)
    b.vec("token_embd_norm.bias", n_embd, 0.0)
    b.vec("output_norm.weight", n_embd, 1.0)
    b.vec("output_norm.bias", n_embd, 0.0)
    b.mat("output.weight", N_VOCAB, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        for n in ("attn_norm", "attn_norm_2", "time_mix_ln"):
            b.vec(p + n + ".weight", n_embd, 1.0)
            b.vec(p + n + ".bias", n_embd, 0.0)
        b.mat(p + "time_mix_w1.weight", mix * 5, n_embd, dtype=f32)
        b.mat(p + "time_mix_w2.weight", 5, n_embd, mix, dtype=f32)
        b.mat(p + "time_mix_lerp_x.weight", 1, 1, n_embd, scale=0.5, dtype=f32)
        b.mat(p + "time_mix_lerp_fused.weight", 5, 1, 1, n_embd, scale=0.5, dtype=f32)
        b.mat(p + "time_mix_first.weight", n_embd // hs, hs, dtype=f32)
        b.vec(p + "time_mix_decay.weight", n_embd, -1.0)
        b.mat(p + "time_mix_decay_w1.weight", decay, n_embd, dtype=f32)
        b.mat(p + "time_mix_decay_w2.weight", n_embd, decay, dtype=f32)
        for n in ("key", "value", "receptance", "gate", "output"):
            b.mat(p + f"time_mix_{n}.weight", n_embd, n_embd)
        b.mat(p + "channel_mix_lerp_k.weight", 1, 1, n_embd, scale=0.5, dtype=f32)
        b.mat(p + "channel_mix_lerp_r.weight", 1, 1, n_embd, scale=0.5, dtype=f32)
        b.mat(p + "channel_mix_key.weight", n_ff, n_embd)
        b.mat(p + "channel_mix_value.weight", n_embd, n_ff)
        b.mat(p + "channel_mix_receptance.weight", n_embd, n_embd)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(0)
        w.add_layer_norm_eps(1e-5)
        w.add_wkv_head_size(hs)
        w.add_time_mix_extra_dim(mix)
        w.add_time_decay_extra_dim(decay)
        w.add_rescale_every_n_layers(6)
        w.add_vocab_size(N_VOCAB)

    path = out / "rwkv6-tiny.gguf"
    b.write(path, meta)
    hp = _recurrent_hparams("rwkv6", n_layer, n_embd, n_ff, [True] * n_layer,
                            n_embd_r=2 * n_embd, n_embd_s=n_embd * hs,
                            wkv_head_size=hs, token_shift_count=2)
    return _finish(TinyModel("rwkv6-tiny", "rwkv6", hp), path, b)


# ---------------------------------------------------------------- lfm2 (hybrid: short conv + attention)

def build_lfm2(out: Path, n_swa: int = 0) -> TinyModel:
    """4 layers: short conv, attention, short conv, attention (4 x 8 over 2 KV heads, rope neox);
    conv L_cache 3: n_embd_r = 32 * 2 = 64, n_embd_s = 0.  With ``n_swa`` every attention layer
    uses a sliding window (llama.cpp then builds llama_memory_hybrid_iswa, whose base cache
    has no layer)."""
    n_layer, n_embd, n_head, hd, n_ff, l_cache = 4, 32, 4, 8, 32, 3
    n_head_kv = [0, 2, 0, 2]
    b = _Builder("lfm2", seed=1011)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("token_embd_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        if n_head_kv[i]:
            b.vec(p + "attn_q_norm.weight", hd, 1.0)
            b.vec(p + "attn_k_norm.weight", hd, 1.0)
            b.mat(p + "attn_q.weight", n_embd, n_embd)
            b.mat(p + "attn_k.weight", n_head_kv[i] * hd, n_embd)
            b.mat(p + "attn_v.weight", n_head_kv[i] * hd, n_embd)
            b.mat(p + "attn_output.weight", n_embd, n_embd)
        else:
            b.mat(p + "shortconv.conv.weight", n_embd, l_cache, scale=0.2, dtype=np.float32)
            b.mat(p + "shortconv.in_proj.weight", 3 * n_embd, n_embd)
            b.mat(p + "shortconv.out_proj.weight", n_embd, n_embd)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_freq_base(1000000.0)
        w.add_shortconv_l_cache(l_cache)
        w.add_layer_norm_rms_eps(1e-5)
        if n_swa:
            w.add_sliding_window(n_swa)
        w.add_vocab_size(N_VOCAB)

    name = "lfm2-swa-tiny" if n_swa else "lfm2-tiny"
    path = out / f"{name}.gguf"
    b.write(path, meta)
    swa = dict(n_swa=n_swa, swa_type="standard", swa_layers=[h > 0 for h in n_head_kv]) if n_swa else {}
    hp = _attn_hparams("lfm2", n_layer, n_embd, n_head, n_head_kv, hd, n_ff, rope_type="neox",
                       freq_base=1000000.0, recurrent_layers=[h == 0 for h in n_head_kv],
                       n_embd_r=n_embd * (l_cache - 1), n_embd_s=0, n_shortconv_l_cache=l_cache, **swa)
    return _finish(TinyModel(name, "lfm2", hp), path, b)


def build_lfm2_swa(out: Path) -> TinyModel:
    return build_lfm2(out, n_swa=4)


BUILDERS.update({
    "gemma3": build_gemma3,
    "qwen3": build_qwen3,
    "llama4": build_llama4,
    "mamba2": build_mamba2,
    "rwkv6": build_rwkv6,
    "lfm2": build_lfm2,
    "lfm2-swa": build_lfm2_swa,
})
