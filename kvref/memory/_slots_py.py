"""Pure-Python twin of the per-cell work of slot placement (llama.cpp's ``llama_kv_cache::find_slot`` and the
checks ``apply_ubatch`` makes on its target cells, src/llama-kv-cache.cpp).

This is the readable statement of the rules; ``_slots_c.pyx`` implements the same functions at C speed.
Both take one stream's ``KVCells`` (either twin: they read its ``pos`` and ``seq`` arrays, ``size()``,
``get_used()`` and ``seq_pos_max``) and never change it, except ``place_single`` (a whole decode step, which writes
through ``KVCells.place``; ``plan_single`` is the same step without the writes). ``kvref/memory/slots.py`` calls them
per stream of a ubatch and does the rest (streams, heads, writing the cells, prepare's rollback).

find_cells, the search of one stream, walks from the head as llama.cpp does and stops as soon as it has
its ``n_tokens`` cells, so its cost grows with the cells it tests, not with the cache size:

- start at ``head``, or at 0 when ``head > used + 2*n_tokens`` (plenty of free cells before the head: fill
  the cache from the front); a head past the end (only when set by hand) counts as the end;
- a cell can be used when it is empty, or when it holds exactly one sequence and its position is SWA-masked
  (``is_masked_swa``) for a query at that sequence's ``seq_pos_max + 1`` (a chunked window of 0 masks nothing);
- not ``cont``: test one cell per step, wrapping at the end, and take the first ``n_tokens`` usable cells;
  give up once ``size`` cells were tested;
- ``cont``: test ``n_tokens`` cells in a row from the current cell, restart after the first unusable one;
  when fewer than ``n_tokens`` cells are left before the end, count them as tested and wrap to 0; give up
  when, after a failed run, the tested count (runs plus skipped tails) reaches ``size``;
- ``n_tokens > size`` fits nowhere (None); ``n_tokens == 0`` gets no cells (kvref's rule: llama.cpp's
  loop has no defined answer for an empty ubatch).

The cells come back as an int64 array (8 bytes a cell: a restore places every cell of a sequence at once).

Threads: these functions reach the cells only through their public methods and read-only views, each call atomic
under the cells' guard (``kvref/_cells_py.py``), and a view keeps its buffer alive. The Cython twin reads the Cython
cells' buffers directly, so it holds their guard for the whole kernel.

The module also holds the per-token work of a decode step's other parts, so that the Cython twin can do it in C:
the batch allocator's checks of a batch whose tokens have one sequence id each (``kvref.memory.batch`` takes its general
path whenever these answer None), and the reading of a ubatch's sequence ids for apply_ubatch (``seq_flat``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from ..constants import INT32_MIN, LLAMA_MAX_SEQ, POS_MAX
from ..errors import CellError
from ..hparams import SWAType, is_masked_swa

if TYPE_CHECKING:
    from ._cells_py import KVCells

IntArray = npt.NDArray[np.int32]
_BLOCK = 256  # cells whose usability is computed together (the walk reads it from the current block)


class Usable:
    """find_slot's "can we use this cell?" for the cells of one stream, computed a block at a time.

    A cell can be used when it is empty, or when it holds exactly one sequence and its position is masked by
    that sequence's sliding window for a query at the sequence's ``seq_pos_max + 1``.
    """

    def __init__(self, cells: KVCells, n_swa: int, swa_type: int, block: int) -> None:
        self.pos = np.asarray(cells.pos)
        self.seq = np.asarray(cells.seq)
        self.seq_pos_max = cells.seq_pos_max
        self.n_swa = int(n_swa)
        self.swa_type = int(swa_type)
        # a chunked window of 0 positions has no chunk start to mask before (and no division to do)
        self.swa = self.swa_type != SWAType.NONE and not (self.swa_type == SWAType.CHUNKED and self.n_swa == 0)
        self.block = block
        self.pos_max: dict[int, int] = {}  # seq_pos_max of the sequences met so far
        self.lo = self.hi = 0
        self.flags: list[bool] = []

    def __call__(self, idx: int) -> bool:
        if not self.lo <= idx < self.hi:
            self.lo = idx - idx % self.block
            self.hi = min(self.lo + self.block, self.pos.shape[0])
            self.flags = self.can_use(self.lo, self.hi).tolist()
        return self.flags[idx - self.lo]

    def can_use(self, lo: int, hi: int) -> npt.NDArray[np.bool_]:
        """The test for cells ``[lo, hi)``."""
        pos = self.pos[lo:hi].astype(np.int64)
        usable: npt.NDArray[np.bool_] = pos == -1
        if not self.swa:
            return usable
        seq = np.ascontiguousarray(self.seq[lo:hi], dtype="<u8")  # little-endian words: byte k holds bits 8k..8k+7
        bits = np.unpackbits(seq.view(np.uint8), axis=1, bitorder="little")  # column 64*w + b: sequence 64*w + b
        single = np.flatnonzero((bits.sum(axis=1) == 1) & ~usable)
        if single.size == 0:
            return usable
        seq_ids = np.argmax(bits[single], axis=1).tolist()
        for s in set(seq_ids) - self.pos_max.keys():
            self.pos_max[s] = int(self.seq_pos_max(s))
        # seq_pos_max + 1 is an int32 sum in llama.cpp: past INT32_MAX it wraps to INT32_MIN
        query = np.array([(self.pos_max[s] + 1 + 2**31) % 2**32 - 2**31 for s in seq_ids], dtype=np.int64)
        usable[single] = is_masked_swa(self.n_swa, self.swa_type, pos[single], query)
        return usable


def find_cells(
    cells: KVCells, head: int, n_tokens: int, cont: bool, n_swa: int, swa_type: int
) -> npt.NDArray[np.int64] | None:
    """The cells llama_kv_cache::find_slot picks in one stream for ``n_tokens`` tokens (int64[n_tokens], in the
    order picked); None when they do not fit.

    ``head`` is the stream's head; ``n_swa`` / ``swa_type`` the cache's window (see the module docstring).
    """
    size = cells.size()
    head_cur = min(int(head), size)
    if head_cur > cells.get_used() + 2 * n_tokens:
        head_cur = 0
    if n_tokens > size:
        return None
    if n_tokens == 0:
        return np.empty(0, dtype=np.int64)
    can_use = Usable(cells, n_swa, swa_type, max(_BLOCK, n_tokens))
    idxs = np.empty(n_tokens, dtype=np.int64)  # the first n_found are the cells picked so far
    n_found = 0
    n_tested = 0
    n_test = n_tokens if cont else 1  # cells tested in a row before the checks below
    while True:
        if head_cur + n_test > size:
            n_tested += size - head_cur
            head_cur = 0
            continue
        for _ in range(n_test):
            idx = head_cur
            head_cur += 1
            n_tested += 1
            if can_use(idx):
                idxs[n_found] = idx
                n_found += 1
            elif cont:
                break
        if n_found == n_tokens:
            return idxs
        if cont:
            n_found = 0
        if n_tested >= size:
            return None


def used_targets(cells: KVCells, idxs: list[int] | npt.NDArray[np.int64], size: int) -> list[tuple[int, int, int]]:
    """Check one stream's target cells before apply_ubatch writes them; ``(cell, seq_id, pos)`` of each used one.

    CellError when ``idxs`` does not hold ``size`` distinct cells, when a cell index is outside the cells, or
    when a used target holds several sequences (llama.cpp asserts it holds exactly one). Nothing changes.
    """
    if len(set(idxs)) != size:
        raise CellError("apply_ubatch: a cell index appears twice in the slot")
    used = []
    for idx in idxs:
        if not cells.is_empty(idx):
            if cells.seq_count(idx) != 1:
                raise CellError(f"apply_ubatch: cell {idx} is shared by several sequences")
            used.append((int(idx), cells.seq_get(idx), cells.pos_get(idx)))
    return used


# ------------------------------------------------------------------------------ the batch allocator's per-token work
# llama_batch_allocr::init (kvref.memory.batch.BatchAllocr) states every rule of a batch in Python. The common batch,
# where every token has exactly one sequence id, is checked here in one pass instead: these functions answer None
# whenever that batch is not of that shape or breaks any rule, and the allocator then takes its general path, which
# raises the error llama.cpp gives. They never raise for a bad batch and never change their arguments.


def int32_values(values: object, lo: int) -> npt.NDArray[np.int64] | None:
    """A Batch's ``tokens`` or ``pos`` copied as int64, when they are a 1-D int32 or int64 array or a list of plain
    ``int`` and every value lies in ``[lo, 2**31 - 1]``; None otherwise (the Batch then checks them one by one)."""
    if type(values) is np.ndarray and values.ndim == 1 and values.dtype in (np.int32, np.int64):
        arr = values.astype(np.int64)
    elif type(values) is list and all(type(v) is int for v in values):
        try:
            arr = np.array(values, dtype=np.int64)
        except OverflowError:
            return None
    else:
        return None
    if arr.size and (arr.min() < lo or arr.max() > POS_MAX):
        return None
    return arr


def token_batch(
    tokens: object, pos: object, seq_ids: object
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None, list[list[int]] | None] | None:
    """A Batch's ``tokens``, ``pos`` and ``seq_ids`` checked and copied in one call, for the common batch: at least one
    token id (``int32_values``), no positions or one position >= 0 per token, no sequence ids or one plain list of
    them per token (``plain_seq_ids``); None otherwise (the Batch then checks each field, raising its error)."""
    t = int32_values(tokens, -(2**31))
    if t is None or len(t) == 0:
        return None
    p = None if pos is None else int32_values(pos, 0)
    if pos is not None and (p is None or len(p) != len(t)):
        return None
    ids = None if seq_ids is None else plain_seq_ids(seq_ids)
    if seq_ids is not None and (ids is None or len(ids) != len(t)):
        return None
    return t, p, ids


def plain_seq_ids(seq_ids: object) -> list[list[int]] | None:
    """A Batch's ``seq_ids`` copied as a list of lists, when it is a list (or tuple) of lists (or tuples) of plain
    ``int``; None otherwise (the Batch then checks and converts each id)."""
    if type(seq_ids) is not list and type(seq_ids) is not tuple:
        return None
    out = []
    for ids in seq_ids:
        if (type(ids) is not list and type(ids) is not tuple) or any(type(s) is not int for s in ids):
            return None
        out.append(list(ids))
    return out


def single_seq_ids(
    seq_ids: list[list[int]] | None, n_tokens: int, n_seq_max: int
) -> tuple[IntArray, list[int], IntArray] | None:
    """The one sequence id of every token as int32[n_tokens], the distinct ids ascending (``seq_id_unq``) and
    ``seq_idx`` (int32[LLAMA_MAX_SEQ]: each id's index in that list, -1 for the others).

    ``seq_ids`` None means sequence 0 for every token (llama_batch_compat's default). None when a token has not
    exactly one id, when an id is not a plain ``int`` in a one-element list, or is outside
    ``[0, min(n_seq_max, LLAMA_MAX_SEQ))``.
    """
    if n_tokens <= 0:
        return None
    if seq_ids is None:
        return (np.zeros(n_tokens, np.int32), [0], _seq_index([0])) if n_seq_max >= 1 else None
    if type(seq_ids) is not list or len(seq_ids) != n_tokens:
        return None
    flat = []
    for ids in seq_ids:
        if type(ids) is not list or len(ids) != 1 or type(ids[0]) is not int:
            return None
        flat.append(ids[0])
    if min(flat) < 0 or max(flat) >= min(n_seq_max, LLAMA_MAX_SEQ):  # the general path says what is wrong
        return None
    unq = sorted(set(flat))
    return np.array(flat, dtype=np.int32), unq, _seq_index(unq)


def _seq_index(unq: list[int]) -> IntArray:
    seq_idx = np.full(LLAMA_MAX_SEQ, -1, dtype=np.int32)
    seq_idx[unq] = np.arange(len(unq), dtype=np.int32)
    return seq_idx


def single_seq_batch(
    tokens: npt.NDArray[np.int64],
    pos: npt.NDArray[np.int64] | None,
    seq: IntArray,
    present: list[int],
    mem_pos_max: list[int],
    n_vocab: int,
    mrope: bool,
) -> IntArray | None:
    """The positions of a token batch whose tokens have one sequence id each, when it passes llama_batch_allocr::init.

    ``tokens`` are the ids (each must be in ``[0, n_vocab)``; ``n_vocab`` -1: no upper bound); ``pos`` the given
    positions (its first ``n_tokens`` entries), or None to continue each sequence after ``mem_pos_max`` (the
    memory's ``seq_pos_max`` of each sequence of ``present``, -1 for none): the k-th token of sequence s gets
    ``mem_pos_max[s] + 1 + k``. The rules, per sequence s with y its smallest and x the memory's last position:
    positions never decrease along the batch and fit int32; without M-RoPE ``y == x + 1`` (when x >= 0) and no
    position in ``[y, max]`` is missing; under M-RoPE ``x < y`` (when x >= 0). None when any rule fails.
    """
    n = int(seq.shape[0])
    if n == 0 or tokens.shape[0] != n or tokens.min() < 0 or (n_vocab >= 0 and tokens.max() >= n_vocab):
        return None
    last = np.full(LLAMA_MAX_SEQ, -1, dtype=np.int64)
    last[present] = mem_pos_max
    # the tokens grouped by sequence, in batch order within each group
    order = np.argsort(seq, kind="stable")
    s_sorted = seq[order].astype(np.int64)
    first = np.ones(n, dtype=bool)
    first[1:] = s_sorted[1:] != s_sorted[:-1]
    group = np.cumsum(first) - 1
    if pos is None:
        rank = np.arange(n) - np.flatnonzero(first)[group]  # k: the token is its sequence's k-th in the batch
        p = np.empty(n, dtype=np.int64)
        p[order] = last[s_sorted] + 1 + rank
    else:
        if pos.shape[0] < n:
            return None
        p = pos[:n].astype(np.int64)
    if p.min() < 0 or p.max() > POS_MAX:
        return None
    p_sorted = p[order]
    if np.any(~first[1:] & (p_sorted[1:] < p_sorted[:-1])):
        return None  # a sequence's positions decrease
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], n) - 1
    y, y_max, x = p_sorted[starts], p_sorted[ends], last[s_sorted[starts]]
    if mrope:
        return None if np.any((x >= 0) & (x >= y)) else p.astype(np.int32)
    new = first.copy()
    new[1:] |= p_sorted[1:] != p_sorted[:-1]  # a position not seen before in its sequence
    distinct = np.add.reduceat(new.astype(np.int64), starts)
    if np.any((x >= 0) & (y != x + 1)) or np.any(y_max - y + 1 > distinct):
        return None
    return p.astype(np.int32)


def plan_single(
    cells: KVCells,
    head: int,
    tokens: npt.NDArray[np.int64],
    pos: npt.NDArray[np.int64] | None,
    seq_ids: list[list[int]] | None,
    n_seq_max: int,
    n_swa: int,
    swa_type: int,
) -> tuple[npt.NDArray[np.int64], IntArray, IntArray, IntArray] | None:
    """A decode step of the common batch on one stream's cells, planned but not written: the batch allocator's
    one-pass check (``single_seq_ids``, the cells' ``seq_pos_max`` of each sequence, ``single_seq_batch`` without a
    vocabulary bound or M-RoPE) and find_slot's search from ``head`` (``find_cells``, not contiguous). Returns the
    cells (int64), the positions, the sequence ids and the tokens (int32), or None when any part would decline (a
    token beyond int32 too): the caller's general path then does each part in turn (and raises its error). The
    cells found may hold a sequence's window-masked positions (a sliding-window cache reusing them)."""
    n = int(tokens.shape[0])
    ids = single_seq_ids(seq_ids, n, n_seq_max) if 0 < n <= cells.size() else None
    if ids is None:
        return None
    seq, present, _seq_idx = ids
    try:
        mem_pos_max = [cells.seq_pos_max(s) for s in present]
    except Exception:
        return None  # the general path asks again, where llama.cpp would
    p = single_seq_batch(tokens, pos, seq, present, mem_pos_max, -1, False)
    if p is None or tokens.min() < INT32_MIN or tokens.max() > POS_MAX:
        return None
    idxs = find_cells(cells, head, n, False, n_swa, swa_type)
    if idxs is None:
        return None
    return idxs, p, seq, tokens.astype(np.int32)


def place_single(
    cells: KVCells,
    head: int,
    tokens: npt.NDArray[np.int64],
    pos: npt.NDArray[np.int64] | None,
    seq_ids: list[list[int]] | None,
    n_seq_max: int,
    n_swa: int,
    swa_type: int,
) -> tuple[npt.NDArray[np.int64], IntArray, IntArray, IntArray] | None:
    """A whole decode step of the common batch on one stream's cells, when every part of it succeeds:
    ``plan_single`` and apply_ubatch's writes into the cells planned when they are all empty (``KVCells.place``,
    ext ``(0, 0, token)``). Returns what ``plan_single`` returns, or None with nothing changed when any part would
    decline."""
    plan = plan_single(cells, head, tokens, pos, seq_ids, n_seq_max, n_swa, swa_type)
    if plan is None or not place_planned(cells, plan):
        return None
    return plan


def place_planned(cells: KVCells, plan: tuple[npt.NDArray[np.int64], IntArray, IntArray, IntArray]) -> bool:
    """apply_ubatch's writes of a ``plan_single`` plan into its cells, when they are all empty: ``KVCells.place``
    with ext ``(0, 0, token)``; False, and nothing changes, when it declines."""
    idxs, p, seq, tok = plan
    return cells.place(idxs, p, seq, (0, 0, tok))


def seq_lists(seq: IntArray) -> tuple[list[list[int]], list[int], IntArray]:
    """``[[s] for s in seq]`` (a ubatch's ``seq_id`` when every token has one sequence), the distinct ids ascending
    (``seq_id_unq``), and ``seq_idx``: int32[LLAMA_MAX_SEQ], each id's index in that list, -1 for the others."""
    flat = seq.tolist()
    unq = sorted(set(flat))
    return [[s] for s in flat], unq, _seq_index(unq)


def single_ubatch(
    token: IntArray, pos: IntArray, seq: IntArray, logits: npt.NDArray[np.bool_] | None
) -> dict[str, object]:
    """The fields of the ubatch ``split_simple`` makes of a whole batch of one sequence id and one position per token
    (``kvref.memory.batch.UBatch.whole_single``), in the dataclass's field order: ``token``, ``pos`` and ``seq`` int32
    (the ubatch keeps ``token`` and ``pos``), ``logits`` the batch's bool flags or None (only the last token
    outputs)."""
    n = int(token.shape[0])
    seq_id, seq_id_unq, seq_idx = seq_lists(seq)
    if logits is not None:
        output = logits.astype(np.int8)
    else:
        output = np.zeros(n, dtype=np.int8)
        output[-1] = 1
    return dict(
        equal_seqs=False, n_tokens=n, n_seq_tokens=1, n_seqs=n, n_seqs_unq=len(seq_id_unq), n_pos=1, token=token,
        embd=None, pos=pos, n_seq_id=np.ones(n, np.int32), seq_id=seq_id, seq_id_unq=seq_id_unq, seq_idx=seq_idx,
        output=output, batch_idxs=np.arange(n, dtype=np.int32),
    )  # fmt: skip


class RecurrentCells(Protocol):
    """What ``recurrent_owned_step`` reads and writes of a recurrent memory (``kvref.memory.recurrent``): its cells
    as lists (``pos``, ``src``, ``src0``, ``tail``, ``seq``: one set of sequence ids per cell) and find_slot's
    counters."""

    pos: list[int]
    src: list[int]
    src0: list[int]
    tail: list[int]
    seq: list[set[int]]
    head: int
    used: int
    n: int
    rs_z: int


def recurrent_owned_step(
    mem: RecurrentCells,
    tokens: npt.NDArray[np.int64],
    pos: npt.NDArray[np.int64] | None,
    seq_ids: list[list[int]] | None,
    logits: npt.NDArray[np.bool_] | None,
    n_seq_max: int,
) -> tuple[dict[str, object], int, IntArray] | None:
    """A recurrent memory's decode step of one sequence that owns its state's cell alone, whole: the batch allocator's
    one-pass check (``single_seq_ids`` below ``n_seq_max``, ``single_seq_batch`` after the memory's ``seq_pos_max``),
    then llama_memory_recurrent::find_slot for that ubatch, which here only does this (in its order): the head
    goes back to 0 when more than ``used + 2`` cells lie before it; the sequence keeps its cell ``t`` (no other cell
    changes: no move, no swap); ``t`` gets the ubatch's last position and the sequence; ``rs_z`` is ``t`` unless a
    cell copies its state from ``t``; ``src0[t]`` stages ``src[t]`` (``rs_z`` when it has none), then ``src[t] = t``;
    ``head = t``, ``n = 1``, ``used`` counted again. Returns the ubatch's fields (the one ``split_equal`` makes:
    `single_ubatch` as one sequence set), ``t`` and the graph's ``s_copy`` (int32 ``[src0[t]]``: no rollback).
    None, with nothing changed, for any other batch, a sequence without a cell of its own, positions that do not
    continue the cell's (find_slot would warn) or no zeroed state."""
    n = int(tokens.shape[0])
    ids = single_seq_ids(seq_ids, n, n_seq_max) if n > 0 else None
    if ids is None or len(ids[1]) != 1:
        return None
    seq, (sid,), _seq_idx = ids
    cells = mem.seq
    if sid >= len(cells) or mem.tail[sid] < 0 or cells[mem.tail[sid]] != {sid}:
        return None
    t = mem.tail[sid]
    pos_max = max([-1, *(mem.pos[i] for i in range(len(cells)) if sid in cells[i])])  # seq_pos_max(sid)
    p = single_seq_batch(tokens, pos, seq, [sid], [pos_max], -1, False)
    if p is None:
        return None
    last_pos = int(p[-1])
    if mem.pos[t] >= 0 and last_pos != mem.pos[t] + n:
        return None  # find_slot warns of non-consecutive positions: the general path says it
    rs_z = -1 if t in mem.src else t
    if mem.src[t] < 0 and rs_z < 0:
        return None  # find_slot raises: no zeroed state
    if mem.head > mem.used + 2:
        mem.head = 0
    mem.pos[t] = last_pos
    cells[t] = {sid}
    mem.tail[sid] = t
    mem.rs_z = rs_z
    mem.src0[t] = mem.src[t] if mem.src[t] >= 0 else rs_z
    mem.src[t] = t
    mem.head = t
    mem.n = 1
    mem.used = sum(1 for c in cells if c)
    fields = single_ubatch(tokens.astype(np.int32), p, seq, logits)
    fields.update(equal_seqs=True, n_seq_tokens=n, n_seqs=1)
    return fields, t, np.array([mem.src0[t]], dtype=np.int32)


def seq_flat(
    seq_ids: list[list[int]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int, bool] | None:
    """A ubatch's sequence ids for apply_ubatch: (ids per token, all ids in token order, the smallest id, the largest
    id, whether every token has exactly one id); int64 arrays, (0, -1) as the bounds of no id. None unless
    ``seq_ids`` is a list of lists of plain ``int`` (apply_ubatch then checks them one by one)."""
    if type(seq_ids) is not list:
        return None
    counts, flat = [], []
    for ids in seq_ids:
        if type(ids) is not list or any(type(s) is not int for s in ids):
            return None
        counts.append(len(ids))
        flat.extend(ids)
    try:
        c, f = np.array(counts, dtype=np.int64), np.array(flat, dtype=np.int64)
    except OverflowError:
        return None
    lo, hi = (min(flat), max(flat)) if flat else (0, -1)
    return c, f, lo, hi, all(k == 1 for k in counts)


__all__ = [
    "find_cells",
    "int32_values",
    "place_planned",
    "place_single",
    "plain_seq_ids",
    "plan_single",
    "recurrent_owned_step",
    "seq_flat",
    "seq_lists",
    "single_seq_batch",
    "single_seq_ids",
    "single_ubatch",
    "token_batch",
    "used_targets",
]
