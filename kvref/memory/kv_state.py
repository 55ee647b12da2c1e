"""The attention KV cache's state section: llama_kv_cache::state_write / state_read (per ``cache.profile``).

``KVCache.state_write`` / ``state_read`` (and the two-phase ``stage_state`` the iSWA and hybrid memories
use) are thin methods over the functions here; the byte layout itself is declared once in
``kvref.state.sections`` and this module only builds / consumes its object model.

Writing (``state_section``), per stream, ``u32 n_stream`` first:

- the cells written are the used cells, in index order; for a sequence (``seq_id >= 0``) only the cells
  of that sequence that are *not* SWA-masked against the sequence's ``seq_pos_max`` in that stream
  (llama.cpp calls ``is_masked_swa(n_swa, swa_type, pos, seq_pos_max)``: note no ``+ 1``); with
  ``Profile.seq_save_keeps_masked_swa`` every cell of the sequence, masked or not;
- each cell lists the sequence ids ``0 <= s < n_seq_max`` it holds (only ``seq_id`` for a sequence save:
  ids a unified cache accepts above ``n_seq_max`` are never written, as in llama.cpp);
- the cell ext (``i32 x, y, tok``) is written only when the cache has one (``has_cell_ext``): the model
  uses M-RoPE (``n_pos_per_embd() > 1``) or, with ``Profile.cell_ext_ple``, per-layer-embedding n-grams
  (``ple_n_heads > 0``); ``Profile.cell_ext_size`` says how many bytes (8: only ``i32 x, y``; 0: never);
- an empty stream is only its zero ``cell_count``; without ``Profile.kv_streams`` (before PR #14363)
  the data header (``v_trans``, ``n_layer``, every layer's type and row size) followed it, and restoring such
  an empty sequence section failed (NoSlotError: ``find_slot`` of a zero-token ubatch finds nothing);
- K rows, then V rows (or, with ``v_trans``, per V component the cells' elements); layers without V
  (MLA) write no V block.

Reading (``stage_state``) parses *and validates* the whole section with ``kvref.state.cache_api`` (stream
count, cell count vs cache size, ``n_seq_id == 1`` for a sequence, seq id range for a whole restore,
layer count, ``v_trans``, every type / row size / element size / V width), then replays the bookkeeping on a
copy of the cache. Only when all of that succeeded does ``commit()`` touch the cache:

- whole restore (``seq_id == -1``): ``clear(True)``, then stream ``s`` gets its cells at indices
  ``0 .. cell_count-1`` (positions, ext, seq ids as written) and head 0 (``Profile.whole_restore_clear``
  ``"per_stream"``: only the last non-empty stream is restored, and an all-empty section changes nothing --
  see ``stage_state``);
- sequence restore into ``seq_id`` (the destination; the ids in the file are ignored): the destination's
  cells in its stream are removed (``seq_rm(seq_id)``), a ubatch of ``cell_count`` tokens is built as
  llama_batch_allocr::ubatch_reserve(cell_count, 1) does (positions from the file, M-RoPE y/x and token
  from the ext, token 0 when the cache has no ext), placed with ``find_slot(cont=False)`` +
  ``apply_ubatch``, and the saved ext put back (``Profile.seq_restore_contiguous``: ``find_slot(cont=True)``,
  and the stream's head moves to the first restored cell). Positions are not required to be consecutive (llama.cpp
  does not check them either). The rows are then copied to the cells found.

On failure: llama.cpp reads and applies as it goes; when a check fails half way it has already removed
the destination sequence (or cleared the whole cache), and ``state_clear`` removes the sequence and zeroes
the rows of the cells it had placed. kvref checks everything first (``stage_state`` changes nothing), and
``state_read`` then raises (FormatError for a malformed or mismatching section, NoSlotError when a sequence
does not fit, SequenceError for a bad destination id) leaving the cells as llama.cpp leaves them
(``state_read_failed``: the destination sequence removed, or the cache cleared; nothing when the n_stream
count or the destination id is wrong). Rows of cells no sequence holds any more are not zeroed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, BinaryIO, Protocol, TypeVar, cast

import numpy as np
import numpy.typing as npt

from ..args import as_buffer
from ..constants import LLAMA_MAX_SEQ, N_SEQ_WORDS, TOKEN_NULL
from ..errors import CellError, FormatError, KVRefError, NoSlotError, SequenceError
from ..ggml.types import traits
from ..hparams import SWAType, is_masked_swa
from . import slot_kernels as _kernels
from .base import Restorable, clear_seq
from .batch import UBatch
from .cells import KVCells
from .slots import SlotCache, SlotInfo, _ext_values, apply_ubatch, find_slot_seq

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..ggml.types import GGMLType
    from ..profile import Profile
    from ..state import Cells, KVData, KVSpec, KVStream, TransposedRows
    from ..state.sections import KVSection

CELL_EXT_SIZE = 12  # llama_kv_cell_ext with a token: i32 x, y, tok (Profile.cell_ext_size)


class LayerBuffers(Protocol):
    """A layer of a `StateCache` (a `kvref.memory.kv_cache.CacheLayer`): the model layer, its K buffer and its V buffer
    (None without V: MLA), uint8, one row block per stream."""

    @property
    def il(self) -> int: ...
    @property
    def k(self) -> npt.NDArray[np.uint8]: ...
    @property
    def v(self) -> npt.NDArray[np.uint8] | None: ...


class StateCache(SlotCache, Restorable, Protocol):
    """What the state code reads and writes of a KV cache (a `kvref.memory.kv_cache.KVCache`): the slot code's view
    (`SlotCache`: a sequence restore places its cells as a ubatch) and a restore's (`Restorable`), plus the cache's
    shape, types and buffers, its llama.cpp profile, and a fork of some streams to try placements on."""

    @property
    def profile(self) -> Profile: ...
    @property
    def type_k(self) -> GGMLType: ...
    @property
    def type_v(self) -> GGMLType: ...
    @property
    def v_trans(self) -> bool: ...
    @property
    def n_stream(self) -> int: ...
    @property
    def n_seq_max(self) -> int: ...
    @property
    def layers(self) -> Sequence[LayerBuffers]: ...
    def get_size(self) -> int: ...
    def fork(self, streams: Iterable[int] | None = None) -> StateCache: ...


# ---------------------------------------------------------------------------------------------- layout
def has_cell_ext(cache: StateCache) -> bool:
    """llama_kv_cache::has_cell_ext: M-RoPE needs the 2-D position, the PLE n-gram hash the token id.

    Never with ``Profile.cell_ext_size`` 0; PLE models only with ``Profile.cell_ext_ple``.
    """
    if not cache.profile.cell_ext_size:
        return False
    hp = cache.hparams
    if not cache.profile.cell_ext_ple:
        return hp.n_pos_per_embd() > 1
    return hp.n_pos_per_embd() > 1 or hp.ple_n_heads > 0


def ext_size(cache: StateCache) -> int:
    """Bytes of cell ext per cell in the cache's state: ``Profile.cell_ext_size`` when it has one, else 0."""
    return cache.profile.cell_ext_size if has_cell_ext(cache) else 0


def _ext_xyt(ext: npt.NDArray[np.int32], i: int) -> tuple[int, int, int]:
    """Cell i's ext as (x, y, tok); an 8-byte ext has no token: LLAMA_TOKEN_NULL."""
    row = ext[i]
    return int(row[0]), int(row[1]), (int(row[2]) if len(row) > 2 else -1)


def _v_width(cache: StateCache, il: int) -> int:
    return int(cache.hparams.n_embd_v_gqa(il))


def spec(cache: StateCache) -> KVSpec:
    """The cache as ``kvref.state`` sees it: what a section must match to be restored here."""
    from ..state import KVLayerSpec, KVSpec

    layers = []
    for layer in cache.layers:
        k_row = int(layer.k.shape[-1])
        if layer.v is None:
            layers.append(KVLayerSpec(int(cache.type_k), k_row))
            continue
        n_embd_v = _v_width(cache, layer.il)
        v_row = int(layer.v.shape[-1]) if not cache.v_trans else n_embd_v * traits(cache.type_v).type_size
        layers.append(KVLayerSpec(int(cache.type_k), k_row, int(cache.type_v), v_row, n_embd_v))
    return KVSpec(
        n_stream=cache.n_stream,
        kv_size=cache.get_size(),
        n_seq_max=cache.n_seq_max,
        v_trans=cache.v_trans,
        layers=tuple(layers),
        ext_size=ext_size(cache),
        has_n_stream=cache.profile.kv_streams,  # no u32 n_stream without streams
        seq_cell_ids=1 if cache.profile.kv_seq_save_ids else 0,
    )


# ---------------------------------------------------------------------------------------------- write
def _seq_bits(cells: KVCells, idx: npt.NDArray[np.intp], n_seq: int) -> npt.NDArray[np.bool_]:
    """(len(idx), n_seq) bool: bit s of a row is set when the cell holds sequence s (only s < n_seq)."""
    n_bytes = -(-n_seq // 8)
    words = np.ascontiguousarray(_take(np.asarray(cells.seq), idx)[:, : -(-n_bytes // 8)], dtype="<u8")
    bits = np.unpackbits(words.view(np.uint8)[:, :n_bytes], axis=1, bitorder="little")
    return bits[:, :n_seq].astype(bool)


def _cell_ids(
    cells: KVCells, idx: npt.NDArray[np.intp], n_seq: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    """The sequence ids (``< n_seq``) of cells ``idx`` as a CSR table: ``ids`` and ``start`` (``n + 1``)."""
    if n_seq <= 64:
        # the usual case, one id per cell (checked first): the index of the word's one bit, its log2 (exact for
        # a power of two)
        w = _take(np.asarray(cells.seq), idx)[:, 0] & np.uint64((1 << n_seq) - 1)
        if bool(w.all()) and not (w & (w - np.uint64(1))).any():
            return np.log2(w).astype(np.int32), np.arange(idx.size + 1, dtype=np.int64)
    else:
        ids_one = _one_id_each(cells, idx, n_seq)
        if ids_one is not None:
            return ids_one, np.arange(idx.size + 1, dtype=np.int64)
    rows, ids = np.nonzero(_seq_bits(cells, idx, n_seq))
    start = np.zeros(idx.size + 1, np.int64)
    np.cumsum(np.bincount(rows, minlength=idx.size), out=start[1:])
    return ids.astype(np.int32), start


def _one_id_each(cells: KVCells, idx: npt.NDArray[np.intp], n_seq: int) -> npt.NDArray[np.int32] | None:
    """With ``n_seq`` above 64: the one sequence id (``< n_seq``) of each of cells ``idx``, or None when a cell
    holds none or several. ``_SET_CHUNK`` cells at a time, no (cells x n_seq) bit matrix: a row's four "word is
    non-zero" flags read as one uint32 (a byte each) must be a single flag, which says the word; that word must be
    a power of two, whose log2 is the bit (exact), plus 64 per word before it."""
    if N_SEQ_WORDS != 4 or sys.byteorder != "little":  # pragma: no cover - LLAMA_MAX_SEQ is 256; x86, arm
        return None
    mask = np.zeros(N_SEQ_WORDS, np.uint64)  # ids a unified cache accepts at n_seq_max and above are never written
    for k in range(N_SEQ_WORDS):
        mask[k] = np.uint64((1 << max(0, min(64, n_seq - 64 * k))) - 1)
    seq = np.asarray(cells.seq)
    out = np.empty(idx.size, np.int32)
    for i0 in range(0, idx.size, _SET_CHUNK):
        words = _take(seq, idx[i0 : i0 + _SET_CHUNK]) & mask  # (n, 4), a copy
        flags = np.ascontiguousarray(words != 0).view(np.uint32)[:, 0]  # word k non-zero: byte k is 1
        if not flags.all() or (flags & (flags - np.uint32(1))).any():
            return None  # no id, or ids in two words
        wi = (flags > 0xFF).astype(np.int32) + (flags > 0xFFFF) + (flags > 0xFFFFFF)
        w = words.reshape(-1)[np.arange(words.shape[0]) * N_SEQ_WORDS + wi]
        if (w & (w - np.uint64(1))).any():
            return None  # two ids in one word
        out[i0 : i0 + _SET_CHUNK] = np.log2(w).astype(np.int32) + 64 * wi
    return out


def _run(idx: npt.NDArray[np.intp] | npt.NDArray[np.int64]) -> slice[int, int, None] | None:
    """``idx`` as a slice when it is a run of consecutive ascending cells (the rows are then one block)."""
    if idx.size and int(idx[-1]) - int(idx[0]) + 1 == idx.size and (idx.size < 3 or bool((np.diff(idx) == 1).all())):
        return slice(int(idx[0]), int(idx[-1]) + 1)
    return None


_G = TypeVar("_G", bound="np.generic[object]")


def _take(a: npt.NDArray[_G], idx: npt.NDArray[np.intp], axis: int = 0) -> npt.NDArray[_G]:
    """``a``'s entries ``idx`` along ``axis``: a view when they are one run of cells, else a gathered copy."""
    run = _run(idx)
    if run is None:
        return np.take(a, idx, axis=axis)
    return a[(slice(None),) * axis + (run,)]


def written_cells(cache: StateCache, stream: int, seq_id: int = -1) -> npt.NDArray[np.intp]:
    """Indices of the cells state_write writes for ``stream`` (ascending)."""
    cells = cache.cells(stream)
    pos = np.asarray(cells.pos, dtype=np.int64)
    idx = np.flatnonzero(pos != -1)
    if seq_id == -1 or idx.size == 0:
        return idx
    w, b = divmod(int(seq_id), 64)
    seq = np.asarray(cells.seq)
    has: npt.NDArray[np.bool_] = ((seq[idx, w] >> np.uint64(b)) & np.uint64(1)).astype(bool)
    idx = idx[has]
    # Profile.seq_save_keeps_masked_swa: every non-empty cell of the sequence is written, the ones SWA-masked
    # against its last position included; else those are left out
    if idx.size and cache.swa_type != SWAType.NONE and not cache.profile.seq_save_keeps_masked_swa:
        p_max = np.full(idx.size, cells.seq_pos_max(int(seq_id)), dtype=np.int64)
        masked: npt.NDArray[np.bool_] = is_masked_swa(cache.n_swa, cache.swa_type, pos[idx], p_max)
        idx = idx[~masked]
    return idx


def state_section(cache: StateCache, seq_id: int = -1, flags: int = 0, *, copy: bool = True) -> KVSection:
    """The section llama_kv_cache::state_write writes, as ``kvref.state`` objects (``flags`` change nothing).

    Rows are copies, so the section stays valid when the cache changes afterwards; with ``copy=False`` the
    rows of a run of consecutive cells are views of the cache's buffers (``state_write`` serializes them at
    once, so they are copied only into the bytes it returns).
    """
    from ..state import Cells, KVSection, KVStream

    del flags
    seq_id = int(seq_id)
    if not -1 <= seq_id < LLAMA_MAX_SEQ and any(cache.cells(s).get_used() for s in range(cache.n_stream)):
        # llama.cpp asks each used cell whether it holds the id (std::bitset::test, which throws past its
        # LLAMA_MAX_SEQ bits): llama_state_seq_get_data then writes 0 bytes. Any other id is written, a stream
        # the id does not map to (n_seq_max and above without kv_unified) with no cell of it
        raise SequenceError(f"seq_id {seq_id} is outside [0, {LLAMA_MAX_SEQ}): llama.cpp throws saving it")
    n_ext = ext_size(cache) // 4
    streams = []
    for s in range(cache.n_stream):
        idx = written_cells(cache, s, seq_id)
        if idx.size == 0:
            # without streams the data header of zero cells is written too
            streams.append(KVStream(None, None if cache.profile.kv_streams else _kv_data(cache, s, idx, copy)))
            continue
        cells = cache.cells(s)
        if seq_id == -1:
            ids, start = _cell_ids(cells, idx, cache.n_seq_max)
        elif seq_id < cache.n_seq_max and cache.profile.kv_seq_save_ids:
            # every written cell holds seq_id (written_cells), and it is the only id written (none in 2024)
            ids = np.full(idx.size, seq_id, np.int32)
            start = np.arange(idx.size + 1, dtype=np.int64)
        else:
            ids, start = np.zeros(0, np.int32), np.zeros(idx.size + 1, np.int64)
        ext = np.array(_take(np.asarray(cells.ext), idx)[:, :n_ext]) if n_ext else None  # copies, not views
        table = Cells(np.array(_take(np.asarray(cells.pos), idx)), ids.astype(np.int32), start, ext, n_ext * 4)

        streams.append(KVStream(table, _kv_data(cache, s, idx, copy)))
    return KVSection(streams, has_n_stream=cache.profile.kv_streams)


def _kv_data(cache: StateCache, s: int, idx: npt.NDArray[np.intp], copy: bool = True) -> KVData:
    """The K/V rows of cells ``idx`` of stream ``s`` as ``kvref.state.KVData``: copies, or with ``copy=False``
    views of the buffers when the cells are one run (a transposed V block is then ``n_embd`` strided rows)."""
    from ..state import KVData, LayerRows, TransposedRows

    run = _run(idx)

    def rows(a: npt.NDArray[_G], axis: int = 0) -> npt.NDArray[_G]:
        if run is None:
            return np.take(a, idx, axis=axis)  # a gathered copy
        view = a[(slice(None),) * axis + (run,)]
        return view.copy() if copy else view

    k_rows: list[LayerRows] = []
    v_rows: list[LayerRows | TransposedRows] = []
    size = cache.cells(s).size()
    for layer in cache.layers:
        k_rows.append(LayerRows(int(cache.type_k), int(layer.k.shape[-1]), rows(layer.k[s])))
    for layer in cache.layers:
        if layer.v is None:
            continue
        if not cache.v_trans:
            v_rows.append(LayerRows(int(cache.type_v), int(layer.v.shape[-1]), rows(layer.v[s])))
            continue
        el = traits(cache.type_v).type_size
        n_embd = _v_width(cache, layer.il)
        comp = _elements(layer.v[s][:n_embd], size, el)
        v_rows.append(TransposedRows(int(cache.type_v), el, n_embd, _bytes2d(rows(comp, axis=1), n_embd)))
    return KVData(int(cache.v_trans), k_rows, v_rows)


_EL_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elements(v: npt.NDArray[np.uint8], size: int, el: int) -> npt.NDArray[np.generic[object]]:
    """A transposed V block ``(n_embd, size * el)`` as one element per cell: ``(n_embd, size)`` of an el-byte
    unsigned type when there is one (gathers move whole elements), else ``(n_embd, size, el)`` bytes."""
    dt = _EL_DTYPES.get(el)
    if dt is not None and v.strides[1] == 1:
        return v.view(dt)
    return v.reshape(v.shape[0], size, el)


def _bytes2d(comp: npt.NDArray[np.generic[object]], n_embd: int) -> npt.NDArray[np.uint8]:
    """Elements per cell (`_elements`) back to ``(n_embd, n_cells * el)`` bytes (a view when ``comp`` is one)."""
    return comp.reshape(n_embd, -1).view(np.uint8)


def state_write(cache: StateCache, seq_id: int = -1, flags: int = 0) -> bytes:
    from ..state import section_bytes

    # the rows are serialized straight from the buffers: views, copied once into the bytes returned
    return section_bytes(state_section(cache, seq_id, flags, copy=False))


def state_size(cache: StateCache, seq_id: int = -1, flags: int = 0) -> int:
    """The byte count of what ``state_write`` writes (llama_state_get_size's share for this cache)."""
    from ..state import sections_size

    return sections_size(state_section(cache, seq_id, flags, copy=False))


def state_write_into(cache: StateCache, dst: Buffer | BinaryIO, seq_id: int = -1, flags: int = 0) -> int:
    """``state_write`` into a caller's writable buffer (or a binary file): each row block is copied once, from
    the cache's buffers into ``dst``; returns the byte count."""
    from ..state import write_sections_into

    return write_sections_into(dst, state_section(cache, seq_id, flags, copy=False))


# ---------------------------------------------------------------------------------------------- read
def clone_cells(cells: KVCells) -> KVCells:
    """A full copy of one stream's cells, pending shifts included (``cp`` refuses shifted cells)."""
    size = cells.size()
    shift = np.asarray(cells.shift)
    out = type(cells)(size)
    if not shift.any():
        out.set(0, cells)  # set() takes the other cells' pos / ext / seq arrays as they are
        return out
    pos, ext, seq = np.asarray(cells.pos), np.asarray(cells.ext), np.asarray(cells.seq)
    used = pos != -1
    moved = used & (shift != 0)
    keep = used & ~moved
    # the cells with no pending shift in one set(); an empty cell keeps the null ext of new cells
    block = _CellBlock(np.where(keep, pos, -1), np.where(keep[:, None], ext, _NULL_EXT), seq * keep[:, None])
    out.set(0, block.as_cells())
    for i in np.flatnonzero(moved).tolist():
        out.pos_set_shifted(i, int(pos[i]), int(shift[i]))  # pos - shift may be negative after a seq_div
        for s in cells.seq_get_all(i):
            out.seq_add(i, s)
        out.ext_set(i, *(int(x) for x in ext[i]))
    return out


_NULL_EXT = np.array([0, 0, TOKEN_NULL], np.int32)  # the ext of an empty cell: x, y, tok
_SET_CHUNK = 1 << 14  # cells per KVCells.set() of a whole restore (bounds the temporary bit sets)


class _CellBlock:
    """Cells in the form ``KVCells.set`` takes: ``pos (n,)``, ``ext (n, 3)``, ``seq (n, N_SEQ_WORDS)`` bit sets."""

    __slots__ = ("ext", "pos", "seq")

    def __init__(self, pos: npt.NDArray[np.int32], ext: npt.NDArray[np.int32], seq: npt.NDArray[np.uint64]) -> None:
        self.pos, self.ext, self.seq = pos, ext, seq

    @classmethod
    def of_section(cls, c: Cells, i0: int, i1: int) -> _CellBlock:
        """Cells ``[i0, i1)`` of a section as a whole restore places them: positions, ext, the ids as bits."""
        n = i1 - i0
        ext = np.empty((n, 3), np.int32)
        ext[:] = _NULL_EXT
        k = min(c.ext.shape[1], 3)
        if k:
            ext[:, :k] = c.ext[i0:i1, :k]  # an 8-byte ext has no token: LLAMA_TOKEN_NULL
        j0, j1 = int(c.seq_start[i0]), int(c.seq_start[i1])
        ids = c.seq_id[j0:j1].astype(np.int64)
        bits = np.left_shift(np.uint64(1), (ids & 63).astype(np.uint64))
        seq = np.zeros((n, N_SEQ_WORDS), np.uint64)
        if j1 - j0 == n and bool((np.diff(c.seq_start[i0 : i1 + 1]) == 1).all()):
            seq[np.arange(n), ids >> 6] = bits  # one id a cell: one bit each, set at once
        else:
            rows = np.repeat(np.arange(n), np.diff(c.seq_start[i0 : i1 + 1]))
            np.bitwise_or.at(seq, (rows, ids >> 6), bits)
        return cls(c.pos[i0:i1], ext, seq)

    def as_cells(self) -> KVCells:
        """What ``KVCells.set`` is given: it reads only the other cells' ``pos``, ``ext`` and ``seq`` arrays."""
        return cast("KVCells", self)


def _reserve_ubatch(cache: StateCache, cells: Cells, dest: int, has_ext: bool, i0: int = 0, i1: int = -1) -> UBatch:
    """ubatch_reserve(cell_count, 1) filled as state_read_meta fills it (built at once: every token's
    ``seq_id`` is the same one-element list, which nothing changes); of the section's cells ``[i0, i1)`` (all
    by default: `_apply_restore` places a large section a part at a time)."""
    if i1 < 0:
        i1 = cells.n
    n = i1 - i0
    n_pos = cache.hparams.n_pos_per_embd()
    pos = np.zeros(n * n_pos, np.int32)
    token = np.zeros(n, np.int32)
    pos[:n] = cells.pos[i0:i1]
    if has_ext:
        if n_pos > 1:
            pos[n : 2 * n] = cells.ext[i0:i1, 1]  # y
            pos[2 * n : 3 * n] = cells.ext[i0:i1, 0]  # x
        if cells.ext.shape[1] > 2:  # an 8-byte ext: state_read_meta leaves the tokens as reserved
            token[:] = cells.ext[i0:i1, 2]
    seq_idx = np.full(LLAMA_MAX_SEQ, -1, np.int32)
    seq_idx[dest] = 0
    return UBatch(
        equal_seqs=True, n_tokens=n, n_seq_tokens=n, n_seqs=1, n_seqs_unq=1, n_pos=n_pos, token=token, embd=None,
        pos=pos, n_seq_id=np.ones(n, np.int32), seq_id=[[dest]] * n, seq_id_unq=[dest], seq_idx=seq_idx,
        output=np.zeros(n, np.int8), batch_idxs=np.zeros(0, np.int32),
    )  # fmt: skip


def _slot_after_seq_rm(
    cache: StateCache, strm: int, seq_id: int, n: int, cont: bool, keep: bool = False
) -> tuple[SlotInfo | None, bool]:
    """find_slot for the restore's ubatch (``n`` cells of ``seq_id``) as it runs once ``seq_id`` is removed from its
    stream, without copying the stream's cells: the destination's cells are removed from the cache itself and put
    back exactly as they were (pos, ext, sequence bits, the head) before returning. The slot is None when it does
    not fit.

    With ``keep`` a slot found is returned with ``seq_id`` left removed (what the restore does next, when its
    caller commits at once: the cells are not put back to be removed again); a failed placement is undone. The
    flag returned says whether ``seq_id`` holds no cell of the stream now (removed, or none held)."""
    cells = cache.cells(strm)
    w, b = divmod(seq_id, 64)
    bit = np.uint64(1) << np.uint64(b)
    seq_w = np.asarray(cells.seq)[:, w]
    at = np.int32 if len(seq_w) <= np.iinfo(np.int32).max else np.intp  # 4 bytes a held cell where they do
    held = np.concatenate(
        [
            (np.flatnonzero(seq_w[i0 : i0 + _UNDO_CHUNK] & bit) + i0).astype(at)
            for i0 in range(0, len(seq_w), _UNDO_CHUNK)
        ]
        or [np.zeros(0, at)]
    )  # the cells holding seq_id, found a chunk at a time (bounds the temporaries)
    if held.size == 0:
        return find_slot_seq(cache, seq_id, n, cont), True  # nothing to remove: the cache as it is
    if np.asarray(cells.shift)[held].any():
        # a pending shift (which KVCells.set cannot put back): try the placement on a copy of the stream
        trial = cache.fork([strm])
        trial.seq_rm(seq_id, -1, -1)
        return find_slot_seq(trial, seq_id, n, cont), False
    pos, head = np.asarray(cells.pos)[held], cache.heads[strm]
    ext = _held_ext(np.asarray(cells.ext), held)
    cache.seq_rm(seq_id, -1, -1)
    sinfo = None
    try:
        sinfo = find_slot_seq(cache, seq_id, n, cont)
    finally:
        if sinfo is None or not keep:
            _put_back(cache, strm, held, pos, ext, w, bit, head)
    return sinfo, sinfo is not None and keep


def _put_back(
    cache: StateCache,
    strm: int,
    held: npt.NDArray[np.int32] | npt.NDArray[np.intp],
    pos: npt.NDArray[np.int32],
    ext: npt.NDArray[np.int32],
    w: int,
    bit: np.uint64,
    head: int,
) -> None:
    """Undo `_slot_after_seq_rm`'s seq_rm: the removed cells come back with what they held: their pos and ext,
    the sequences they still hold plus seq_id (set() recomputes the cells' bookkeeping, the used count and the
    per-sequence positions), and the stream's head."""
    cells = cache.cells(strm)
    for i0 in range(0, held.size, _UNDO_CHUNK):
        part = held[i0 : i0 + _UNDO_CHUNK]
        seq = np.asarray(cells.seq)[part]  # a copy (fancy indexing)
        seq[:, w] |= bit
        part_ext = ext[: part.size] if ext.strides[0] == 0 else ext[i0 : i0 + _UNDO_CHUNK]
        block = _CellBlock(pos[i0 : i0 + _UNDO_CHUNK], part_ext, seq)
        cells.set(part, block.as_cells())
    cache.heads[strm] = head


def _held_ext(ext: npt.NDArray[np.int32], held: npt.NDArray[np.int32] | npt.NDArray[np.intp]) -> npt.NDArray[np.int32]:
    """The ext of cells ``held``: when they all have the same one (a cache without ext, or a restore's token 0),
    that row repeated ``_UNDO_CHUNK`` times (a view), else a copy of each. Compared a chunk at a time."""
    row = ext[held[0]]
    for i0 in range(0, held.size, _UNDO_CHUNK):
        if (ext[held[i0 : i0 + _UNDO_CHUNK]] != row).any():
            return ext[held]
    return np.broadcast_to(np.array(row), (_UNDO_CHUNK, 3))


_UNDO_CHUNK = 1 << 13  # cells per KVCells.set() when a trial placement is undone (bounds its temporaries)


def _apply_restore(cache: StateCache, sinfo: SlotInfo, cells: Cells, seq_id: int, has_ext: bool) -> None:
    """apply_ubatch of the restore's ubatch (`_reserve_ubatch` of all the section's cells) into ``sinfo``.

    When every target cell is empty, the ubatch's tokens only fill those cells (the slot's cells are distinct and
    every token writes its own): applying it ``_APPLY_CHUNK`` cells at a time writes the same cells and leaves the
    head where the whole ubatch leaves it, with ubatches and temporaries of a part's size. Otherwise (a target held
    by a sequence whose window has moved past it: apply_ubatch removes it first) the ubatch is applied whole."""
    idxs = sinfo.idxs[0]
    n = len(idxs)
    strm = sinfo.strm[0]
    kv_cells = cache.cells(strm)
    at = np.asarray(idxs, dtype=np.int64)
    if n and bool((np.asarray(kv_cells.pos)[at] == -1).all()):
        # every target empty (the usual case): what apply_ubatch does then, without its per-token checks (the
        # slot's cells are distinct, the one sequence id valid): KVCells.place of each part, the head after it;
        # a part place declines (a value a write would refuse) goes through apply_ubatch, which raises as it does
        for i0 in range(0, n, _APPLY_CHUNK):
            i1 = min(i0 + _APPLY_CHUNK, n)
            ub = _reserve_ubatch(cache, cells, seq_id, has_ext, i0, i1)
            pos_all = np.asarray(ub.pos, dtype=np.int64)
            ids = np.full(i1 - i0, seq_id, np.int64)
            if kv_cells.place(at[i0:i1], pos_all[: i1 - i0], ids, _ext_values(cache, ub, pos_all, slice(0, i1 - i0))):
                cache.heads[strm] = int(at[i1 - 1]) + 1
            else:
                apply_ubatch(cache, SlotInfo(sinfo.s0, sinfo.s1, list(sinfo.strm), [idxs[i0:i1]]), ub)
        return
    if n <= _APPLY_CHUNK or _kernels.impl.used_targets(kv_cells, idxs, n):
        apply_ubatch(cache, sinfo, _reserve_ubatch(cache, cells, seq_id, has_ext))
        return
    for i0 in range(0, n, _APPLY_CHUNK):
        i1 = min(i0 + _APPLY_CHUNK, n)
        part = SlotInfo(sinfo.s0, sinfo.s1, list(sinfo.strm), [idxs[i0:i1]])
        apply_ubatch(cache, part, _reserve_ubatch(cache, cells, seq_id, has_ext, i0, i1))


_APPLY_CHUNK = 1 << 14  # cells per apply_ubatch of a large sequence restore (bounds its ubatch and temporaries)


def _check_whole_cells(cache: StateCache, st: KVStream, at: int) -> None:
    """Raise what placing the section's cells one by one (`_whole_cells`) would raise, checked at once: a
    position -1 (an empty cell's mark: llama.cpp would keep it used while it reads as empty), or a sequence id
    listed twice in a cell (the walk then names the first bad cell). A position below -1 is one a seq_div by a
    negative divisor left: restored as it is, as llama.cpp does."""
    c, _ = _filled(st)
    bad = bool((c.pos == -1).any())
    if not bad and len(c.seq_id):
        bad = int(c.seq_id.min()) < 0 or int(c.seq_id.max()) >= LLAMA_MAX_SEQ
        if not bad and int(np.diff(c.seq_start).max()) > 1:
            key = c.cell_seq().astype(np.int64) * LLAMA_MAX_SEQ + c.seq_id
            key.sort()
            bad = bool((key[1:] == key[:-1]).any())
    if bad:
        _whole_cells(cache, st, at)


def _zero_rows_after(cache: StateCache, n_cells: dict[int, int]) -> None:
    """Zero what ``clear(True)`` zeroes except the rows a whole restore copies next: in stream ``s``, the K / V rows
    of cells ``n_cells[s]`` on (a transposed V: each component's elements of those cells); every row of the other
    streams."""
    el = traits(cache.type_v).type_size if cache.v_trans else 0
    for s in range(cache.n_stream):
        n = n_cells.get(s, 0)
        for layer in cache.layers:
            layer.k[s][n:] = 0
            if layer.v is None:
                continue
            if not cache.v_trans:
                layer.v[s][n:] = 0
                continue
            v = layer.v[s]
            v[:, n * el :] = 0  # the elements of the cells after n, in every component
            if n:
                v[_v_width(cache, layer.il) :, : n * el] = 0  # components past n_embd_v_gqa (copy_rows skips them)


def _set_whole_cells(cells: KVCells, c: Cells) -> None:
    """Cells ``0 .. c.n - 1`` of emptied ``cells`` get the section's cells (checked by `_check_whole_cells`)."""
    for i0 in range(0, c.n, _SET_CHUNK):
        i1 = min(i0 + _SET_CHUNK, c.n)
        cells.set(i0, _CellBlock.of_section(c, i0, i1).as_cells())


def _whole_cells(cache: StateCache, st: KVStream, at: int) -> KVCells:
    """A stream's cells after a whole restore: cell i holds the i-th cell of the section (cell by cell: only to
    raise the error of the first bad cell, see `_check_whole_cells`)."""
    c, _ = _filled(st)
    out = _empty_cells_like(cache, cache.get_size())
    pos = c.pos
    has_ext = c.ext_size > 0
    for i in range(c.n):
        field = "pos"
        try:
            out.pos_set(i, int(pos[i]))
            field = "cell_ext"
            if has_ext:
                out.ext_set(i, *_ext_xyt(c.ext, i))
            field = "seq_id"
            for s in c.seq_ids(i):
                out.seq_add(i, s)
        except CellError as exc:
            raise FormatError(f"cell {i}: {exc}", field=field, offset=at) from exc
    return out


def _put_ext(cells: KVCells, idxs: npt.NDArray[np.int64], c: Cells) -> None:
    """Cells ``idxs`` (just placed, so holding no pending shift) get the section's ext, its cell ``i`` at
    ``idxs[i]``: ``set()`` of the cells as they are with the new ext (``_SET_CHUNK`` cells at a time)."""
    if np.asarray(cells.shift)[idxs].any():  # never after apply_ubatch; the one-by-one form to be sure
        for i, idx in enumerate(idxs.tolist()):
            cells.ext_set(idx, *_ext_xyt(c.ext, i))
        return
    k = min(c.ext.shape[1], 3)
    for i0 in range(0, len(idxs), _SET_CHUNK):  # a part at a time: bounds the copies of the cells' bit sets
        part = idxs[i0 : i0 + _SET_CHUNK]
        ext = np.empty((len(part), 3), np.int32)
        ext[:] = _NULL_EXT
        ext[:, :k] = c.ext[i0 : i0 + len(part), :k]
        cells.set(part, _CellBlock(np.asarray(cells.pos)[part], ext, np.asarray(cells.seq)[part]).as_cells())


def _filled(st: KVStream) -> tuple[Cells, KVData]:
    """The cells and rows of a stream that has cells (the reader gives every such stream its K/V rows)."""
    assert st.cells is not None and st.data is not None
    return st.cells, st.data


def _empty_cells_like(cache: StateCache, size: int) -> KVCells:
    """Empty cells of the same twin as the cache's (so a Python-twin cache stays pure Python)."""
    return type(cache.cells(0))(size)


def copy_rows(cache: StateCache, strm: int, idxs: npt.NDArray[np.int64] | npt.NDArray[np.intp], data: KVData) -> None:
    """Write a section's K/V rows (``data``: a ``kvref.state.KVData``) into cells ``idxs`` of stream ``strm``."""
    size = cache.get_size()
    run = _run(np.asarray(idxs))
    at = idxs if run is None else run  # a run of cells: one block copy per layer (straight from the input)
    for layer, k in zip(cache.layers, data.k, strict=True):
        layer.k[strm][at] = k.data
    v_bufs = [layer.v for layer in cache.layers if layer.v is not None]
    for vbuf, v in zip(v_bufs, data.v, strict=True):
        if not cache.v_trans:
            vbuf[strm][at] = v.data
            continue
        v = cast("TransposedRows", v)  # validated against the cache's spec: a transposed V has transposed rows
        el = v.el_size
        n = len(idxs)
        src = np.asarray(v.data).reshape(v.n_embd, n * el)
        block = vbuf[strm][: v.n_embd]
        if run is not None:
            block[:, run.start * el : run.stop * el] = src  # per component one run of bytes
        else:
            _scatter_elements(_elements(block, size, el), idxs, src, el)


def _scatter_elements(
    dst: npt.NDArray[np.generic[object]], idxs: npt.NDArray[np.intp], src: npt.NDArray[np.uint8], el: int
) -> None:
    """``dst[:, idxs] = src`` for a transposed V block in `_elements` form and its ``(n_embd, n * el)`` bytes.

    Many cells: component by component through an aligned buffer (a 2-D scatter, or one from bytes that are
    unaligned in the input, is several times slower)."""
    n = len(idxs)
    if dst.ndim == 3 or n < _SCATTER_ROWWISE:
        dst[:, idxs] = _elements(src, n, el)
        return
    buf = np.empty(src.shape[1], np.uint8)
    el_buf = buf.view(dst.dtype)
    for r in range(src.shape[0]):
        buf[:] = src[r]
        dst[r][idxs] = el_buf


_SCATTER_ROWWISE = 4096  # cells from which `_scatter_elements` goes component by component


def stage_state(
    cache: StateCache, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0, *, commit_next: bool = False
) -> tuple[Callable[[], None], int]:
    """Parse, validate and dry-run the section at ``offset``; returns ``(commit, end)``. Changes nothing.

    ``commit_next`` (`state_read` of the cache alone): the caller calls ``commit`` as soon as this returns when the
    section ends the input. A sequence's placement, tried on the cache after removing the sequence, then keeps the
    removal instead of undoing it for ``commit`` to redo; the cells are then as ``commit``'s first step leaves
    them (which it skips), and a failure still leaves them as they were."""
    from ..state import mismatch, read_kv_section

    del flags
    seq_id = int(seq_id)
    if seq_id != -1:
        cache.check_seq(seq_id)
    buf = as_buffer(data)
    if len(buf) >= offset + 4 and cache.profile.kv_streams:
        # llama.cpp compares n_stream before it reads anything else: blame it even when the rest is garbage
        n_stream = int.from_bytes(buf[offset : offset + 4], "little")
        if n_stream != cache.n_stream:
            raise FormatError(mismatch.n_stream(n_stream, cache.n_stream), field="n_stream", offset=offset)
    sec, end = read_kv_section(data, spec(cache), seq_id=seq_id, offset=offset)
    streams = [(s, st) for s, st in enumerate(sec.streams) if st.cells is not None]

    if seq_id == -1:
        for _, st in streams:
            _check_whole_cells(cache, st, st.offsets.get("cells", offset))
        if cache.profile.whole_restore_clear == "per_stream":
            # a stream with no cells is skipped and every other stream's read begins with clear(true), which
            # empties (and zeroes) all streams: only the last non-empty stream survives, and a section whose
            # streams are all empty leaves the cache as it was ("once": clear once, up front)
            streams = [(s, st) for s, st in streams if st.cell_count > 0][-1:]
            if not streams:
                return (lambda: None), end

        def commit_whole() -> None:
            # clear(True), whose zeroes the rows copied next would overwrite at once: only the others are zeroed
            cache.clear(False)
            _zero_rows_after(cache, {s: st.cell_count for s, st in streams})
            for s, st in streams:
                cells, data = _filled(st)
                _set_whole_cells(cache.cells(s), cells)
                cache.heads[s] = 0
                copy_rows(cache, s, np.arange(cells.n), data)

        return commit_whole, end

    strm = cache.seq_to_stream[seq_id]
    if not streams and not cache.profile.kv_streams:
        # without streams an empty section is not skipped: find_slot(cont=true) of a zero-token ubatch
        # returns an empty slot, which reads as "failed to find available cells"
        raise NoSlotError(f"failed to find 0 available cells for sequence {seq_id} (an empty sequence section)")
    has_ext = has_cell_ext(cache)
    # Profile.seq_restore_contiguous: the sequence's cells must be one contiguous block (find_slot with
    # cont=true) and the stream's head is moved back to its first cell; else they are placed cell by cell and
    # the head stays where apply_ubatch put it (after the last cell)
    contiguous = cache.profile.seq_restore_contiguous
    steps: list[tuple[SlotInfo, Cells, KVData, bool]] = []  # and whether seq_id is already removed
    # every placement is tried first; one stream with cells (what llama.cpp writes) is tried on the cache itself
    # and undone (`_slot_after_seq_rm`), several (a crafted section) one after the other on a copy of the stream
    trial = cache.fork([strm]) if len(streams) > 1 else None
    for _, st in streams:
        st_cells, st_data = _filled(st)
        if st_cells.n and bool((st_cells.pos == -1).any()):
            # what placing the cells would refuse, said before anything changes (a position below -1 is restored)
            i = int(np.argmax(st_cells.pos == -1))
            raise FormatError(
                f"cell {i}: position -1 marks an empty cell (llama.cpp would keep it used while it reads as empty)",
                field="pos",
                offset=st.offsets.get("cells", offset),
            )
        removed = False
        if trial is None:
            keep = commit_next and end == len(buf)  # else trailing bytes: refused after the stage
            sinfo, removed = _slot_after_seq_rm(cache, strm, seq_id, st_cells.n, contiguous, keep)
        else:
            trial.seq_rm(seq_id, -1, -1)
            sinfo = find_slot_seq(trial, seq_id, st_cells.n, contiguous)
        if sinfo is None:
            raise NoSlotError(
                f"failed to find {st_cells.n} available cells in stream {strm} for sequence {seq_id}: "
                "free cells (seq_rm) or build the memory with a larger n_ctx"
            )
        if trial is not None:
            apply_ubatch(trial, sinfo, _reserve_ubatch(cache, st_cells, seq_id, has_ext))
        steps.append((sinfo, st_cells, st_data, removed))

    def commit_seq() -> None:
        for sinfo, st_cells, st_data, removed in steps:
            if not removed:
                cache.seq_rm(seq_id, -1, -1)
            _apply_restore(cache, sinfo, st_cells, seq_id, has_ext)
            cells = cache.cells(strm)
            idxs = np.asarray(sinfo.idxs[0], dtype=np.int64)
            if has_ext:
                _put_ext(cells, idxs, st_cells)
            copy_rows(cache, strm, idxs, st_data)
            if contiguous:
                cache.heads[strm] = sinfo.head()

    if not streams:
        # an empty section: llama.cpp reads only the zero cell counts and leaves the cache as it is
        return (lambda: None), end
    return commit_seq, end


def state_read(cache: StateCache, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
    """Restore what ``state_write`` wrote; returns the bytes read (trailing bytes are a FormatError).

    On failure the cache is untouched, or with ``atomic=False`` left as llama.cpp leaves it
    (``state_read_failed``)."""
    # read_parts([cache], ...) with the stage told that its commit follows at once
    try:
        commit, end = stage_state(cache, data, seq_id, flags, 0, commit_next=True)
    except KVRefError as exc:
        if not atomic:
            state_read_failed(cache, seq_id, exc)
        raise
    total = as_buffer(data).nbytes
    if end != total:
        raise FormatError(f"{total - end} trailing bytes after the memory sections", field="trailing", offset=end)
    commit()
    return end


def state_read_failed(cache: StateCache, seq_id: int, exc: Exception) -> None:
    """llama_kv_cache::state_read after a failure: the n_stream count is compared before anything changes
    (and a bad destination id is an assert there); past it, a whole restore has cleared the cache and a
    sequence restore ends in state_clear, which removes the destination sequence."""
    from ..errors import SequenceError

    if isinstance(exc, SequenceError) or getattr(exc, "field", None) == "n_stream":
        return
    clear_seq(cache, seq_id)


__all__ = [
    "CELL_EXT_SIZE",
    "LayerBuffers",
    "StateCache",
    "clone_cells",
    "copy_rows",
    "ext_size",
    "has_cell_ext",
    "spec",
    "stage_state",
    "state_read",
    "state_read_failed",
    "state_section",
    "state_size",
    "state_write",
    "state_write_into",
    "written_cells",
]
