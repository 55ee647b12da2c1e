"""The memory interface every kvref memory implements, and llama.cpp's memory factory.

`Memory` documents the method set shared by KVCache, RecurrentMemory, KVCacheISWA and HybridMemory
(llama_memory_i), so callers never branch on the kind. `create_memory` builds the memory object llama.cpp
builds for a model and a set of context parameters: `context_params` mirrors the relevant part of the
llama_context constructor (src/llama-context.cpp) and `create_memory` mirrors llama_model::create_memory
(src/llama-model.cpp).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .archs import NO_MEMORY_ARCHS, UNSUPPORTED_ARCHS
from .constants import LLAMA_MAX_SEQ
from .errors import KVRefError
from .profile import DEFAULT, Profile, resolve
from .profile import RS_ROLLBACK_ARCHS as RS_ROLLBACK_ARCHS
from .profile import RS_ROLLBACK_ARCHS_2026_08 as RS_ROLLBACK_ARCHS_2026_08

# llama_state_seq_flags (include/llama.h)
LLAMA_STATE_SEQ_FLAGS_NONE = 0
LLAMA_STATE_SEQ_FLAGS_SWA_ONLY = 1  # the old name of PARTIAL_ONLY: same bit
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1  # iSWA: only the SWA cache; hybrid: only the recurrent part
LLAMA_STATE_SEQ_FLAGS_ON_DEVICE = 2


@runtime_checkable
class Memory(Protocol):
    """What every kvref memory offers (llama_memory_i plus kvref's state entry points).

    Sequence ops follow llama.cpp: ``p0 < 0`` means 0, ``p1 < 0`` means "to the end". ``decode`` splits
    and places a batch, raising NoSlotError (memory unchanged) when llama_decode would return 1, and
    returns ``[(ubatch, slot), ...]`` where the slot's type depends on the memory. ``state_write`` returns
    the memory section(s) llama.cpp writes; ``state_read`` restores them atomically and returns the bytes
    read. ``stage_state`` is the two-phase form composites use: it parses and checks a section at
    ``offset`` without changing anything and returns ``(commit, end)``.
    """

    kind: str

    def clear(self, data: bool = True) -> None:
        """Like llama_memory_clear: empty the memory; zero its buffers too when ``data``."""

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Like llama_memory_seq_rm: remove ``seq_id`` (every sequence when -1) from positions [p0, p1).

        False when the memory refuses (a recurrent state cannot drop only its last tokens).
        """

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Like llama_memory_seq_cp: make ``seq_id_dst`` see the cells of ``seq_id_src`` in [p0, p1)."""

    def seq_keep(self, seq_id: int) -> None:
        """Like llama_memory_seq_keep: drop every sequence but ``seq_id``."""

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Like llama_memory_seq_add: add ``shift`` to the positions of ``seq_id`` in [p0, p1)."""

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Like llama_memory_seq_div: integer-divide the positions of ``seq_id`` in [p0, p1) by ``d``."""

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_memory_seq_pos_min: the smallest position of ``seq_id``, or -1 when it holds no cell."""

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_memory_seq_pos_max: the largest position of ``seq_id``, or -1 when it holds no cell."""

    def get_can_shift(self) -> bool:
        """Like llama_memory_can_shift: can positions be shifted (seq_add / seq_div)."""

    def decode(self, batch: Any, n_ubatch: int = 512) -> list[tuple[Any, Any]]:
        """What llama_decode does to the memory: validate, update, split and place ``batch``.

        Returns ``[(ubatch, slot), ...]``; raises NoSlotError when the batch does not fit.
        """

    def update(self) -> Any:
        """Apply pending shifts and stream copies (llama_context::memory_update); True when something was pending."""

    def state_sections(self, seq_id: int = -1, flags: int = 0) -> list[Any]:
        """The sections ``state_write`` serializes, as ``kvref.state`` objects in write order."""

    def state_write(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """The bytes of the section(s) llama.cpp's state_write writes (every sequence when ``seq_id`` is -1)."""

    def state_read(self, data: Any, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore what ``state_write`` wrote, atomically unless ``atomic=False``; returns the bytes read."""

    def stage_state(
        self, data: Any, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Parse and check the section(s) at ``offset`` without changing anything; returns ``(commit, end)``."""


def stage_parts(
    parts: list[Any], data: Any, seq_id: int, flags: int, offset: int = 0
) -> tuple[Callable[[], None], int]:
    """Stage consecutive sections, one per part; nothing changes unless every one of them checks out."""
    commits = []
    for part in parts:
        stage = getattr(part, "stage_state", None)
        if stage is None:
            raise KVRefError(f"{type(part).__name__} has no stage_state(): it cannot take part in an atomic restore")
        commit, offset = stage(data, seq_id, flags, offset)
        commits.append(commit)

    def commit_all() -> None:
        for c in commits:
            c()

    return commit_all, offset


def clear_seq(part: Any, seq_id: int) -> None:
    """What llama.cpp's state_clear leaves in a memory: the sequence removed (everything for seq_id -1)."""
    if seq_id == -1:
        part.clear(True)
        return
    with contextlib.suppress(KVRefError):  # an id the memory does not have: llama.cpp's seq_rm does nothing
        part.seq_rm(seq_id, -1, -1)


def read_parts(
    parts: list[Any], data: Any, seq_id: int, flags: int, undo_before: bool = False, *, atomic: bool = True
) -> int:
    """state_read of consecutive sections, one per part.

    Every section is parsed, checked and placed (on copies) before anything is applied. With ``atomic``
    (kvref's default) a failure raises with every part exactly as it was. With ``atomic=False`` the memory
    is left the way llama.cpp leaves it. llama.cpp reads and applies part by part; when the section of part k
    fails, the parts before it stay
    restored (``undo_before``: they are cleared for the sequence again, as llama_memory_hybrid does), part k
    is left as its ``state_read_failed(seq_id, exc)`` says (the sequence removed, or everything cleared for
    seq_id -1, unless llama.cpp fails before touching it), later parts are untouched, and the error
    propagates. Bytes after the last section are kvref's own check: refused before anything changes.
    """
    from .errors import FormatError

    offset = 0
    staged: list[tuple[Any, Callable[[], None]]] = []
    for part in parts:
        try:
            commit, offset = part.stage_state(data, seq_id, flags, offset)
        except KVRefError as exc:
            if atomic:
                raise
            for _, c in staged:
                c()
            if undo_before:
                for p, _ in staged:
                    clear_seq(p, seq_id)
            failed = getattr(part, "state_read_failed", None)
            if failed is not None:
                failed(seq_id, exc)
            raise
        staged.append((part, commit))
    total = memoryview(data).nbytes
    if offset != total:
        raise FormatError(f"{total - offset} trailing bytes after the memory sections", field="trailing", offset=offset)
    for _, c in staged:
        c()
    return offset


def read_all(stage: Callable[..., tuple[Callable[[], None], int]], data: Any, seq_id: int, flags: int) -> int:
    """state_read from stage_state: the sections must end exactly at the end of ``data``."""
    from .errors import FormatError

    commit, end = stage(data, seq_id, flags, 0)
    total = memoryview(data).nbytes
    if end != total:
        raise FormatError(f"{total - end} trailing bytes after the memory sections", field="trailing", offset=end)
    commit()
    return end


def sections_of(parts: list[Any], seq_id: int, flags: int) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        out.extend(part.state_sections(seq_id, flags))
    return out


# --- the factory --------------------------------------------------------------------------------------------


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


# llm_arch_supports_rs_rollback (RS_ROLLBACK_ARCHS, and its older list RS_ROLLBACK_ARCHS_2026_08) live in
# kvref.profile: a memory asks its Profile.rs_rollback_archs


@dataclass(frozen=True)
class ContextParams:
    """The resolved context parameters the memory is built from (llama_cparams, the relevant part)."""

    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    n_rs_seq: int
    kv_unified: bool
    flash_attn: bool
    swa_full: bool


def kv_pad(flash_attn: bool, compat: Profile | str = DEFAULT) -> int:
    """The KV cache padding create_memory uses: ``Profile.n_kv_pad`` (without, with flash attention): 1 when the
    context pads n_ctx instead; llama_kv_cache_unified::get_padding's 32 / 256 when it does not."""
    return resolve(compat).n_kv_pad[1 if flash_attn else 0]


def context_params(
    hparams: Any,
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
    n_seq_max = max(1, int(n_seq_max))
    if n_seq_max > LLAMA_MAX_SEQ:
        raise KVRefError(f"n_seq_max must be <= {LLAMA_MAX_SEQ}")
    # an empty Profile.rs_rollback_archs: no n_rs_seq at all
    if n_rs_seq > 0 and hparams.arch not in profile.rs_rollback_archs:
        n_rs_seq = 0
    if n_ctx == 0:
        n_ctx = int(getattr(hparams, "n_ctx_train", 0) or 0)
        if n_ctx == 0:
            raise KVRefError("n_ctx and hparams.n_ctx_train cannot both be zero")
    if isinstance(flash_attn, str):
        if flash_attn not in ("auto", "enabled", "disabled", "on", "off"):
            raise ValueError(f"flash_attn must be a bool or 'auto'/'enabled'/'disabled', got {flash_attn!r}")
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


def create_memory(
    hparams: Any,
    n_ctx: int = 0,
    n_seq_max: int = 1,
    kv_unified: bool = True,
    flash_attn: bool | str = False,
    type_k: Any = "f16",
    type_v: Any = "f16",
    swa_full: bool = False,
    n_ubatch: int = 512,
    *,
    n_batch: int = 2048,
    n_rs_seq: int = 0,
    causal_attn: bool | None = None,
    compat: Profile | str = DEFAULT,
) -> Any:
    """The memory llama.cpp creates for this model and these context parameters (None: no memory).

    Mirrors llama_model::create_memory after llama_context's parameter resolution (`context_params`):

    - encoder-only and diffusion archs (NO_MEMORY_ARCHS) get no memory;
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
    from .hparams import SWAType

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
    n_pad = kv_pad(cp.flash_attn, profile)
    arch = hparams.arch
    if arch in NO_MEMORY_ARCHS:
        return None
    if arch in UNSUPPORTED_ARCHS:
        raise KVRefError(f"llama.cpp builds a dedicated memory for {arch!r}, which kvref does not model")
    v_trans = not cp.flash_attn

    mem: Any
    if hparams.is_recurrent_arch():
        from .recurrent import RecurrentMemory

        mem = RecurrentMemory(
            hparams, "f32", "f32", max(1, cp.n_seq_max), cp.n_seq_max, n_rs_seq=cp.n_rs_seq, compat=profile
        )
        mem.kv_unified = cp.kv_unified
    elif hparams.is_hybrid_arch():
        if arch == "qwen4exp" and getattr(hparams, "indexer_head_size", 0):
            raise KVRefError("qwen4exp with an indexer uses llama_memory_hybrid_idx, which kvref does not model")
        from .hybrid import HybridMemory

        mem = HybridMemory(
            hparams,
            type_k,
            type_v,
            v_trans,
            cp.n_ctx_seq,
            n_pad,
            hparams.n_swa,
            hparams.swa_type,
            "f32",
            "f32",
            max(1, cp.n_seq_max),
            cp.n_seq_max,
            cp.kv_unified,
            filter_attn=hparams.attn_layer_filter,
            filter_recr=hparams.recr_layer_filter,
            n_rs_seq=cp.n_rs_seq,
            swa=hparams.swa_type != SWAType.NONE,
            swa_full=cp.swa_full,
            n_ubatch=cp.n_ubatch,
            compat=profile,
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
        if getattr(hparams, "n_layer_nextn", 0) > 0 and n_trunk > 0 and getattr(hparams, "router_layer", -1) < 0:

            def layer_filter(il: int) -> bool:
                return il < n_trunk  # the trunk context never attends the MTP blocks

        if hparams.swa_type != SWAType.NONE:
            from .kv_cache_iswa import KVCacheISWA

            mem = KVCacheISWA(
                hparams,
                type_k,
                type_v,
                v_trans,
                cp.swa_full,
                cp.kv_unified,
                cp.n_ctx_seq,
                cp.n_seq_max,
                cp.n_ubatch,
                n_pad,
                layer_filter=layer_filter,
                layer_reuse=layer_reuse,
                compat=profile,
            )
        else:
            from .kv_cache import KVCache

            mem = KVCache(
                hparams,
                type_k,
                type_v,
                v_trans,
                cp.kv_unified,
                cp.n_ctx_seq,
                cp.n_seq_max,
                n_pad,
                hparams.n_swa,
                hparams.swa_type,
                layer_filter,
                layer_reuse,
                compat=profile,
            )
    mem.cparams = cp
    return mem


class PairedMemory:
    """What llama_kv_cache_iswa and llama_memory_hybrid share: two memories that every sequence operation
    reaches in turn (``_pair()``, in llama.cpp's order), and a state made of their sections one after the
    other (``_state_parts(flags)``). The subclasses say what differs: ``seq_rm``'s result, which part's
    positions count, how a batch is split, and what a failed restore leaves."""

    def _pair(self) -> list[Any]:
        raise NotImplementedError

    def _state_parts(self, flags: int) -> list[Any]:
        raise NotImplementedError

    def clear(self, data: bool = True) -> None:
        """Clear both parts, in order (zeroing their buffers too when ``data``)."""
        for m in self._pair():
            m.clear(data)

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """seq_cp on both parts, in order."""
        for m in self._pair():
            m.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        """seq_keep on both parts, in order."""
        for m in self._pair():
            m.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """seq_add on both parts, in order."""
        for m in self._pair():
            m.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """seq_div on both parts, in order."""
        for m in self._pair():
            m.seq_div(seq_id, p0, p1, d)

    def state_sections(self, seq_id: int = -1, flags: int = 0) -> list[Any]:
        """The sections ``state_write`` serializes: those of the parts ``flags`` selects, in order."""
        return sections_of(self._state_parts(flags), seq_id, flags)

    def state_write(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """The bytes of the parts' sections, one after the other (the parts ``flags`` selects)."""
        from .state import section_bytes

        return section_bytes(*self.state_sections(seq_id, flags))

    def stage_state(
        self, data: Any, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Stage the parts' sections one after the other (`stage_parts`); returns ``(commit, end)``. Changes nothing."""
        return stage_parts(self._state_parts(flags), data, seq_id, flags, offset)

    # decode's steps that differ: the seq-id limit, applying a prepared slot, which cache holds a layer
    def _decode_n_seq_max(self) -> int:
        raise NotImplementedError

    def _apply(self, slot: Any, ubatch: Any) -> Any:
        raise NotImplementedError

    def _owner(self, il: int, slot: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def decode(
        self,
        batch: Any,
        n_ubatch: int = 512,
        *,
        k: Mapping[int, Any] | None = None,
        v: Mapping[int, Any] | None = None,
        balloc: Any = None,
        embd_all: bool = False,
        on_ubatch: Callable[[Any, Any], None] | None = None,
    ) -> list[tuple[Any, Any]]:
        """What llama_decode does to the memory: validate the batch, apply the pending update, split and
        prepare, then apply every ubatch; ``k`` / ``v`` rows (per layer, in batch order) are stored in the
        attention cache that owns each layer. Raises NoSlotError, changing nothing, when the batch does not fit.
        ``on_ubatch(ubatch, slot)`` is called after each ubatch is applied (when llama.cpp computes its graph)."""
        import numpy as np

        from .batch import BatchAllocr
        from .kv_cache import decode_seq_bound

        if balloc is None:
            balloc = BatchAllocr(self.hparams.n_pos_per_embd())  # type: ignore[attr-defined]
        n_seq_max = decode_seq_bound(self.profile, self.unified, self._decode_n_seq_max())  # type: ignore[attr-defined]
        balloc.init(batch, memory=self, n_seq_max=n_seq_max, output_all=embd_all)
        self.update()  # type: ignore[attr-defined]
        out = []
        for ub, prepared in self.init_batch(balloc, n_ubatch, embd_all):  # type: ignore[attr-defined]
            slot = self._apply(prepared, ub)
            rows = np.asarray(ub.batch_idxs)
            for il, data in (k or {}).items():
                cache, sinfo = self._owner(il, slot)
                cache.cpy_k(il, np.asarray(data)[rows], sinfo)
            for il, data in (v or {}).items():
                cache, sinfo = self._owner(il, slot)
                cache.cpy_v(il, np.asarray(data)[rows], sinfo)
            if on_ubatch is not None:
                on_ubatch(ub, slot)
            out.append((ub, slot))
        return out


__all__ = [
    "LLAMA_STATE_SEQ_FLAGS_NONE",
    "LLAMA_STATE_SEQ_FLAGS_ON_DEVICE",
    "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "LLAMA_STATE_SEQ_FLAGS_SWA_ONLY",
    "NO_MEMORY_ARCHS",
    "UNSUPPORTED_ARCHS",
    "ContextParams",
    "Memory",
    "PairedMemory",
    "context_params",
    "create_memory",
    "kv_pad",
]
