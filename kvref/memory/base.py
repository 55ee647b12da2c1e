"""The memory interface every kvref memory implements, and the plumbing the composite memories share.

`Memory` documents the method set shared by KVCache, RecurrentMemory, KVCacheISWA and HybridMemory
(llama_memory_i), so callers never branch on the kind. `read_parts` / `stage_parts` restore consecutive
sections atomically; `PairedMemory` is what llama_kv_cache_iswa and llama_memory_hybrid have in common. The
factory that builds a memory for a model (`create_memory`) lives in ``kvref.memory.factory``.

The interface never names the concrete memories (they are built on it): what differs per memory is a type
parameter (the slot ``decode`` returns), and what the shared code needs of a memory is a protocol (`Decodable`,
`Restorable`, `RowStore`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Generic, Protocol, TypeAlias, TypeVar, runtime_checkable

import numpy as np
import numpy.typing as npt

from ..args import as_buffer, as_int, as_state_args
from ..constants import LLAMA_MAX_SEQ
from ..errors import ArgumentError, ArgumentTypeError, CorruptionError, FormatError, KVRefError
from ..profile import Profile, resolve
from ..state import section_bytes
from .batch import BatchAllocr

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer (Python 3.12); only the type checker needs it

    from ..hparams import HParams
    from ..state import KVSection, RecurrentSection
    from .batch import Batch, UBatch
    from .slots import SlotInfo

    # the sections a memory's state is made of
    Section: TypeAlias = "KVSection | RecurrentSection"

_P = TypeVar("_P")  # what a memory's init_batch prepares for each ubatch (decode_batch hands it to _apply)
_S = TypeVar("_S")  # the slot a memory's _apply returns for a placed ubatch
# the slot a memory's decode places each ubatch in: a KVCache's SlotInfo, a KVCacheISWA's ISWASlot, ...
_S_co = TypeVar("_S_co", covariant=True)

# llama_state_seq_flags (include/llama.h)
LLAMA_STATE_SEQ_FLAGS_NONE = 0
LLAMA_STATE_SEQ_FLAGS_SWA_ONLY = 1  # the old name of PARTIAL_ONLY: same bit
LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1  # iSWA: only the SWA cache; hybrid: only the recurrent part
LLAMA_STATE_SEQ_FLAGS_ON_DEVICE = 2


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


@runtime_checkable
class Memory(Protocol[_S_co]):
    """What every kvref memory offers (llama_memory_i plus kvref's state entry points).

    Sequence ops follow llama.cpp: ``p0 < 0`` means 0, ``p1 < 0`` means "to the end". ``decode`` splits
    and places a batch, raising NoSlotError (memory unchanged) when llama_decode would return 1, and
    returns ``[(ubatch, slot), ...]`` where the slot's type depends on the memory (the type parameter: a
    KVCache is a ``Memory[SlotInfo]``, a KVCacheISWA a ``Memory[ISWASlot]``, ...). ``state_write`` returns
    the memory section(s) llama.cpp writes; ``state_read`` restores them atomically and returns the bytes
    read. ``stage_state`` is the two-phase form composites use: it parses and checks a section at
    ``offset`` without changing anything and returns ``(commit, end)``.
    """

    @property
    def kind(self) -> str:
        """The memory's kind, as case.json's memory.type names it ("kv", "iswa", "recurrent", "hybrid", ...)."""

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

    def decode(self, batch: Batch, n_ubatch: int = 512) -> Sequence[tuple[UBatch, _S_co]]:
        """What llama_decode does to the memory: validate, update, split and place ``batch``.

        Returns ``[(ubatch, slot), ...]``; raises NoSlotError when the batch does not fit.
        """

    def update(self) -> bool:
        """Apply pending shifts and stream copies (llama_context::memory_update); True when something was pending."""

    def state_sections(self, seq_id: int = -1, flags: int = 0, *, copy: bool = True) -> Sequence[Section]:
        """The sections ``state_write`` serializes, as ``kvref.state`` objects in write order. Their rows are copies;
        with ``copy=False`` they may be views of the memory's buffers, valid until it changes (to serialize at
        once)."""

    def state_write(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """The bytes of the section(s) llama.cpp's state_write writes (every sequence when ``seq_id`` is -1)."""

    def state_size(self, seq_id: int = -1, flags: int = 0) -> int:
        """The byte count of ``state_write(seq_id, flags)`` (llama_state_get_size's share of the memory)."""

    def state_write_into(self, dst: Buffer | BinaryIO, seq_id: int = -1, flags: int = 0) -> int:
        """``state_write`` into a writable buffer of at least ``state_size()`` bytes, or a binary file (as
        llama_state_get_data fills the buffer its caller allocated); returns the byte count."""

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore what ``state_write`` wrote, atomically unless ``atomic=False``; returns the bytes read."""

    def stage_state(
        self, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Parse and check the section(s) at ``offset`` without changing anything; returns ``(commit, end)``."""


class MemoryPart(Memory[_S_co], Protocol[_S_co]):
    """A memory a composite drives (`PairedMemory`): a `Memory` that checks a sequence operation's arguments."""

    def check_op(self, op: str, *args: object) -> tuple[int, ...]:
        """The arguments of sequence operation ``op`` normalised, or the error ``op`` would raise; changes nothing."""


class Restorable(Protocol):
    """What restoring consecutive state sections (`read_parts`) needs of each part: stage its section, and clear a
    sequence (`clear_seq`, llama.cpp's state_clear) when a restore that is not atomic fails. Every `Memory` is one."""

    def clear(self, data: bool = True) -> None: ...
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...
    def stage_state(
        self, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]: ...


class RowStore(Protocol):
    """Where `store_rows` puts a placed ubatch's K / V rows of a layer: the attention cache that owns the layer (a
    `kvref.memory.kv_cache.KVCache`), at the cells of its slot info."""

    def cpy_k(self, il: int, k_cur: npt.ArrayLike, sinfo: SlotInfo) -> None: ...
    def cpy_v(self, il: int, v_cur: npt.ArrayLike, sinfo: SlotInfo) -> None: ...


class Decodable(Protocol[_P, _S]):
    """What `decode_batch` needs from a memory: its model and profile, the sequence ranges the batch continues,
    and the steps that differ per memory (``_P``: what ``init_batch`` prepares per ubatch, ``_S``: the slot)."""

    @property
    def hparams(self) -> HParams: ...
    @property
    def profile(self) -> Profile: ...
    @property
    def kv_unified(self) -> bool: ...
    @property
    def kind(self) -> str: ...
    @property
    def cparams(self) -> ContextParams | None: ...
    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...
    def update(self) -> bool: ...
    def init_batch(self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False) -> list[tuple[UBatch, _P]]: ...
    def _decode_n_seq_max(self) -> int: ...
    def _apply(self, prepared: _P, ubatch: UBatch) -> _S: ...
    def _owner(self, il: int, slot: _S) -> tuple[RowStore, SlotInfo]: ...


def stage_parts(
    parts: Sequence[Memory[object]], data: Buffer, seq_id: int, flags: int, offset: int = 0
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


def clear_seq(part: Restorable, seq_id: int) -> None:
    """What llama.cpp's state_clear leaves in a memory: the sequence removed (everything for seq_id -1)."""
    if seq_id == -1:
        part.clear(True)
        return
    with contextlib.suppress(KVRefError):  # an id the memory does not have: llama.cpp's seq_rm does nothing
        part.seq_rm(seq_id, -1, -1)


def read_parts(
    parts: Sequence[Restorable],
    data: Buffer,
    seq_id: int,
    flags: int,
    undo_before: bool | Sequence[bool] = False,
    *,
    atomic: bool = True,
) -> int:
    """state_read of consecutive sections, one per part.

    Every section is parsed, checked and placed (on copies) before anything is applied. With ``atomic``
    (kvref's default) a failure raises with every part exactly as it was. With ``atomic=False`` the memory
    is left the way llama.cpp leaves it. llama.cpp reads and applies part by part; when the section of part k
    fails, the parts before it stay
    restored (``undo_before``: they are cleared for the sequence again, as llama_memory_hybrid does; a sequence of
    flags says it per failing part, as llama_kv_cache_dsa_iswa, whose DSA part undoes its MLA cache), part k
    is left as its ``state_read_failed(seq_id, exc)`` says (the sequence removed, or everything cleared for
    seq_id -1, unless llama.cpp fails before touching it), later parts are untouched, and the error
    propagates. Bytes after the last section are kvref's own check: refused before anything changes.
    """
    offset = 0
    staged: list[tuple[Restorable, Callable[[], None]]] = []
    for k, part in enumerate(parts):
        try:
            commit, offset = part.stage_state(data, seq_id, flags, offset)
        except KVRefError as exc:
            if atomic:
                raise
            for _, c in staged:
                c()
            if undo_before if isinstance(undo_before, bool) else undo_before[k]:
                for p, _ in staged:
                    clear_seq(p, seq_id)
            failed = getattr(part, "state_read_failed", None)
            if failed is not None:
                failed(seq_id, exc)
            raise
        staged.append((part, commit))
    total = as_buffer(data).nbytes
    if offset != total:
        raise FormatError(f"{total - offset} trailing bytes after the memory sections", field="trailing", offset=offset)
    for _, c in staged:
        c()
    return offset


def read_all(
    stage: Callable[[Buffer, int, int, int], tuple[Callable[[], None], int]], data: Buffer, seq_id: int, flags: int
) -> int:
    """state_read from stage_state: the sections must end exactly at the end of ``data``."""
    commit, end = stage(data, seq_id, flags, 0)
    total = as_buffer(data).nbytes
    if end != total:
        raise FormatError(f"{total - end} trailing bytes after the memory sections", field="trailing", offset=end)
    commit()
    return end


def sections_of(parts: Sequence[Memory[object]], seq_id: int, flags: int, copy: bool = True) -> list[Section]:
    out: list[Section] = []
    for part in parts:
        out.extend(part.state_sections(seq_id, flags, copy=copy))
    return out


def decode_seq_bound(compat: Profile | str, unified: bool, n_seq_max: int) -> int:
    """The bound llama_decode's batch validation puts on sequence ids (``Profile.decode_seq_id_bound``).

    ``"n_seq_max"``: the context's n_seq_max, unified or not (llama_batch_ext takes llama_n_seq_max(ctx)).
    ``"llama_max_seq_if_unified"`` (llama_batch_allocr::init got ``kv_unified ? LLAMA_MAX_SEQ : n_seq_max``):
    LLAMA_MAX_SEQ for a unified cache, n_seq_max otherwise.
    """
    if resolve(compat).decode_seq_id_bound == "llama_max_seq_if_unified" and unified:
        return LLAMA_MAX_SEQ
    return int(n_seq_max)


def decode_batch(
    memory: Decodable[_P, _S],
    batch: Batch,
    n_ubatch: int = 512,
    *,
    k: Mapping[int, npt.ArrayLike] | None = None,
    v: Mapping[int, npt.ArrayLike] | None = None,
    balloc: BatchAllocr | None = None,
    embd_all: bool = False,
    on_ubatch: Callable[[UBatch, _S], None] | None = None,
) -> list[tuple[UBatch, _S]]:
    """What llama_decode does to a memory, the one implementation every memory's ``decode`` runs.

    llama_context::decode validates the batch first (positions from seq_pos_max + 1, seq ids below
    `decode_seq_bound`), then ``memory_update()`` applies pending shifts and copies, then ``init_batch`` splits
    and prepares every ubatch (NoSlotError when it cannot: llama_decode returns 1), then each ubatch is applied
    in turn. ``k`` / ``v`` map a layer id to its rows for the whole batch (n_tokens, n_embd_gqa), in batch
    order; they are stored at the placed cells of the cache that owns the layer. ``on_ubatch(ubatch, slot)`` is
    called after each ubatch is applied, when llama.cpp computes its graph. Returns ``[(ubatch, slot), ...]``.

    The memory supplies the steps that differ: ``_decode_n_seq_max()`` (the n_seq_max the bound uses),
    ``init_batch(balloc, n_ubatch, embd_all)`` (``[(ubatch, prepared), ...]``), ``_apply(prepared, ubatch)``
    (the slot) and ``_owner(il, slot)`` (the cache and slot info that hold layer ``il``).
    """
    n_ubatch = as_int(n_ubatch, "n_ubatch")
    if n_ubatch < 1:
        raise ArgumentError(f"n_ubatch = {n_ubatch}: a ubatch holds at least one token")
    if balloc is None:
        balloc = BatchAllocr(memory.hparams.n_pos_per_embd())
    n_seq_max = decode_seq_bound(memory.profile, memory.kv_unified, memory._decode_n_seq_max())
    balloc.init(batch, memory=memory, n_seq_max=n_seq_max, output_all=embd_all)
    check_decode(memory, balloc)
    memory.update()
    out = []
    for ub, prepared in memory.init_batch(balloc, n_ubatch, embd_all):
        slot = memory._apply(prepared, ub)
        store_rows(memory, ub, slot, k, v, on_ubatch)
        out.append((ub, slot))
    return out


def over_n_batch(cparams: ContextParams | None, batch: Batch) -> bool:
    """More tokens than the context's n_batch, where llama_decode asserts (`check_decode` raises; a decode's fast path
    leaves such a batch to it)."""
    return cparams is not None and batch.n_tokens > cparams.n_batch


def one_call_batch(batch: Batch, n_ubatch: object, cparams: ContextParams | None) -> bool:
    """Is ``batch`` one a memory's one-call decode step may take: token ids as an array (no embeddings), positions
    an array or None, logits a bool array of one flag per token or None, at most ``n_ubatch`` (an int) and the
    context's n_batch tokens. Anything else goes to `decode_batch`, which raises the errors in llama.cpp's order."""
    tokens, pos, logits = batch.tokens, batch.pos, batch.logits
    if (
        type(tokens) is not np.ndarray
        or batch.embd is not None
        or not (pos is None or type(pos) is np.ndarray)
        or type(n_ubatch) is not int
        or tokens.shape[0] > n_ubatch
    ):
        return False
    n = tokens.shape[0]
    if not (logits is None or (type(logits) is np.ndarray and logits.dtype == np.bool_ and logits.shape == (n,))):
        return False
    return not over_n_batch(cparams, batch)


def check_decode(memory: Decodable[_P, _S], balloc: BatchAllocr) -> None:
    """What llama_decode refuses by dying (or by corrupting its cells) after the batch validated, before the memory
    changes: more tokens than the context's n_batch (GGML_ASSERT: ArgumentError), more than its n_ubatch for a model
    without causal attention (GGML_ASSERT: ArgumentError), and a token at position -1 for an
    attention cache (it would sit in a cell that reads as empty yet stays used, in its sequence: CorruptionError)."""
    n_tokens = balloc.get_n_tokens()
    cparams = memory.cparams
    if cparams is not None and n_tokens > cparams.n_batch:
        raise ArgumentError(f"a batch of {n_tokens} tokens is more than n_batch = {cparams.n_batch} (llama.cpp aborts)")
    if cparams is not None and not memory.hparams.causal_attn and n_tokens > cparams.n_ubatch:
        # the context's causal_attn is the model's until llama_set_causal_attn (which kvref's memory does not see)
        raise ArgumentError(f"a batch of {n_tokens} tokens is more than n_ubatch = {cparams.n_ubatch} for a model "
                            "without causal attention (llama.cpp aborts: non-causal attention requires n_ubatch >= "
                            "n_tokens)")  # fmt: skip
    if memory.kind != "recurrent" and bool((np.asarray(balloc.pos[:n_tokens]) == -1).any()):
        raise CorruptionError("a token at position -1 would leave a cell that reads as empty but stays used and in its "
                              "sequence (llama.cpp decodes it so)")  # fmt: skip


def store_rows(
    memory: Decodable[_P, _S],
    ub: UBatch,
    slot: _S,
    k: Mapping[int, npt.ArrayLike] | None,
    v: Mapping[int, npt.ArrayLike] | None,
    on_ubatch: Callable[[UBatch, _S], None] | None,
) -> None:
    """After a ubatch is applied: its ``k`` / ``v`` rows (taken from the whole batch's) to the cache that owns each
    layer, then ``on_ubatch(ub, slot)``."""
    if k or v:
        rows = np.asarray(ub.batch_idxs)
        for il, data in (k or {}).items():
            cache, sinfo = memory._owner(il, slot)
            cache.cpy_k(il, np.asarray(data)[rows], sinfo)
        for il, data in (v or {}).items():
            cache, sinfo = memory._owner(il, slot)
            cache.cpy_v(il, np.asarray(data)[rows], sinfo)
    if on_ubatch is not None:
        on_ubatch(ub, slot)


class PairedMemory(Generic[_P, _S]):
    """What llama_kv_cache_iswa and llama_memory_hybrid share: two memories that every sequence operation
    reaches in turn (``_pair()``, in llama.cpp's order), and a state made of their sections one after the
    other (``_state_parts(flags)``). The subclasses say what differs: ``seq_rm``'s result, which part's
    positions count, how a batch is split, and what a failed restore leaves."""

    def _pair(self) -> Sequence[MemoryPart[object]]:
        raise NotImplementedError

    def _state_parts(self, flags: int) -> Sequence[MemoryPart[object]]:
        raise NotImplementedError

    def check_op(self, op: str, *args: object) -> tuple[int, ...]:
        """The arguments of sequence operation ``op`` checked against every part (each normalises them as it
        would, `kvref.args`) before any part changes: a composite refuses as a whole or not at all."""
        first, *rest = self._pair()  # always two parts
        checked = first.check_op(op, *args)
        for m in rest:
            checked = m.check_op(op, *checked)
        return checked

    def clear(self, data: bool = True) -> None:
        """Clear both parts, in order (zeroing their buffers too when ``data``)."""
        for m in self._pair():
            m.clear(data)

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """seq_cp on both parts, in order."""
        seq_id_src, seq_id_dst, p0, p1 = self.check_op("seq_cp", seq_id_src, seq_id_dst, p0, p1)
        for m in self._pair():
            m.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        """seq_keep on both parts, in order."""
        (seq_id,) = self.check_op("seq_keep", seq_id)
        for m in self._pair():
            m.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """seq_add on both parts, in order."""
        seq_id, p0, p1, shift = self.check_op("seq_add", seq_id, p0, p1, shift)
        for m in self._pair():
            m.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """seq_div on both parts, in order."""
        seq_id, p0, p1, d = self.check_op("seq_div", seq_id, p0, p1, d)
        for m in self._pair():
            m.seq_div(seq_id, p0, p1, d)

    def state_sections(self, seq_id: int = -1, flags: int = 0, *, copy: bool = True) -> list[Section]:
        """The sections ``state_write`` serializes: those of the parts ``flags`` selects, in order (rows as
        `Memory.state_sections` says)."""
        seq_id, flags = as_state_args(seq_id, flags)
        return sections_of(self._state_parts(flags), seq_id, flags, copy)

    def state_write(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """The bytes of the parts' sections, one after the other (the parts ``flags`` selects)."""
        seq_id, flags = as_state_args(seq_id, flags)
        return section_bytes(*self.state_sections(seq_id, flags, copy=False))

    def state_size(self, seq_id: int = -1, flags: int = 0) -> int:
        """The byte count of ``state_write(seq_id, flags)``: the parts' sizes added."""
        seq_id, flags = as_state_args(seq_id, flags)
        return sum(part.state_size(seq_id, flags) for part in self._state_parts(flags))

    def state_write_into(self, dst: Buffer | BinaryIO, seq_id: int = -1, flags: int = 0) -> int:
        """The parts' sections into ``dst`` one after the other, each part writing its own (`Memory.state_write_into`);
        returns the byte count."""
        seq_id, flags = as_state_args(seq_id, flags)
        parts = self._state_parts(flags)
        if hasattr(dst, "write"):
            return sum(part.state_write_into(dst, seq_id, flags) for part in parts)
        try:
            mv = memoryview(dst)  # not a file: a buffer, or a TypeError
        except TypeError:
            raise ArgumentTypeError(f"dst: a writable buffer or a binary file, not {type(dst).__name__}") from None
        if not mv.c_contiguous:
            raise ArgumentTypeError("dst: expected a writable C-contiguous buffer")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        n = 0
        try:
            for part in parts:
                n += part.state_write_into(mv[n:], seq_id, flags)
        except ArgumentError:
            need = self.state_size(seq_id, flags)
            if need > mv.nbytes:  # a part ran out of room: name the size of the whole state
                raise ArgumentError(f"dst: {mv.nbytes} bytes, the state needs {need}") from None
            raise
        return n

    def stage_state(
        self, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Stage the parts' sections one after the other (`stage_parts`); returns ``(commit, end)``. Changes nothing."""
        seq_id, flags = as_state_args(seq_id, flags)
        return stage_parts(self._state_parts(flags), data, seq_id, flags, offset)

    # decode's steps that differ: the seq-id limit, applying a prepared slot, which cache holds a layer
    def _decode_n_seq_max(self) -> int:
        raise NotImplementedError

    def _apply(self, slot: _P, ubatch: UBatch) -> _S:
        raise NotImplementedError

    def _owner(self, il: int, slot: _S) -> tuple[RowStore, SlotInfo]:
        raise NotImplementedError

    def decode(
        self: Decodable[_P, _S],
        batch: Batch,
        n_ubatch: int = 512,
        *,
        k: Mapping[int, npt.ArrayLike] | None = None,
        v: Mapping[int, npt.ArrayLike] | None = None,
        balloc: BatchAllocr | None = None,
        embd_all: bool = False,
        on_ubatch: Callable[[UBatch, _S], None] | None = None,
    ) -> list[tuple[UBatch, _S]]:
        """What llama_decode does to the memory (`decode_batch`); ``k`` / ``v`` rows go to the attention cache
        that owns each layer."""
        return decode_batch(self, batch, n_ubatch, k=k, v=v, balloc=balloc, embd_all=embd_all, on_ubatch=on_ubatch)


__all__ = [
    "LLAMA_STATE_SEQ_FLAGS_NONE",
    "LLAMA_STATE_SEQ_FLAGS_ON_DEVICE",
    "LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "LLAMA_STATE_SEQ_FLAGS_SWA_ONLY",
    "ContextParams",
    "Decodable",
    "Memory",
    "MemoryPart",
    "PairedMemory",
    "Restorable",
    "RowStore",
    "check_decode",
    "clear_seq",
    "decode_batch",
    "decode_seq_bound",
    "over_n_batch",
    "read_all",
    "read_parts",
    "sections_of",
    "stage_parts",
    "store_rows",
]
