"""Model hyper-parameters the memory modules need (a subset of llama.cpp's ``llama_hparams``).

Where llama.cpp has a field and a per-layer getter of the same name (``n_head`` / ``n_head(il)``),
the field keeps the name and the getter gets an ``_l`` suffix (``n_head_l(il)``, ``n_head_kv_l(il)``,
``n_embd_head_k_l(il)``, ``n_rot_l(il)``). ``n_layer`` is llama.cpp's ``n_layer_all`` (every block in
the file, including ``n_layer_nextn`` trailing MTP blocks).

``HParams.from_gguf(path)`` follows llama.cpp's ``llama_model_base::load_hparams`` (October 2026) and
the per-arch ``load_arch_hparams`` of the architectures listed in ``SUPPORTED_ARCHS``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict, TypeVar, cast, overload

import numpy as np
import numpy.typing as npt

from ._backend import select
from .archs import _ARCH_ROPE_IF_MROPE, ARCH_ROPE_TYPE, HYBRID_ARCHS, RECURRENT_ARCHS
from .constants import LLAMA_MAX_LAYERS, RopeType, SWAType
from .errors import HParamsError

_gguf = select("gguf")  # the walk over a vocabulary's strings: kvref/_gguf_py.py, or its Cython twin


_Positions = npt.NDArray[np.int32] | npt.NDArray[np.int64]  # positions (cells keep int32, batches int64)


@overload
def is_masked_swa(n_swa: int, swa_type: SWAType | int, p0: int, p1: int) -> bool: ...
@overload
def is_masked_swa(
    n_swa: int, swa_type: SWAType | int, p0: _Positions, p1: _Positions | int
) -> npt.NDArray[np.bool_]: ...
@overload
def is_masked_swa(n_swa: int, swa_type: SWAType | int, p0: int, p1: _Positions) -> npt.NDArray[np.bool_]: ...


def is_masked_swa(
    n_swa: int, swa_type: SWAType | int, p0: _Positions | int, p1: _Positions | int
) -> bool | npt.NDArray[np.bool_]:
    """llama_hparams::is_masked_swa: is key position p0 outside the window of query position p1.

    ``p0`` and ``p1`` are ints (the result is a bool) or NumPy integer arrays (elementwise, broadcast).
    """
    if swa_type == SWAType.STANDARD:  # the last n_swa positions up to p1
        return p1 - p0 >= n_swa
    if swa_type == SWAType.CHUNKED:  # from the start of p1's chunk
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == SWAType.SYMMETRIC:  # n_swa/2 either side of p1
        half = n_swa // 2
        d = p1 - p0
        return (d < -half) | (d > half)
    if np.ndim(p0) or np.ndim(p1):
        return np.zeros(np.broadcast(p0, p1).shape, dtype=bool)
    return False


def swa_pattern(n_layer: int, n_pattern: int, dense_first: bool = False) -> tuple[bool, ...]:
    """llama_hparams::set_swa_pattern as a value: which of ``n_layer`` layers are SWA.

    Every ``n_pattern``-th layer is dense: the last of each group, or the first with ``dense_first``.
    ``n_pattern == 0``: all layers SWA; ``n_pattern == 1``: none.
    """
    if dense_first:
        return tuple(n_pattern == 0 or il % n_pattern != 0 for il in range(n_layer))
    return tuple(n_pattern == 0 or il % n_pattern < n_pattern - 1 for il in range(n_layer))


_V = TypeVar("_V", int, bool)  # a per-layer field's value: a count or a flag


def _per_layer(name: str, value: _V | Sequence[_V], n_layer: int, conv: Callable[[_V], _V]) -> _V | tuple[_V, ...]:
    """Scalar stays scalar; a sequence must have one entry per layer and becomes a tuple."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return conv(cast(_V, value))  # a str / bytes is converted (or refused) like any scalar
    if len(value) != n_layer:
        raise HParamsError(f"{name} has {len(value)} per-layer values, expected n_layer = {n_layer}")
    return tuple(conv(v) for v in value)


def _at(value: _V | Sequence[_V], il: int) -> _V:
    # __post_init__ made every per-layer field a scalar or a tuple
    return value[il] if isinstance(value, tuple) else cast(_V, value)


@dataclass
class HParams:
    """Model hyper-parameters as llama_hparams holds them (the part the memory modules use).

    ``n_head``, ``n_head_kv``, ``n_ff`` and the ``*_layers`` flags take one value for every layer or one per layer;
    ``n_head_kv``, the head sizes and ``n_rot`` left at None / 0 get llama.cpp's defaults. Build one by hand or
    with `from_gguf`.
    """

    arch: str = "llama"
    n_layer: int = 1  # llama.cpp's n_layer_all
    n_embd: int = 0
    n_head: int | Sequence[int] = 1
    n_head_kv: int | Sequence[int] | None = None  # default: n_head (like llama.cpp)
    n_embd_head_k: int = 0  # 0: n_embd // n_head_l(0) (like llama.cpp)
    n_embd_head_v: int = 0
    # per layer: does it attend with a sliding window / does it have recurrent state
    swa_layers: bool | Sequence[bool] = False
    recurrent_layers: bool | Sequence[bool] = False
    n_swa: int = 0
    swa_type: SWAType = SWAType.NONE
    n_layer_kv_from_start: int = -1
    rope_type: RopeType = RopeType.NORM
    n_rot: int = 0  # n_rot_full; 0: n_embd_head_k
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    rope_freq_base_swa: float | None = None
    rope_freq_scale_swa: float | None = None
    use_alibi: bool = False
    causal_attn: bool = True
    n_vocab: int = 0
    # recurrent (Mamba / RWKV) sizes, see n_embd_r() / n_embd_s()
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    extra: dict = field(default_factory=dict)
    # --- per-layer-kind head sizes and the rest kvref's memories need beyond the above ---
    n_embd_head_k_swa: int = 0  # head sizes of SWA layers; 0: same as the full-attention layers
    n_embd_head_v_swa: int = 0
    n_rot_swa: int = 0  # 0: n_rot
    n_layer_nextn: int = 0  # trailing MTP blocks (counted in n_layer)
    n_embd_head_k_mla: int = 0  # MLA (deepseek2): both non-zero, the cache then stores no V
    n_embd_head_v_mla: int = 0
    rope_sections: tuple[int, ...] = (0, 0, 0, 0)  # the four M-RoPE sections (__post_init__ checks the count)
    rope_layers: bool | Sequence[bool] = True  # llama.cpp's rope_pattern: layers that use RoPE
    n_ctx_train: int = 0
    n_ff: int | Sequence[int] = 0
    ssm_dt_rank: int = 0
    wkv_head_size: int = 0  # RWKV
    token_shift_count: int = 2  # RWKV
    n_shortconv_l_cache: int = 0  # LFM2
    n_embd_head_kda: int = 0  # Kimi linear (KDA)
    n_embd_head_la: int = 0  # MiniMax-01 linear attention
    f_max_alibi_bias: float = 0.0
    # --- optional hparams of llama_hparams (llama-hparams.h) some code paths read; llama.cpp's defaults ---
    n_rel_attn_bkts: int = 0  # T5 relative-position buckets (fill_pos_bucket's default)
    n_lora_kv: int = 0  # MLA KV LoRA rank (deepseek2, minicpm3, plm): > 0 keeps K's "nope" dims out of the K-shift
    non_causal_type: int = 0  # llama_non_causal_type: 0 ALL, 1 SWA_ONLY (gemma4), 2 SWA_FULL (deepseek4)
    indexer_head_size: int = 0  # DSA / qwen4exp indexer key length
    indexer_top_k: int = 0  # DSA: keys the lightning indexer selects (hy_v4 without an indexer: 0)
    # llama.cpp's is_indexer_full_impl over the trunk layers: layers that own an indexer (the others reuse the top-k
    # of the last full one); MTP blocks have no entry (is_indexer_full aborts past the trunk)
    indexer_full_layers: bool | Sequence[bool] = False
    # llama_memory_hybrid_idx (glm5-next, qwen4exp): glm5-next's k-pool size (the indexer caches key | gate | pooled
    # per token; its indexer layers are indexer_full_layers, its budget indexer_top_k), qwen4exp's per-layer QSA
    # block ratio
    indexer_kpool: int = 0
    indexer_kpool_select_tail: bool = True  # glm5-next: the incomplete tail is selected too (llama.cpp's default)
    # per layer: qwen4exp's QSA block ratio (0: dense); DeepSeek-V4's 0 (raw only), 4 (CSA + indexer) or 128 (HCA)
    dsv4_compress_ratios: tuple[int, ...] = ()
    router_layer: int = -1  # >= 0: n_layer_nextn counts a router layer, not MTP blocks (granite-switch)
    dsv4_hc_mult: int = 0  # hyper-connection count (DeepSeek-V4, qwen4exp)
    # MiniMax-M3 sparse attention (MSA): the leading dense layers have no indexer; the indexer's position blocks
    n_layer_dense_lead: int = 0
    indexer_block_size: int = 0
    indexer_local_blocks: int = 0
    # per-layer n-gram embeddings (PLE, qwen4exp); ple_n_heads = (ple_ngram_size - 1) * heads per n-gram
    ple_ngram_size: int = 0
    ple_conv_kernel: int = 0
    ple_n_heads: int = 0
    ple_eos_token_id: int = 0
    ple_image_token_id: int = 0  # 0: image positions use ple_eos_token_id
    ple_layers: bool | Sequence[bool] = False  # llama.cpp's is_ple_impl: layers with a PLE module

    def __post_init__(self) -> None:
        n = int(self.n_layer)
        if not 0 < n <= LLAMA_MAX_LAYERS:
            raise HParamsError(f"n_layer = {n} must be in [1, {LLAMA_MAX_LAYERS}]")
        self.n_layer = n
        if not 0 <= self.n_layer_nextn <= n:
            raise HParamsError(f"n_layer_nextn = {self.n_layer_nextn} must be in [0, n_layer = {n}]")
        self.n_head = _per_layer("n_head", self.n_head, n, int)
        if self.n_head_kv is None:
            self.n_head_kv = self.n_head
        self.n_head_kv = _per_layer("n_head_kv", self.n_head_kv, n, int)
        self.n_ff = _per_layer("n_ff", self.n_ff, n, int)
        self.swa_layers = _per_layer("swa_layers", self.swa_layers, n, bool)
        self.recurrent_layers = _per_layer("recurrent_layers", self.recurrent_layers, n, bool)
        self.rope_layers = _per_layer("rope_layers", self.rope_layers, n, bool)
        self.ple_layers = _per_layer("ple_layers", self.ple_layers, n, bool)
        self.indexer_full_layers = _per_layer("indexer_full_layers", self.indexer_full_layers, n, bool)
        self.dsv4_compress_ratios = tuple(int(x) for x in self.dsv4_compress_ratios)
        self.dsv4_compress_ratios = tuple(int(x) for x in self.dsv4_compress_ratios)
        for il in range(n):
            if self.n_head_l(il) < 0 or self.n_head_kv_l(il) < 0:
                raise HParamsError(f"layer {il}: negative head count")
        self.swa_type = SWAType(self.swa_type)
        self.rope_type = RopeType(self.rope_type)
        if self.swa_type == SWAType.NONE and self.is_swa_any():
            raise HParamsError("swa_layers marks SWA layers but swa_type is NONE (set swa_type and n_swa)")
        if self.swa_type != SWAType.NONE and self.n_swa <= 0:
            raise HParamsError(f"swa_type {self.swa_type.name} needs n_swa > 0, got n_swa = {self.n_swa}")
        if self.n_layer_kv_from_start > n:
            raise HParamsError(f"n_layer_kv_from_start = {self.n_layer_kv_from_start} > n_layer = {n}")
        if (self.n_embd_head_k_mla == 0) != (self.n_embd_head_v_mla == 0):
            raise HParamsError("n_embd_head_k_mla and n_embd_head_v_mla must be both zero or both non-zero")
        if len(self.rope_sections) != 4:
            raise HParamsError(f"rope_sections needs 4 values, got {len(self.rope_sections)}")
        self.rope_sections = tuple(int(x) for x in self.rope_sections)

        # llama.cpp's defaults: head sizes from n_embd / n_head(0) (0 for non-transformers), n_rot
        # from the key head size, SWA variants from the full-attention values
        h0 = self.n_head_l(0)
        if self.n_embd_head_k == 0 and h0 > 0:
            self.n_embd_head_k = self.n_embd // h0
        if self.n_embd_head_v == 0 and h0 > 0:
            self.n_embd_head_v = self.n_embd // h0
        if self.n_rot == 0:
            self.n_rot = self.n_embd_head_k
        if self.n_embd_head_k_swa == 0:
            self.n_embd_head_k_swa = self.n_embd_head_k
        if self.n_embd_head_v_swa == 0:
            self.n_embd_head_v_swa = self.n_embd_head_v
        if self.n_rot_swa == 0:
            self.n_rot_swa = self.n_rot
        if self.f_max_alibi_bias > 0.0:
            self.use_alibi = True

    # ------------------------------------------------------------ per layer

    def _check_il(self, il: int) -> None:
        if not 0 <= il < self.n_layer:
            raise HParamsError(f"layer index {il} out of range [0, {self.n_layer})")

    def n_layer_trunk(self) -> int:
        """llama_hparams::n_layer(): the layers before the trailing MTP blocks."""
        return self.n_layer - self.n_layer_nextn

    def n_head_l(self, il: int = 0) -> int:
        """llama_hparams::n_head(il): query heads of layer il."""
        self._check_il(il)
        return _at(self.n_head, il)

    def n_head_kv_l(self, il: int = 0) -> int:
        """llama_hparams::n_head_kv(il): KV heads of layer il."""
        self._check_il(il)
        return _at(cast("int | Sequence[int]", self.n_head_kv), il)  # None became n_head in __post_init__

    def n_ff_l(self, il: int = 0) -> int:
        """llama_hparams::n_ff(il): feed-forward width of layer il."""
        self._check_il(il)
        return _at(self.n_ff, il)

    def n_gqa(self, il: int = 0) -> int:
        """llama_hparams::n_gqa(il): query heads per KV head of layer il (0 when it has no KV heads)."""
        kv = self.n_head_kv_l(il)
        return 0 if kv == 0 else self.n_head_l(il) // kv

    def n_embd_head_k_l(self, il: int = 0) -> int:
        """Key head size of layer il (SWA layers may have their own)."""
        return self.n_embd_head_k_swa if self.is_swa(il) else self.n_embd_head_k

    def n_embd_head_v_l(self, il: int = 0) -> int:
        """Value head size of layer il (SWA layers may have their own)."""
        return self.n_embd_head_v_swa if self.is_swa(il) else self.n_embd_head_v

    def n_rot_l(self, il: int = 0) -> int:
        """llama_hparams::n_rot(il): rotated dimensions of layer il (SWA layers may have their own)."""
        return self.n_rot_swa if self.is_swa(il) else self.n_rot

    def n_embd_k_gqa(self, il: int = 0) -> int:
        """Key width of one cell in layer il: head size x KV heads."""
        return self.n_embd_head_k_l(il) * self.n_head_kv_l(il)

    def n_embd_v_gqa(self, il: int = 0) -> int:
        """Value width of one cell in layer il: head size x KV heads (llama_hparams::n_embd_v_gqa)."""
        return self.n_embd_head_v_l(il) * self.n_head_kv_l(il)

    def is_n_embd_k_gqa_variable(self) -> bool:
        """llama_hparams::is_n_embd_k_gqa_variable: the layers' key widths differ."""
        return len({self.n_embd_k_gqa(il) for il in range(self.n_layer)}) > 1

    def is_n_embd_v_gqa_variable(self) -> bool:
        """llama_hparams::is_n_embd_v_gqa_variable: the layers' value widths differ."""
        return len({self.n_embd_v_gqa(il) for il in range(self.n_layer)}) > 1

    def n_embd_k_gqa_max(self) -> int:
        """llama_hparams::n_embd_k_gqa_max: the largest key width of any layer."""
        return max(self.n_embd_k_gqa(il) for il in range(self.n_layer))

    def n_embd_v_gqa_max(self) -> int:
        """The V width a transposed V cache pads every layer to (llama.cpp's TAG_V_CACHE_VARIABLE)."""
        return max(self.n_embd_v_gqa(il) for il in range(self.n_layer))

    def is_swa(self, il: int) -> bool:
        """llama_hparams::is_swa(il): layer il attends through the sliding window."""
        self._check_il(il)
        return _at(self.swa_layers, il)

    def is_swa_any(self) -> bool:
        """llama_hparams::is_swa_any: some layer attends through the sliding window."""
        return any(_at(self.swa_layers, il) for il in range(self.n_layer))

    def is_recurrent(self, il: int) -> bool:
        """llama_hparams::is_recr: layer il keeps recurrent state (hybrids; every layer of Mamba/RWKV)."""
        self._check_il(il)
        return _at(self.recurrent_layers, il)

    is_recr = is_recurrent

    def has_kv(self, il: int) -> bool:
        """llama_hparams::has_kv: only ``n_layer_kv_from_start`` matters here.

        Recurrent layers are kept out of the attention cache by the memory's layer filter, not by
        this rule (falcon-h1 layers are both); see ``attn_layer_filter``.
        """
        self._check_il(il)
        if self.n_layer_kv_from_start >= 0:
            return il < self.n_layer_kv_from_start
        return True

    def has_rope(self, il: int) -> bool:
        """Does layer il apply RoPE (llama.cpp's rope_pattern, here ``rope_layers``)."""
        self._check_il(il)
        return _at(self.rope_layers, il)

    def is_ple(self, il: int) -> bool:
        """llama_hparams::is_ple(il): layer il has a per-layer n-gram embedding module (``ple_layers``)."""
        self._check_il(il)
        return bool(_at(self.ple_layers, il))

    def is_indexer_full(self, il: int) -> bool:
        """llama_hparams::is_indexer_full(il): trunk layer il owns a lightning indexer (``indexer_full_layers``);
        past the trunk llama.cpp aborts (GGML_ABORT): HParamsError."""
        if not 0 <= il < self.n_layer_trunk():
            raise HParamsError(
                f"is_indexer_full: layer {il} out of bounds (n_layer: {self.n_layer_trunk()}; llama.cpp aborts)"
            )
        return bool(_at(self.indexer_full_layers, il))

    def ple_conv_state(self) -> int:
        """llama_hparams::ple_conv_state: width of a PLE layer's conv-history row, 0 without a PLE module."""
        if self.ple_n_heads == 0 or self.ple_conv_kernel == 0:
            return 0
        # dilation equals the n-gram size, matching the reference module
        return (self.ple_conv_kernel - 1) * self.ple_ngram_size * self.dsv4_hc_mult * self.n_embd

    def set_swa_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """llama_hparams::set_swa_pattern over the trunk layers; MTP blocks are dense."""
        trunk = swa_pattern(self.n_layer_trunk(), n_pattern, dense_first)
        self.swa_layers = trunk + (False,) * self.n_layer_nextn

    def set_recr_pattern(self, n_pattern: int, dense_first: bool = False) -> None:
        """Like set_swa_pattern, for ``recurrent_layers``: every ``n_pattern``-th trunk layer is not
        recurrent (the last of each group, or the first with ``dense_first``); MTP blocks are not recurrent.
        """
        trunk = swa_pattern(self.n_layer_trunk(), n_pattern, dense_first)
        self.recurrent_layers = trunk + (False,) * self.n_layer_nextn

    # ------------------------------------------------------------ model-wide

    def n_pos_per_embd(self) -> int:
        """Positions per token: 4 (GGML_MROPE_SECTIONS) for MROPE / IMROPE, else 1."""
        return 4 if self.rope_type in (RopeType.MROPE, RopeType.IMROPE) else 1

    def use_mrope(self) -> bool:
        """llama_hparams::use_mrope: the model has M-RoPE sections (sections 0 and 1 both > 0)."""
        return self.rope_sections[0] > 0 and self.rope_sections[1] > 0

    def is_mla(self) -> bool:
        """llama_hparams::is_mla: both MLA head sizes are set (the KV cache then stores no V)."""
        return self.n_embd_head_k_mla != 0 and self.n_embd_head_v_mla != 0

    def n_embd_r(self) -> int:
        """Width of the rolling (conv / token-shift) state row, as llama_hparams::n_embd_r."""
        if self.wkv_head_size != 0:  # RWKV token shift
            return self.token_shift_count * self.n_embd
        if self.n_shortconv_l_cache != 0:  # LFM2 short conv
            return self.n_embd * (self.n_shortconv_l_cache - 1)
        if self.n_embd_head_kda != 0:  # Kimi KDA: conv state for Q, K and V
            d_inner = self.n_head_l(0) * self.n_embd_head_kda
            return 3 * (self.ssm_d_conv - 1 if self.ssm_d_conv > 0 else 3) * d_inner
        # Mamba conv state: the first column is shifted out, hence d_conv - 1
        d_conv = self.ssm_d_conv - 1 if self.ssm_d_conv > 0 else 0
        return d_conv * (self.ssm_d_inner + 2 * self.ssm_n_group * self.ssm_d_state)

    def n_embd_s(self) -> int:
        """Width of the recurrent (SSM / wkv) state row, as llama_hparams::n_embd_s."""
        if self.wkv_head_size != 0:
            return self.n_embd * self.wkv_head_size
        if self.n_embd_head_kda != 0:
            return self.n_embd_head_kda * self.n_embd_head_kda * self.n_head_l(0)
        if self.n_embd_head_la != 0:
            return self.n_embd_head_la * self.n_embd_head_la * self.n_head_l(0)
        return self.ssm_d_state * self.ssm_d_inner

    def is_recurrent_arch(self) -> bool:
        """llm_arch_is_recurrent: the architecture is purely recurrent (Mamba, RWKV)."""
        return self.arch in RECURRENT_ARCHS

    def is_hybrid_arch(self) -> bool:
        """llm_arch_is_hybrid: the architecture mixes attention and recurrent layers."""
        return self.arch in HYBRID_ARCHS

    def memory_kind(self) -> str:
        """Which memory llama_model::create_memory builds for the plain archs kvref models.

        ``"recurrent"``, ``"hybrid"``, ``"hybrid_iswa"`` (hybrid with SWA), ``"hybrid_idx"`` (glm5-next, qwen4exp
        with an indexer), ``"iswa"``, ``"msa"`` (minimax-m3), ``"dsv4"`` (deepseek4: llama_kv_cache_dsv4) or ``"kv"``.
        """
        if self.arch == "minimax-m3":
            return "msa"
        if self.arch == "deepseek4":
            return "dsv4"
        if self.is_recurrent_arch():
            return "recurrent"
        if self.arch == "glm5-next" or (
            self.arch == "qwen4exp" and self.indexer_head_size > 0 and self.swa_type == SWAType.NONE
        ):
            return "hybrid_idx"
        if self.is_hybrid_arch():
            return "hybrid_iswa" if self.swa_type != SWAType.NONE else "hybrid"
        return "iswa" if self.swa_type != SWAType.NONE else "kv"

    def attn_layer_filter(self, il: int) -> bool:
        """Does the attention cache of the hybrid memory keep layer il (create_memory's filter_attn)."""
        if self.arch == "falcon-h1":
            return True
        if self.arch in ("nemotron_h", "nemotron_h_moe"):
            return not self.is_recurrent(il) and self.n_ff_l(il) == 0
        if self.arch in ("qwen3next", "qwen35", "qwen35moe", "qwen4exp", "minimax-01"):
            return il < self.n_layer_trunk() and not self.is_recurrent(il)
        return not self.is_recurrent(il)

    def recr_layer_filter(self, il: int) -> bool:
        """Does the recurrent memory of the hybrid memory keep layer il (filter_recr)."""
        if self.arch == "falcon-h1":
            return True
        if self.arch in ("nemotron_h", "nemotron_h_moe"):
            return self.is_recurrent(il) and self.n_ff_l(il) == 0
        if self.arch in ("qwen3next", "qwen35", "qwen35moe", "qwen4exp", "minimax-01"):
            return il < self.n_layer_trunk() and self.is_recurrent(il)
        return self.is_recurrent(il)

    # ------------------------------------------------------------ from GGUF

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> HParams:
        """Read the hyper-parameters from a GGUF model file's metadata, as llama.cpp loads them."""
        return _load_gguf(cls, path)


# ---------------------------------------------------------------------------------------------------
# GGUF loading (llama_model_base::load_hparams + the per-arch load_arch_hparams)

_REQUIRED = object()

# plain transformer archs whose load_arch_hparams touches nothing the memory uses: the common keys
# are all there is to read (checked against src/models/*.cpp, October 2026)
_GENERIC = """
    apertus arcee arctic baichuan bailingmoe bailingmoe2 bert bitnet chameleon chatglm codeshell cogvlm
    command-r dbrx deci deepseek deepseek2-ocr dots1 eagle3 eurobert exaone falcon gemma gpt2 gptneox
    granitemoe grok grovemoe hrm_text hunyuan-moe hy_v3 internlm2 jais2 jina-bert-v3 llama llama-embed
    maincoder minicpm minicpm3 minimax-m2 minimax-m3 mistral3 nemotron neo-bert nomic-bert nomic-bert-moe
    olmo olmoe openelm orion pangu-embedded phi2 phimoe plamo plm pockettts qwen qwen2 qwen2moe qwen3
    qwen3moe seed_oss smollm3 stablelm starcoder starcoder2 t5 t5encoder talkie xverse
"""
GENERIC_ARCHS = frozenset(_GENERIC.split())
# archs with their own rules below
SPECIAL_ARCHS = frozenset({
    "gemma2", "gemma3", "mamba", "mamba2", "jamba", "falcon-h1", "granitehybrid", "lfm2", "nemotron_h",
    "qwen2vl", "qwen3vl", "qwen3vlmoe", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7", "bloom", "refact", "mpt",
    "jais", "jina-bert-v2", "llama4", "glm-dsa", "deepseek32", "dots3note", "hy_v4", "qwen4exp", "deepseek4",
    "glm5-next", "gemma4-assistant", "dflash", "gemma4",
})  # fmt: skip
SUPPORTED_ARCHS = GENERIC_ARCHS | SPECIAL_ARCHS


def _arch_required(arch: str) -> tuple[str, ...]:
    """The keys llama.cpp requires for ``arch`` beyond the common ones (gguf.Keys templates or arch-relative
    suffixes): values the memory does not use included, so that a file llama.cpp refuses is refused here too."""
    from gguf import Keys as K  # imported lazily like the rest of gguf (see _GGUFMeta)

    rms = K.Attention.LAYERNORM_RMS_EPS
    ssm = (K.SSM.CONV_KERNEL, K.SSM.INNER_SIZE, K.SSM.STATE_SIZE, K.SSM.TIME_STEP_RANK)
    group = "ssm.group_count"  # gguf 0.16 has no Keys.SSM.GROUP_COUNT
    l_cache = "shortconv.l_cache"  # gguf 0.16 has no Keys.ShortConv
    moe_step = "interleave_moe_layer_step"  # gguf 0.16 has no Keys.LLM.INTERLEAVE_MOE_LAYER_STEP
    sections, wkv = K.Rope.DIMENSION_SECTIONS, K.WKV.HEAD_SIZE
    # the DeepSeek-sparse-attention archs (gguf 0.16 has no Keys for the MLA ranks nor the indexer)
    mla = ("attention.q_lora_rank", "attention.kv_lora_rank")
    indexer = ("attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k")
    dsa_moe = (rms, "expert_feed_forward_length", "expert_shared_count")
    hc = ("hyper_connection.count", "hyper_connection.sinkhorn_iterations", "hyper_connection.epsilon")
    # gemma4 / gemma4-assistant: the pattern array, the window and the SWA head sizes
    gemma4_swa = (
        "attention.sliding_window_pattern",
        K.Attention.SLIDING_WINDOW,
        "attention.key_length_swa",
        "attention.value_length_swa",
    )
    # fmt: off
    table: dict[str, tuple[str, ...]] = {
        "llama": (rms,), "qwen2": (rms,), "gemma2": (rms,), "gemma3": (rms,),
        "mamba": (*ssm, rms), "mamba2": (*ssm, group, rms), "jamba": (*ssm, rms),
        "falcon-h1": (rms, *ssm, group), "granitehybrid": (rms, *ssm, group),
        "nemotron_h": (*ssm, group, K.Attention.LAYERNORM_EPS),
        "lfm2": (l_cache, rms),
        "qwen2vl": (sections,), "qwen3vl": (sections, rms), "qwen3vlmoe": (sections, rms),
        "rwkv6": (wkv,), "rwkv6qwen2": (wkv,), "rwkv7": (wkv,), "arwkv7": (wkv,),
        "llama4": (rms, K.LLM.EXPERT_FEED_FORWARD_LENGTH, moe_step),
        "glm-dsa": (*dsa_moe, *mla, *indexer),
        "deepseek32": (*dsa_moe, *mla, *indexer, "expert_gating_func"),
        "dots3note": (rms, "expert_shared_count", "expert_feed_forward_length", "leading_dense_block_count",
                      "expert_gating_func", *mla, "attention.key_length_mla", "attention.value_length_mla",
                      "attention.kv_lora_rank_swa", "attention.key_length_mla_swa", "attention.value_length_mla_swa",
                      "attention.sliding_window", "rope.freq_base_swa", "attention.sliding_window_pattern",
                      *indexer, "attention.indexer.types"),
        "hy_v4": (rms, *mla, "attention.key_length_mla", "attention.value_length_mla", "expert_feed_forward_length",
                  "expert_shared_count", "hyper_connection.count", "hyper_connection.epsilon",
                  "hyper_connection.magnitude"),
        "qwen4exp": (rms, sections, *ssm, group, "hyper_connection.count", "hyper_connection.low_rank",
                     "attention.indexer.head_count", "attention.indexer.key_length", "attention.indexer.top_k"),
        "deepseek4": (rms, K.Attention.SLIDING_WINDOW, "attention.indexer.key_length", "attention.compress_ratios",
                      "hyper_connection.count"),
        "glm5-next": (rms, "attention.key_length_mla", "attention.value_length_mla", *mla, K.SSM.CONV_KERNEL,
                      "kda.head_dim", "expert_feed_forward_length", "expert_shared_count", *indexer,
                      "attention.indexer.kpool", *hc),
        "gemma4-assistant": (gemma4_swa[0], gemma4_swa[1], rms, *gemma4_swa[2:]),
        "gemma4": (gemma4_swa[0], gemma4_swa[1], rms, "embedding_length_per_layer_input", *gemma4_swa[2:]),
        "dflash": (rms,),
    }
    # fmt: on
    return table.get(arch, ())


# a GGUF metadata value as gguf's ReaderField.contents() gives it: a scalar, or an array flattened to a list
GGUFScalar = str | int | float | bool
GGUFContents = GGUFScalar | list[GGUFScalar]
_GGUFPerLayer = GGUFScalar | tuple[GGUFScalar, ...]  # get_key_or_arr: one value for all layers, or one per layer
_D = TypeVar("_D")


class HParamsArgs(TypedDict, total=False):
    """`HParams` keyword arguments: the fields `HParams.from_gguf` reads from a GGUF file and the conformance
    runner from a golden case's ``model.hparams`` (``HParams(**args)``)."""

    arch: str
    n_layer: int
    n_layer_nextn: int
    n_layer_kv_from_start: int
    n_embd: int
    n_ff: int | Sequence[int]
    n_head: int | Sequence[int]
    n_head_kv: int | Sequence[int] | None
    n_embd_head_k: int
    n_embd_head_v: int
    n_embd_head_k_swa: int
    n_embd_head_v_swa: int
    n_embd_head_k_mla: int
    n_embd_head_v_mla: int
    n_rot: int
    n_rot_swa: int
    n_lora_kv: int
    n_ctx_train: int
    n_vocab: int
    causal_attn: bool
    swa_layers: bool | Sequence[bool]
    recurrent_layers: bool | Sequence[bool]
    rope_layers: bool | Sequence[bool]
    n_swa: int
    swa_type: SWAType
    rope_type: RopeType
    rope_freq_base: float
    rope_freq_scale: float
    rope_freq_base_swa: float | None
    rope_freq_scale_swa: float | None
    rope_sections: tuple[int, ...]
    use_alibi: bool
    f_max_alibi_bias: float
    non_causal_type: int
    n_rel_attn_bkts: int
    ssm_d_conv: int
    ssm_d_inner: int
    ssm_d_state: int
    ssm_n_group: int
    ssm_dt_rank: int
    wkv_head_size: int
    token_shift_count: int
    n_shortconv_l_cache: int
    indexer_head_size: int
    indexer_top_k: int
    indexer_full_layers: bool | Sequence[bool]
    dsv4_compress_ratios: tuple[int, ...]
    dsv4_hc_mult: int
    indexer_kpool: int
    indexer_kpool_select_tail: bool
    n_embd_head_kda: int
    # minimax-m3 (MSA)
    n_layer_dense_lead: int
    indexer_block_size: int
    indexer_local_blocks: int


class _GGUFValue:
    """One metadata value as stored: its type (``types``: the value type, then an array's element types, as
    gguf's ReaderField has them), decoded on demand. Arrays are not materialised until asked for."""

    __slots__ = ("_count", "_decoded", "_offset", "_parser", "key", "types")

    def __init__(self, types: list[int], parser: _GGUFParser, offset: int, count: int = 1, key: str = "") -> None:
        self.types, self.key = types, key
        self._parser, self._offset, self._count = parser, offset, count
        self._decoded: GGUFContents | None = None  # not decoded yet (no value decodes to None)

    @property
    def n_elements(self) -> int:
        """An array's element count, nested arrays flattened as gguf does (1 for a scalar)."""
        return self._count

    def contents(self) -> GGUFContents:
        """The value as gguf's ReaderField.contents() gives it (str, int, float, bool, or a flat list).

        A string that is not UTF-8 is an HParamsError naming the key (llama.cpp keeps the bytes, but no key whose
        value kvref reads can hold such a string)."""
        if self._decoded is None:
            try:
                self._decoded = self._parser.decode(self.types, self._offset)
            except UnicodeDecodeError as e:
                raise HParamsError(
                    f"key {self.key}: a string of its value is not valid UTF-8 ({e.reason} at byte {e.start})"
                ) from None
        return self._decoded

    def raw_strings(self) -> list[bytes]:
        """The strings of an array of strings, as bytes (not decoded)."""
        return list(self._parser.raw_strings(self._offset))


# value type -> struct format and size (GGUFValueType: 0 u8 .. 7 bool, 8 string, 9 array, 10 u64 .. 12 f64)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_INTS = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_GGUF_TYPE_NAMES = {0: "u8", 1: "i8", 2: "u16", 3: "i16", 4: "u32", 5: "i32", 6: "f32", 7: "bool", 8: "string"}
_GGUF_TYPE_NAMES |= {9: "array", 10: "u64", 11: "i64", 12: "f64"}
# what a key read as each kind may hold: llama.cpp wants the exact type; kvref takes any integer for an integer and
# refuses what cannot be one (a string, an array, NaN)
_GGUF_KINDS = {"int": _GGUF_INTS, "float": _GGUF_INTS | {6, 12}, "bool": _GGUF_INTS | {7}, "str": {8}}
_MAX_NESTING = 8  # arrays of arrays: gguf-py flattens them, llama.cpp refuses them


class _GGUFParser:
    """A GGUF metadata reader: the header and the key/value pairs, nothing else (no tensor infos, no data).

    gguf's GGUFReader builds NumPy views of every value, a 262,144-token vocabulary included; this reads each
    pair's key and type and notes where its value lies. Arrays are skipped by their byte length: numeric ones
    in one step, string arrays by their length prefixes. Every count is bounded by the bytes left, so a lying
    header fails fast instead of allocating or looping."""

    def __init__(self, buf: memoryview, end: int, order: str = "<") -> None:
        import struct

        self.buf, self.end, self.order = buf, end, order
        self._u32 = struct.Struct(order + "I").unpack_from
        self._u64 = struct.Struct(order + "Q").unpack_from
        self._struct = struct

    def _need(self, at: int, n: int, what: str) -> None:
        if n > self.end - at:
            raise ValueError(
                f"truncated GGUF metadata: {what} at offset {at} needs {n} bytes, {max(self.end - at, 0)} left"
            )

    def u32(self, at: int, what: str) -> int:
        self._need(at, 4, what)
        v: int = self._u32(self.buf, at)[0]
        return v

    def u64(self, at: int, what: str) -> int:
        self._need(at, 8, what)
        v: int = self._u64(self.buf, at)[0]
        return v

    def string(self, at: int, what: str) -> tuple[bytes, int]:
        n = self.u64(at, what)
        self._need(at + 8, n, what)
        return bytes(self.buf[at + 8 : at + 8 + n]), at + 8 + n

    def value_type(self, raw: int) -> int:
        if raw not in _GGUF_SCALARS and raw not in (_GGUF_STRING, _GGUF_ARRAY):
            raise ValueError(f"Unknown/unhandled field type {raw}")
        return raw

    def skip(self, vtype: int, at: int, what: str, depth: int = 0) -> tuple[list[int], int, int]:
        """Step over one value: (its types, its element count (1 for a scalar), the offset after it)."""
        if vtype == _GGUF_STRING:
            n = self.u64(at, what)
            self._need(at + 8, n, what)
            return [vtype], 1, at + 8 + n
        if vtype != _GGUF_ARRAY:
            size = self._struct.calcsize(_GGUF_SCALARS[vtype])
            self._need(at, size, what)
            return [vtype], 1, at + size
        raw_etype, count = self.u32(at, what), self.u64(at + 4, what)
        at += 12
        if count == 0:  # gguf's reader never looks at the element type of an empty array
            return [_GGUF_ARRAY], 0, at
        etype = self.value_type(raw_etype)
        smallest = {_GGUF_STRING: 8, _GGUF_ARRAY: 12}.get(etype) or self._struct.calcsize(_GGUF_SCALARS[etype])
        if count * smallest > self.end - at:
            raise ValueError(f"array {what} of {count} elements does not fit in the {self.end - at} bytes left")
        types = [_GGUF_ARRAY, etype]
        if etype == _GGUF_STRING:
            at, short = _gguf.skip_strings(self.buf, at, count, self.end, self.order == ">")
            if short:  # a length field, or a string, that the bytes left cannot hold
                self._need(at, 8 if short == _gguf.TRUNCATED_LENGTH else 0, what)
                raise ValueError(f"truncated GGUF metadata: a string of {what} runs past the end")
        elif etype == _GGUF_ARRAY:
            if depth >= _MAX_NESTING:  # llama.cpp's gguf reader refuses nested arrays outright
                raise ValueError(f"array {what} nests arrays more than {_MAX_NESTING} deep")
            leaves = 0
            for i in range(count):  # nested arrays (gguf's reader flattens them): walk each
                sub, n, at = self.skip(_GGUF_ARRAY, at, what, depth + 1)
                leaves += n
                if i == 0:
                    types += sub[1:]
            count = leaves
        else:
            at += count * smallest
        return types, count, at

    def decode(self, types: list[int], at: int) -> GGUFContents:
        """The value at ``at`` as gguf's ReaderField.contents() returns it."""
        vtype = types[0]
        if vtype == _GGUF_STRING:
            return self.string(at, "value")[0].decode("utf-8")
        if vtype != _GGUF_ARRAY:
            v: GGUFScalar = self._struct.unpack_from(self.order + _GGUF_SCALARS[vtype], self.buf, at)[0]
            return v
        return list(self._elements(at))

    def raw_strings(self, at: int) -> Iterator[bytes]:
        """The strings of the array of strings at ``at``, undecoded."""
        count = self.u64(at + 4, "array")
        at += 12
        for _ in range(count):
            raw, at = self.string(at, "array")
            yield raw

    def _elements(self, at: int) -> Iterator[GGUFScalar]:
        etype, count = self.u32(at, "array"), self.u64(at + 4, "array")
        at += 12
        if count == 0:
            return
        if etype == _GGUF_STRING:
            for _ in range(count):
                raw, at = self.string(at, "array")
                yield raw.decode("utf-8")
        elif etype == _GGUF_ARRAY:
            for _ in range(count):
                yield from self._elements(at)
                at = self.skip(_GGUF_ARRAY, at, "array")[2]
        else:
            fmt = self._struct.Struct(f"{self.order}{count}{_GGUF_SCALARS[etype]}")
            yield from fmt.unpack_from(self.buf, at)

    def read(self) -> dict[str, _GGUFValue]:
        """The key/value pairs, with gguf's GGUF.version / GGUF.tensor_count / GGUF.kv_count pseudo-keys."""
        if self.end < 4 or bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("GGUF magic invalid")
        version = self.u32(4, "version")
        if version & 0xFFFF == 0:  # written for the other byte order (gguf's reader swaps it)
            swapped = _GGUFParser(self.buf, self.end, ">" if self.order == "<" else "<")
            swapped_version = swapped.u32(4, "version")
            if swapped_version in (2, 3):
                return swapped.read()
            version = swapped_version
        if version not in (2, 3):
            raise ValueError(f"Sorry, file appears to be version {version} which we cannot handle")
        fields: dict[str, _GGUFValue] = {"GGUF.version": _GGUFValue([4], self, 4, key="GGUF.version")}
        fields["GGUF.tensor_count"] = _GGUFValue([10], self, 8, key="GGUF.tensor_count")
        fields["GGUF.kv_count"] = _GGUFValue([10], self, 16, key="GGUF.kv_count")
        n_kv = self.u64(16, "kv_count")
        at = 24
        if n_kv * 13 > self.end - at:  # every pair takes at least a key length, a type and one byte of value
            raise ValueError(f"kv_count {n_kv} cannot fit in the {self.end - at} bytes left")
        for _ in range(n_kv):
            start = at
            raw, at = self.string(at, "key")
            try:
                key = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                why = f"{e.reason} at byte {e.start}"
                raise ValueError(f"the key at offset {start} is not valid UTF-8 ({why})") from None
            vtype = self.value_type(self.u32(at, key))
            types, count, after = self.skip(vtype, at + 4, key)
            if key in fields:
                raise KeyError(f"Duplicate {key} already in list at offset {start}")
            fields[key] = _GGUFValue(types, self, at + 4, count, key)
            at = after
        align = fields.get("general.alignment")
        if align is not None:
            if align.types != [4]:
                raise ValueError("Bad type for general.alignment field")
            a = cast(int, align.contents())  # types [4]: a u32
            if a == 0 or a & (a - 1):
                raise ValueError("Invalid alignment: must be a non-zero power of two")
        return fields


class _GGUFMeta:
    """The metadata of a GGUF file with llama_model_loader's get_key / get_arr / get_key_or_arr rules."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            from gguf import GGUFValueType
        except ImportError as e:  # gguf is a dependency; name what is really missing (gguf or one of its imports)
            raise HParamsError(
                f"HParams.from_gguf cannot import the 'gguf' package: {type(e).__name__}: {e} "
                "(install or upgrade it: pip install 'gguf>=0.16')"
            ) from e
        self._array = GGUFValueType.ARRAY
        try:
            self.fields = _read_gguf_metadata(os.fspath(path))
        except (ValueError, IndexError, OSError, KeyError) as e:
            if isinstance(e, FileNotFoundError):
                raise
            raise HParamsError(f"cannot read GGUF metadata from {os.fspath(path)!r}: {e}") from e
        self.arch = ""

    def key(self, suffix: str) -> str:
        """The full key: a gguf.Keys template (``"{arch}.context_length"``) filled in, or ``arch.suffix``."""
        return suffix.format(arch=self.arch) if "{arch}" in suffix else f"{self.arch}.{suffix}"

    def has(self, suffix: str) -> bool:
        return self.key(suffix) in self.fields

    def is_array(self, suffix: str) -> bool:
        f = self.fields.get(self.key(suffix))
        return f is not None and bool(f.types) and f.types[0] == self._array

    @overload
    def get(self, suffix: str, *, full_key: bool = False) -> GGUFScalar: ...
    @overload
    def get(self, suffix: str, default: _D, *, full_key: bool = False) -> GGUFScalar | _D: ...

    def get(self, suffix: str, default: object = _REQUIRED, *, full_key: bool = False) -> object:
        """A scalar value; ``default`` when absent (absent and no default: llama.cpp's error)."""
        key = suffix if full_key else self.key(suffix)
        f = self.fields.get(key)
        if f is None:
            if default is _REQUIRED:
                raise HParamsError(f"key not found in model: {key}")
            return default
        if f.types and f.types[0] == self._array:
            raise HParamsError(f"key {key} has wrong type array but expected a scalar")
        return f.contents()

    def get_int(self, suffix: str, default: object = _REQUIRED, *, full_key: bool = False) -> int:
        """An integer scalar (any GGUF integer type); HParamsError naming the key for any other type."""
        return int(cast("int", self._typed(suffix, default, full_key, "int")))

    def get_float(self, suffix: str, default: object = _REQUIRED) -> float:
        """A number (f32, f64 or an integer type) as a float; HParamsError naming the key for any other type."""
        return float(cast("float", self._typed(suffix, default, False, "float")))

    def get_bool(self, suffix: str, default: object = _REQUIRED) -> bool:
        """A bool (or an integer); HParamsError naming the key for any other type."""
        return bool(self._typed(suffix, default, False, "bool"))

    def get_str(self, suffix: str, default: object = _REQUIRED, *, full_key: bool = False) -> str:
        """A string; HParamsError naming the key for any other type."""
        return str(self._typed(suffix, default, full_key, "str"))

    def _typed(self, suffix: str, default: object, full_key: bool, kind: str) -> object:
        key = suffix if full_key else self.key(suffix)
        f = self.fields.get(key)
        if f is None or not f.types or f.types[0] == self._array:
            return self.get(suffix, default, full_key=full_key)  # absent: the default, or llama.cpp's errors
        if f.types[0] not in _GGUF_KINDS[kind]:
            raise HParamsError(
                f"key {key} has type {_GGUF_TYPE_NAMES.get(f.types[0], f.types[0])} but kvref reads it as "
                f"{'a ' + kind if kind != 'int' else 'an integer'}"
            )
        return f.contents()

    def get_arr(self, suffix: str) -> list[GGUFScalar] | None:
        """An array value, or ``None`` when absent or not an array (llama.cpp's optional get_arr)."""
        if not self.is_array(suffix):
            return None
        return list(cast("list[GGUFScalar]", self.fields[self.key(suffix)].contents()))

    @overload
    def get_key_or_arr(self, suffix: str, n: int, *, required: Literal[True]) -> _GGUFPerLayer: ...
    @overload
    def get_key_or_arr(self, suffix: str, n: int, *, required: bool = False) -> _GGUFPerLayer | None: ...
    @overload
    def get_key_or_arr(self, suffix: str, n: int, default: _D, required: bool = False) -> _GGUFPerLayer | _D: ...

    def get_key_or_arr(self, suffix: str, n: int, default: object = None, required: bool = False) -> object:
        """A scalar (applies to all n) or an array of exactly n values; ``default`` when absent."""
        key = self.key(suffix)
        if key not in self.fields:
            if required:
                raise HParamsError(f"key not found in model: {key}")
            return default
        if self.is_array(suffix):
            f = self.fields[key]
            if f.n_elements and (len(f.types) != 2 or f.types[1] not in _GGUF_INTS):
                names = "/".join(_GGUF_TYPE_NAMES.get(t, str(t)) for t in f.types)
                raise HParamsError(f"key {key} is an array of type {names} but kvref reads it as integers")
            vals = self.get_arr(suffix)
            assert vals is not None
            if len(vals) != n:
                raise HParamsError(f"key {key} has wrong array length; expected {n}, got {len(vals)}")
            return tuple(vals)
        return self.get_int(suffix)


def _ints(value: _GGUFPerLayer) -> int | tuple[int, ...]:
    """A per-layer count as `HParams` converts it (``int`` of the value, or of each layer's)."""
    return tuple(int(x) for x in value) if isinstance(value, tuple) else int(value)


def _read_gguf_metadata(path: str) -> dict[str, _GGUFValue]:
    """The key/value metadata of the GGUF file at ``path`` (memory-mapped; values are read when asked for)."""
    import mmap

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ValueError("cannot mmap an empty file")
        buf = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    return _GGUFParser(buf, len(buf)).read()


def _load_gguf(cls: type[HParams], path: str | os.PathLike[str]) -> HParams:
    m = _GGUFMeta(path)
    from gguf import Keys as K  # importable: _GGUFMeta imported gguf

    # keys are gguf.Keys templates; the arch-relative suffixes left as strings are keys gguf 0.16 (the minimum
    # kvref supports) has no Keys entry for: nextn_predict_layers, the *_swa / *_mla lengths, rope.freq_base_swa,
    # rope.scale_linear, attention.sliding_window_pattern, ssm.group_count, shortconv.l_cache
    arch = m.get(K.General.ARCHITECTURE, "", full_key=True)
    if not arch:
        raise HParamsError("unknown model architecture: key general.architecture is missing or empty")
    arch = m.get_str(K.General.ARCHITECTURE, full_key=True)
    if arch not in SUPPORTED_ARCHS:
        known = arch in ARCH_ROPE_TYPE or arch in _ARCH_ROPE_IF_MROPE or arch in HYBRID_ARCHS
        raise HParamsError(
            f"architecture {arch!r} (key general.architecture) is "
            + ("not supported by kvref.HParams.from_gguf" if known else "unknown to llama.cpp")
        )
    m.arch = arch

    kw: HParamsArgs = {"arch": arch}
    # common part of load_hparams
    kw["n_ctx_train"] = m.get_int(K.LLM.CONTEXT_LENGTH)
    n_embd = m.get_int(K.LLM.EMBEDDING_LENGTH)
    kw["n_embd"] = n_embd
    kw["causal_attn"] = m.get_bool(K.Attention.CAUSAL, True)
    n_layer = m.get_int(K.LLM.BLOCK_COUNT)
    if not 0 < n_layer <= LLAMA_MAX_LAYERS:
        raise HParamsError(f"key {m.key(K.LLM.BLOCK_COUNT)} = {n_layer} must be in [1, {LLAMA_MAX_LAYERS}]")
    kw["n_layer"] = n_layer
    n_nextn = m.get_int("nextn_predict_layers", 0)
    if n_nextn > n_layer:
        raise HParamsError(f"key {m.key('nextn_predict_layers')} = {n_nextn} > block_count = {n_layer}")
    kw["n_layer_nextn"] = n_nextn
    n_trunk = n_layer - n_nextn

    # as int here (HParams would convert them the same way): the head counts are read below
    n_ff = _ints(m.get_key_or_arr(K.LLM.FEED_FORWARD_LENGTH, n_layer, 0))
    kw["n_ff"] = n_ff
    n_head = _ints(m.get_key_or_arr(K.Attention.HEAD_COUNT, n_layer, 0))
    n_head_kv = _ints(m.get_key_or_arr(K.Attention.HEAD_COUNT_KV, n_layer, n_head))  # default: n_head
    kw["n_head"], kw["n_head_kv"] = n_head, n_head_kv
    head0 = int(n_head[0] if isinstance(n_head, tuple) else n_head)

    kw["rope_freq_base"] = m.get_float(K.Rope.FREQ_BASE, 10000.0)
    ropescale = m.get_float(K.Rope.SCALING_FACTOR, 0.0)
    if ropescale == 0.0:
        ropescale = m.get_float("rope.scale_linear", 0.0)  # the old key name
    kw["rope_freq_scale"] = 1.0 if ropescale == 0.0 else 1.0 / ropescale

    if head0 > 0:
        hk = m.get_int(K.Attention.KEY_LENGTH, n_embd // head0)
        hv = m.get_int(K.Attention.VALUE_LENGTH, n_embd // head0)
        n_rot = m.get_int(K.Rope.DIMENSION_COUNT, hk)
        if arch in ("llama", "deci", "falcon", "llama-embed") and n_rot != hk:
            raise HParamsError(f"invalid n_rot: {n_rot}, expected {hk} (key {m.key(K.Rope.DIMENSION_COUNT)})")
    else:  # non-transformer: no heads
        hk = hv = n_rot = 0
    kw["n_embd_head_k"], kw["n_embd_head_v"], kw["n_rot"] = hk, hv, n_rot
    kw["n_embd_head_k_swa"] = m.get_int("attention.key_length_swa", hk)
    kw["n_embd_head_v_swa"] = m.get_int("attention.value_length_swa", hv)
    kw["n_rot_swa"] = m.get_int("rope.dimension_count_swa", n_rot)
    kw["n_embd_head_k_mla"] = m.get_int("attention.key_length_mla", 0)
    kw["n_embd_head_v_mla"] = m.get_int("attention.value_length_mla", 0)
    if arch in ("minicpm3", "plm"):  # their load_arch_hparams read the KV LoRA rank (it decides the K-shift)
        kw["n_lora_kv"] = m.get_int(K.Attention.KV_LORA_RANK, 0)
    if arch in ("t5", "t5encoder"):  # T5's relative-position bucket count
        kw["n_rel_attn_bkts"] = m.get_int(K.Attention.REL_BUCKETS_COUNT, 0)
    if m.has(K.LLM.VOCAB_SIZE):
        kw["n_vocab"] = m.get_int(K.LLM.VOCAB_SIZE)
    elif K.Tokenizer.LIST in m.fields:
        kw["n_vocab"] = m.fields[K.Tokenizer.LIST].n_elements  # the token count only: the strings stay unread

    for suffix in _arch_required(arch):
        if not m.has(suffix):
            raise HParamsError(f"key not found in model: {m.key(suffix)}")

    recurrent = arch in RECURRENT_ARCHS  # is_recr defaults to the arch being recurrent
    swa_layers: bool | tuple[bool, ...] = False
    recr: bool | tuple[bool, ...] = recurrent
    rope_sections: tuple[int, ...] = (0, 0, 0, 0)
    f_max_alibi_bias = 0.0
    base_swa = scale_swa = None
    rope_type: RopeType | None = None  # the arch's rope type when llama_model_rope_type decides it from the hparams

    def load_swa_pattern(n_pattern: int, dense_first: bool = False) -> tuple[bool, ...]:
        # an explicit per-layer array wins; else every n-th layer is dense (key may override n)
        arr = m.get_arr("attention.sliding_window_pattern")
        if arr is not None:
            if len(arr) > LLAMA_MAX_LAYERS:
                raise HParamsError(
                    f"array length {len(arr)} for key "
                    f"{m.key('attention.sliding_window_pattern')} exceeds max {LLAMA_MAX_LAYERS}"
                )
            # llama.cpp copies the array over an all-dense default
            flags = [bool(x) for x in arr[:n_layer]] + [False] * max(0, n_layer - len(arr))
            return tuple(flags)
        n_pattern = m.get_int("attention.sliding_window_pattern", n_pattern)
        return swa_pattern(n_trunk, n_pattern, dense_first) + (False,) * n_nextn

    def per_layer(v: int | tuple[int, ...], il: int) -> int:
        return int(v[il] if isinstance(v, tuple) else v)

    if arch == "gemma2":
        kw["swa_type"] = SWAType.STANDARD
        kw["n_swa"] = 4096  # gemma 2's default window
        swa_layers = load_swa_pattern(2)
        base_swa, scale_swa = kw["rope_freq_base"], kw["rope_freq_scale"]
        base_swa = m.get_float("rope.freq_base_swa", base_swa)
        kw["n_swa"] = m.get_int(K.Attention.SLIDING_WINDOW, kw["n_swa"])
    elif arch == "llama4":
        # llama4 refuses a model without experts when it loads the tensors
        if m.get_int(K.LLM.EXPERT_COUNT, 0) == 0:
            raise HParamsError(f"llama4 model cannot have zero experts (key {m.key(K.LLM.EXPERT_COUNT)})")
        # a window key of 0 turns chunked attention off; any other value is ignored: the chunk is 8192
        if m.has(K.Attention.SLIDING_WINDOW) and m.get_int(K.Attention.SLIDING_WINDOW) == 0:
            kw["swa_type"] = SWAType.NONE
        else:
            kw["swa_type"], kw["n_swa"] = SWAType.CHUNKED, 8192
            swa_layers = load_swa_pattern(4)  # 3 chunked, 1 full
            base_swa, scale_swa = kw["rope_freq_base"], kw["rope_freq_scale"]
            base_swa = m.get_float("rope.freq_base_swa", base_swa)
    elif arch == "gemma3":
        n_swa = m.get_int(K.Attention.SLIDING_WINDOW, 0)
        if m.has(K.Attention.SLIDING_WINDOW) and n_swa > 0:
            kw["swa_type"], kw["n_swa"] = SWAType.STANDARD, n_swa
            swa_layers = load_swa_pattern(6)
            base_swa = m.get_float("rope.freq_base_swa", 10000.0)  # llama_hparams' own defaults
            scale_swa = 1.0
        else:
            kw["swa_type"] = SWAType.NONE
    elif arch in ("mamba", "mamba2", "jamba", "falcon-h1", "granitehybrid", "nemotron_h"):
        kw["ssm_d_conv"] = m.get_int(K.SSM.CONV_KERNEL)
        kw["ssm_d_inner"] = m.get_int(K.SSM.INNER_SIZE)
        kw["ssm_d_state"] = m.get_int(K.SSM.STATE_SIZE)
        kw["ssm_dt_rank"] = m.get_int(K.SSM.TIME_STEP_RANK)
        if arch != "mamba" and arch != "jamba":
            kw["ssm_n_group"] = m.get_int("ssm.group_count")
        if arch in ("jamba", "granitehybrid"):
            # a layer is recurrent exactly when it has no KV heads
            recr = tuple(il < n_trunk and per_layer(n_head_kv, il) == 0 for il in range(n_layer))
        elif arch == "falcon-h1":
            recr = True  # every layer has both attention and an SSM
        elif arch == "nemotron_h":
            # recurrent: no KV heads and no FFN; appended MTP blocks are dense
            recr = tuple(
                il < n_trunk and per_layer(n_head_kv, il) == 0 and per_layer(n_ff, il) == 0 for il in range(n_layer)
            )
        if arch == "granitehybrid":
            # granite uses rope_finetuned as the rope switch for every layer, default on
            kw["rope_layers"] = m.get_bool(K.Rope.SCALING_FINETUNED, True)
    elif arch == "lfm2":
        kw["n_shortconv_l_cache"] = m.get_int("shortconv.l_cache")
        recr = tuple(il < n_trunk and per_layer(n_head_kv, il) == 0 for il in range(n_layer))
        n_swa = m.get_int(K.Attention.SLIDING_WINDOW, 0)
        if m.has(K.Attention.SLIDING_WINDOW) and n_swa > 0:
            kw["swa_type"], kw["n_swa"] = SWAType.STANDARD, n_swa
            swa_layers = tuple(il < n_trunk and not recr[il] for il in range(n_layer))
    elif arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe"):
        sec = m.get_key_or_arr(K.Rope.DIMENSION_SECTIONS, 4, required=True)
        rope_sections = tuple(int(x) for x in (sec if isinstance(sec, tuple) else (sec,) * 4))
    elif arch == "qwen4exp":
        # load_arch_hparams of src/models/qwen4exp.cpp: GDN sizes, IMROPE sections, hyper-connections, the QSA indexer
        # (llama.cpp requires every one of them non-zero), the recurrent layers (an explicit array, else every
        # full_attention_interval-th trunk layer is attention)
        kw["ssm_d_conv"] = m.get_int(K.SSM.CONV_KERNEL)
        kw["ssm_d_inner"] = m.get_int(K.SSM.INNER_SIZE)
        kw["ssm_d_state"] = m.get_int(K.SSM.STATE_SIZE)
        kw["ssm_dt_rank"] = m.get_int(K.SSM.TIME_STEP_RANK)
        kw["ssm_n_group"] = m.get_int("ssm.group_count")
        for key in (K.SSM.CONV_KERNEL, K.SSM.INNER_SIZE, K.SSM.STATE_SIZE, K.SSM.TIME_STEP_RANK, "ssm.group_count",
                    "hyper_connection.low_rank", "attention.indexer.head_count", "attention.indexer.key_length",
                    "attention.indexer.top_k"):  # fmt: skip
            if m.get_int(key) == 0:
                raise HParamsError(f"{m.key(key)} must be greater than zero, got 0")
        hc = m.get_int("hyper_connection.count")
        if hc <= 1:
            raise HParamsError(f"{m.key('hyper_connection.count')} must be greater than one, got {hc}")
        kw["dsv4_hc_mult"] = hc
        kw["indexer_head_size"] = m.get_int("attention.indexer.key_length")
        ratios = m.get_key_or_arr("attention.compress_ratios", n_layer, 0)
        kw["dsv4_compress_ratios"] = tuple(int(ratios[il] if isinstance(ratios, tuple) else ratios)
                                           for il in range(n_layer))  # fmt: skip
        if m.has("ple.layers"):
            raise HParamsError("qwen4exp with PLE layers: kvref.HParams.from_gguf does not read the PLE keys")
        sec = m.get_key_or_arr(K.Rope.DIMENSION_SECTIONS, 4, required=True)
        rope_sections = tuple(int(x) for x in (sec if isinstance(sec, tuple) else (sec,) * 4))
        recr_arr = m.get_key_or_arr("attention.recurrent_layers", n_layer)
        if recr_arr is not None:
            recr = tuple(bool(recr_arr[il] if isinstance(recr_arr, tuple) else recr_arr) for il in range(n_layer))
        else:
            interval = m.get_int("full_attention_interval", 4)
            if interval == 0:
                raise HParamsError(f"{m.key('full_attention_interval')} must be greater than zero, got 0")
            recr = tuple(il < n_trunk and (il + 1) % interval != 0 for il in range(n_layer))
    elif arch in ("rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"):
        kw["wkv_head_size"] = m.get_int(K.WKV.HEAD_SIZE)
        kw["token_shift_count"] = m.get_int(K.LLM.TOKEN_SHIFT_COUNT, 2)
    elif arch == "deepseek4":
        # llama_model_deepseek4::load_arch_hparams: every layer (the MTP blocks too) attends through a standard
        # window, non-causal SWA_FULL, the indexer key length and the per-layer compress ratios
        # (llama.cpp also drops n_layer_nextn when the first MTP block's nextn.eh_proj tensor is missing: not read)
        kw["swa_type"], kw["n_swa"] = SWAType.STANDARD, m.get_int(K.Attention.SLIDING_WINDOW)
        swa_layers = True
        kw["non_causal_type"] = 2
        kw["indexer_head_size"] = m.get_int("attention.indexer.key_length")
        kw["dsv4_hc_mult"] = m.get_int("hyper_connection.count")
        comp = m.get_arr("attention.compress_ratios") or []
        if len(comp) < n_layer:
            raise HParamsError("DeepSeek-V4 compress_ratios is shorter than block_count "
                               f"(key {m.key('attention.compress_ratios')})")  # fmt: skip
        kw["dsv4_compress_ratios"] = tuple(int(x) for x in comp[:n_layer])
    elif arch in ("bloom", "refact", "jina-bert-v2"):
        f_max_alibi_bias = 8.0  # hard-coded in llama.cpp for these archs
    elif arch in ("mpt", "jais"):
        f_max_alibi_bias = m.get_float(K.Attention.MAX_ALIBI_BIAS, 0.0)
    elif arch == "baichuan" and n_trunk == 40:
        f_max_alibi_bias = 8.0  # only the 13B variant uses ALiBi
    elif arch in ("glm-dsa", "deepseek32", "dots3note", "hy_v4"):
        _load_dsa(m, kw, n_layer, n_trunk)
        if arch == "dots3note":
            # load_arch_hparams: a standard window, its own rope base, the layers from the required pattern array
            kw["swa_type"], kw["n_swa"] = SWAType.STANDARD, m.get_int(K.Attention.SLIDING_WINDOW)
            base_swa, scale_swa = m.get_float("rope.freq_base_swa"), kw["rope_freq_scale"]
            arr = m.get_arr("attention.sliding_window_pattern")
            if arr is None:
                raise HParamsError(f"array key not found in model: {m.key('attention.sliding_window_pattern')}")
            if len(arr) > LLAMA_MAX_LAYERS:
                raise HParamsError(f"array length {len(arr)} for key {m.key('attention.sliding_window_pattern')} "
                                   f"exceeds max {LLAMA_MAX_LAYERS}")  # fmt: skip
            swa_layers = tuple(bool(x) for x in arr[:n_layer]) + (False,) * max(0, n_layer - len(arr))
    elif arch == "minimax-m3":  # llama_model_minimax_m3::load_arch_hparams: the MSA indexer cache's keys
        kw["n_layer_dense_lead"] = m.get_int("leading_dense_block_count", 0)
        kw["indexer_head_size"] = m.get_int("attention.indexer.key_length")
        kw["indexer_block_size"] = m.get_int("attention.indexer.block_size")
        kw["indexer_local_blocks"] = m.get_int("attention.indexer.local_blocks")
        if kw["indexer_block_size"] == 0:
            raise HParamsError(f"key {m.key('attention.indexer.block_size')} = 0 (llama.cpp asserts it is > 0)")

    elif arch == "glm5-next":
        # llama_model_glm5_next::load_arch_hparams: KDA (recurrent) layers are those without KV heads, the NextN block
        # included; the MLA cache holds the compressed latent (V head size = kv_lora_rank); the k-pool indexer
        # (every trunk layer owns one unless the types key says otherwise); mHC with exactly 4 connections
        kw["n_lora_kv"] = m.get_int("attention.kv_lora_rank")
        kw["n_embd_head_v"] = kw["n_lora_kv"]
        kw["ssm_d_conv"] = m.get_int(K.SSM.CONV_KERNEL)
        kw["n_embd_head_kda"] = m.get_int("kda.head_dim")
        recr = tuple(per_layer(n_head_kv, il) == 0 for il in range(n_layer))
        kw["indexer_head_size"] = m.get_int("attention.indexer.key_length")
        kw["indexer_top_k"] = top_k = m.get_int("attention.indexer.top_k")
        kw["indexer_kpool"] = kpool = m.get_int("attention.indexer.kpool")
        kw["indexer_kpool_select_tail"] = m.get_bool("attention.indexer.kpool_select_tail", True)
        if not (kpool > 1 and top_k % kpool == 0):
            raise HParamsError(f"glm5-next: key {m.key('attention.indexer.kpool')} = {kpool} must be > 1 and divide "
                               f"{m.key('attention.indexer.top_k')} = {top_k} (llama.cpp asserts)")  # fmt: skip
        full = [True] * n_layer
        types = m.get_key_or_arr("attention.indexer.types", n_trunk)
        if types is not None:
            full[:n_trunk] = [bool(x) for x in (types if isinstance(types, tuple) else (types,) * n_trunk)]
        kw["indexer_full_layers"] = tuple(full)
        kw["dsv4_hc_mult"] = hc = m.get_int("hyper_connection.count")
        if hc != 4:
            raise HParamsError(f"glm5-next: key {m.key('hyper_connection.count')} = {hc}: llama.cpp asserts mHC "
                               "with exactly 4 connections")  # fmt: skip
    elif arch in ("gemma4", "gemma4-assistant"):
        # load_arch_hparams of gemma4 / gemma4-assistant: a standard window over the layers of the required pattern
        # array, the SWA rope base (llama_hparams' default 10000); gemma4's trailing shared-KV layers own no KV and
        # its non-causal attention is bidirectional on the SWA layers only
        kw["swa_type"], kw["n_swa"] = SWAType.STANDARD, m.get_int(K.Attention.SLIDING_WINDOW)
        swa_layers = _required_flags(m, "attention.sliding_window_pattern", n_layer)
        base_swa, scale_swa = m.get_float("rope.freq_base_swa", 10000.0), 1.0
        n_shared = m.get_int("attention.shared_kv_layers", 0)
        if arch == "gemma4":
            kw["n_layer_kv_from_start"] = n_layer - n_shared
            kw["non_causal_type"] = 1  # LLAMA_NON_CAUSAL_TYPE_SWA_ONLY
    elif arch == "dflash":
        rope_type = _load_dflash(m, kw, n_layer)
        if kw.get("swa_type", SWAType.NONE) != SWAType.NONE:
            # a single rope: the SWA layers rotate with the main base and scale
            base_swa, scale_swa = kw["rope_freq_base"], kw["rope_freq_scale"]
            if kw["dsv4_hc_mult"] > 0:
                swa_layers = True  # DSpark: every stage is windowed
            else:
                swa_layers = _required_flags(m, "attention.sliding_window_pattern", n_layer)
        sections = m.get_key_or_arr(K.Rope.DIMENSION_SECTIONS, 4)
        if sections is not None:
            rope_sections = tuple(int(x) for x in (sections if isinstance(sections, tuple) else (sections,) * 4))
            if any(rope_sections):
                rope_type = RopeType.MROPE  # drafts for M-RoPE targets follow the target's temporal dim

    kw["swa_layers"] = swa_layers
    kw["recurrent_layers"] = recr
    kw["rope_sections"] = rope_sections
    kw["f_max_alibi_bias"] = f_max_alibi_bias
    kw["use_alibi"] = f_max_alibi_bias > 0.0
    kw["rope_freq_base_swa"] = base_swa
    kw["rope_freq_scale_swa"] = scale_swa
    if arch in _ARCH_ROPE_IF_MROPE:
        use_mrope = rope_sections[0] > 0 and rope_sections[1] > 0
        kw["rope_type"] = RopeType.MROPE if use_mrope else _ARCH_ROPE_IF_MROPE[arch]
    elif rope_type is not None:
        kw["rope_type"] = rope_type
    else:
        kw["rope_type"] = ARCH_ROPE_TYPE[arch]
    hp = cls(**kw)
    _check_attention_widths(hp, m)
    return hp


# GLM-5.2's default indexer types (src/models/glm-dsa.cpp, 78 entries): layers 0 and 1 own an indexer, then the first
# of every group of four (2, 6, 10, ...)
_GLM_5_2_INDEXER_TYPES = (True, True, *((il - 2) % 4 == 0 for il in range(2, 78)))


def _load_dsa(m: _GGUFMeta, kw: HParamsArgs, n_layer: int, n_trunk: int) -> None:
    """The MLA and indexer hparams of glm-dsa, deepseek32, dots3note and hy_v4 (their load_arch_hparams)."""
    arch = m.arch
    kw["n_lora_kv"] = m.get_int("attention.kv_lora_rank")
    required = arch != "hy_v4"  # hy_v4's all-full-attention checkpoints have no indexer
    kw["indexer_head_size"] = m.get_int("attention.indexer.key_length", None if required else 0)
    kw["indexer_top_k"] = top_k = m.get_int("attention.indexer.top_k", None if required else 0)
    n_idx_head = m.get_int("attention.indexer.head_count", None if required else 0)
    n_rot = int(kw.get("n_rot", 0))
    key_len = m.key("attention.indexer.key_length")
    if arch == "hy_v4" and top_k > 0 and (n_idx_head == 0 or kw["indexer_head_size"] <= n_rot):
        raise HParamsError(f"hy_v4: bad indexer head count / key length (key {key_len} must exceed n_rot {n_rot})")
    if arch != "hy_v4" and n_rot > kw["indexer_head_size"]:
        # the graph asserts that the indexer's rotated dims fit its head (GGML_ASSERT when the context is made)
        raise HParamsError(f"{arch}: n_rot {n_rot} exceeds the indexer key length (key {key_len}); llama.cpp asserts")
    full: list[bool] = [False] * n_layer  # is_indexer_full_impl starts all zero
    key = "attention.indexer.types"
    if arch == "glm-dsa":
        # GLM 5 / 5.1 (trained context below 1M) have full indexers everywhere; GLM 5.2 its default pattern
        if m.get_int("context_length") < 1048576:
            full = [True] * n_layer
        else:
            full = [il < len(_GLM_5_2_INDEXER_TYPES) and _GLM_5_2_INDEXER_TYPES[il] for il in range(n_layer)]
    if arch in ("glm-dsa", "hy_v4") and (arch == "glm-dsa" or top_k > 0):
        types = m.get_key_or_arr(key, n_trunk)
        if types is not None:
            vals = types if isinstance(types, tuple) else (types,) * n_trunk
            full[:n_trunk] = [bool(x) for x in vals]
        if arch == "hy_v4" and not full[0]:
            raise HParamsError(f"hy_v4: layer 0 must own an indexer, nothing precedes it to share (key {m.key(key)})")
    elif arch == "dots3note":
        arr = m.get_arr(key)
        if arr is None:
            raise HParamsError(f"array key not found in model: {m.key(key)}")
        full[: min(len(arr), n_layer)] = [bool(x) for x in arr[:n_layer]]
    # past the trunk llama.cpp's flags are never read (is_indexer_full aborts there): kept false
    kw["indexer_full_layers"] = tuple(full[:n_trunk]) + (False,) * (n_layer - n_trunk)
    if arch == "dots3note":
        m.get_int("attention.kv_lora_rank_swa")
    # every one of them throws without MLA when it loads its tensors (hy_v4 and dots3note require the keys)
    if not (kw.get("n_embd_head_k_mla") and kw.get("n_embd_head_v_mla")):
        raise HParamsError(f"{arch} requires MLA (keys {m.key('attention.key_length_mla')}, "
                           f"{m.key('attention.value_length_mla')})")  # fmt: skip


def _required_flags(m: _GGUFMeta, suffix: str, n_layer: int) -> tuple[bool, ...]:
    """A required per-layer flag array (llama.cpp's get_arr into an all-zero std::array): copied over ``n_layer``
    false flags; a missing key or a scalar is an HParamsError naming the key."""
    arr = m.get_arr(suffix)
    if arr is None:
        raise HParamsError(f"array key not found in model: {m.key(suffix)}")
    if len(arr) > LLAMA_MAX_LAYERS:
        raise HParamsError(f"array length {len(arr)} for key {m.key(suffix)} exceeds max {LLAMA_MAX_LAYERS}")
    return tuple(bool(x) for x in arr[:n_layer]) + (False,) * max(0, n_layer - len(arr))


# the DSpark (DeepSeek-V4 backbone) draft's keys, all required once hyper_connection.count is > 0
_DFLASH_HC_REQUIRED = (
    "attention.q_lora_rank", "attention.sliding_window", "expert_feed_forward_length", "expert_shared_count",
    "expert_weights_scale", "expert_weights_norm", "expert_gating_func", "swiglu_clamp_exp",
    "attention.output_group_count", "attention.output_lora_rank", "hyper_connection.sinkhorn_iterations",
    "hyper_connection.epsilon",
)  # fmt: skip


def _load_dflash(m: _GGUFMeta, kw: HParamsArgs, n_layer: int) -> RopeType:
    """llama_model_dflash::load_arch_hparams: the hidden activation, the required target layers, then either a
    DSpark draft (hyper-connections: uncompressed windowed DSV4 stages) or an optional window with its pattern.
    Sets the window in ``kw`` and returns llama_model_rope_type's choice before the M-RoPE sections."""
    act = m.get_str("hidden_activation", "silu")
    if act not in ("silu", "gelu", "gelu_pytorch_tanh"):
        raise HParamsError(f"unsupported DFlash hidden activation: {act} (key {m.key('hidden_activation')})")
    if m.get_arr("target_layers") is None:
        raise HParamsError(f"DFlash model requires 'target_layers' in GGUF metadata (key {m.key('target_layers')})")
    kw["dsv4_hc_mult"] = hc = m.get_int("hyper_connection.count", 0)
    if hc > 0:
        for suffix in _DFLASH_HC_REQUIRED:
            if not m.has(suffix):
                raise HParamsError(f"key not found in model: {m.key(suffix)}")
        if m.get_int("attention.output_group_count") == 0:
            raise HParamsError(f"key {m.key('attention.output_group_count')} = 0 (llama.cpp asserts it is > 0)")
        if m.get_int("expert_gating_func") != 4:  # LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
            raise HParamsError(f"DSpark DSV4 draft expects sqrtsoftplus MoE scoring (key "
                               f"{m.key('expert_gating_func')})")  # fmt: skip
        ratios = m.get_arr("attention.compress_ratios") or []
        if len(ratios) > LLAMA_MAX_LAYERS:
            raise HParamsError(f"array length {len(ratios)} for key {m.key('attention.compress_ratios')} exceeds max "
                               f"{LLAMA_MAX_LAYERS}")  # fmt: skip
        if any(int(x) != 0 for x in ratios[:n_layer]):
            raise HParamsError("DSpark DSV4 draft expects uncompressed attention on all stages "
                               f"(key {m.key('attention.compress_ratios')})")  # fmt: skip
        n_swa = m.get_int("attention.sliding_window")
        if n_swa == 0:
            raise HParamsError(f"key {m.key('attention.sliding_window')} = 0 (llama.cpp asserts it is > 0)")
        kw["swa_type"], kw["n_swa"] = SWAType.STANDARD, n_swa
        return RopeType.NORM  # DeepSeek-V4's normal RoPE
    n_swa = m.get_int("attention.sliding_window", 0)
    if n_swa > 0:
        kw["swa_type"], kw["n_swa"] = SWAType.STANDARD, n_swa
    return RopeType.NEOX  # legacy DFlash backbones


def _check_attention_widths(hp: HParams, m: _GGUFMeta) -> None:
    """Every layer the attention cache keeps has K (and V) rows of at least one element: head counts or head sizes
    of 0 on such a layer (llama.cpp cannot build its attention tensors) are an HParamsError naming the keys."""
    from gguf import Keys as K

    kind = hp.memory_kind()
    if kind == "recurrent":
        return
    for il in range(hp.n_layer):
        if not hp.has_kv(il) or (kind.startswith("hybrid") and not hp.attn_layer_filter(il)):
            continue
        widths = [("K", hp.n_embd_k_gqa(il), hp.n_embd_head_k_l(il), K.Attention.KEY_LENGTH)]
        if not hp.is_mla():
            widths.append(("V", hp.n_embd_v_gqa(il), hp.n_embd_head_v_l(il), K.Attention.VALUE_LENGTH))
        for what, width, head, size_key in widths:
            if width <= 0:
                raise HParamsError(
                    f"layer {il} has attention but {what} rows of {width} elements: {hp.n_head_kv_l(il)} KV heads "
                    f"(keys {m.key(K.Attention.HEAD_COUNT_KV)}, {m.key(K.Attention.HEAD_COUNT)}) of {head} elements "
                    f"(key {m.key(size_key)}, or {m.key(K.LLM.EMBEDDING_LENGTH)} / head count); llama.cpp cannot "
                    "build that layer's attention"
                )


__all__ = [
    "ARCH_ROPE_TYPE",
    "GENERIC_ARCHS",
    "HYBRID_ARCHS",
    "LLAMA_MAX_LAYERS",
    "RECURRENT_ARCHS",
    "SUPPORTED_ARCHS",
    "HParams",
    "HParamsArgs",
    "HParamsError",
    "RopeType",
    "SWAType",
    "is_masked_swa",
    "swa_pattern",
]
