"""The recurrent memory's state section: llama_memory_recurrent::state_write / state_read (per ``mem.profile``).

``RecurrentMemory.state_write`` / ``state_read`` (and the two-phase ``stage_state`` the hybrid memories use)
are thin methods over the functions here; the byte layout itself is declared once in ``kvref.state.sections``
and this module only builds / consumes its object model.

The section: ``u32 cell_count``, per cell ``i32 pos, u32 n_seq_id, i32 seq_id[n_seq_id]``, then ``u32 s_trans``
(always 0 here) and ``u32 n_layer`` (every model layer but the trailing MTP blocks: hparams.n_layer()), then
per layer with state the R rows (and, with PLE, the PLE conv rows), then per layer with state the S rows. Layers
without state (a layer filter, e.g. the attention layers of a hybrid) are skipped, so the section has the same
shape with or without one. The 2025 recurrent memory (llama-cpp-python 0.3.12 .. 0.3.16) wrote the same layout
for a model with state in every layer.

Writing (``state_section``; ``flags`` change nothing):

- the cells written are the cells holding a sequence, in index order (for a sequence save, ``seq_id >= 0``,
  the cells holding ``seq_id``); a whole save lists each cell's sequence ids (ascending), a sequence save
  none (``n_seq_id == 0``);
- ``Profile.recurrent_rows_from_src``: each cell's rows are taken from its ``src`` (the cell itself when it
  has none), in the rollback plane of its sequence(s) when ``n_rs_seq > 0`` (a KVRefError when the sequences
  sharing a cell have different rollback indices); else from the cell itself.

Reading (``stage_state``) parses *and validates* the whole section with ``kvref.state.cache_api`` against
``spec`` (cell count vs memory size, ``n_seq_id == 0`` for a sequence, seq id range for a whole restore --
``Profile.recurrent_restore_seq_bound``: below ``n_seq_max``, or below the cell count ``mem_size`` --, layer
count, ``s_trans``, every type and row size), then replays state_read_meta on the bookkeeping
(``check_section``), putting it back afterwards. Only when all of that succeeded does ``commit()``
(``apply_section``) touch the memory:

- whole restore (``seq_id == -1``): ``clear(True)``, then cell ``i`` gets the ``i``-th cell of the section
  (position and sequence ids, each of which becomes that sequence's tail; a sequence in two cells is a
  FormatError), head 0;
- sequence restore into ``seq_id`` (the destination): the sequence is removed (``seq_rm(seq_id)``), a ubatch
  of ``cell_count`` tokens as llama_batch_allocr::ubatch_reserve(cell_count, 1) builds it is placed with
  ``find_slot``, and the restored cells must be ``head .. head + cell_count - 1`` (llama.cpp asserts it: a
  sequence state is one cell; more is a FormatError);
- either way the restored cells are their own ``src``, a pending rollback index is reset (``n_rs_seq > 0``),
  and the rows are copied to cells ``head ..``.

On failure: llama.cpp reads and applies as it goes, and ends in state_clear. kvref checks everything first
(``stage_state`` changes nothing); ``state_read`` then raises leaving the memory untouched, or with
``atomic=False`` as llama.cpp leaves it (``state_read_failed``: the destination sequence removed, or the whole
memory cleared for ``seq_id == -1``; rows are not zeroed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import numpy as np
import numpy.typing as npt

from ..errors import FormatError, KVRefError
from ..state import RecurrentLayerSpec, RecurrentSpec, read_recurrent_section, section_bytes
from ..state.cells import Cells
from ..state.sections import LayerRows, RecurrentLayer, RecurrentSection, TransposedRows
from .base import Restorable, clear_seq, read_parts

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..ggml.types import GGMLType
    from ..hparams import HParams
    from ..profile import Profile

# a memory's bookkeeping (no rows): pos, src, src0, tail, seq, head, used, n, rs_z, rs_idx
Bookkeeping = tuple[list[int], list[int], list[int], list[int], list[set[int]], int, int, int, int, list[int]]


class SlotUBatch(Protocol):
    """What ``find_slot`` reads from a ubatch: a `kvref.memory.batch.UBatch`, or the one a state restore reserves."""

    @property
    def n_seq_tokens(self) -> int: ...
    @property
    def n_seqs(self) -> int: ...
    @property
    def equal_seqs(self) -> bool: ...
    @property
    def seq_id(self) -> list[list[int]]: ...
    @property
    def pos(self) -> npt.NDArray[np.int32]: ...


class StateMemory(Restorable, Protocol):
    """What the state code reads and writes of a recurrent memory (a `kvref.memory.recurrent.RecurrentMemory`):
    a restore's view (`Restorable`); the bookkeeping, which a restore replays on the memory itself and puts back
    (`Bookkeeping`: assigned); the cells' sizes, types and R / S (/ PLE) buffers per layer; the model and the
    llama.cpp profile; and the memory's own slot search and rollback index."""

    pos: list[int]
    src: list[int]
    src0: list[int]
    tail: list[int]
    seq: list[set[int]]
    head: int
    used: int
    n: int
    rs_z: int
    rs_idx: list[int]

    @property
    def size(self) -> int: ...
    @property
    def n_seq_max(self) -> int: ...
    @property
    def n_rs_seq(self) -> int: ...
    @property
    def type_r(self) -> GGMLType: ...
    @property
    def type_s(self) -> GGMLType: ...
    @property
    def r_row(self) -> int: ...
    @property
    def s_row(self) -> int: ...
    @property
    def p_row(self) -> int: ...
    @property
    def n_embd_s(self) -> int: ...
    @property
    def p_l(self) -> Sequence[npt.NDArray[np.uint8] | None]: ...
    @property
    def layers(self) -> Sequence[int]: ...
    @property
    def hparams(self) -> HParams: ...
    @property
    def profile(self) -> Profile: ...
    def _rs(self, il: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.uint8] | None]: ...
    def find_slot(self, ub: SlotUBatch) -> bool: ...
    def _set_rs_idx(self, seq_id: int, idx: int) -> None: ...


# ---------------------------------------------------------------------------------------------- layout
def spec(mem: StateMemory) -> RecurrentSpec:
    """The memory as ``kvref.state`` sees it: what a section must match to be restored here."""
    layers = tuple(
        RecurrentLayerSpec(
            int(mem.type_r),
            mem.r_row,
            int(mem.type_s),
            mem.s_row,
            mem.n_embd_s,
            mem.p_row if mem.p_l[il] is not None else None,
        )
        for il in mem.layers
    )
    # Profile.recurrent_restore_seq_bound "mem_size": only the cell count bounds the ids
    n_seq_max = mem.size if mem.profile.recurrent_restore_seq_bound == "mem_size" else mem.n_seq_max
    # llama_memory_recurrent writes hparams.n_layer(): the trunk, without the trailing MTP (NextN) blocks
    return RecurrentSpec(mem.size, n_seq_max, mem.hparams.n_layer_trunk(), layers)


# ---------------------------------------------------------------------------------------------- write
def state_section(mem: StateMemory, seq_id: int = -1, flags: int = 0) -> RecurrentSection:
    """The recurrent section llama_memory_recurrent::state_write would write, as kvref.state objects."""
    # Profile.recurrent_rows_from_src: rows are read from the cell's src in the rollback plane, else from
    # the cell itself
    own_rows = not mem.profile.recurrent_rows_from_src
    size = mem.size
    cells_idx: list[int] = []
    data_rows: list[int] = []
    for i in range(size):
        c = mem.seq[i]
        if not ((seq_id == -1 and c) or seq_id in c):
            continue
        cells_idx.append(i)
        if own_rows:
            data_rows.append(i)
            continue
        plane = 0
        if mem.n_rs_seq:
            if seq_id != -1:
                plane = mem.rs_idx[seq_id]
            else:
                planes = {mem.rs_idx[s] for s in c}
                if len(planes) > 1:
                    raise KVRefError("cannot write a shared recurrent state with different rollback indices")
                plane = planes.pop()
        data_rows.append(plane * size + (mem.src[i] if mem.src[i] >= 0 else i))

    cells = Cells.from_lists(
        [mem.pos[i] for i in cells_idx],
        [sorted(mem.seq[i]) if seq_id == -1 else () for i in cells_idx],
    )
    rows = np.asarray(data_rows, dtype=np.intp)
    r_layers: list[RecurrentLayer] = []
    s_layers: list[LayerRows | TransposedRows] = []
    for il in mem.layers:
        r, s, p = mem._rs(il)
        r_layers.append(
            RecurrentLayer(
                int(mem.type_r),
                mem.r_row,
                r[rows],
                mem.p_row if p is not None else None,
                p[rows] if p is not None else None,
            )
        )
        s_layers.append(LayerRows(int(mem.type_s), mem.s_row, s[rows]))
    return RecurrentSection(cells, 0, mem.hparams.n_layer_trunk(), r_layers, s_layers)


def state_write(mem: StateMemory, seq_id: int = -1, flags: int = 0) -> bytes:
    """The bytes of llama_memory_recurrent::state_write (``flags`` do not change them)."""
    return section_bytes(state_section(mem, seq_id, flags))


# ---------------------------------------------------------------------------------------------- read
def _snapshot(mem: StateMemory) -> Bookkeeping:
    """A copy of the memory's bookkeeping (cells, head, used, n, rs_z, rollback indices); no rows."""
    return (
        list(mem.pos),
        list(mem.src),
        list(mem.src0),
        list(mem.tail),
        [set(s) for s in mem.seq],
        mem.head,
        mem.used,
        mem.n,
        mem.rs_z,
        list(mem.rs_idx),
    )


def _restore(mem: StateMemory, snap: Bookkeeping) -> None:
    """Put back the bookkeeping ``_snapshot`` took (copies of it: the snapshot stays reusable)."""
    (mem.pos, mem.src, mem.src0, mem.tail, mem.seq, mem.head, mem.used, mem.n, mem.rs_z, mem.rs_idx) = (
        list(snap[0]),
        list(snap[1]),
        list(snap[2]),
        list(snap[3]),
        [set(s) for s in snap[4]],
        *snap[5:9],
        list(snap[9]),
    )


@dataclass
class _ReservedUBatch:
    """llama_batch_allocr::ubatch_reserve(n, 1) as state_read_meta fills it: one sequence, n positions."""

    n_seq_tokens: int
    pos: npt.NDArray[np.int32]
    seq_id: list[list[int]]
    n_seqs: int = 1
    equal_seqs: bool = True


def _reserve_ubatch(pos: npt.NDArray[np.int32], seq_id: int) -> _ReservedUBatch:
    n = len(pos)
    return _ReservedUBatch(n, np.asarray(pos, np.int32), [[seq_id]] * n)


def parse_section(mem: StateMemory, data: Buffer, seq_id: int = -1, offset: int = 0) -> tuple[RecurrentSection, int]:
    """Parse and format-check the recurrent section at ``offset``; returns it and its end offset."""
    return read_recurrent_section(data, spec(mem), seq_id=seq_id, offset=offset)


def check_section(mem: StateMemory, sec: RecurrentSection, seq_id: int = -1) -> Bookkeeping:
    """Replay state_read_meta on a copy of the bookkeeping; returns the bookkeeping after the restore.

    Nothing changes here: a refusal raises FormatError, success hands ``apply_section`` the result.
    """
    n = sec.cell_count
    if n > mem.size:
        raise FormatError(f"not enough cells in the recurrent memory ({n} > {mem.size})", field="cell_count")
    snap = _snapshot(mem)
    try:
        if seq_id != -1:
            mem.seq_rm(seq_id, -1, -1)
            if n:
                if (sec.cells.n_seq_id != 0).any():
                    raise FormatError("invalid seq_id-agnostic cell in a sequence state", field="n_seq_id")
                ub = _reserve_ubatch(sec.cells.pos, seq_id)
                if not mem.find_slot(ub):
                    raise FormatError(f"failed to find a recurrent cell for sequence {seq_id}", field="state_seq_id")
                # llama.cpp asserts the restored cells are head .. head+n: one cell per sequence state
                last = mem.head + n - 1
                if last >= mem.size or mem.pos[mem.head] != sec.cells.pos[0] or mem.pos[last] != sec.cells.pos[-1]:
                    raise FormatError(
                        f"a sequence state holds {n} recurrent cells, llama.cpp restores one", field="cell_count"
                    )
        else:
            mem.clear(False)
            limit = spec(mem).n_seq_max
            for i in range(n):
                mem.pos[i] = int(sec.cells.pos[i])
                for s in sec.cells.seq_ids(i):
                    if s < 0 or s >= limit:
                        raise FormatError(f"invalid seq_id {s}: out of range [0, {limit})", field="seq_id")
                    mem.seq[i].add(s)
                    if mem.tail[s] != -1:
                        raise FormatError(
                            f"duplicate tail for seq_id {s} in cells {i} and {mem.tail[s]}", field="seq_id"
                        )
                    mem.tail[s] = i
            mem.head = 0
            mem.used = n
        for i in range(n):
            mem.src[mem.head + i] = mem.head + i  # restored states stay where they are put
        if mem.n_rs_seq:
            mem._set_rs_idx(seq_id, 0)
        return _snapshot(mem)
    finally:
        _restore(mem, snap)


def apply_section(mem: StateMemory, sec: RecurrentSection, after: Bookkeeping, seq_id: int = -1) -> None:
    """Commit a section checked by ``check_section`` (``after`` is what it returned)."""
    if seq_id == -1:
        mem.clear(True)  # a whole restore starts from zeroed buffers (clear(true) in state_read_meta)
    _restore(mem, after)
    n = sec.cell_count
    head = mem.head
    if n == 0:
        return
    for k, il in enumerate(mem.layers):
        r, s, p = mem._rs(il)
        r[head : head + n] = sec.r[k].data
        if p is not None:
            # validate_recurrent_section matched p_row_size: the section has PLE rows where the memory does
            p[head : head + n] = cast("npt.NDArray[np.uint8]", sec.r[k].p_data)
        s[head : head + n] = sec.s[k].data


def stage_state(
    mem: StateMemory, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
) -> tuple[Callable[[], None], int]:
    """Parse and check the section at ``offset`` without changing anything; returns ``(commit, end)``."""
    sec, end = parse_section(mem, data, seq_id, offset)
    after = check_section(mem, sec, seq_id)
    return (lambda: apply_section(mem, sec, after, seq_id)), end


def state_read(mem: StateMemory, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
    """Restore what ``state_write`` wrote; returns the bytes read (trailing bytes are an error).

    Everything is checked before anything changes; on error the memory is untouched, or with
    ``atomic=False`` left as llama.cpp leaves it (``state_read_failed``: the sequence removed, or the
    whole memory cleared).
    """
    return read_parts([mem], data, seq_id, flags, atomic=atomic)


def state_read_failed(mem: StateMemory, seq_id: int, exc: Exception) -> None:
    """llama_memory_recurrent::state_read after a failure: state_clear removes the destination sequence
    (clears everything for seq_id -1); rows are not zeroed here."""
    del exc
    clear_seq(mem, seq_id)


__all__ = [
    "Bookkeeping",
    "SlotUBatch",
    "StateMemory",
    "apply_section",
    "check_section",
    "parse_section",
    "spec",
    "stage_state",
    "state_read",
    "state_read_failed",
    "state_section",
    "state_write",
]
