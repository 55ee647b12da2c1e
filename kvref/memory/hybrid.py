"""Hybrid attention + recurrent memory: llama.cpp's ``llama_memory_hybrid`` (and ``llama_memory_hybrid_iswa``).

An attention cache over the attention layers and a RecurrentMemory over the recurrent layers, driven by one
splitter (the recurrent pattern: equal splits) and prepared recurrent-first. With ``swa=True`` the attention
part is a KVCacheISWA, which is llama_memory_hybrid_iswa (llama.cpp uses it for hybrid models with SWA).
The state is the attention section(s) followed by the recurrent section.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple, cast

from ..args import as_state_args
from ..errors import NoSlotError
from ..ggml.types import GGMLType
from ..hparams import HParams, SWAType
from ..profile import DEFAULT, Profile, resolve
from .base import (
    LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY,
    ContextParams,
    PairedMemory,
    decode_batch,
    decode_seq_bound,
    over_n_batch,
    read_parts,
)
from .kv_cache import KVCache, YarnParams
from .kv_cache_iswa import ISWASlot, KVCacheISWA
from .recurrent import RecurrentMemory, RecurrentSlot
from .slots import SlotInfo

if TYPE_CHECKING:
    import numpy.typing as npt
    from typing_extensions import Buffer, Unpack

    from .base import MemoryPart
    from .batch import Batch, BatchAllocr, UBatch


class HybridSlot(NamedTuple):
    attn: SlotInfo | ISWASlot  # the KVCache slot (an ISWASlot for hybrid_iswa)
    recr: RecurrentSlot


class HybridMemory(PairedMemory[SlotInfo | ISWASlot, HybridSlot]):
    """llama_memory_hybrid (``swa=False``) / llama_memory_hybrid_iswa (``swa=True``).

    Constructor arguments follow llama.cpp's: attention (types, v_trans, kv_size, n_pad, n_swa, swa_type),
    recurrent (types, rs_size), common (n_seq_max, unified) and the layer filters; a ``None`` filter means
    llama.cpp's default (attention: not recurrent; recurrent: recurrent).
    """

    def __init__(
        self,
        hparams: HParams,
        *,
        type_k: GGMLType | int | str = "f16",
        type_v: GGMLType | int | str = "f16",
        v_trans: bool = True,
        kv_size: int = 256,
        n_pad: int = 1,
        n_swa: int = 0,
        swa_type: SWAType | int = SWAType.NONE,
        type_r: GGMLType | int | str = "f32",
        type_s: GGMLType | int | str = "f32",
        rs_size: int = 1,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        filter_attn: Callable[[int], bool] | None = None,
        filter_recr: Callable[[int], bool] | None = None,
        n_rs_seq: int = 0,
        swa: bool = False,
        swa_full: bool = False,
        n_ubatch: int = 512,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        self.hparams = hparams
        self.kv_unified = bool(kv_unified)
        self.cparams = cparams  # the context create_memory built this for (None when built directly)
        self.profile = resolve(compat)
        if filter_attn is None:
            filter_attn = lambda il: not hparams.is_recurrent(il)  # noqa: E731
        if filter_recr is None:
            filter_recr = hparams.is_recurrent
        self.kind: Literal["hybrid", "hybrid_iswa"] = "hybrid_iswa" if swa else "hybrid"
        self.attn: KVCache | KVCacheISWA
        if swa:
            self.attn = KVCacheISWA(
                hparams,
                type_k=type_k,
                type_v=type_v,
                v_trans=v_trans,
                swa_full=swa_full,
                kv_unified=kv_unified,
                kv_size=kv_size,
                n_seq_max=n_seq_max,
                n_ubatch=n_ubatch,
                n_pad=n_pad,
                layer_filter=filter_attn,
                compat=self.profile,
            )
        else:
            self.attn = KVCache(
                hparams,
                type_k=type_k,
                type_v=type_v,
                v_trans=v_trans,
                kv_unified=kv_unified,
                kv_size=kv_size,
                n_seq_max=n_seq_max,
                n_pad=n_pad,
                n_swa=n_swa,
                swa_type=swa_type,
                layer_filter=filter_attn,
                layer_reuse=None,
                compat=self.profile,
            )
        self.recr = RecurrentMemory(
            hparams,
            type_r=type_r,
            type_s=type_s,
            rs_size=rs_size,
            n_seq_max=n_seq_max,
            kv_unified=kv_unified,
            layer_filter=filter_recr,
            n_rs_seq=n_rs_seq,
            compat=self.profile,
        )
        # decode's one-call step (`_decode_owned`): one KV stream, and the parts bound sequence ids as the memory does
        bound = decode_seq_bound(self.profile, self.kv_unified, self.recr.n_seq_max)
        self._one_call = (
            isinstance(self.attn, KVCache)
            and self.attn.n_stream == 1
            and self.attn._seq_bound == self.recr._seq_bound == bound
        )

    def attention_cache(self, sinfo: HybridSlot | None = None, *, swa: bool = False) -> tuple[KVCache, SlotInfo | None]:
        """The cache a KQ mask is built over: the attention part's (its base or SWA cache for hybrid_iswa)."""
        aslot = None if sinfo is None else sinfo.attn
        # the attention part's slot is the one it placed: a SlotInfo for a KVCache, an ISWASlot for a KVCacheISWA
        if isinstance(self.attn, KVCache):
            return self.attn.attention_cache(cast("SlotInfo | None", aslot), swa=swa)
        return self.attn.attention_cache(cast("ISWASlot | None", aslot), swa=swa)

    def get_mem_attn(self) -> KVCache | KVCacheISWA:
        """The attention part: a KVCache, or a KVCacheISWA for hybrid_iswa (llama_memory_hybrid::get_mem_attn)."""
        return self.attn

    def _pair(self) -> Sequence[MemoryPart[object]]:
        return [self.attn, self.recr]

    def get_mem_recr(self) -> RecurrentMemory:
        """The recurrent part (llama_memory_hybrid::get_mem_recr)."""
        return self.recr

    def total_size(self) -> int:
        """Backing-buffer bytes of both parts."""
        return self.attn.total_size() + self.recr.total_size()

    def get_n_stream(self) -> int:
        """The attention part's number of streams."""
        return self.attn.get_n_stream()

    def get_can_shift(self) -> bool:
        """The attention part's get_can_shift (a recurrent state can always shift)."""
        return self.attn.get_can_shift()  # a recurrent state shifts trivially

    # --- sequence operations -------------------------------------------------------------------------------

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """The recurrent part first, which may refuse (False, nothing changed), then the attention part."""
        # the recurrent part answers first: where it refuses (an id past n_seq_max, a range cutting its state),
        # llama.cpp returns false without asking the attention part, whose assert on the id is never reached;
        # where it accepts, an id the attention part refuses is refused before either part changes
        seq_id, p0, p1 = self.recr.check_op("seq_rm", seq_id, p0, p1)
        if self.recr.seq_rm_refused(seq_id, p0, p1):
            return False
        self.attn.check_op("seq_rm", seq_id, p0, p1)
        self.recr.seq_rm(seq_id, p0, p1)
        return bool(self.attn.seq_rm(seq_id, p0, p1))

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_memory_hybrid::seq_pos_min: the larger of the two parts' minima."""
        # the positions both parts hold: the larger of the minima, the smaller of the maxima
        return max(self.attn.seq_pos_min(seq_id), self.recr.seq_pos_min(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_memory_hybrid::seq_pos_max: the smaller of the two parts' maxima."""
        return min(self.attn.seq_pos_max(seq_id), self.recr.seq_pos_max(seq_id))

    # --- batches -------------------------------------------------------------------------------------------

    def update(self, **kw: Unpack[YarnParams]) -> bool:
        """Apply the parts' pending updates (the recurrent part has none); returns the attention part's result."""
        res = self.attn.update(**kw)
        self.recr.update()
        return res

    def init_batch(
        self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False
    ) -> list[tuple[UBatch, SlotInfo | ISWASlot]]:
        """llama_memory_hybrid::init_batch: by sequence when every token is an output, else equal splits
        (sequential only with several streams, keeping ``1 + n_rs_seq`` trailing tokens together); the
        recurrent part is prepared first, then the attention part."""
        n_rs_seq = self.recr.n_rs_seq
        if embd_all:
            ubatches = balloc.split_whole("seq", n_ubatch)
        else:
            keep_tail = n_rs_seq + 1 if n_rs_seq > 0 else 0
            sequential = self.get_n_stream() != 1
            ubatches = balloc.split_whole("equal", n_ubatch, sequential=sequential, n_keep_tail=keep_tail)
        if ubatches is None:
            raise NoSlotError("the batch cannot be split for the hybrid memory (failed to prepare)")
        if not self.recr.prepare(ubatches):
            raise NoSlotError("failed to prepare recurrent ubatches")
        slots = self.attn.prepare(ubatches)
        if not slots:
            raise NoSlotError("failed to prepare attention ubatches")
        return list(zip(ubatches, slots, strict=True))

    def decode(
        self,
        batch: Batch,
        n_ubatch: int = 512,
        *,
        k: Mapping[int, npt.ArrayLike] | None = None,
        v: Mapping[int, npt.ArrayLike] | None = None,
        balloc: BatchAllocr | None = None,
        embd_all: bool = False,
        on_ubatch: Callable[[UBatch, HybridSlot], None] | None = None,
    ) -> list[tuple[UBatch, HybridSlot]]:
        """What llama_decode does to the memory (`kvref.memory.base.decode_batch`); ``k`` / ``v`` rows go to the
        attention cache that owns each layer. The common step of one sequence takes `_decode_owned`."""
        if (
            balloc is None
            and not embd_all
            and not k
            and not v
            and on_ubatch is None
            and self._one_call
            and not over_n_batch(self.cparams, batch)
        ):
            step = self._decode_owned(batch, n_ubatch)
            if step is not None:
                return [step]
        return decode_batch(self, batch, n_ubatch, k=k, v=v, balloc=balloc, embd_all=embd_all, on_ubatch=on_ubatch)

    def _decode_owned(self, batch: Batch, n_ubatch: int) -> tuple[UBatch, HybridSlot] | None:
        """decode_batch for the common step of a hybrid memory with one KV stream: the tokens of one sequence that
        owns its recurrent state, continuing both parts (their ``seq_pos_max`` agree, so the memory's is theirs),
        in one ubatch. The attention part plans it first (`KVCache._single`, nothing written), then the recurrent
        part places it (`RecurrentMemory._decode_owned`: the checks, find_slot, split_equal's ubatch), then the plan
        is written (`KVCache._commit_single`). prepare's trial runs are skipped: a planned step fits. None, with
        nothing changed, for any other step."""
        attn, recr = self.attn, self.recr
        assert isinstance(attn, KVCache)  # _one_call
        plan = attn._single(batch, n_ubatch, False)
        if plan is None:
            return None
        sid = int(plan[2][0])
        if attn.seq_pos_max(sid) != recr.seq_pos_max(sid):
            return None
        step = recr._decode_owned(batch, n_ubatch)
        if step is None:
            return None
        ub, rslot = step
        return ub, HybridSlot(attn._commit_single(plan), rslot)

    def _decode_n_seq_max(self) -> int:
        return self.recr.n_seq_max

    def _apply(self, aslot: SlotInfo | ISWASlot, ubatch: UBatch) -> HybridSlot:
        # llama_memory_hybrid_context::apply: attention, then recurrent
        if isinstance(self.attn, KVCache):
            self.attn.apply_ubatch(cast(SlotInfo, aslot), ubatch)
        else:
            self.attn.apply_ubatch(cast(ISWASlot, aslot), ubatch)
        return HybridSlot(aslot, self.recr.apply_ubatch(ubatch))

    def _owner(self, il: int, slot: HybridSlot) -> tuple[KVCache, SlotInfo]:
        return self._attn_cache(il, slot.attn)

    def _attn_cache(self, il: int, aslot: SlotInfo | ISWASlot) -> tuple[KVCache, SlotInfo]:
        if isinstance(self.attn, KVCache):
            return self.attn, cast(SlotInfo, aslot)
        return self.attn._owner(il, cast(ISWASlot, aslot))

    # --- state ---------------------------------------------------------------------------------------------

    def _state_parts(self, flags: int) -> Sequence[MemoryPart[object]]:
        if self.kind == "hybrid_iswa":
            # llama_memory_hybrid_iswa hands the flags to the iSWA cache (which then skips its base)
            return [self.attn, self.recr]
        # PARTIAL_ONLY: the recurrent part alone
        return [self.recr] if flags & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY else [self.attn, self.recr]

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore both sections; a failure leaves both parts untouched.

        With ``atomic=False``, as llama.cpp: the attention part is restored before the recurrent section is
        read; a failing part is left as llama.cpp leaves it (the sequence removed). When the recurrent part
        fails, ``Profile.hybrid_restore_undo`` clears the restored attention part for the sequence again
        (llama_memory_hybrid::state_read); without it, and always for hybrid_iswa (llama_memory_hybrid_iswa), the
        attention part is kept."""
        seq_id, flags = as_state_args(seq_id, flags)
        # llama_memory_hybrid_iswa::state_read reads one part after the other and undoes nothing
        undo = self.profile.hybrid_restore_undo and self.kind == "hybrid"
        return read_parts(self._state_parts(flags), data, seq_id, flags, undo_before=undo, atomic=atomic)

    @property
    def compat(self) -> str:
        """The name of the memory's profile (``self.profile.name``)."""
        return self.profile.name

    def __repr__(self) -> str:
        return f"HybridMemory(kind={self.kind}, attn={self.attn!r}, recr={self.recr!r})"


__all__ = ["HybridMemory", "HybridSlot"]
