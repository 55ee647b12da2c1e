"""llama.cpp's memory factory: the memory object llama.cpp builds for a model and a set of context parameters.

`context_params` mirrors the relevant part of the llama_context constructor (src/llama-context.cpp) and
`create_memory` mirrors llama_model::create_memory (src/llama-model.cpp). The interface every memory implements
(`Memory`) is in ``kvref.memory.base`` and re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias

from ..archs import NO_MEMORY_ARCHS, UNSUPPORTED_ARCHS
from ..args import as_int
from ..constants import LLAMA_MAX_SEQ, UINT32_MAX
from ..errors import ArgumentError, KVRefError
from ..ggml.types import GGMLType, traits
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
from .kv_cache import KVCache
from .kv_cache_dsv4 import KVCacheDSV4
from .kv_cache_iswa import KVCacheISWA
from .recurrent import RecurrentMemory

if TYPE_CHECKING:
    from .hybrid import HybridSlot
    from .kv_cache_iswa import ISWASlot
    from .recurrent import RecurrentSlot
    from .slots import SlotInfo

    # what the decode of the memory create_memory builds places each ubatch in (`Memory`'s type parameter)
    _Slot: TypeAlias = "SlotInfo | ISWASlot | HybridSlot | RecurrentSlot"

# llama_context_type: the default context, and a draft context of the model's MTP (NextN) blocks
CONTEXT_TYPES = ("default", "mtp")

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
    """What llama_init_from_model refuses of the cache types (the context is not created: KVRefError): with flash
    attention on (or auto) a quantized K or V type whose block does not divide every layer's head size."""
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
    if arch == "deepseek4":
        return _deepseek4(hparams, cp, ctx_type, type_k, type_v, v_trans, profile)
    if hparams.is_recurrent_arch():
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
    elif hparams.is_hybrid_arch():
        if arch == "qwen4exp" and hparams.indexer_head_size > 0:
            raise KVRefError("qwen4exp with an indexer uses llama_memory_hybrid_idx, which kvref does not model")

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
        if hparams.n_layer_nextn > 0 and n_trunk > 0 and hparams.router_layer < 0:

            def layer_filter(il: int) -> bool:
                return il < n_trunk  # the trunk context never attends the MTP blocks

        if hparams.swa_type != SWAType.NONE:
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
