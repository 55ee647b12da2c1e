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
    name: str  # file stem, e.g. "llama-tiny"
    arch: str  # general.architecture
    hparams: dict  # what case.json records (see case.schema.json, $defs/hparams)
    path: Path | None = None
    sha256: str | None = None
    size: int = 0
    tensors: list = field(default_factory=list)
    committed: bool = False


@dataclass(frozen=True)
class _Dims:
    """The sizes a builder's tensor lists, metadata and hparams derive from (0: not used)."""

    n_layer: int
    n_embd: int
    n_head: int = 0
    n_head_kv: int | list[int] = 0  # a list: one count a layer, 0 for a recurrent layer
    hd: int = 0  # head dim: key and value length
    n_ff: int = 0


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
        w.add_vocab_size(N_VOCAB)
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

    def finish(self, out: Path, name: str, meta, hp: dict) -> TinyModel:
        """Write ``out/<name>.gguf`` (``meta(w)`` adds the arch keys; the vocabulary size and
        the tokenizer follow) and return its TinyModel."""
        path = out / f"{name}.gguf"
        self.write(path, meta)
        data = path.read_bytes()
        m = TinyModel(name, self.arch, hp)
        m.path = path
        m.sha256 = hashlib.sha256(data).hexdigest()
        m.size = len(data)
        m.tensors = [n for n, _ in self.tensors]
        return m


# ---------------------------------------------------------------- shared tensor lists and metadata


def _attn_proj(b: _Builder, p, d: _Dims, n_head_kv: int, bias=False):
    """attn_q, attn_k, attn_v (each followed by its bias when ``bias``) and attn_output."""
    b.mat(p + "attn_q.weight", d.n_head * d.hd, d.n_embd)
    if bias:
        b.vec(p + "attn_q.bias", d.n_head * d.hd)
    for n in ("k", "v"):
        b.mat(p + f"attn_{n}.weight", n_head_kv * d.hd, d.n_embd)
        if bias:
            b.vec(p + f"attn_{n}.bias", n_head_kv * d.hd)
    b.mat(p + "attn_output.weight", d.n_embd, d.n_head * d.hd)


def _ffn(b: _Builder, p, d: _Dims, norm=1.0):
    """ffn_norm (filled with ``norm``), then the gated FFN: ffn_gate, ffn_up, ffn_down."""
    b.vec(p + "ffn_norm.weight", d.n_embd, norm)
    b.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
    b.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
    b.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)


def _transformer(b: _Builder, d: _Dims, norm=1.0, post_norms=False, qk_norms=False):
    """token_embd, output_norm, then ``d.n_layer`` attention layers of attn_norm,
    attn_q/k/v/output, [post_attention_norm], [attn_k_norm, attn_q_norm], ffn_norm,
    ffn_gate/up/down, [post_ffw_norm].  Every norm weight is filled with ``norm`` (gemma stores
    its norm weights as offsets from 1, hence 0.0)."""
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.vec("output_norm.weight", d.n_embd, norm)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", d.n_embd, norm)
        _attn_proj(b, p, d, d.n_head_kv)
        if post_norms:
            b.vec(p + "post_attention_norm.weight", d.n_embd, norm)
        if qk_norms:
            b.vec(p + "attn_k_norm.weight", d.hd, norm)
            b.vec(p + "attn_q_norm.weight", d.hd, norm)
        _ffn(b, p, d, norm)
        if post_norms:
            b.vec(p + "post_ffw_norm.weight", d.n_embd, norm)


def _common_meta(w, d: _Dims, key_length=True):
    """The keys every tiny model starts with: context length, embedding length, block count,
    FFN length and head count; with attention (``d.n_head``) the KV head count, then the
    key/value length unless ``key_length`` is False."""
    w.add_context_length(4096)
    w.add_embedding_length(d.n_embd)
    w.add_block_count(d.n_layer)
    w.add_feed_forward_length(d.n_ff)
    w.add_head_count(d.n_head)
    if d.n_head:
        w.add_head_count_kv(d.n_head_kv)
        if key_length:
            w.add_key_length(d.hd)
            w.add_value_length(d.hd)


def _ssm_meta(w, d_conv, d_inner, d_state, dt_rank):
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)


def _attn_hparams(arch, d: _Dims, rope_type, freq_base=10000.0, **extra) -> dict:
    n_layer, head_dim = d.n_layer, d.hd
    n_head_kv_l = list(d.n_head_kv) if isinstance(d.n_head_kv, (list, tuple)) else [d.n_head_kv] * n_layer
    hp = {
        "arch": arch,
        "n_layer": n_layer,
        "n_embd": d.n_embd,
        "n_vocab": N_VOCAB,
        "n_ff": d.n_ff,
        "n_head": [d.n_head] * n_layer,
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


def _recurrent_hparams(arch, d: _Dims, n_embd_r, n_embd_s, **extra) -> dict:
    """hparams of a model whose every layer is recurrent (no attention)."""
    hp = _attn_hparams(
        arch, d, rope_type="none", recurrent_layers=[True] * d.n_layer, n_embd_r=n_embd_r, n_embd_s=n_embd_s
    )
    hp["n_rot"] = 0
    hp.update(extra)
    return hp


def _swa_hparams(d: _Dims, n_swa, swa_type, pattern) -> dict:
    """llama.cpp's set_swa_pattern(pattern): layer il uses the window when il % pattern < pattern - 1."""
    swa_layers = [il % pattern < pattern - 1 for il in range(d.n_layer)]
    return dict(n_swa=n_swa, swa_type=swa_type, swa_layers=swa_layers, swa_pattern=pattern)


# ---------------------------------------------------------------- llama (GQA)


def build_llama(out: Path) -> TinyModel:
    """2 layers, n_embd 64, 4 query heads of dim 32 over 2 KV heads (GQA 2:1)."""
    return _llama(out, "llama-tiny", _Dims(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, hd=32, n_ff=64), 1001)


def _llama(out: Path, name: str, d: _Dims, seed: int) -> TinyModel:
    """A llama of shape ``d``: rope norm over the whole head, base 1e4."""
    b = _Builder("llama", seed=seed)
    _transformer(b, d)

    def meta(w):
        _common_meta(w, d)
        w.add_rope_dimension_count(d.hd)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)

    return b.finish(out, name, meta, _attn_hparams("llama", d, rope_type="norm"))


# ---------------------------------------------------------------- mamba (recurrent)


def build_mamba(out: Path) -> TinyModel:
    """2 Mamba-1 layers: n_embd 32, d_inner 64, d_state 8, d_conv 4, dt_rank 4."""
    d = _Dims(n_layer=2, n_embd=32)
    d_inner, d_state, d_conv, dt_rank = 64, 8, 4, 4
    b = _Builder("mamba", seed=1002)
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.vec("output_norm.weight", d.n_embd, 1.0)
    for i in range(d.n_layer):
        _mamba1_layer(b, f"blk.{i}.", d.n_embd, d_inner, d_state, d_conv, dt_rank, jamba=False)

    def meta(w):
        _common_meta(w, d)
        _ssm_meta(w, d_conv, d_inner, d_state, dt_rank)
        w.add_layer_norm_rms_eps(1e-5)

    hp = _recurrent_hparams(
        "mamba",
        d,
        # llama_hparams::n_embd_r(): (d_conv - 1) * (d_inner + 2*n_group*d_state), n_group = 0 for Mamba-1
        n_embd_r=(d_conv - 1) * d_inner,
        # llama_hparams::n_embd_s(): d_state * d_inner
        n_embd_s=d_state * d_inner,
        ssm={"d_conv": d_conv, "d_inner": d_inner, "d_state": d_state, "dt_rank": dt_rank, "n_group": 0},
    )
    return b.finish(out, "mamba-tiny", meta, hp)


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
    d = _Dims(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, hd=32, n_ff=64)
    b = _Builder("gemma2", seed=1003)
    _transformer(b, d, norm=0.0, post_norms=True)

    def meta(w):
        _common_meta(w, d)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_sliding_window(n_swa)
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)

    # gemma2 uses set_swa_pattern(2): layer il is SWA when il % 2 < 1
    hp = _attn_hparams("gemma2", d, rope_type="neox", **_swa_hparams(d, n_swa, "standard", pattern=2))
    return b.finish(out, "gemma2-tiny", meta, hp)


# ---------------------------------------------------------------- jamba (hybrid)


def build_jamba(out: Path) -> TinyModel:
    """3 layers: Mamba-1, attention (n_head 2 x dim 32, 1 KV head), Mamba-1; dense FFN."""
    d = _Dims(n_layer=3, n_embd=64, n_head=2, n_head_kv=[0, 1, 0], hd=32, n_ff=64)
    d_inner, d_state, d_conv, dt_rank = 2 * d.n_embd, 8, 4, 4
    b = _Builder("jamba", seed=1004)
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.vec("output_norm.weight", d.n_embd, 1.0)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        if d.n_head_kv[i] == 0:
            _mamba1_layer(b, p, d.n_embd, d_inner, d_state, d_conv, dt_rank, jamba=True)
        else:
            b.vec(p + "attn_norm.weight", d.n_embd, 1.0)
            _attn_proj(b, p, d, d.n_head_kv[i])
        _ffn(b, p, d)

    def meta(w):
        _common_meta(w, d, key_length=False)
        _ssm_meta(w, d_conv, d_inner, d_state, dt_rank)
        w.add_layer_norm_rms_eps(1e-6)

    hp = _attn_hparams(
        "jamba",
        d,
        rope_type="none",
        recurrent_layers=[h == 0 for h in d.n_head_kv],
        n_embd_r=(d_conv - 1) * d_inner,
        n_embd_s=d_state * d_inner,
        ssm={"d_conv": d_conv, "d_inner": d_inner, "d_state": d_state, "dt_rank": dt_rank, "n_group": 0},
    )
    hp["n_rot"] = d.hd
    return b.finish(out, "jamba-tiny", meta, hp)


# ---------------------------------------------------------------- qwen2vl (M-RoPE)


def build_qwen2vl(out: Path) -> TinyModel:
    """2 layers, n_embd 64, 2 query heads of dim 32 over 1 KV head, M-RoPE sections [4,6,6,0]."""
    d = _Dims(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, hd=32, n_ff=64)
    sections = [4, 6, 6, 0]
    b = _Builder("qwen2vl", seed=1005)
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.vec("output_norm.weight", d.n_embd, 1.0)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", d.n_embd, 1.0)
        _attn_proj(b, p, d, d.n_head_kv, bias=True)
        _ffn(b, p, d)

    def meta(w):
        _common_meta(w, d, key_length=False)
        w.add_rope_freq_base(1000000.0)
        w.add_rope_dimension_sections(sections)
        w.add_layer_norm_rms_eps(1e-6)

    hp = _attn_hparams(
        "qwen2vl",
        d,
        rope_type="mrope",
        freq_base=1000000.0,
        rope_sections=sections,
        n_pos_per_embd=4,
        has_cell_ext=True,
    )
    return b.finish(out, "qwen2vl-tiny", meta, hp)


# ---------------------------------------------------------------- gemma3 (iSWA, dual rope base)


def build_gemma3(out: Path) -> TinyModel:
    """6 layers (gemma 3's default SWA pattern 6: layers 0-4 SWA, layer 5 full), n_embd 32,
    4 query heads of dim 16 (key_length != n_embd / n_head) over 1 KV head, window 4,
    rope base 1e6 for full layers and 1e4 for SWA layers."""
    d = _Dims(n_layer=6, n_embd=32, n_head=4, n_head_kv=1, hd=16, n_ff=32)
    n_swa = 4
    b = _Builder("gemma3", seed=1006)
    _transformer(b, d, norm=0.0, post_norms=True, qk_norms=True)

    def meta(w):
        _common_meta(w, d)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_sliding_window(n_swa)
        w.add_rope_freq_base(1000000.0)
        w.add_rope_freq_base_swa(10000.0)

    # load_swa_pattern(6) with no pattern key: layer il is SWA when il % 6 < 5
    swa = _swa_hparams(d, n_swa, "standard", pattern=6)
    hp = _attn_hparams("gemma3", d, rope_type="neox", freq_base=1000000.0, **swa, rope_freq_base_swa=10000.0)
    return b.finish(out, "gemma3-tiny", meta, hp)


# ---------------------------------------------------------------- qwen3 (GQA 4:1, head dim != n_embd/n_head)


def build_qwen3(out: Path) -> TinyModel:
    """2 layers, n_embd 32, 4 query heads of dim 16 (not 32/4) over 1 KV head; q/k norms."""
    d = _Dims(n_layer=2, n_embd=32, n_head=4, n_head_kv=1, hd=16, n_ff=32)
    b = _Builder("qwen3", seed=1007)
    _transformer(b, d, qk_norms=True)

    def meta(w):
        _common_meta(w, d)
        w.add_rope_freq_base(1000000.0)
        w.add_layer_norm_rms_eps(1e-6)

    return b.finish(out, "qwen3-tiny", meta, _attn_hparams("qwen3", d, rope_type="neox", freq_base=1000000.0))


# ---------------------------------------------------------------- llama4 (chunked SWA)


def build_llama4(out: Path) -> TinyModel:
    """4 layers (pattern 4: layers 0-2 chunked attention, layer 3 full), 2 x 16 over 1 KV head;
    llama.cpp fixes the chunk at 8192 whatever the file says; dense FFNs (no MoE layer, but
    llama4 refuses n_expert 0)."""
    d = _Dims(n_layer=4, n_embd=32, n_head=2, n_head_kv=1, hd=16, n_ff=32)
    b = _Builder("llama4", seed=1008)
    _transformer(b, d)

    def meta(w):
        _common_meta(w, d)
        w.add_rope_dimension_count(d.hd)
        w.add_rope_freq_base(500000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_expert_count(2)
        w.add_expert_used_count(1)
        w.add_expert_feed_forward_length(d.n_ff)
        w.add_interleave_moe_layer_step(0)

    swa = _swa_hparams(d, 8192, "chunked", pattern=4)
    hp = _attn_hparams("llama4", d, rope_type="norm", freq_base=500000.0, **swa, rope_freq_base_swa=500000.0)
    return b.finish(out, "llama4-tiny", meta, hp)


# ---------------------------------------------------------------- mamba2 (recurrent, n_group)


def build_mamba2(out: Path) -> TinyModel:
    """2 Mamba-2 layers: n_embd 32, d_inner 64, d_state 8, n_group 2, d_conv 4, 4 heads
    (dt_rank) of dim 16: n_embd_r = 3 * (64 + 2*2*8) = 288, n_embd_s = 512."""
    d = _Dims(n_layer=2, n_embd=32)
    n_embd, d_inner, d_state, n_group, d_conv, dt_rank = d.n_embd, 64, 8, 2, 4, 4
    conv_dim = d_inner + 2 * n_group * d_state
    d_in_proj = d_inner + conv_dim + dt_rank
    b = _Builder("mamba2", seed=1009)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(d.n_layer):
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
        _common_meta(w, d)
        _ssm_meta(w, d_conv, d_inner, d_state, dt_rank)
        w.add_ssm_group_count(n_group)
        w.add_layer_norm_rms_eps(1e-5)

    hp = _recurrent_hparams(
        "mamba2",
        d,
        n_embd_r=(d_conv - 1) * conv_dim,
        n_embd_s=d_state * d_inner,
        ssm={"d_conv": d_conv, "d_inner": d_inner, "d_state": d_state, "dt_rank": dt_rank, "n_group": n_group},
    )
    return b.finish(out, "mamba2-tiny", meta, hp)


# ---------------------------------------------------------------- rwkv6 (recurrent, token shift + wkv)


def build_rwkv6(out: Path) -> TinyModel:
    """2 RWKV-6 layers: n_embd 32, wkv head size 16 (2 heads), token_shift_count 2:
    n_embd_r = 2 * 32 = 64, n_embd_s = 32 * 16 = 512."""
    d = _Dims(n_layer=2, n_embd=32, n_ff=64)
    n_embd, hs, n_ff, mix, decay = d.n_embd, 16, d.n_ff, 4, 4
    f32 = np.float32
    b = _Builder("rwkv6", seed=1010)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("token_embd_norm.weight", n_embd, 1.0)
    b.vec("token_embd_norm.bias", n_embd, 0.0)
    b.vec("output_norm.weight", n_embd, 1.0)
    b.vec("output_norm.bias", n_embd, 0.0)
    b.mat("output.weight", N_VOCAB, n_embd)
    for i in range(d.n_layer):
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
        _common_meta(w, d)
        w.add_layer_norm_eps(1e-5)
        w.add_wkv_head_size(hs)
        w.add_time_mix_extra_dim(mix)
        w.add_time_decay_extra_dim(decay)
        w.add_rescale_every_n_layers(6)

    hp = _recurrent_hparams(
        "rwkv6", d, n_embd_r=2 * n_embd, n_embd_s=n_embd * hs, wkv_head_size=hs, token_shift_count=2
    )
    return b.finish(out, "rwkv6-tiny", meta, hp)


# ---------------------------------------------------------------- lfm2 (hybrid: short conv + attention)


def build_lfm2(out: Path, n_swa: int = 0) -> TinyModel:
    """4 layers: short conv, attention, short conv, attention (4 x 8 over 2 KV heads, rope neox);
    conv L_cache 3: n_embd_r = 32 * 2 = 64, n_embd_s = 0.  With ``n_swa`` every attention layer
    uses a sliding window (llama.cpp then builds llama_memory_hybrid_iswa, whose base cache
    has no layer)."""
    d = _Dims(n_layer=4, n_embd=32, n_head=4, n_head_kv=[0, 2, 0, 2], hd=8, n_ff=32)
    n_embd, n_ff, hd, l_cache = d.n_embd, d.n_ff, d.hd, 3
    b = _Builder("lfm2", seed=1011)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("token_embd_norm.weight", n_embd, 1.0)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        # lfm2's order differs from _transformer's: ffn first, ffn_down before ffn_up, the q/k
        # norms (q first) before the projections
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        if d.n_head_kv[i]:
            b.vec(p + "attn_q_norm.weight", hd, 1.0)
            b.vec(p + "attn_k_norm.weight", hd, 1.0)
            _attn_proj(b, p, d, d.n_head_kv[i])
        else:
            b.mat(p + "shortconv.conv.weight", n_embd, l_cache, scale=0.2, dtype=np.float32)
            b.mat(p + "shortconv.in_proj.weight", 3 * n_embd, n_embd)
            b.mat(p + "shortconv.out_proj.weight", n_embd, n_embd)

    def meta(w):
        _common_meta(w, d, key_length=False)
        w.add_rope_freq_base(1000000.0)
        w.add_shortconv_l_cache(l_cache)
        w.add_layer_norm_rms_eps(1e-5)
        if n_swa:
            w.add_sliding_window(n_swa)

    swa = dict(n_swa=n_swa, swa_type="standard", swa_layers=[h > 0 for h in d.n_head_kv]) if n_swa else {}
    hp = _attn_hparams(
        "lfm2",
        d,
        rope_type="neox",
        freq_base=1000000.0,
        recurrent_layers=[h == 0 for h in d.n_head_kv],
        n_embd_r=n_embd * (l_cache - 1),
        n_embd_s=0,
        n_shortconv_l_cache=l_cache,
        **swa,
    )
    return b.finish(out, "lfm2-swa-tiny" if n_swa else "lfm2-tiny", meta, hp)


def build_lfm2_swa(out: Path) -> TinyModel:
    return build_lfm2(out, n_swa=4)


# ---------------------------------------------------------------- bloom (ALiBi)


def build_bloom(out: Path) -> TinyModel:
    """2 layers, n_embd 64, 4 heads of dim 16 (no GQA), no rope: llama.cpp hard-codes f_max_alibi_bias 8 for
    bloom, so use_alibi is set and the KQ mask holds -|p0 - p1| (the per-head slopes come in soft_max_ext)."""
    d = _Dims(n_layer=2, n_embd=64, n_head=4, n_head_kv=4, hd=16, n_ff=64)
    n_embd, n_ff = d.n_embd, d.n_ff
    b = _Builder("bloom", seed=1012)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("token_embd_norm.weight", n_embd, 1.0)
    b.vec("token_embd_norm.bias", n_embd, 0.0)
    b.vec("output_norm.weight", n_embd, 1.0)
    b.vec("output_norm.bias", n_embd, 0.0)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        b.vec(p + "attn_norm.bias", n_embd, 0.0)
        b.mat(p + "attn_qkv.weight", 3 * n_embd, n_embd)
        b.vec(p + "attn_qkv.bias", 3 * n_embd)
        b.mat(p + "attn_output.weight", n_embd, n_embd)
        b.vec(p + "attn_output.bias", n_embd)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.vec(p + "ffn_norm.bias", n_embd, 0.0)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.vec(p + "ffn_up.bias", n_ff)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)
        b.vec(p + "ffn_down.bias", n_embd)

    def meta(w):
        _common_meta(w, d, key_length=False)
        w.add_layer_norm_eps(1e-5)

    hp = _attn_hparams("bloom", d, rope_type="none", f_max_alibi_bias=8.0)
    return b.finish(out, "bloom-tiny", meta, hp)


# ---------------------------------------------------------------- t5 (encoder-decoder, relative position buckets)


def build_t5(out: Path) -> TinyModel:
    """2 encoder + 2 decoder layers, n_embd 32, 2 heads of dim 16, no rope, 32 relative-position buckets (the
    bias table only in layer 0, as T5 stores it): llama_encode fills the cache-less, bidirectional
    ``pos_bucket_enc``; the decoder's KV cache fills ``pos_bucket_dec`` (set_input_pos_bucket)."""
    d = _Dims(n_layer=2, n_embd=32, n_head=2, n_head_kv=2, hd=16, n_ff=32)
    n_embd, n_ff, n_bkts = d.n_embd, d.n_ff, 32
    b = _Builder("t5", seed=1013)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("enc.output_norm.weight", n_embd, 1.0)
    b.vec("dec.output_norm.weight", n_embd, 1.0)
    for i in range(d.n_layer):
        for side in ("enc", "dec"):
            p = f"{side}.blk.{i}."
            b.vec(p + "attn_norm.weight", n_embd, 1.0)
            if i == 0:
                b.mat(p + "attn_rel_b.weight", n_bkts, d.n_head, dtype=np.float32)
            for n in ("q", "k", "v", "o"):
                b.mat(p + f"attn_{n}.weight", n_embd, n_embd)
            if side == "dec":
                b.vec(p + "cross_attn_norm.weight", n_embd, 1.0)
                for n in ("q", "k", "v", "o"):
                    b.mat(p + f"cross_attn_{n}.weight", n_embd, n_embd)
            b.vec(p + "ffn_norm.weight", n_embd, 1.0)
            b.mat(p + "ffn_up.weight", n_ff, n_embd)
            b.mat(p + "ffn_down.weight", n_embd, n_ff)

    def meta(w):
        _common_meta(w, d)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_relative_attn_buckets_count(n_bkts)
        w.add_decoder_start_token_id(0)

    hp = _attn_hparams("t5", d, rope_type="none", n_rel_attn_bkts=n_bkts)
    return b.finish(out, "t5-tiny", meta, hp)


# ---------------------------------------------------------------- gemma4 (iSWA, non_causal_type SWA_ONLY)


def build_gemma4(out: Path) -> TinyModel:
    """4 layers (sliding_window_pattern [SWA, SWA, SWA, full]), n_embd 32, 2 heads of dim 16 over 1 KV head
    (same head dim for SWA layers), window 4, no per-layer embeddings: llama.cpp sets non_causal_type SWA_ONLY
    for gemma4, so set_causal false makes only the SWA cache's mask bidirectional."""
    d = _Dims(n_layer=4, n_embd=32, n_head=2, n_head_kv=1, hd=16, n_ff=32)
    n_swa, pattern = 4, [True, True, True, False]
    b = _Builder("gemma4", seed=1014)
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.vec("output_norm.weight", d.n_embd, 1.0)
    b.vec("rope_freqs.weight", d.hd // 2, 1.0)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", d.n_embd, 1.0)
        _attn_proj(b, p, d, d.n_head_kv)
        b.vec(p + "attn_q_norm.weight", d.hd, 1.0)
        b.vec(p + "attn_k_norm.weight", d.hd, 1.0)
        b.vec(p + "post_attention_norm.weight", d.n_embd, 1.0)
        _ffn(b, p, d)
        b.vec(p + "post_ffw_norm.weight", d.n_embd, 1.0)

    def meta(w):
        _common_meta(w, d)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_sliding_window(n_swa)
        w.add_sliding_window_pattern(pattern)
        w.add_key_length_swa(d.hd)
        w.add_value_length_swa(d.hd)
        w.add_embedding_length_per_layer_input(0)
        w.add_rope_freq_base(1000000.0)
        w.add_rope_freq_base_swa(10000.0)

    swa = dict(n_swa=n_swa, swa_type="standard", swa_layers=pattern)
    hp = _attn_hparams(
        "gemma4",
        d,
        rope_type="neox",
        freq_base=1000000.0,
        **swa,
        rope_freq_base_swa=10000.0,
        non_causal_type=1,
        n_layer_kv_from_start=d.n_layer,  # no shared-KV layers (attention.shared_kv_layers absent)
    )
    return b.finish(out, "gemma4-tiny", meta, hp)


# ---------------------------------------------------------------- head sizes 64 / 128: llama.cpp's attention rotation


def build_llama_h64(out: Path) -> TinyModel:
    """2 layers, n_embd 64, 2 query heads of dim 64 over 1 KV head (key_length 64 = n_embd / 1, not / 2), rope
    norm: a head size multiple of 64, so a quantized K/V cache is rotated (attn_rot_k / attn_rot_v, size 64)."""
    return _llama(out, "llama-h64-tiny", _Dims(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, hd=64, n_ff=64), 1015)


def build_qwen3_h128(out: Path) -> TinyModel:
    """2 layers, n_embd 32, 2 query heads of dim 128 over 1 KV head, q/k norms, rope neox (base 1e6): the K
    rotation is 128 wide (the largest power of two from 64 dividing the head size), the V rotation 64."""
    d = _Dims(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, hd=128, n_ff=32)
    b = _Builder("qwen3", seed=1016)
    _transformer(b, d, qk_norms=True)

    def meta(w):
        _common_meta(w, d)
        w.add_rope_freq_base(1000000.0)
        w.add_layer_norm_rms_eps(1e-6)

    return b.finish(out, "qwen3-h128-tiny", meta, _attn_hparams("qwen3", d, rope_type="neox", freq_base=1000000.0))


def build_stablelm_rot32(out: Path) -> TinyModel:
    """2 layers, n_embd 64, 1 head of dim 64, rope neox over the first 32 dims only (rope.dimension_count 32:
    partial rotary, which stablelm allows); layer norms with biases and a separate output matrix."""
    d = _Dims(n_layer=2, n_embd=64, n_head=1, n_head_kv=1, hd=64, n_ff=64)
    n_rot = 32
    b = _Builder("stablelm", seed=1017)
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.vec("output_norm.weight", d.n_embd, 1.0)
    b.vec("output_norm.bias", d.n_embd, 0.0)
    b.mat("output.weight", N_VOCAB, d.n_embd)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", d.n_embd, 1.0)
        b.vec(p + "attn_norm.bias", d.n_embd, 0.0)
        _attn_proj(b, p, d, d.n_head_kv)
        b.vec(p + "ffn_norm.weight", d.n_embd, 1.0)
        b.vec(p + "ffn_norm.bias", d.n_embd, 0.0)
        b.mat(p + "ffn_gate.weight", d.n_ff, d.n_embd)
        b.mat(p + "ffn_up.weight", d.n_ff, d.n_embd)
        b.mat(p + "ffn_down.weight", d.n_embd, d.n_ff)

    def meta(w):
        _common_meta(w, d)
        w.add_rope_dimension_count(n_rot)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_eps(1e-5)

    hp = _attn_hparams("stablelm", d, rope_type="neox")
    hp["n_rot"] = n_rot
    return b.finish(out, "stablelm-rot32-tiny", meta, hp)


# ---------------------------------------------------------------- DeepSeek sparse attention (llama_kv_cache_dsa)


def _mla_dsa_layer(b: _Builder, i: int, n_embd, n_head, q_lora, kv_lora, nope, rope, v_mla, idx_heads, idx_hd, indexer):
    """One MLA attention block with (``indexer``) a lightning indexer: attn_norm, q_a / q_a_norm / q_b, kv_a_mqa /
    kv_a_norm, k_b, v_b, output; indexer k_norm (+ bias), proj, attn_k, attn_q_b."""
    p = f"blk.{i}."
    b.vec(p + "attn_norm.weight", n_embd, 1.0)
    b.vec(p + "attn_q_a_norm.weight", q_lora, 1.0)
    b.vec(p + "attn_kv_a_norm.weight", kv_lora, 1.0)
    b.mat(p + "attn_q_a.weight", q_lora, n_embd)
    b.mat(p + "attn_q_b.weight", n_head * (nope + rope), q_lora)
    b.mat(p + "attn_kv_a_mqa.weight", kv_lora + rope, n_embd)
    b.mat(p + "attn_k_b.weight", n_head, kv_lora, nope)
    b.mat(p + "attn_v_b.weight", n_head, v_mla, kv_lora)
    b.mat(p + "attn_output.weight", n_embd, n_head * v_mla)
    if indexer:
        b.vec(p + "indexer.k_norm.weight", idx_hd, 1.0)
        b.vec(p + "indexer.k_norm.bias", idx_hd, 0.0)
        b.mat(p + "indexer.proj.weight", idx_heads, n_embd)
        b.mat(p + "indexer.attn_k.weight", idx_hd, n_embd)
        b.mat(p + "indexer.attn_q_b.weight", idx_heads * idx_hd, q_lora)


def _moe(b: _Builder, i: int, n_embd, n_expert, n_ff_exp, n_shared):
    p = f"blk.{i}."
    b.mat(p + "ffn_gate_inp.weight", n_expert, n_embd, dtype=np.float32)
    b.mat(p + "ffn_gate_exps.weight", n_expert, n_ff_exp, n_embd)
    b.mat(p + "ffn_down_exps.weight", n_expert, n_embd, n_ff_exp)
    b.mat(p + "ffn_up_exps.weight", n_expert, n_ff_exp, n_embd)
    b.mat(p + "ffn_gate_shexp.weight", n_ff_exp * n_shared, n_embd)
    b.mat(p + "ffn_down_shexp.weight", n_embd, n_ff_exp * n_shared)
    b.mat(p + "ffn_up_shexp.weight", n_ff_exp * n_shared, n_embd)


def build_glm_dsa(out: Path) -> TinyModel:
    """glm-dsa: 2 trunk layers + 1 NextN (MTP) block, n_embd 32, 2 heads; MLA with q_lora 32, kv_lora 32, rope 16,
    nope 32, v 32 (the cache holds kv_lora + rope = 48 per cell, one KV head, no V); the lightning indexer has 2 heads
    of 64 (a multiple of 64: its keys are Hadamard-rotated) and top-k 4; indexer types [full, shared], so the indexer
    cache keeps layer 0 only. The trunk layers are dense (leading_dense_block_count 2), the NextN block MoE (2 experts,
    1 used, 1 shared)."""
    return _dsa_mla(out, "glm-dsa", 2301, [1, 0])


def build_deepseek32(out: Path) -> TinyModel:
    """deepseek32: glm-dsa's shapes (see build_glm_dsa) with an indexer in every layer, the NextN block's included
    (deepseek32 requires its tensors); no indexer types: the indexer cache keeps every trunk layer."""
    return _dsa_mla(out, "deepseek32", 2303, None)


def _dsa_mla(out: Path, arch: str, seed: int, indexer_types: list[int] | None) -> TinyModel:
    n_layer, n_nextn, n_embd, n_head, n_ff = 3, 1, 32, 2, 32
    q_lora, kv_lora, rope, nope, v_mla = 32, 32, 16, 32, 32
    idx_heads, idx_hd, top_k = 2, 64, 4
    n_expert, n_ff_exp = 2, 32
    n_trunk = n_layer - n_nextn
    b = _Builder(arch, seed=seed)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        full = indexer_types is None or (i < n_trunk and bool(indexer_types[i]))
        _mla_dsa_layer(b, i, n_embd, n_head, q_lora, kv_lora, nope, rope, v_mla, idx_heads, idx_hd, full)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        if i < n_trunk:
            b.mat(p + "ffn_gate.weight", n_ff, n_embd)
            b.mat(p + "ffn_up.weight", n_ff, n_embd)
            b.mat(p + "ffn_down.weight", n_embd, n_ff)
        else:
            _moe(b, i, n_embd, n_expert, n_ff_exp, 1)
            b.mat(p + "nextn.eh_proj.weight", n_embd, 2 * n_embd)
            b.vec(p + "nextn.enorm.weight", n_embd, 1.0)
            b.vec(p + "nextn.hnorm.weight", n_embd, 1.0)

    def meta(w):
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(1)
        w.add_key_length(kv_lora + rope)
        w.add_value_length(kv_lora)
        w.add_key_value(f"{arch}.attention.key_length_mla", nope + rope, gguf.GGUFValueType.UINT32)
        w.add_key_value(f"{arch}.attention.value_length_mla", v_mla, gguf.GGUFValueType.UINT32)
        w.add_rope_dimension_count(rope)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_q_lora_rank(q_lora)
        w.add_kv_lora_rank(kv_lora)
        w.add_leading_dense_block_count(n_trunk)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(1)
        w.add_expert_shared_count(1)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_nextn_predict_layers(n_nextn)
        w.add_indexer_head_count(idx_heads)
        w.add_indexer_key_length(idx_hd)
        w.add_indexer_top_k(top_k)
        if indexer_types is not None:
            w.add_key_value(
                f"{arch}.attention.indexer.types", indexer_types, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT32
            )

    d = _Dims(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=1, hd=kv_lora + rope, n_ff=n_ff)
    hp = _attn_hparams(arch, d, rope_type="norm")
    hp.update(
        n_embd_head_v=kv_lora,
        n_embd_v_gqa=[kv_lora] * n_layer,
        n_rot=rope,
        n_layer_nextn=n_nextn,
        n_embd_head_k_mla=nope + rope,
        n_embd_head_v_mla=v_mla,
        n_lora_kv=kv_lora,
        indexer_head_size=idx_hd,
        indexer_top_k=top_k,
        # deepseek32 never reads indexer types (llama.cpp's flags stay 0)
        indexer_full_layers=[bool(x) for x in indexer_types or [0] * n_trunk] + [False] * n_nextn,
    )
    return b.finish(out, f"{arch}-tiny", meta, hp)


def build_dots3note(out: Path) -> TinyModel:
    """dots3note: 4 layers (sliding_window_pattern [SWA, full, SWA, full], window 4), n_embd 32, 2 heads, every
    layer dense. MLA: q_lora 32, rope 16; full layers kv_lora 32, nope 32, v 32 (cache rows 48), SWA layers kv_lora
    16, nope 16, v 16 (cache rows 32); one KV head, no V. The lightning indexer (2 heads of 64, top-k 4) owns the
    full layers (indexer types [0, 1, 0, 1]): llama_kv_cache_dsa_iswa with the MLA and indexer caches over layers 1
    and 3 and the SWA cache over layers 0 and 2."""
    n_layer, n_embd, n_head, n_ff = 4, 32, 2, 32
    q_lora, rope = 32, 16
    full = dict(kv_lora=32, nope=32, v=32)
    swa = dict(kv_lora=16, nope=16, v=16)
    idx_heads, idx_hd, top_k, n_swa = 2, 64, 4, 4
    swa_layers = [True, False, True, False]
    b = _Builder("dots3note", seed=2302)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        g = swa if swa_layers[i] else full
        _mla_dsa_layer(
            b, i, n_embd, n_head, q_lora, g["kv_lora"], g["nope"], rope, g["v"], idx_heads, idx_hd, not swa_layers[i]
        )
        b.vec(p + "attn_k_norm.weight", rope, 1.0)
        b.mat(p + "attn_gate.weight", n_head, n_embd)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)

    def meta(w):
        a = "dots3note"
        u32 = gguf.GGUFValueType.UINT32
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(1)
        w.add_key_length(full["kv_lora"] + rope)
        w.add_value_length(full["kv_lora"])
        w.add_key_value(f"{a}.attention.key_length_swa", swa["kv_lora"] + rope, u32)
        w.add_key_value(f"{a}.attention.value_length_swa", swa["kv_lora"], u32)
        w.add_key_value(f"{a}.attention.key_length_mla", full["nope"] + rope, u32)
        w.add_key_value(f"{a}.attention.value_length_mla", full["v"], u32)
        w.add_key_value(f"{a}.attention.kv_lora_rank_swa", swa["kv_lora"], u32)
        w.add_key_value(f"{a}.attention.key_length_mla_swa", swa["nope"] + rope, u32)
        w.add_key_value(f"{a}.attention.value_length_mla_swa", swa["v"], u32)
        w.add_rope_dimension_count(rope)
        w.add_rope_freq_base(10000.0)
        w.add_key_value(f"{a}.rope.freq_base_swa", 10000.0, gguf.GGUFValueType.FLOAT32)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_q_lora_rank(q_lora)
        w.add_kv_lora_rank(full["kv_lora"])
        w.add_leading_dense_block_count(n_layer)
        w.add_expert_shared_count(0)
        w.add_expert_feed_forward_length(32)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_sliding_window(n_swa)
        w.add_key_value(
            f"{a}.attention.sliding_window_pattern", [int(x) for x in swa_layers], gguf.GGUFValueType.ARRAY, u32
        )
        w.add_indexer_head_count(idx_heads)
        w.add_indexer_key_length(idx_hd)
        w.add_indexer_top_k(top_k)
        w.add_key_value(f"{a}.attention.indexer.types", [int(not x) for x in swa_layers], gguf.GGUFValueType.ARRAY, u32)

    d = _Dims(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=1, hd=full["kv_lora"] + rope, n_ff=n_ff)
    hp = _attn_hparams("dots3note", d, rope_type="norm")
    hp.update(
        n_embd_head_v=full["kv_lora"],
        n_embd_head_k_swa=swa["kv_lora"] + rope,
        n_embd_head_v_swa=swa["kv_lora"],
        n_embd_k_gqa=[(swa if s else full)["kv_lora"] + rope for s in swa_layers],
        n_embd_v_gqa=[(swa if s else full)["kv_lora"] for s in swa_layers],
        n_rot=rope,
        n_swa=n_swa,
        swa_type="standard",
        swa_layers=swa_layers,
        rope_freq_base_swa=10000.0,
        n_embd_head_k_mla=full["nope"] + rope,
        n_embd_head_v_mla=full["v"],
        n_lora_kv=full["kv_lora"],
        indexer_head_size=idx_hd,
        indexer_top_k=top_k,
        indexer_full_layers=[not x for x in swa_layers],
    )
    return b.finish(out, "dots3note-tiny", meta, hp)


def build_hy_v4_full(out: Path) -> TinyModel:
    """hy_v4's all-full-attention checkpoint (build_hy_v4 without the indexer keys and tensors: indexer_top_k 0):
    create_memory builds a plain K-only KV cache."""
    return build_hy_v4(out, indexer=False)


def build_hy_v4(out: Path, indexer: bool = True) -> TinyModel:
    """hy_v4 with an indexer: 2 dense layers, n_embd 32, 2 heads, 2 hyper-connection streams; MLA with q_lora 32,
    kv_lora 32, rope 16, nope 32, v 32 (cache rows 48, no V), attention sinks and a gate; the indexer (2 heads of 64,
    top-k 4, types [full, shared]) keeps layer 0 in its cache. hy_v4 is not among the archs whose indexer keys
    llama.cpp rotates: with f16 caches attn_rot_k stays off."""
    n_layer, n_embd, n_head, n_ff, hc = 2, 32, 2, 32, 2
    q_lora, kv_lora, rope, nope, v_mla = 32, 32, 16, 32, 32
    idx_heads, idx_hd, top_k = 2, 64, 4
    indexer_types = [1, 0] if indexer else [0, 0]
    b = _Builder("hy_v4", seed=2304)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    b.mat("output.weight", N_VOCAB, n_embd)
    b.mat("output_hc_fn.weight", hc, hc * n_embd, dtype=np.float32)
    b.vec("output_hc_base.weight", hc)
    b.vec("output_hc_scale.weight", 1, 1.0)
    for i in range(n_layer):
        p = f"blk.{i}."
        _mla_dsa_layer(b, i, n_embd, n_head, q_lora, kv_lora, nope, rope, v_mla, idx_heads, idx_hd, indexer_types[i])
        b.vec(p + "attn_sinks.weight", n_head)
        b.mat(p + "attn_gate.weight", n_head * v_mla, n_embd)
        for part in ("attn", "ffn"):
            b.mat(p + f"hc_{part}_fn.weight", 2 * hc, hc * n_embd, dtype=np.float32)
            b.vec(p + f"hc_{part}_base.weight", 2 * hc)
            b.vec(p + f"hc_{part}_scale.weight", 2, 1.0)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        b.mat(p + "ffn_gate.weight", n_ff, n_embd)
        b.mat(p + "ffn_up.weight", n_ff, n_embd)
        b.mat(p + "ffn_down.weight", n_embd, n_ff)

    def meta(w):
        a, u32, f32 = "hy_v4", gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32
        w.add_context_length(4096)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(1)
        w.add_key_length(kv_lora + rope)
        w.add_value_length(kv_lora)
        w.add_key_value(f"{a}.attention.key_length_mla", nope + rope, u32)
        w.add_key_value(f"{a}.attention.value_length_mla", v_mla, u32)
        w.add_rope_dimension_count(rope)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_q_lora_rank(q_lora)
        w.add_kv_lora_rank(kv_lora)
        w.add_leading_dense_block_count(n_layer)
        w.add_expert_shared_count(0)
        w.add_expert_feed_forward_length(32)
        w.add_key_value(f"{a}.hyper_connection.count", hc, u32)
        w.add_key_value(f"{a}.hyper_connection.epsilon", 1e-6, f32)
        w.add_key_value(f"{a}.hyper_connection.magnitude", 1.0, f32)
        if indexer:
            w.add_indexer_head_count(idx_heads)
            w.add_indexer_key_length(idx_hd)
            w.add_indexer_top_k(top_k)
            w.add_key_value(f"{a}.attention.indexer.types", indexer_types, gguf.GGUFValueType.ARRAY, u32)

    d = _Dims(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=1, hd=kv_lora + rope, n_ff=n_ff)
    hp = _attn_hparams("hy_v4", d, rope_type="norm")
    hp.update(
        n_embd_head_v=kv_lora,
        n_embd_v_gqa=[kv_lora] * n_layer,
        n_rot=rope,
        n_embd_head_k_mla=nope + rope,
        n_embd_head_v_mla=v_mla,
        n_lora_kv=kv_lora,
        indexer_head_size=idx_hd if indexer else 0,
        indexer_top_k=top_k if indexer else 0,
        indexer_full_layers=[bool(x) for x in indexer_types],
    )
    return b.finish(out, "hy_v4-tiny" if indexer else "hy_v4-full-tiny", meta, hp)


# ---------------------------------------------------------------- qwen4exp (llama_memory_hybrid_idx)


def build_qwen4exp(out: Path) -> TinyModel:
    """2 layers: a gated-delta-net layer, then a full-attention layer (full_attention_interval 2) with a QSA indexer
    (2 heads of key length 16, top_k 4, compress ratio 4): llama.cpp builds llama_memory_hybrid_idx, whose indexer
    cache holds one 16-wide key per cell of the attention layer.  n_embd 64, 2 query heads of dim 32 over 1 KV head,
    IMROPE over 16 dims (sections 4, 2, 2, 0); hyper-connections 2 x low rank 8; a 2-expert MoE (1 used) with a
    shared expert.  GDN: d_conv 4, 2 key heads and 2 value heads of dim 16 (d_inner 32)."""
    d = _Dims(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, hd=32, n_ff=32)
    recr = [True, False]
    n_embd, hd, hc, hc_lr = d.n_embd, d.hd, 2, 8
    hc_dim = hc * n_embd
    n_rot, sections = 16, [4, 2, 2, 0]
    idx_heads, idx_dim, idx_top_k, ratios = 2, 16, 4, [0, 4]
    d_conv, d_state, n_group, dt_rank = 4, 16, 2, 2
    key_dim, value_dim = d_state * n_group, d_state * dt_rank
    conv_dim = 2 * key_dim + value_dim
    n_expert, n_expert_used, n_ff_exp, n_ff_shexp = 2, 1, 32, 32
    b = _Builder("qwen4exp", seed=1023)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_hc_norm.weight", hc_dim, 1.0)
    b.mat("output_hc_down.weight", hc_lr, hc_dim)
    b.mat("output_hc_up.weight", hc_dim, hc_lr)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        for m in ("attn", "ffn"):
            b.vec(p + f"hc_{m}_norm.weight", hc_dim, 1.0)
            b.mat(p + f"hc_{m}_down.weight", hc_lr, hc_dim)
            b.mat(p + f"hc_{m}_up.weight", hc_dim, hc_lr)
            b.mat(p + f"hc_{m}_inject.weight", hc, hc_dim)
        if not recr[i]:
            b.mat(p + "attn_q.weight", 2 * d.n_head * hd, n_embd)
            b.mat(p + "attn_k.weight", hd, n_embd)
            b.mat(p + "attn_v.weight", hd, n_embd)
            b.mat(p + "attn_output.weight", n_embd, d.n_head * hd)
            b.vec(p + "attn_q_norm.weight", hd, 1.0)
            b.vec(p + "attn_k_norm.weight", hd, 1.0)
            b.mat(p + "indexer.q_proj.weight", idx_heads * idx_dim, n_embd)
            b.mat(p + "indexer.k_proj.weight", idx_dim, n_embd)
            b.vec(p + "indexer.q_norm.weight", idx_dim, 1.0)
            b.vec(p + "indexer.k_norm.weight", idx_dim, 1.0)
        else:
            b.mat(p + "attn_qkv.weight", conv_dim, n_embd)
            b.mat(p + "attn_gate.weight", value_dim, n_embd)
            b.mat(p + "ssm_conv1d.weight", conv_dim, d_conv, scale=0.2, dtype=np.float32)
            b.vec(p + "ssm_dt.bias", dt_rank, 0.0)
            b.vec(p + "ssm_a", dt_rank, -1.0)
            b.mat(p + "ssm_beta.weight", dt_rank, n_embd)
            b.mat(p + "ssm_alpha.weight", dt_rank, n_embd)
            b.vec(p + "ssm_norm.weight", d_state, 1.0)
            b.mat(p + "ssm_out.weight", n_embd, value_dim)
        b.mat(p + "ffn_gate_inp.weight", n_expert, n_embd, dtype=np.float32)
        b.mat(p + "ffn_down_exps.weight", n_expert, n_embd, n_ff_exp)
        b.mat(p + "ffn_gate_exps.weight", n_expert, n_ff_exp, n_embd)
        b.mat(p + "ffn_up_exps.weight", n_expert, n_ff_exp, n_embd)
        b.vec(p + "ffn_gate_inp_shexp.weight", n_embd)
        b.mat(p + "ffn_gate_shexp.weight", n_ff_shexp, n_embd)
        b.mat(p + "ffn_up_shexp.weight", n_ff_shexp, n_embd)
        b.mat(p + "ffn_down_shexp.weight", n_embd, n_ff_shexp)

    def meta(w):
        _common_meta(w, d)
        a = "qwen4exp."
        w.add_rope_dimension_count(n_rot)
        w.add_rope_freq_base(10000000.0)
        w.add_array(a + "rope.dimension_sections", sections)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_uint32(a + "full_attention_interval", 2)
        _ssm_meta(w, d_conv, value_dim, d_state, dt_rank)
        w.add_uint32(a + "ssm.group_count", n_group)
        w.add_uint32(a + "hyper_connection.count", hc)
        w.add_uint32(a + "hyper_connection.low_rank", hc_lr)
        w.add_uint32(a + "attention.indexer.head_count", idx_heads)
        w.add_uint32(a + "attention.indexer.key_length", idx_dim)
        w.add_uint32(a + "attention.indexer.top_k", idx_top_k)
        w.add_array(a + "attention.compress_ratios", ratios)
        w.add_uint32(a + "expert_count", n_expert)
        w.add_uint32(a + "expert_used_count", n_expert_used)
        w.add_uint32(a + "expert_feed_forward_length", n_ff_exp)
        w.add_uint32(a + "expert_shared_feed_forward_length", n_ff_shexp)

    hp = _attn_hparams(
        "qwen4exp",
        d,
        rope_type="imrope",
        freq_base=10000000.0,
        recurrent_layers=recr,
        n_embd_r=(d_conv - 1) * conv_dim,
        n_embd_s=d_state * value_dim,
        ssm=dict(d_conv=d_conv, d_inner=value_dim, d_state=d_state, n_group=n_group, dt_rank=dt_rank),
        rope_sections=sections,
        n_pos_per_embd=4,
        has_cell_ext=True,
        indexer_head_size=idx_dim,
        dsv4_compress_ratios=ratios,
        dsv4_hc_mult=hc,
    )
    hp["n_rot"] = n_rot
    return b.finish(out, "qwen4exp-tiny", meta, hp)


# ---------------------------------------------------------------- glm5-next (llama_memory_hybrid_idx with a k-pool)


def build_glm5_next(out: Path) -> TinyModel:
    """2 trunk layers and 1 NextN (MTP) block: a KDA layer (2 heads of dim 16, d_conv 4), then a nope-MLA layer (2
    heads, q / kv LoRA rank 32, key length 32 over the latent, value length 16; its cache keeps only the 32-wide
    latent) with a k-pool DSA indexer (2 heads of key length 16, k-pool 4, top_k 8): llama.cpp builds
    llama_memory_hybrid_idx, whose indexer cache holds key | gate | pooled (3 x 16) per cell.  n_embd 64, mHC with 4
    streams, a 2-expert MoE (1 used, sigmoid gating) with a shared expert on every layer."""
    n_head_kv = [0, 1, 1]
    d = _Dims(n_layer=3, n_embd=64, n_head=2, n_head_kv=n_head_kv, hd=32, n_ff=32)
    n_embd, n_trunk, hc = d.n_embd, 2, 4
    hc_mix = (2 + hc) * hc
    head_dim, d_conv, n_head = 16, 4, d.n_head
    d_inner = head_dim * n_head
    q_lora, kv_lora, k_mla, v_mla = 32, 32, 32, 16
    idx_heads, idx_dim, idx_top_k, kpool = 2, 16, 8, 4
    n_expert, n_expert_used, n_ff_exp = 2, 1, 32
    b = _Builder("glm5-next", seed=1024)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    b.mat("output.weight", N_VOCAB, n_embd)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        b.vec(p + "ffn_norm.weight", n_embd, 1.0)
        if i < n_trunk:
            for m in ("attn", "ffn"):
                b.mat(p + f"hc_{m}_fn.weight", hc_mix, hc * n_embd, dtype=np.float32)
                b.vec(p + f"hc_{m}_base.weight", hc_mix)
                b.vec(p + f"hc_{m}_scale.weight", 3, 1.0)
        if n_head_kv[i] == 0:
            for n in ("q", "k", "v"):
                b.mat(p + f"ssm_conv1d_{n}.weight", d_inner, 1, d_conv, scale=0.2, dtype=np.float32)
            for n in ("q", "k", "v"):
                b.mat(p + f"attn_{n}.weight", d_inner, n_embd)
            b.mat(p + "ssm_f_a.weight", head_dim, n_embd)
            b.mat(p + "ssm_f_b.weight", d_inner, head_dim)
            b.mat(p + "ssm_beta.weight", n_head, n_embd)
            b.vec(p + "ssm_a", n_head, -1.0)
            b.vec(p + "ssm_dt.bias", d_inner, 0.0)
            b.mat(p + "ssm_g_a.weight", head_dim, n_embd)
            b.mat(p + "ssm_g_b.weight", d_inner, head_dim)
            b.vec(p + "ssm_norm.weight", head_dim, 1.0)
            b.mat(p + "attn_output.weight", n_embd, d_inner)
        else:
            b.vec(p + "attn_q_a_norm.weight", q_lora, 1.0)
            b.vec(p + "attn_kv_a_norm.weight", kv_lora, 1.0)
            b.mat(p + "attn_q_a.weight", q_lora, n_embd)
            b.mat(p + "attn_q_b.weight", n_head * k_mla, q_lora)
            b.mat(p + "attn_kv_a_mqa.weight", kv_lora, n_embd)
            b.mat(p + "attn_k_b.weight", n_head, kv_lora, k_mla)
            b.mat(p + "attn_v_b.weight", n_head, v_mla, kv_lora)
            b.mat(p + "attn_output.weight", n_embd, n_head * v_mla)
            b.vec(p + "indexer.k_norm.weight", idx_dim, 1.0)
            b.vec(p + "indexer.k_norm.bias", idx_dim, 0.0)
            b.mat(p + "indexer.proj.weight", idx_heads, n_embd)
            b.mat(p + "indexer.attn_k.weight", idx_dim, n_embd)
            b.mat(p + "indexer.attn_q_b.weight", idx_heads * idx_dim, q_lora)
            b.mat(p + "indexer_compressor_gate.weight", idx_dim, n_embd)
            b.mat(p + "indexer_compressor_ape.weight", kpool, idx_dim, dtype=np.float32)
        b.mat(p + "ffn_gate_inp.weight", n_expert, n_embd, dtype=np.float32)
        b.vec(p + "exp_probs_b.bias", n_expert, 0.0)
        b.mat(p + "ffn_gate_exps.weight", n_expert, n_ff_exp, n_embd)
        b.mat(p + "ffn_down_exps.weight", n_expert, n_embd, n_ff_exp)
        b.mat(p + "ffn_up_exps.weight", n_expert, n_ff_exp, n_embd)
        b.mat(p + "ffn_gate_shexp.weight", n_ff_exp, n_embd)
        b.mat(p + "ffn_down_shexp.weight", n_embd, n_ff_exp)
        b.mat(p + "ffn_up_shexp.weight", n_ff_exp, n_embd)
        if i >= n_trunk:
            b.mat(p + "nextn.eh_proj.weight", n_embd, 2 * n_embd)
            b.vec(p + "nextn.enorm.weight", n_embd, 1.0)
            b.vec(p + "nextn.hnorm.weight", n_embd, 1.0)

    def meta(w):
        _common_meta(w, d, key_length=False)
        a = "glm5-next."
        w.add_key_length(kv_lora)
        w.add_value_length(kv_lora)
        w.add_rope_dimension_count(0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_uint32(a + "attention.key_length_mla", k_mla)
        w.add_uint32(a + "attention.value_length_mla", v_mla)
        w.add_uint32(a + "attention.q_lora_rank", q_lora)
        w.add_uint32(a + "attention.kv_lora_rank", kv_lora)
        w.add_uint32(a + "ssm.conv_kernel", d_conv)
        w.add_uint32(a + "kda.head_dim", head_dim)
        w.add_uint32(a + "expert_feed_forward_length", n_ff_exp)
        w.add_uint32(a + "expert_shared_count", 1)
        w.add_uint32(a + "expert_count", n_expert)
        w.add_uint32(a + "expert_used_count", n_expert_used)
        w.add_uint32(a + "expert_gating_func", 2)
        w.add_uint32(a + "attention.indexer.head_count", idx_heads)
        w.add_uint32(a + "attention.indexer.key_length", idx_dim)
        w.add_uint32(a + "attention.indexer.top_k", idx_top_k)
        w.add_uint32(a + "attention.indexer.kpool", kpool)
        w.add_uint32(a + "hyper_connection.count", hc)
        w.add_uint32(a + "hyper_connection.sinkhorn_iterations", 2)
        w.add_float32(a + "hyper_connection.epsilon", 1e-6)
        w.add_uint32(a + "nextn_predict_layers", d.n_layer - n_trunk)

    hp = _attn_hparams(
        "glm5-next",
        d,
        rope_type="none",
        recurrent_layers=[h == 0 for h in n_head_kv],
        n_embd_r=3 * (d_conv - 1) * d_inner,
        n_embd_s=head_dim * head_dim * n_head,
        ssm=dict(d_conv=d_conv, d_inner=0, d_state=0, n_group=0, dt_rank=0),
        n_embd_head_kda=head_dim,
        n_embd_head_k_mla=k_mla,
        n_embd_head_v_mla=v_mla,
        n_lora_kv=kv_lora,
        indexer_head_size=idx_dim,
        indexer_kpool=kpool,
        indexer_top_k=idx_top_k,
        indexer_kpool_select_tail=True,
        indexer_full_layers=[True] * d.n_layer,
        n_layer_nextn=d.n_layer - n_trunk,
        dsv4_hc_mult=hc,
    )
    hp["n_rot"] = 0
    hp["n_embd_head_v"] = kv_lora
    hp["n_embd_v_gqa"] = [kv_lora * h for h in n_head_kv]
    return b.finish(out, "glm5-next-tiny", meta, hp)


# ---------------------------------------------------------------- minimax-m3 (llama_kv_cache_msa)


def build_minimax_m3(out: Path) -> TinyModel:
    """3 layers (1 leading dense, 2 sparse MSA layers with an indexer and MoE FFNs), n_embd 32, 4 query heads of
    dim 16 over 2 KV heads, partial rotary (8 dims, neox), per-head q/k norms; the MSA indexer: 2 heads (one per
    KV head, as llama.cpp asserts) of key length 8, top-k 2 blocks of 4 positions, 1 local block. llama.cpp builds
    llama_kv_cache_msa: the base cache over every layer, the indexer key cache (1 head of 8) over layers >= 1."""
    d = _Dims(n_layer=3, n_embd=32, n_head=4, n_head_kv=2, hd=16, n_ff=32)
    n_dense, n_expert, n_ff_exp = 1, 2, 16
    idx_heads, idx_len, n_rot = 2, 8, 8
    b = _Builder("minimax-m3", seed=1023)
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.vec("output_norm.weight", d.n_embd, 1.0)
    b.mat("output.weight", N_VOCAB, d.n_embd)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", d.n_embd, 1.0)
        _attn_proj(b, p, d, d.n_head_kv)
        b.vec(p + "attn_q_norm.weight", d.hd, 1.0)
        b.vec(p + "attn_k_norm.weight", d.hd, 1.0)
        if i < n_dense:
            _ffn(b, p, d)
            continue
        b.vec(p + "ffn_norm.weight", d.n_embd, 1.0)
        b.mat(p + "ffn_gate_inp.weight", n_expert, d.n_embd, dtype=np.float32)
        b.vec(p + "exp_probs_b.bias", n_expert, 0.0)
        b.mat(p + "ffn_gate_exps.weight", n_expert, n_ff_exp, d.n_embd)
        b.mat(p + "ffn_down_exps.weight", n_expert, d.n_embd, n_ff_exp)
        b.mat(p + "ffn_up_exps.weight", n_expert, n_ff_exp, d.n_embd)
        b.mat(p + "ffn_gate_shexp.weight", n_ff_exp, d.n_embd)
        b.mat(p + "ffn_down_shexp.weight", d.n_embd, n_ff_exp)
        b.mat(p + "ffn_up_shexp.weight", n_ff_exp, d.n_embd)
        b.mat(p + "indexer.q_proj.weight", idx_heads * idx_len, d.n_embd)
        b.mat(p + "indexer.k_proj.weight", idx_len, d.n_embd)
        b.vec(p + "indexer.q_norm.weight", idx_len, 1.0)
        b.vec(p + "indexer.k_norm.weight", idx_len, 1.0)

    def meta(w):
        _common_meta(w, d)
        w.add_rope_dimension_count(n_rot)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_leading_dense_block_count(n_dense)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(1)
        w.add_expert_feed_forward_length(n_ff_exp)
        w.add_expert_shared_count(1)
        w.add_expert_weights_scale(1.0)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_indexer_head_count(idx_heads)
        w.add_indexer_key_length(idx_len)
        w.add_indexer_top_k(2)
        w.add_uint32("minimax-m3.attention.indexer.block_size", 4)
        w.add_uint32("minimax-m3.attention.indexer.local_blocks", 1)

    hp = _attn_hparams(
        "minimax-m3",
        d,
        rope_type="neox",
        n_layer_dense_lead=n_dense,
        indexer_head_size=idx_len,
        indexer_block_size=4,
        indexer_local_blocks=1,
    )
    hp["n_rot"] = n_rot
    return b.finish(out, "minimax-m3-tiny", meta, hp)


# ---------------------------------------------------------------- gemma4-assistant (a draft reading gemma4's cache)


def build_gemma4_assistant(out: Path) -> TinyModel:
    """The draft head of gemma4-tiny: 2 layers, both NextN blocks (nextn_predict_layers 2: n_layer() is 0),
    sliding_window_pattern [SWA, full], n_embd 16, 2 query heads of dim 16 over 1 KV head (gemma4-tiny's K/V
    shape), window 4, embedding_length_out 32 (the target's hidden size, the decode batch's embd width). It has
    no K/V projections: llama.cpp's context needs ctx_other (a gemma4-tiny context) and builds a
    llama_kv_cache_iswa whose layers are shared with the target's last SWA / full layer and whose cells are the
    target's."""
    n_embd, n_embd_out, hd, n_head, n_ff = 16, 32, 16, 2, 16
    pattern = [True, False]
    d = _Dims(n_layer=2, n_embd=n_embd, n_head=n_head, n_head_kv=1, hd=hd, n_ff=n_ff)
    b = _Builder("gemma4-assistant", seed=1024)
    b.mat("token_embd.weight", N_VOCAB, n_embd)
    b.vec("output_norm.weight", n_embd, 1.0)
    b.mat("nextn.post_projection.weight", n_embd_out, n_embd)
    b.vec("rope_freqs.weight", hd // 2, 1.0)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        if i == 0:
            b.mat("nextn.pre_projection.weight", n_embd, 2 * n_embd_out)
        b.vec(p + "attn_norm.weight", n_embd, 1.0)
        b.mat(p + "attn_q.weight", n_head * hd, n_embd)
        b.mat(p + "attn_output.weight", n_embd, n_head * hd)
        b.vec(p + "attn_q_norm.weight", hd, 1.0)
        b.vec(p + "post_attention_norm.weight", n_embd, 1.0)
        b.vec(p + "layer_output_scale.weight", 1, 1.0)
        _ffn(b, p, d)
        b.vec(p + "post_ffw_norm.weight", n_embd, 1.0)

    def meta(w):
        _common_meta(w, d)
        w.add_uint32("gemma4-assistant.embedding_length_out", n_embd_out)
        w.add_uint32("gemma4-assistant.nextn_predict_layers", d.n_layer)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_sliding_window(4)
        w.add_sliding_window_pattern(pattern)
        w.add_key_length_swa(hd)
        w.add_value_length_swa(hd)
        w.add_rope_freq_base(1000000.0)
        w.add_rope_freq_base_swa(10000.0)

    hp = _attn_hparams(
        "gemma4-assistant",
        d,
        rope_type="neox",
        freq_base=1000000.0,
        n_swa=4,
        swa_type="standard",
        swa_layers=pattern,
        rope_freq_base_swa=10000.0,
        n_layer_nextn=d.n_layer,
        n_embd_out=n_embd_out,
    )
    return b.finish(out, "gemma4-assistant-tiny", meta, hp)


# ---------------------------------------------------------------- dflash (a block-diffusion draft, default memory)


def build_dflash(out: Path) -> TinyModel:
    """A DFlash draft (no hyper-connections: llama.cpp's default path builds a plain KV cache): 2 layers, n_embd
    32, 2 query heads of dim 16 over 1 KV head, q/k norms, rope neox, target_layers [1, 2] (a KV-injection batch
    carries 2 x 32 target features per token), its own token_embd and output (so no ctx_other), non-causal."""
    d = _Dims(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, hd=16, n_ff=32)
    target_layers = [1, 2]
    b = _Builder("dflash", seed=1025)
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.mat("fc.weight", d.n_embd, len(target_layers) * d.n_embd)
    b.vec("enc.output_norm.weight", d.n_embd, 1.0)
    b.vec("output_norm.weight", d.n_embd, 1.0)
    b.mat("output.weight", N_VOCAB, d.n_embd)
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", d.n_embd, 1.0)
        _attn_proj(b, p, d, d.n_head_kv)
        b.vec(p + "attn_q_norm.weight", d.hd, 1.0)
        b.vec(p + "attn_k_norm.weight", d.hd, 1.0)
        _ffn(b, p, d)

    def meta(w):
        _common_meta(w, d)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_freq_base(10000.0)
        w.add_causal_attention(False)
        w.add_array("dflash.target_layers", target_layers)

    hp = _attn_hparams("dflash", d, rope_type="neox", causal_attn=False, n_embd_inp_enc=len(target_layers) * d.n_embd)
    return b.finish(out, "dflash-tiny", meta, hp)


# ---------------------------------------------------------------- deepseek4 (llama_kv_cache_dsv4)


def build_deepseek4(out: Path) -> TinyModel:
    """DeepSeek-V4: 3 trunk layers with compress ratios [0, 4, 128] (raw SWA only, CSA + lightning indexer, HCA)
    and 1 MTP block (ratio 0), n_embd 64, 2 query heads of dim 64 over one K-only head (rope over the last 16
    dims), window 8, hyper-connections x4 (the graph asserts 4), 2 experts (1 used) + 1 shared, no hash layers;
    the MTP context builds an iSWA cache over the MTP block."""
    n_trunk, n_nextn = 3, 1
    ratios = [0, 4, 128, 0]
    d = _Dims(n_layer=n_trunk + n_nextn, n_embd=64, n_head=2, n_head_kv=1, hd=64, n_ff=32)
    n_rot, n_swa, q_lora, o_groups, o_lora, hc = 16, 8, 32, 2, 16, 4
    idx_heads, idx_hd, idx_top_k = 2, 128, 4  # 64+ (its K rotation), not the K head size (all caches would rotate)
    n_expert, n_used, n_ff_exp = 2, 1, 16
    hc_dim, hc_mix = hc * d.n_embd, (2 + hc) * hc
    b = _Builder("deepseek4", seed=1023)
    b.mat("token_embd.weight", N_VOCAB, d.n_embd)
    b.vec("output_norm.weight", d.n_embd, 1.0)
    b.mat("output.weight", N_VOCAB, d.n_embd)
    b.raw("output_hc_fn.weight", (b.rng.standard_normal((hc, hc_dim)) * 0.05).astype(np.float32))
    b.vec("output_hc_base.weight", hc)
    b.vec("output_hc_scale.weight", 1, 1.0)
    f32 = np.float32
    for i in range(d.n_layer):
        p = f"blk.{i}."
        b.vec(p + "attn_norm.weight", d.n_embd, 1.0)
        b.vec(p + "attn_sinks.weight", d.n_head)
        b.mat(p + "attn_q_a.weight", q_lora, d.n_embd)
        b.vec(p + "attn_q_a_norm.weight", q_lora, 1.0)
        b.mat(p + "attn_q_b.weight", d.n_head * d.hd, q_lora)
        b.mat(p + "attn_kv.weight", d.hd, d.n_embd)
        b.vec(p + "attn_kv_a_norm.weight", d.hd, 1.0)
        b.mat(p + "attn_output_a.weight", o_lora * o_groups, d.n_head * d.hd // o_groups)
        b.mat(p + "attn_output_b.weight", d.n_embd, o_groups * o_lora)
        for n in ("attn", "ffn"):
            b.mat(p + f"hc_{n}_fn.weight", hc_mix, hc_dim, dtype=f32)
            b.vec(p + f"hc_{n}_base.weight", hc_mix)
            b.vec(p + f"hc_{n}_scale.weight", 3, 1.0)
        ratio = ratios[i]
        if ratio:
            coff = 2 if ratio == 4 else 1
            b.mat(p + "attn_compressor_kv.weight", coff * d.hd, d.n_embd)
            b.mat(p + "attn_compressor_gate.weight", coff * d.hd, d.n_embd)
            b.mat(p + "attn_compressor_ape.weight", ratio, coff * d.hd, dtype=f32)
            b.vec(p + "attn_compressor_norm.weight", d.hd, 1.0)
            if ratio == 4:
                b.mat(p + "indexer.proj.weight", idx_heads, d.n_embd)
                b.mat(p + "indexer.attn_q_b.weight", idx_heads * idx_hd, q_lora)
                b.mat(p + "indexer_compressor_kv.weight", 2 * idx_hd, d.n_embd)
                b.mat(p + "indexer_compressor_gate.weight", 2 * idx_hd, d.n_embd)
                b.mat(p + "indexer_compressor_ape.weight", ratio, 2 * idx_hd, dtype=f32)
                b.vec(p + "indexer_compressor_norm.weight", idx_hd, 1.0)
        b.mat(p + "ffn_gate_inp.weight", n_expert, d.n_embd, dtype=f32)
        b.vec(p + "exp_probs_b.bias", n_expert, 0.0)
        b.vec(p + "ffn_norm.weight", d.n_embd, 1.0)
        b.mat(p + "ffn_gate_exps.weight", n_expert, n_ff_exp, d.n_embd)
        b.mat(p + "ffn_down_exps.weight", n_expert, d.n_embd, n_ff_exp)
        b.mat(p + "ffn_up_exps.weight", n_expert, n_ff_exp, d.n_embd)
        b.mat(p + "ffn_gate_shexp.weight", n_ff_exp, d.n_embd)
        b.mat(p + "ffn_down_shexp.weight", d.n_embd, n_ff_exp)
        b.mat(p + "ffn_up_shexp.weight", n_ff_exp, d.n_embd)
        if i >= n_trunk:
            b.mat(p + "nextn.eh_proj.weight", d.n_embd, 2 * d.n_embd)
            b.vec(p + "nextn.enorm.weight", d.n_embd, 1.0)
            b.vec(p + "nextn.hnorm.weight", d.n_embd, 1.0)

    def meta(w):
        _common_meta(w, d)
        a = "deepseek4"
        w.add_layer_norm_rms_eps(1e-6)
        w.add_rope_dimension_count(n_rot)
        w.add_rope_freq_base(10000.0)
        w.add_sliding_window(n_swa)
        w.add_uint32(f"{a}.attention.q_lora_rank", q_lora)
        w.add_uint32(f"{a}.nextn_predict_layers", n_nextn)
        w.add_uint32(f"{a}.expert_count", n_expert)
        w.add_uint32(f"{a}.expert_used_count", n_used)
        w.add_uint32(f"{a}.expert_feed_forward_length", n_ff_exp)
        w.add_uint32(f"{a}.expert_shared_count", 1)
        w.add_float32(f"{a}.expert_weights_scale", 1.0)
        w.add_bool(f"{a}.expert_weights_norm", True)
        w.add_uint32(f"{a}.expert_gating_func", 4)  # sqrtsoftplus
        w.add_float32(f"{a}.swiglu_clamp_exp", 10.0)
        w.add_uint32(f"{a}.attention.indexer.head_count", idx_heads)
        w.add_uint32(f"{a}.attention.indexer.key_length", idx_hd)
        w.add_uint32(f"{a}.attention.indexer.top_k", idx_top_k)
        w.add_uint32(f"{a}.attention.output_group_count", o_groups)
        w.add_uint32(f"{a}.attention.output_lora_rank", o_lora)
        w.add_float32(f"{a}.attention.compress_rope_freq_base", 160000.0)
        w.add_array(f"{a}.attention.compress_ratios", ratios)
        w.add_uint32(f"{a}.hyper_connection.count", hc)
        w.add_uint32(f"{a}.hyper_connection.sinkhorn_iterations", 2)
        w.add_float32(f"{a}.hyper_connection.epsilon", 1e-6)
        w.add_uint32(f"{a}.hash_layer_count", 0)

    hp = _attn_hparams(
        "deepseek4",
        d,
        rope_type="norm",
        n_swa=n_swa,
        swa_type="standard",
        swa_layers=[True] * d.n_layer,
        non_causal_type=2,
        n_layer_nextn=n_nextn,
        indexer_head_size=idx_hd,
        dsv4_hc_mult=hc,
        dsv4_compress_ratios=ratios,
    )
    hp["n_rot"] = n_rot
    return b.finish(out, "deepseek4-tiny", meta, hp)


BUILDERS = {
    "hy_v4": build_hy_v4,
    "hy_v4-full": build_hy_v4_full,
    "glm-dsa": build_glm_dsa,
    "dots3note": build_dots3note,
    "deepseek32": build_deepseek32,
    "llama": build_llama,
    "mamba": build_mamba,
    "gemma2": build_gemma2,
    "jamba": build_jamba,
    "qwen2vl": build_qwen2vl,
    "gemma3": build_gemma3,
    "qwen3": build_qwen3,
    "llama4": build_llama4,
    "mamba2": build_mamba2,
    "rwkv6": build_rwkv6,
    "lfm2": build_lfm2,
    "lfm2-swa": build_lfm2_swa,
    "bloom": build_bloom,
    "t5": build_t5,
    "gemma4": build_gemma4,
    "llama-h64": build_llama_h64,
    "qwen3-h128": build_qwen3_h128,
    "stablelm-rot32": build_stablelm_rot32,
    "qwen4exp": build_qwen4exp,
    "glm5-next": build_glm5_next,
    "minimax-m3": build_minimax_m3,
    "gemma4-assistant": build_gemma4_assistant,
    "dflash": build_dflash,
    "deepseek4": build_deepseek4,
}
