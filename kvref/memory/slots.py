"""Where a ubatch's tokens land in the KV cache: llama_kv_cache's find_slot, apply_ubatch and prepare.

The functions take the cache and work through what `SlotCache` names of it (``cells(stream)``, ``heads``,
``seq_to_stream``, ``n_swa``/``swa_type``, ...); ``KVCache`` exposes them as methods. The per-cell
work (find_slot's walk over one stream, the checks on apply_ubatch's target cells) is done by the twin module
that ``KVREF_BACKEND`` picks, ``_slots_c`` or ``_slots_py`` (``kvref.memory.slot_kernels``);
``kvref/memory/_slots_py.py`` states it in full.

Rules (llama-kv-cache.cpp as the default profile's llama.cpp has them; older builds differ only where noted):

- find_slot, per stream of the ubatch's sequences: start at the stream's head, or at 0 when
  ``head > used + 2*n_tokens``; a cell can be used when it is empty, or when it holds exactly one sequence
  and its position is SWA-masked for a query at that sequence's ``seq_pos_max + 1``. Non-contiguous search
  takes the first ``n_tokens`` usable cells scanning forward with wrap-around over at most ``size`` cells;
  contiguous search (``cont``) needs ``n_tokens`` usable cells in a row, restarting after the first
  unusable one and skipping the tail that is too short. The walk stops as soon as it has its cells, so a
  decode step costs about the tokens it places, not the cache size.
- apply_ubatch: every used target cell is cleared (remembering, per overwritten sequence, the highest
  position removed), the token's position, ext and sequences are written; then each overwritten sequence
  loses all its positions up to that highest one (``seq_rm``), so every sequence keeps a gap-free range;
  finally each stream's head moves past its last placed cell.
- prepare: places each ubatch with find_slot + apply_ubatch, then restores the saved target cells and
  heads in reverse order. Only the target cells are saved, so cells purged by apply_ubatch outside the
  slot stay purged, and each head is restored from ``v_heads_old[s]`` indexed by the slot's stream
  *index* (not the stream id) — both as in llama.cpp.

How kvref makes a decode step cheap without changing any of this: apply_ubatch checks everything it would refuse
first (``_apply_checks``), then writes the tokens of one sequence each into empty cells with one
``KVCells.place`` call (which does every write or none; when it declines, the writes are made one kind at a time
and raise llama.cpp's error where they did before). prepare applies the *last* ubatch only when that apply would
do more than fill empty cells: otherwise the restore would undo it exactly, so it only checks it (the same
errors, at the same point) and restores the heads as llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import BatchError, KVRefError
from . import _slots_py
from . import slot_kernels as _kernels
from .cells import LLAMA_MAX_SEQ, POS_MAX, TOKEN_NULL, KVCells

if TYPE_CHECKING:
    from ..hparams import HParams, SWAType
    from .batch import UBatch

BACKEND = _kernels.BACKEND
CellIdxs = list[int] | npt.NDArray[np.int64]  # one stream's cells of a slot


@dataclass
class SlotInfo:
    """llama_kv_cache::slot_info: the cells a ubatch occupies, per stream.

    ``strm[s]`` is the stream of the ubatch's s-th sequence group and ``idxs[s]`` its cell indices (one per
    token of that group, in token order); ``s0``/``s1`` the lowest and highest stream used. ``find_slot`` and
    ``prepare`` give lists of ints; a sequence restore places its cells with int64 arrays (`find_slot_seq`), which
    everything here also takes.
    """

    s0: int = LLAMA_MAX_SEQ
    s1: int = 0
    strm: list[int] = field(default_factory=list)
    idxs: list[CellIdxs] = field(default_factory=list)

    @classmethod
    def one_stream(cls, idxs: CellIdxs) -> SlotInfo:
        """``SlotInfo(0, 0, [0], [idxs])``: the slot of a one-stream cache's decode step, without the dataclass's
        ``__init__`` (half the cost, once per step)."""
        slot = object.__new__(cls)
        slot.__dict__ = {"s0": 0, "s1": 0, "strm": [0], "idxs": [idxs]}
        return slot

    def size(self) -> int:
        """Tokens per stream."""
        if not self.idxs or len(self.idxs) != len(self.strm):
            raise KVRefError("SlotInfo.size() of an empty slot")
        return len(self.idxs[0])

    def n_stream(self) -> int:
        """The number of streams the slot spans (slot_info::n_stream)."""
        return len(self.strm)

    def empty(self) -> bool:
        """True when the slot holds no stream (slot_info::empty)."""
        return not self.idxs

    def head(self) -> int:
        """The first cell of a one-stream slot (slot_info::head); KVRefError for any other slot."""
        if len(self.idxs) != 1 or len(self.idxs[0]) == 0:
            raise KVRefError("SlotInfo.head() needs exactly one non-empty stream")
        return int(self.idxs[0][0])

    def is_contiguous(self) -> bool:
        """slot_info::is_contiguous: one stream of consecutive cells (an empty slot counts as contiguous)."""
        if not self.idxs or len(self.idxs[0]) == 0:
            return True
        if len(self.idxs) > 1:
            return False
        ix = self.idxs[0]
        h = ix[0]
        if isinstance(ix, np.ndarray):
            return bool((np.diff(ix) == 1).all())
        return ix == list(range(h, h + len(ix)))


class SlotCache(Protocol):
    """What the slot code reads and writes of the KV cache it places ubatches in (a `kvref.memory.kv_cache.KVCache`):
    each stream's cells and head (``heads[s]`` is assigned), the stream of each sequence, the sliding window, the
    model (apply_ubatch's ext values), and the cache's own sequence check and head update."""

    @property
    def hparams(self) -> HParams: ...
    @property
    def heads(self) -> list[int]: ...
    @property
    def seq_to_stream(self) -> list[int]: ...
    @property
    def n_swa(self) -> int: ...
    @property
    def swa_type(self) -> SWAType: ...
    def cells(self, stream: int) -> KVCells: ...
    def get_n_stream(self) -> int: ...
    def check_seq(self, seq_id: object, name: str = "seq_id") -> int: ...
    def _lower_head(self, stream: int, new_head: int) -> None: ...


# ---------------------------------------------------------------------------------------------- helpers
def usable_cells(cache: SlotCache, stream: int) -> npt.NDArray[np.bool_]:
    """find_slot's "can use" test for every cell of a stream (bool array), for inspection.

    find_slot itself tests only the cells it walks over (see ``kvref/memory/_slots_py.py``).
    """
    cells = cache.cells(stream)
    return _slots_py.Usable(cells, cache.n_swa, int(cache.swa_type), cells.size()).can_use(0, cells.size())


# ---------------------------------------------------------------------------------------------- find_slot
def find_slot(cache: SlotCache, ubatch: UBatch, cont: bool = False) -> SlotInfo | None:
    """Find cells for every token of the ubatch without changing anything; None when it does not fit."""
    n_tokens = int(ubatch.n_tokens)
    n_seqs = 1
    multi = cache.get_n_stream() > 1
    if multi:
        if n_tokens % ubatch.n_seqs_unq:
            raise BatchError(f"ubatch of {n_tokens} tokens is not split evenly over {ubatch.n_seqs_unq} sequences")
        n_seqs = int(ubatch.n_seqs_unq)
        n_tokens //= n_seqs

    s0, s1 = LLAMA_MAX_SEQ, 0
    strms: list[int] = []
    all_idxs: list[CellIdxs] = []  # lists of ints (find_cells answers an int64 array)
    n_seq_ok = len(cache.seq_to_stream)
    for s in range(n_seqs):
        seq_id = int(ubatch.seq_id_unq[s])
        if not 0 <= seq_id < n_seq_ok:
            cache.check_seq(seq_id)  # raises
        # a multi-stream ubatch comes from split_equal: groups of n_tokens tokens, one sequence each
        if multi and (ubatch.n_seq_id[s * n_tokens] != 1 or ubatch.seq_id[s * n_tokens][0] != seq_id):
            raise BatchError("multi-stream ubatch is not grouped by sequence (use split_equal)")
        strm = cache.seq_to_stream[seq_id]
        s0 = min(s0, strm)
        s1 = max(s1, strm)
        strms.append(strm)
        idxs = _kernels.impl.find_cells(
            cache.cells(strm), cache.heads[strm], n_tokens, cont, cache.n_swa, cache.swa_type
        )
        if idxs is None:
            return None
        all_idxs.append(idxs.tolist())
    return SlotInfo(s0, s1, strms, all_idxs)


def find_slot_seq(cache: SlotCache, seq_id: int, n_tokens: int, cont: bool = False) -> SlotInfo | None:
    """``find_slot`` of a ubatch of ``n_tokens`` tokens that all belong to ``seq_id`` alone (the ubatch a sequence
    restore reserves), without building it (find_slot reads only the count and the sequence); the slot holds the
    cells as find_cells' int64 array (8 bytes a cell, where a list of ints takes 40)."""
    if not 0 <= seq_id < len(cache.seq_to_stream):
        cache.check_seq(seq_id)  # raises
    strm = cache.seq_to_stream[seq_id]
    idxs = _kernels.impl.find_cells(cache.cells(strm), cache.heads[strm], n_tokens, cont, cache.n_swa, cache.swa_type)
    if idxs is None:
        return None
    return SlotInfo(strm, strm, [strm], [idxs])


# ---------------------------------------------------------------------------------------------- apply
def _check_seq_ids(cache: SlotCache, seq_ids: list[list[int]]) -> None:
    """``cache.check_seq`` of every sequence id of these tokens (their range is checked in one go first)."""
    flat = [sid for ids in seq_ids for sid in ids]
    try:
        if not flat or (min(flat) >= 0 and max(flat) < len(cache.seq_to_stream)):
            return
    except TypeError:
        pass
    for sid in flat:
        cache.check_seq(int(sid))


# per stream: the used target cells ((cell, seq_id, pos) each) and the tokens' sequence ids (seq_flat's, or None)
# (ApplyChecks: what apply_ubatch's checks found, for apply_checked)
_Ints = int | npt.NDArray[np.int64] | npt.NDArray[np.int32]  # one value for every token, or one per token
_SeqFlat = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int, bool]
_Plan = tuple[list[list[tuple[int, int, int]]], list[_SeqFlat | None]]
ApplyChecks = _Plan


def _apply_checks(cache: SlotCache, sinfo: SlotInfo, ubatch: UBatch) -> _Plan:
    """What apply_ubatch checks before it changes anything, in its order: the slot size, then per stream the target
    cells (llama.cpp asserts a used target holds exactly one sequence) and the tokens' sequence ids."""
    size = sinfo.size()
    n_stream = len(sinfo.strm)
    if int(ubatch.n_tokens) != n_stream * size:
        raise BatchError(f"slot holds {n_stream * size} cells for a ubatch of {ubatch.n_tokens} tokens")
    used, seqs = [], []
    n_seq_ok = len(cache.seq_to_stream)
    for s in range(n_stream):
        used.append(_kernels.impl.used_targets(cache.cells(sinfo.strm[s]), sinfo.idxs[s], size))
        rows = ubatch.seq_id[s * size : (s + 1) * size]
        flat = _kernels.impl.seq_flat(rows)
        if flat is None:
            _check_seq_ids(cache, rows)
        elif flat[2] < 0 or flat[3] >= n_seq_ok:
            for sid in flat[1].tolist():
                cache.check_seq(sid)
        seqs.append(flat)
    return used, seqs


def _ext_values(
    cache: SlotCache, ubatch: UBatch, pos_all: npt.NDArray[np.int64], rows: slice[int, int, None]
) -> tuple[_Ints, _Ints, _Ints] | None:
    """The (x, y, tok) apply_ubatch writes into the cells of ``rows`` (arrays or one value for all); None when it
    leaves the ext as it is: ext is written when the batch has 2-D positions, token ids, or the model has per-layer
    embeddings (PLE). Builds with the 8-byte ext (Profile.cell_ext_size) wrote it for 2-D positions only, which
    their state never shows (only M-RoPE caches save an ext there)."""
    hp = cache.hparams
    ple = hp.ple_n_heads > 0
    if not (ubatch.n_pos >= 3 or ubatch.token is not None or ple):
        return None
    n_tok = int(ubatch.n_tokens)
    xs: _Ints = 0
    ys: _Ints = 0
    if ubatch.is_pos_2d():
        xs = pos_all[2 * n_tok + rows.start : 2 * n_tok + rows.stop]
        ys = pos_all[n_tok + rows.start : n_tok + rows.stop]
    toks: _Ints = TOKEN_NULL
    if ubatch.token is not None:
        toks = np.asarray(ubatch.token)[rows]
    elif ple:
        # an embedding batch gets the model's image (or EOS) token for the PLE layers
        toks = hp.ple_image_token_id if hp.ple_image_token_id != 0 else hp.ple_eos_token_id
    return xs, ys, toks


def apply_ubatch(cache: SlotCache, sinfo: SlotInfo, ubatch: UBatch) -> None:
    """Write the ubatch's tokens into the cells of ``sinfo`` (llama_kv_cache::apply_ubatch)."""
    _apply_writes(cache, sinfo, ubatch, _apply_checks(cache, sinfo, ubatch))


def apply_checked(cache: SlotCache, sinfo: SlotInfo, ubatch: UBatch, checked: ApplyChecks) -> None:
    """``apply_ubatch`` whose checks ``prepare_checked`` already made: valid only while the cells are as that
    prepare left them (a decode step applying its only ubatch right after preparing it)."""
    _apply_writes(cache, sinfo, ubatch, checked)


def _apply_writes(cache: SlotCache, sinfo: SlotInfo, ubatch: UBatch, plan: _Plan) -> None:
    used, seqs = plan
    size = len(sinfo.idxs[0])
    pos_all = np.asarray(ubatch.pos, dtype=np.int64)
    seq_pos_max_rm: dict[int, int] = {}  # overwritten sequence -> highest position removed
    for s in range(len(sinfo.strm)):
        cells = cache.cells(sinfo.strm[s])
        idxs = sinfo.idxs[s]
        rows = slice(s * size, (s + 1) * size)
        flat = seqs[s]
        # empty targets, one sequence per token: every write in one call, or none when one would be refused
        if (
            not used[s]
            and flat is not None
            and flat[4]
            and cells.place(idxs, pos_all[rows], flat[1], _ext_values(cache, ubatch, pos_all, rows))
        ):
            continue
        for idx, sid, p in used[s]:
            seq_pos_max_rm[sid] = max(seq_pos_max_rm.get(sid, -1), p)
            cells.rm(idx)
        cells.pos_set_many(idxs, pos_all[rows])
        ext = _ext_values(cache, ubatch, pos_all, rows)
        if ext is not None:
            try:
                cells.ext_set_many(idxs, *ext)
            except Exception:
                # ext_set_many changed nothing: ext_set cell by cell writes what llama.cpp would before the error
                xs, ys, toks = (np.broadcast_to(np.asarray(v), (size,)).tolist() for v in ext)
                for idx, x, y, tok in zip(idxs, xs, ys, toks, strict=True):
                    cells.ext_set(idx, x, y, tok)
        if flat is not None:
            counts, ids, _lo, _hi, single = flat
            cells.seq_add_many(idxs if single else np.repeat(np.asarray(idxs, dtype=np.int64), counts), ids)
        else:
            seq_ids = ubatch.seq_id[rows]
            if all(len(ids) == 1 for ids in seq_ids):
                cells.seq_add_many(idxs, [ids[0] for ids in seq_ids])
            else:
                cell_of = [idx for idx, ids in zip(idxs, seq_ids, strict=True) for _ in ids]
                cells.seq_add_many(cell_of, [int(sid) for ids in seq_ids for sid in ids])

    purge_below(cache, seq_pos_max_rm)
    for s in range(len(sinfo.strm)):
        cache.heads[sinfo.strm[s]] = int(sinfo.idxs[s][-1]) + 1


def purge_below(cache: SlotCache, removed: dict[int, int]) -> None:
    """apply_ubatch's last writes: each sequence that lost a cell to the ubatch (``removed``: sequence -> highest
    position removed) loses its cells from its seq_pos_min up to that position, so its positions stay gap-free
    (llama.cpp's seq_rm: the freed cells also lower the stream's head, as ``KVCache.seq_rm`` does; its range starts
    at 0 at the lowest, so cells a seq_div moved below 0 stay)."""
    for sid in sorted(removed):
        stream = cache.seq_to_stream[sid]
        cells = cache.cells(stream)
        p_min = cells.seq_pos_min(sid)
        if p_min <= removed[sid]:
            # removed + 1 is an int32 sum there: past INT32_MAX it wraps negative, which seq_rm reads as INT32_MAX
            p1 = removed[sid] + 1 if removed[sid] < POS_MAX else POS_MAX
            cache._lower_head(stream, cells.seq_rm_range(sid, max(p_min, 0), p1))


def _writes_cannot_fail(cache: SlotCache, sinfo: SlotInfo, ubatch: UBatch, plan: _Plan) -> bool:
    """True when apply_ubatch, its checks passed (``plan``), only fills empty cells and none of its writes can
    refuse: no target cell is used (so nothing is removed or purged), every token has one sequence id, positions
    and ext values fit (``KVCells.place`` with ``check``). Such an apply is undone exactly by prepare's restore."""
    used, seqs = plan
    size = len(sinfo.idxs[0])
    pos_all = np.asarray(ubatch.pos, dtype=np.int64)
    for s in range(len(sinfo.strm)):
        flat = seqs[s]
        if used[s] or flat is None or not flat[4]:
            return False
        rows = slice(s * size, (s + 1) * size)
        ext = _ext_values(cache, ubatch, pos_all, rows)
        if not cache.cells(sinfo.strm[s]).place(sinfo.idxs[s], pos_all[rows], flat[1], ext, check=True):
            return False
    return True


# ---------------------------------------------------------------------------------------------- prepare
def prepare(cache: SlotCache, ubatches: list[UBatch]) -> list[SlotInfo]:
    """Check that all ubatches fit, one after the other; returns their slots, or [] when one does not fit.

    The cells and heads are restored afterwards (see the module docstring for what is not restored). The last
    ubatch is only checked, not applied, when its apply would fill empty cells only: the restore would undo its
    cells exactly, and nothing after it looks at them (its heads are still restored as llama.cpp restores them).
    """
    return prepare_checked(cache, ubatches)[0]


def prepare_checked(cache: SlotCache, ubatches: list[UBatch]) -> tuple[list[SlotInfo], ApplyChecks | None]:
    """``prepare``, and apply_ubatch's checks of the last ubatch when prepare only checked it (else None), for
    `apply_checked`."""
    if not ubatches:
        raise KVRefError("prepare: no ubatches")  # llama.cpp asserts on an empty list
    res: list[SlotInfo] = []
    states: list[tuple[SlotInfo, list[int], list[KVCells] | None]] = []
    pending_shift: str | None = None
    n_last = len(ubatches) - 1
    checked: ApplyChecks | None = None
    for k, ub in enumerate(ubatches):
        sinfo = find_slot(cache, ub, False)
        if sinfo is None:
            break
        shifted = [st for st, ix in zip(sinfo.strm, sinfo.idxs, strict=True) if _any_shift(cache.cells(st), ix)]
        if shifted:
            # llama.cpp asserts this never happens (decode applies pending shifts before preparing)
            pending_shift = f"stream {shifted[0]} has a pending K-shift in a target cell: call update() first"
            break
        res.append(sinfo)
        if k == n_last:
            plan = _apply_checks(cache, sinfo, ub)
            if _writes_cannot_fail(cache, sinfo, ub, plan):
                states.append((sinfo, list(cache.heads), None))  # only the heads' restore has an effect (see below)
                checked = plan
                continue
        states.append(
            (sinfo, list(cache.heads), [cache.cells(st).cp(ix) for st, ix in zip(sinfo.strm, sinfo.idxs, strict=True)])
        )
        apply_ubatch(cache, sinfo, ub)

    for sinfo, heads_old, saved in reversed(states):
        for s in range(sinfo.n_stream()):
            if saved is not None:
                cache.cells(sinfo.strm[s]).set(sinfo.idxs[s], saved[s])
            cache.heads[sinfo.strm[s]] = heads_old[s]  # sic: indexed by the slot's stream index

    if pending_shift is not None:
        raise KVRefError(pending_shift)
    if len(res) != len(ubatches):
        return [], None
    return res, checked


def _any_shift(cells: KVCells, idxs: CellIdxs) -> bool:
    if not cells.get_has_shift():  # a cell's shift is only ever set with has_shift
        return False
    shift = np.asarray(cells.shift)
    if len(idxs) == 1:
        return bool(shift[idxs[0]])
    return bool(np.any(shift[idxs]))


__all__ = [
    "ApplyChecks",
    "SlotCache",
    "SlotInfo",
    "apply_checked",
    "apply_ubatch",
    "find_slot",
    "prepare",
    "prepare_checked",
    "purge_below",
    "usable_cells",
]
