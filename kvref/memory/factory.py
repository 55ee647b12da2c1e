"""llama.cpp's memory factory: the memory object llama.cpp builds for a model and a set of context parameters.

`context_params` mirrors the relevant part of the llama_context constructor (src/llama-context.cpp) and
`create_memory` mirrors llama_model::create_memory (src/llama-model.cpp). The interface every memory implements
(`Memory`) is in ``kvref.memory.base`` and re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

from ..archs import NO_MEMORY_ARCHS, UNSUPPORTED_ARCHS
from ..args import as_int
from ..constants import LLAMA_MAX_SEQ, UINT32_MAX
from ..errors import ArgumentError, KVRefError
from ..ggml.types import GGMLType, ggml_type, traits
from ..hparams import HParams, SWAType
from ..profile import DEFAULT, Profile, resolve
from ..profile import RS_ROLLBACK_ARCHS as RS_ROLLBACK_ARCHS
from ..profile import RS_ROLLBACK_ARCHS_2026_08 as RS_ROLLBACK_ARCHS_2026_08
from .base import (
    LLAMA_STATE_SEQ_FLAGS_NONE,
    LLAMA_STATE_SEQ_FLAGS_ON_DEVICE,
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
    LLAMA_STATE_SEQ_FLAGS_SWA_ONLY,
    ContextParams,
    Memory,
    PairedMemory,
)
from .hybrid import HybridMemory
from .hybrid_idx import HybridIdxMemory
from .kv_cache import KVCache
from .kv_cache_dsv4 import KVCacheDSV4
from .kv_cache_iswa import KVCacheISWA
from .kv_cache_msa import KVCacheMSA
from .kv_cache_shared import shared_iswa
from .recurrent import RecurrentMemory

if TYPE_CHECKING:
    from .hybrid import HybridSlot
    from .kv_cache_dsa import DSASlot
    from .kv_cache_dsa_iswa import DSAISWASlot
    from .kv_cache_iswa import ISWASlot
    from .kv_cache_msa import MSASlot
    from .recurrent import RecurrentSlot
    from .slots import SlotInfo

    # what the decode of the memory create_memory builds places each ubatch in (`Memory`'s type parameter)
    _Slot: TypeAlias = "SlotInfo | ISWASlot | HybridSlot | RecurrentSlot | DSASlot | DSAISWASlot | MSASlot"

# llama_context_type: the default context, and a draft context of the model's MTP (NextN) blocks
CONTEXT_TYPES = ("default", "mtp")

# hybrids whose MTP draft context is a plain attention cache of the nextn layers (create_memory's default branch)
MTP_DENSE_HYBRID_ARCHS = frozenset({"qwen3next", "qwen35", "qwen35moe", "bailingmoe3", "nemotron_h_moe"})

# --- the factory --------------------------------------------------------------------------------------------


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


# llm_arch_supports_rs_rollback (RS_ROLLBACK_ARCHS, and its older list RS_ROLLBACK_ARCHS_2026_08) live in
# kvref.profile: a memory asks its Profile.rs_rollback_archs


def kv_pad(flash_attn: bool, compat: Profile | str = DEFAULT) -> int:
    """The KV cache padding create_memory uses: ``Profile.n_kv_pad`` (without, with flash attention): 1 when the
    context pads n_ctx instead; llama_kv_cache_unified::get_padding's 32 / 256 when it does not."""
    return resolve(compat).n_kv_pad[1 if flash_attn else 0]


def context_params(
    hparams: HParams,
    n_ctx: int = 0,
    n_seq_max: int = 1,
    *,
    kv_unified: bool = True,
    flash_attn: bool | str = False,
    swa_full: bool = False,
    n_batch: int = 2048,
    n_ubatch: int = 512,
    n_rs_seq: int = 0,
    causal_attn: bool | None = None,
    compat: Profile | str = DEFAULT,
) -> ContextParams:
    """llama_context::llama_context, the parameters the memory depends on, in llama.cpp's order.

    - ``n_seq_max = max(1, n_seq_max)``, at most LLAMA_MAX_SEQ;
    - ``n_rs_seq`` is clamped to 0 for archs without recurrent rollback (``Profile.rs_rollback_archs``);
    - ``n_ctx = 0`` takes ``hparams.n_ctx_train``;
    - flash attention "auto" counts as enabled when the memory is created (cparams.flash_attn is
      ``type != DISABLED``; the auto resolution comes after the memory exists), so V is not transposed;
    - with causal attention ``n_batch = min(n_ctx, n_batch)`` (the unpadded n_ctx), and
      ``n_ubatch = min(n_batch, n_ubatch or n_batch)``;
    - ``n_ctx`` is padded to ``Profile.n_ctx_pad`` (256); unified: ``n_ctx_seq = n_ctx``, else
      ``n_ctx_seq = pad(n_ctx / n_seq_max, 256)`` and ``n_ctx = n_ctx_seq * n_seq_max``.

    ``compat`` (a ``kvref.profile.Profile`` or a name it resolves): ``n_batch`` is raised to at least
    ``Profile.n_batch_min`` (GGML_KQ_MASK_PAD); with ``Profile.n_ctx_pad`` 1 the context does not pad
    ``n_ctx``: llama_model::create_memory does, to the cache padding ``kv_pad(flash_attn)``
    (``Profile.n_kv_pad``), per stream -- unified: ``n_ctx_seq = n_ctx = pad(n_ctx)``, else
    ``n_ctx_seq = pad(ceil(n_ctx / n_seq_max))`` and ``n_ctx = n_ctx_seq * n_seq_max`` (a recurrent model's
    n_ctx stays as given); without ``Profile.kv_streams`` every sequence shares the one cache (unified).
    """
    profile = resolve(compat)
    memory_pads = profile.n_ctx_pad <= 1  # the context does not pad: create_memory pads per stream
    if not profile.kv_streams:
        kv_unified = True  # no streams: every sequence shares the one cache
    # llama_context_params holds these as uint32_t (n_rs_seq too): a negative value would wrap to a huge one
    for name, value in (("n_ctx", n_ctx), ("n_seq_max", n_seq_max), ("n_batch", n_batch), ("n_ubatch", n_ubatch)):
        if not 0 <= as_int(value, name) <= UINT32_MAX:
            raise ArgumentError(f"{name} = {value} is outside [0, {UINT32_MAX}] (llama_context_params: uint32_t)")
    if not 0 <= as_int(n_rs_seq, "n_rs_seq") <= UINT32_MAX:
        raise ArgumentError(f"n_rs_seq = {n_rs_seq} is outside [0, {UINT32_MAX}]")
    n_seq_max = max(1, int(n_seq_max))
    if n_seq_max > LLAMA_MAX_SEQ:
        raise KVRefError(f"n_seq_max must be <= {LLAMA_MAX_SEQ}")
    # an empty Profile.rs_rollback_archs: no n_rs_seq at all
    if n_rs_seq > 0 and hparams.arch not in profile.rs_rollback_archs:
        n_rs_seq = 0
    if n_ctx == 0:
        n_ctx = hparams.n_ctx_train
        if n_ctx == 0:
            raise KVRefError("n_ctx and hparams.n_ctx_train cannot both be zero")
    if isinstance(flash_attn, str):
        if flash_attn not in ("auto", "enabled", "disabled", "on", "off"):
            raise ArgumentError(f"flash_attn must be a bool or 'auto'/'enabled'/'disabled', got {flash_attn!r}")
        flash_attn = flash_attn not in ("disabled", "off")
    causal = hparams.causal_attn if causal_attn is None else causal_attn
    n_batch = min(n_ctx, n_batch) if causal else n_batch
    if profile.n_batch_min:
        n_batch = max(n_batch, profile.n_batch_min)  # GGML_KQ_MASK_PAD
    n_ubatch = min(n_batch, n_ubatch if n_ubatch else n_batch)
    if memory_pads:
        pad = kv_pad(flash_attn, profile)
        if hparams.is_recurrent_arch():
            n_ctx_seq = n_ctx
        elif kv_unified or hparams.is_hybrid_arch():  # the hybrid memory ignores n_seq_max here
            n_ctx = n_ctx_seq = _pad(n_ctx, pad)
        else:
            n_ctx_seq = _pad(-(-n_ctx // n_seq_max), pad)
            n_ctx = n_ctx_seq * n_seq_max
        return ContextParams(
            n_ctx, n_ctx_seq, n_batch, n_ubatch, n_seq_max, n_rs_seq, bool(kv_unified), bool(flash_attn), bool(swa_full)
        )
    n_ctx = _pad(n_ctx, profile.n_ctx_pad)
    if kv_unified:
        n_ctx_seq = n_ctx
    else:
        n_ctx_seq = _pad(n_ctx // n_seq_max, profile.n_ctx_pad)
        if n_ctx_seq == 0:
            raise KVRefError("n_ctx_seq == 0")
        n_ctx = n_ctx_seq * n_seq_max
    return ContextParams(
        n_ctx, n_ctx_seq, n_batch, n_ubatch, n_seq_max, n_rs_seq, bool(kv_unified), bool(flash_attn), bool(swa_full)
    )


def check_cache_types(
    hparams: HParams, type_k: GGMLType | int | str, type_v: GGMLType | int | str, flash_attn: bool
) -> None:
    """What llama_init_from_model refuses of the cache types (the context is not created: KVRefError): K and V of
    different types for an MLA model (or deepseek4); with flash attention on (or auto) a quantized K or V type whose
    block does not divide every layer's head size."""
    if (hparams.is_mla() or hparams.arch == "deepseek4") and ggml_type(type_k) != ggml_type(type_v):
        raise KVRefError(
            f"model does not support different K ({traits(type_k).name}) and V ({traits(type_v).name}) cache types "
            "(an MLA model: llama_init_from_model refuses the context)"
        )
    if not flash_attn:
        return
    for name, t, head in (("K", type_k, hparams.n_embd_head_k_l), ("V", type_v, hparams.n_embd_head_v_l)):
        tr = traits(t)
        if not tr.is_quantized:
            continue
        for il in range(hparams.n_layer):
            if head(il) % tr.block_size:
                which = name.lower()
                raise KVRefError(
                    f"{name} cache type {tr.name} with block size {tr.block_size} does not divide "
                    f"n_embd_head_{which}={head(il)} (llama_init_from_model refuses the context)"
                )


def create_memory(
    hparams: HParams,
    n_ctx: int = 0,
    n_seq_max: int = 1,
    kv_unified: bool = True,
    flash_attn: bool | str = False,
    type_k: GGMLType | int | str = "f16",
    type_v: GGMLType | int | str = "f16",
    swa_full: bool = False,
    n_ubatch: int = 512,
    *,
    n_batch: int = 2048,
    n_rs_seq: int = 0,
    causal_attn: bool | None = None,
    compat: Profile | str = DEFAULT,
    ctx_type: str = "default",
    mem_other: Memory[_Slot] | None = None,
) -> Memory[_Slot] | None:
    """The memory llama.cpp creates for this model and these context parameters (None: no memory).

    ``ctx_type`` is llama_context_params.ctx_type: ``"default"`` or ``"mtp"`` (LLAMA_CONTEXT_TYPE_MTP, a draft
    context of the model's NextN/MTP blocks, which builds another memory). ``mem_other`` is the memory of
    llama_context_params.ctx_other, the context a draft model (gemma4-assistant, eagle3, dflash) reads.

    Mirrors llama_model::create_memory after llama_context's parameter resolution (`context_params`):

    - encoder-only and diffusion archs (NO_MEMORY_ARCHS) get no memory;
    - deepseek4: `KVCacheDSV4` (llama_kv_cache_dsv4), or in an MTP context a KVCacheISWA over the MTP blocks;
    - recurrent archs: RecurrentMemory, f32 R and S, ``max(1, n_seq_max)`` cells;
    - hybrid archs: HybridMemory (attention KVCache over ``hparams.attn_layer_filter``, recurrent over
      ``hparams.recr_layer_filter``, attention ``n_pad = 1``); with SWA the attention part is a KVCacheISWA
      (llama_memory_hybrid_iswa);
    - otherwise a KVCache of ``n_ctx_seq`` cells, or a KVCacheISWA when the model has a sliding window;
      ``n_pad = 1`` (the context already padded n_ctx to 256), ``v_trans = not flash_attn``;
      gemma3n / gemma4 reuse the KV of earlier layers from ``n_layer_kv_from_start`` on (layer_reuse);
      models with MTP blocks (``n_layer_nextn``) keep only the trunk layers.
    Parameter defaults are kvref's (unified, no flash attention, no full-size SWA cache); note that
    llama_context_default_params() has kv_unified=false, flash attention auto and swa_full=true.
    The resolved parameters are on the result as ``memory.cparams``.

    ``compat`` says what the llama.cpp to reproduce does where builds differ: a ``kvref.profile.Profile``,
    a named generation or a llama-cpp-python release (resolved through ``kvref.profile.TABLE``; default the
    newest); the profile decides the context sizing and
    the caches' ``n_pad`` here (`context_params`, `kv_pad`) and is passed to every memory built.
    """

    if ctx_type not in CONTEXT_TYPES:
        raise ArgumentError(f"ctx_type must be one of {', '.join(map(repr, CONTEXT_TYPES))}, got {ctx_type!r}")
    profile = resolve(compat)
    cp = context_params(
        hparams,
        n_ctx,
        n_seq_max,
        kv_unified=kv_unified,
        flash_attn=flash_attn,
        swa_full=swa_full,
        n_batch=n_batch,
        n_ubatch=n_ubatch,
        n_rs_seq=n_rs_seq,
        causal_attn=causal_attn,
        compat=profile,
    )
    check_cache_types(hparams, type_k, type_v, cp.flash_attn)
    n_pad = kv_pad(cp.flash_attn, profile)
    arch = hparams.arch
    if arch in NO_MEMORY_ARCHS:
        return None
    if arch in UNSUPPORTED_ARCHS:
        raise KVRefError(f"llama.cpp builds a dedicated memory for {arch!r}, which kvref does not model")
    v_trans = not cp.flash_attn

    mem: Memory[_Slot]
    if arch in DSA_ARCHS:
        return _create_dsa(hparams, cp, ctx_type, type_k, type_v, n_pad, profile)
    if arch == "deepseek4":
        return _deepseek4(hparams, cp, ctx_type, type_k, type_v, v_trans, profile)
    # the dense MTP heads of these hybrids use a plain attention cache of their nextn layers
    mtp_dense = ctx_type == "mtp" and arch in MTP_DENSE_HYBRID_ARCHS
    if arch == "minimax-m3":
        # llama_kv_cache_msa: the base cache over every layer, the indexer key cache over the sparse layers
        mem = KVCacheMSA(
            hparams,
            type_k=type_k,
            type_v=type_v,
            v_trans=v_trans,
            kv_unified=cp.kv_unified,
            kv_size=cp.n_ctx_seq,
            n_seq_max=cp.n_seq_max,
            n_pad=n_pad,
            n_swa=hparams.n_swa,
            swa_type=hparams.swa_type,
            compat=profile,
            cparams=cp,
        )
    elif hparams.is_recurrent_arch():
        mem = RecurrentMemory(
            hparams,
            type_r="f32",
            type_s="f32",
            rs_size=max(1, cp.n_seq_max),
            n_seq_max=cp.n_seq_max,
            kv_unified=cp.kv_unified,
            n_rs_seq=cp.n_rs_seq,
            compat=profile,
            cparams=cp,
        )
    elif arch == "glm5-next" or (
        arch == "qwen4exp" and hparams.indexer_head_size > 0 and hparams.swa_type == SWAType.NONE
    ):
        mem = _hybrid_idx(hparams, cp, ctx_type, type_k, type_v, v_trans, n_pad, profile)
        if arch == "glm5-next" and ctx_type == "mtp":
            # llama.cpp builds the draft memory (the NextN layers), then building the context's graph throws
            raise KVRefError("GLM5-Next NextN graph not implemented yet (llama_init_from_model fails for ctx_type mtp "
                             "in llama.cpp 0.3.36)")  # fmt: skip
    elif hparams.is_hybrid_arch() and not mtp_dense:
        mem = HybridMemory(
            hparams,
            type_k=type_k,
            type_v=type_v,
            v_trans=v_trans,
            kv_size=cp.n_ctx_seq,
            n_pad=n_pad,
            n_swa=hparams.n_swa,
            swa_type=hparams.swa_type,
            type_r="f32",
            type_s="f32",
            rs_size=max(1, cp.n_seq_max),
            n_seq_max=cp.n_seq_max,
            kv_unified=cp.kv_unified,
            filter_attn=hparams.attn_layer_filter,
            filter_recr=hparams.recr_layer_filter,
            n_rs_seq=cp.n_rs_seq,
            swa=hparams.swa_type != SWAType.NONE,
            swa_full=cp.swa_full,
            n_ubatch=cp.n_ubatch,
            compat=profile,
            cparams=cp,
        )
    else:
        layer_filter = None
        layer_reuse = None
        if arch in ("gemma3n", "gemma4"):
            kv_from = hparams.n_layer_kv_from_start
            if kv_from < 2:
                raise KVRefError(f"{arch} needs n_layer_kv_from_start >= 2, got {kv_from}")

            def layer_reuse(il: int) -> int:
                # layers past the KV-owning ones read the last SWA / full layer that owns KV
                if il >= kv_from:
                    return kv_from - (2 if hparams.is_swa(il) else 1)
                return -1

        n_trunk = hparams.n_layer_trunk()
        hc_dflash = arch == "dflash" and hparams.dsv4_hc_mult > 0  # DSpark stages: an iSWA cache, no filter
        if hc_dflash and hparams.swa_type == SWAType.NONE:
            raise KVRefError("dflash with hyper-connections needs a sliding window (llama.cpp asserts swa_type)")
        nextn = hparams.n_layer_nextn > 0 and n_trunk > 0 and hparams.router_layer < 0 and not hc_dflash
        if mtp_dense or (nextn and ctx_type == "mtp"):

            def layer_filter(il: int) -> bool:
                return il >= n_trunk  # a draft context holds only the MTP blocks

        elif nextn:

            def layer_filter(il: int) -> bool:
                return il < n_trunk  # the trunk context never attends the MTP blocks

        if arch == "gemma4-assistant":
            # llama_context requires ctx_other; create_memory hands its memory (mem_other) and a layer_share
            # callback to llama_kv_cache_iswa: every layer and every cell is the target context's
            if hparams.swa_type == SWAType.NONE:
                raise KVRefError("gemma4-assistant without a sliding window: llama.cpp asserts is_swa_any()")
            mem = shared_iswa(
                hparams,
                mem_other,
                type_k=type_k,
                type_v=type_v,
                v_trans=v_trans,
                swa_full=cp.swa_full,
                kv_unified=cp.kv_unified,
                n_seq_max=cp.n_seq_max,
                n_pad=n_pad,
                layer_filter=layer_filter,
                compat=profile,
                cparams=cp,
            )
        elif hparams.swa_type != SWAType.NONE:
            mem = KVCacheISWA(
                hparams,
                type_k=type_k,
                type_v=type_v,
                v_trans=v_trans,
                swa_full=cp.swa_full,
                kv_unified=cp.kv_unified,
                kv_size=cp.n_ctx_seq,
                n_seq_max=cp.n_seq_max,
                n_ubatch=cp.n_ubatch,
                n_pad=n_pad,
                layer_filter=layer_filter,
                layer_reuse=layer_reuse,
                compat=profile,
                cparams=cp,
            )
        else:
            mem = KVCache(
                hparams,
                type_k=type_k,
                type_v=type_v,
                v_trans=v_trans,
                kv_unified=cp.kv_unified,
                kv_size=cp.n_ctx_seq,
                n_seq_max=cp.n_seq_max,
                n_pad=n_pad,
                n_swa=hparams.n_swa,
                swa_type=hparams.swa_type,
                layer_filter=layer_filter,
                layer_reuse=layer_reuse,
                compat=profile,
                cparams=cp,
            )
    return mem


DSA_ARCHS = frozenset({"glm-dsa", "deepseek32", "hy_v4", "dots3note"})  # llama_kv_cache_dsa / _dsa_iswa


def _create_dsa(
    hparams: HParams,
    cp: ContextParams,
    ctx_type: str,
    type_k: GGMLType | int | str,
    type_v: GGMLType | int | str,
    n_pad: int,
    profile: Profile,
) -> Memory[_Slot]:
    """create_memory's cases of the DeepSeek-sparse-attention archs (glm-dsa, deepseek32, hy_v4, dots3note).

    - glm-dsa, deepseek32: an MTP draft context of a model with NextN blocks gets a plain KVCache of those blocks
      (the draft head runs dense MLA); otherwise a KVCacheDSA over the trunk layers whose indexer cache keeps the
      trunk layers (glm-dsa: those that own an indexer, ``is_indexer_full``);
    - hy_v4: a plain KVCache without an indexer (``indexer_top_k`` 0), else a KVCacheDSA whose indexer cache keeps
      the layers that own an indexer;
    - dots3note: a KVCacheDSAISWA over the trunk (the indexer cache: trunk layers that own an indexer); llama.cpp
      builds a plain cache of the NextN blocks for an MTP context, then crashes creating it (no MTP graph): refused.
    """
    from .kv_cache_dsa import KVCacheDSA
    from .kv_cache_dsa_iswa import KVCacheDSAISWA

    arch, hp = hparams.arch, hparams
    n_trunk = hp.n_layer_trunk()
    v_trans = not cp.flash_attn
    if arch == "dots3note" and hp.swa_type == SWAType.NONE:
        raise KVRefError("dots3note needs a sliding window (llama.cpp asserts swa_type != LLAMA_SWA_TYPE_NONE)")

    def plain(layer_filter: Callable[[int], bool] | None) -> KVCache:
        return KVCache(
            hp, type_k=type_k, type_v=type_v, v_trans=v_trans, kv_unified=cp.kv_unified, kv_size=cp.n_ctx_seq,
            n_seq_max=cp.n_seq_max, n_pad=n_pad, n_swa=hp.n_swa, swa_type=hp.swa_type, layer_filter=layer_filter,
            compat=profile, cparams=cp,
        )  # fmt: skip

    if arch == "dots3note" and ctx_type == "mtp" and hp.n_layer_nextn > 0:
        # create_memory builds the plain cache of the NextN block, but dots3note has no MTP graph: llama_init_from_model
        # builds the trunk graph over it and dies (SIGSEGV: llama_kv_cache_dsa_context::get_mla from
        # build_attn_inp_k_dsa_iswa, in graph_reserve)
        raise KVRefError(
            "dots3note has no MTP graph: llama.cpp 0.3.36 crashes creating its MTP context (SIGSEGV in graph_reserve, "
            "build_attn_inp_k_dsa_iswa over a plain KV cache)"
        )
    if arch in ("glm-dsa", "deepseek32") and ctx_type == "mtp" and hp.n_layer_nextn > 0:
        return plain(lambda il: il >= n_trunk)  # the NextN block(s) only
    if arch == "hy_v4" and hp.indexer_top_k == 0:
        return plain(None)  # a full-attention checkpoint: no indexer
    if hp.indexer_head_size < hp.n_rot:
        # the trunk graph asserts n_rot <= indexer_head_size (the indexer head is [rope | nope]); hy_v4's loader throws
        raise KVRefError(
            f"{arch}: n_rot {hp.n_rot} exceeds indexer_head_size {hp.indexer_head_size} (llama.cpp cannot build the "
            "context: GGML_ASSERT in the graph, or the loader throws)"
        )
    filter_mla: Callable[[int], bool] | None = None
    if arch != "hy_v4" and hp.n_layer_nextn > 0:
        filter_mla = lambda il: il < n_trunk  # noqa: E731 -- the trunk never attends the NextN block(s)
    if arch == "glm-dsa" or arch == "dots3note":
        filter_lid = lambda il: il < n_trunk and hp.is_indexer_full(il)  # noqa: E731
    elif arch == "deepseek32":
        filter_lid = lambda il: il < n_trunk  # noqa: E731
    else:  # hy_v4: every layer is asked (an MTP block past the trunk would abort in is_indexer_full)
        filter_lid = hp.is_indexer_full
    if arch == "dots3note":
        return KVCacheDSAISWA(
            hp, type_k=type_k, type_v=type_v, v_trans=v_trans, swa_full=cp.swa_full, kv_unified=cp.kv_unified,
            kv_size=cp.n_ctx_seq, n_seq_max=cp.n_seq_max, n_ubatch=cp.n_ubatch, n_pad=n_pad, filter_mla=filter_mla,
            filter_lid=filter_lid, compat=profile, cparams=cp,
        )  # fmt: skip
    return KVCacheDSA(
        hp, type_k=type_k, type_v=type_v, v_trans=v_trans, kv_unified=cp.kv_unified, kv_size=cp.n_ctx_seq,
        n_seq_max=cp.n_seq_max, n_pad=n_pad, n_swa=hp.n_swa, swa_type=hp.swa_type, filter_mla=filter_mla,
        filter_lid=filter_lid, compat=profile, cparams=cp,
    )  # fmt: skip


def _hybrid_idx(
    hparams: HParams,
    cp: ContextParams,
    ctx_type: str,
    type_k: GGMLType | int | str,
    type_v: GGMLType | int | str,
    v_trans: bool,
    n_pad: int,
    profile: Profile,
) -> HybridIdxMemory:
    """llama_memory_hybrid_idx for glm5-next (KDA recurrent layers, K-only MLA attention layers and an indexer
    cache over the trunk layers with their own indexer; the MTP context keeps only the NextN layers and no
    recurrent one, and needs them) and for qwen4exp with an indexer (QSA over the dense-attention layers)."""
    n_trunk = hparams.n_layer_trunk()

    def filter_attn(il: int) -> bool:
        return il < n_trunk and not hparams.is_recurrent(il)

    def filter_recr(il: int) -> bool:
        return il < n_trunk and hparams.is_recurrent(il)

    filter_idx: Callable[[int], bool] = filter_attn
    if hparams.arch == "glm5-next":

        def filter_idx(il: int) -> bool:
            return filter_attn(il) and hparams.is_indexer_full(il)

        if ctx_type == "mtp":
            if hparams.n_layer_nextn == 0:
                raise KVRefError("GLM5-Next MTP requires the NextN block (llama.cpp throws: convert without --no-mtp)")

            def filter_attn(il: int) -> bool:
                return il >= n_trunk

            def filter_recr(il: int) -> bool:
                return False

            filter_idx = filter_attn
    return HybridIdxMemory(
        hparams,
        type_k=type_k,
        type_v=type_v,
        v_trans=v_trans,
        kv_size=cp.n_ctx_seq,
        n_pad=n_pad,
        n_swa=hparams.n_swa,
        swa_type=hparams.swa_type,
        type_r="f32",
        type_s="f32",
        rs_size=max(1, cp.n_seq_max),
        n_seq_max=cp.n_seq_max,
        kv_unified=cp.kv_unified,
        filter_attn=filter_attn,
        filter_recr=filter_recr,
        filter_idx=filter_idx,
        n_rs_seq=cp.n_rs_seq,
        compat=profile,
        cparams=cp,
    )


def _deepseek4(
    hparams: HParams,
    cp: ContextParams,
    ctx_type: str,
    type_k: GGMLType | int | str,
    type_v: GGMLType | int | str,
    v_trans: bool,
    profile: Profile,
) -> Memory[_Slot]:
    """create_memory's LLM_ARCH_DEEPSEEK4 case: llama_kv_cache_dsv4 (`KVCacheDSV4`: never unified, ``n_pad`` 1),
    or for an MTP draft context a llama_kv_cache_iswa over the MTP blocks (layers from ``n_layer_trunk()`` on)."""
    if hparams.swa_type == SWAType.NONE:
        raise KVRefError("deepseek4 needs a sliding window (create_memory asserts swa_type != NONE)")
    if ctx_type == "mtp":
        n_trunk = hparams.n_layer_trunk()
        return KVCacheISWA(
            hparams, type_k=type_k, type_v=type_v, v_trans=v_trans, swa_full=cp.swa_full, kv_unified=cp.kv_unified,
            kv_size=cp.n_ctx_seq, n_seq_max=cp.n_seq_max, n_ubatch=cp.n_ubatch, n_pad=1,
            layer_filter=lambda il: il >= n_trunk, compat=profile, cparams=cp,
        )  # fmt: skip
    return KVCacheDSV4(  # type: ignore[return-value]
        hparams, type_k=type_k, type_v=type_v, v_trans=v_trans, swa_full=cp.swa_full, kv_size=cp.n_ctx_seq,
        n_seq_max=cp.n_seq_max, n_ubatch=cp.n_ubatch, n_pad=1, n_rs_seq=cp.n_rs_seq, compat=profile, cparams=cp,
    )  # fmt: skip


__all__ = [
    "CONTEXT_TYPES",
    "LLAMA_STATE_SEQ_FLAGS_NONE",
    "LLAMA_STATE_SEQ_FLAGS_ON_DEVICE",
    "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "LLAMA_STATE_SEQ_FLAGS_SWA_ONLY",
    "NO_MEMORY_ARCHS",
    "UNSUPPORTED_ARCHS",
    "ContextParams",
    "Memory",
    "PairedMemory",
    "check_cache_types",
    "context_params",
    "create_memory",
    "kv_pad",
]
