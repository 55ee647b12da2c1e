"""The recurrent-state memory of Mamba / RWKV style models (llama.cpp's ``llama_memory_recurrent``).

A recurrent model keeps one state per sequence, not one entry per token, so a "cell" here holds the
whole state of the sequence(s) that own it: ``pos`` is the position of the last token folded into it.
Per cell llama.cpp keeps:

- ``pos``   last position folded into the state (-1: empty cell);
- ``seq``   the sequences sharing the state (a ``seq_cp`` shares a cell until one of them moves on);
- ``src``   where the cell's state must be read from at the next graph evaluation (the graph copies
            states, it never moves them in place), -1 for "start from zeros";
- ``src0``  ``src`` as staged by the last ``find_slot``, what the graph's ``s_copy`` input holds;
- ``tail``  indexed by *sequence id* (cell i's ``tail`` is sequence i's cell): the cell holding the
            sequence's latest state, -1 when it has none.

The memory has ``mem_size`` cells (``max(1, n_seq_max)`` as ``llama_model::create_memory`` sizes it), so
sequence ids must be below ``mem_size``. Per layer with recurrent state there is an R tensor (conv /
token-shift state, ``n_embd_r()`` elements per row) and an S tensor (SSM / WKV state, ``n_embd_s()``),
``mem_size * (1 + n_rs_seq)`` rows each: the extra ``n_rs_seq`` row groups are rollback snapshots
(``n_rs_seq`` > 0 only for architectures that support partial rollback, ``Profile.rs_rollback_archs``).

Where llama.cpp builds differ, the memory's profile (``compat=``, ``self.profile``: ``kvref.profile``) says
what to do:

- ``recurrent_seq_rm_rule``: ``"cuts_tail"`` refuses only a removal that cuts into the tail (``0 < p0 <= pos
  < p1``) unless a rollback snapshot serves it (a whole-range removal resets the rollback index, a negative
  id's every index); ``"any_end_inside"`` refuses any range with an end strictly inside ``(0, pos]`` and has
  no rollback (``n_rs_seq`` is refused);
- ``recurrent_seq_rm_checks_n_seq_max``: ``seq_rm`` refuses any seq id that is not in ``[0, n_seq_max)`` --
  including every negative id, so ``seq_rm(-1, ...)`` is always refused; else a negative id is accepted for
  the whole range (or an empty one) and an id ``>= mem_size`` is refused;
- ``recurrent_rollback_single_use``: a rollback is refused while one is pending (else the index is replaced);
- ``recurrent_split_sequential``: ``init_batch``'s equal splits keep sequences consecutive (or not);
- ``recurrent_rollback_split``: with ``n_rs_seq > 0``, equal splits (``"equal"``) or by sequence (``"seq"``);
- ``decode_seq_id_bound``: the bound llama_decode puts on sequence ids (``decode``).

State files: ``state_write`` / ``state_read`` / ``stage_state`` / ``state_sections`` are thin methods over
``kvref.memory.recurrent_state``, which documents the section and the restore (and the profile fields of state files,
``recurrent_rows_from_src`` and ``recurrent_restore_seq_bound``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import numpy.typing as npt

from ..args import args_name, as_int32, as_range, as_seq_id, as_state_args, check_alloc
from ..constants import INT32_MIN, POS_MAX
from ..errors import ArgumentError, CellError, KVRefError, NoSlotError, SequenceError
from ..ggml.types import GGMLType, ggml_type, row_size
from ..hparams import HParams
from ..profile import DEFAULT, Profile, resolve
from ..state import sections_size, write_sections_into
from . import recurrent_state as _recurrent_state
from . import slot_kernels as _kernels
from .base import ContextParams, decode_batch, decode_seq_bound, one_call_batch
from .batch import UBatch
from .recurrent_state import SlotUBatch

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..state import RecurrentSection, RecurrentSpec
    from .base import RowStore
    from .batch import Batch, BatchAllocr
    from .slots import SlotInfo

log = logging.getLogger("kvref.memory.recurrent")


TENSOR_ALIGNMENT = 32  # ggml's CPU buffer alignment: every tensor is padded to it in the backend buffer


@dataclass
class RecurrentSlot:
    """What the graph of one placed ubatch reads (llama_memory_recurrent_context after ``apply``).

    ``s_copy[i]`` is the row the state of cell ``head + i`` is gathered from (``llm_graph_input_rs``);
    the first ``n_seqs`` entries are the graph's ``s_copy_main`` (states the model advances), the rest
    ``s_copy_extra`` (states only carried along). ``rs_z`` is the row zeroed before the gather (-1: none).
    """

    head: int
    n: int
    rs_z: int
    n_seqs: int
    s_copy: npt.NDArray[np.int32]

    @property
    def s_copy_main(self) -> npt.NDArray[np.int32]:
        return self.s_copy[: self.n_seqs]

    @property
    def s_copy_extra(self) -> npt.NDArray[np.int32]:
        return self.s_copy[self.n_seqs :]


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


class RecurrentMemory:
    """llama_memory_recurrent. See the module docstring for the cell model.

    ``layer_filter(il)`` selects the layers that get R/S tensors (a hybrid passes its recurrent layers);
    ``None`` means every layer, as in llama.cpp.
    """

    kind = "recurrent"

    def __init__(
        self,
        hparams: HParams,
        *,
        type_r: GGMLType | int | str = "f32",
        type_s: GGMLType | int | str = "f32",
        rs_size: int = 1,
        n_seq_max: int = 1,
        kv_unified: bool = True,
        layer_filter: Callable[[int], bool] | None = None,
        n_rs_seq: int = 0,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        self.profile = resolve(compat)
        if rs_size < 1:
            raise ArgumentError(f"rs_size must be >= 1, got {rs_size}")
        if self.profile.recurrent_seq_rm_rule == "any_end_inside" and n_rs_seq:
            # that seq_rm rule belongs to a memory without rollback snapshots
            raise ArgumentError("recurrent_seq_rm_rule='any_end_inside' does not support n_rs_seq")
        if n_rs_seq and not self.profile.rs_rollback_archs:
            raise ArgumentError(f"profile {self.profile} has no n_rs_seq (Profile.rs_rollback_archs is empty)")
        self.hparams = hparams
        self.type_r = ggml_type(type_r)
        self.type_s = ggml_type(type_s)
        self.size = int(rs_size)  # llama_memory_recurrent's mem_size
        self.n_seq_max = int(n_seq_max)
        self.n_rs_seq = int(n_rs_seq)
        # the context's kv_unified: only bounds the seq ids llama_decode accepts under
        # Profile.decode_seq_id_bound "llama_max_seq_if_unified"
        self.kv_unified = bool(kv_unified)
        self.cparams = cparams  # the context create_memory built this for (None when built directly)
        self.head = 0
        self.used = 0
        self.n = 0  # cells head .. head+n are the ones the last find_slot touched
        self.rs_z = -1  # first cell without src references: the row the graph zeroes
        self.rs_idx = [0] * self.n_seq_max  # per sequence: pending rollback plane
        # decode's one-call step (`_decode_owned`): the seq-id bound llama_decode checks, and M-RoPE (declined)
        self._seq_bound = decode_seq_bound(self.profile, self.kv_unified, self.n_seq_max)
        self._mrope = hparams.n_pos_per_embd() != 1

        size = self.size
        n_state = sum(1 for il in range(hparams.n_layer) if layer_filter is None or layer_filter(il))
        ple_width = hparams.ple_conv_state()
        per_row = row_size(self.type_r, int(hparams.n_embd_r())) + row_size(self.type_s, int(hparams.n_embd_s()))
        per_row += row_size(self.type_r, ple_width) if ple_width else 0
        check_alloc(
            size * (1 + self.n_rs_seq) * n_state * per_row,
            f"a recurrent memory of {size} cells x {1 + self.n_rs_seq} snapshots over {n_state} layers",
            "lower n_seq_max (or n_rs_seq)",
        )
        self.pos = [-1] * size
        self.src = [-1] * size
        self.src0 = [-1] * size
        self.tail = [-1] * size
        self.seq: list[set[int]] = [set() for _ in range(size)]

        n_layer = hparams.n_layer
        self.n_embd_r = int(hparams.n_embd_r())
        self.n_embd_s = int(hparams.n_embd_s())
        ple = hparams.ple_conv_state()
        self.n_embd_p = ple
        self.r_row = row_size(self.type_r, self.n_embd_r)
        self.s_row = row_size(self.type_s, self.n_embd_s)
        self.p_row = row_size(self.type_r, ple) if ple else 0
        n_rows = size * (1 + self.n_rs_seq)
        # per layer: a (n_rows, row bytes) uint8 buffer, or None for a layer without recurrent state
        self.r_l: list[npt.NDArray[np.uint8] | None] = [None] * n_layer
        self.s_l: list[npt.NDArray[np.uint8] | None] = [None] * n_layer
        self.p_l: list[npt.NDArray[np.uint8] | None] = [None] * n_layer
        for il in range(n_layer):
            if layer_filter is not None and not layer_filter(il):
                continue
            self.r_l[il] = np.zeros((n_rows, self.r_row), np.uint8)
            self.s_l[il] = np.zeros((n_rows, self.s_row), np.uint8)
            if ple and hparams.is_ple(il):
                self.p_l[il] = np.zeros((n_rows, self.p_row), np.uint8)

    # --- sizes (llama_memory_recurrent::total_size / size_r_bytes / size_s_bytes / size_p_bytes) ----------

    @property
    def layers(self) -> list[int]:
        """The layers with recurrent state."""
        return [il for il, r in enumerate(self.r_l) if r is not None]

    def _rs(self, il: int) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8], npt.NDArray[np.uint8] | None]:
        """R, S (and PLE) buffers of a layer that has recurrent state."""
        r, s = self.r_l[il], self.s_l[il]
        assert r is not None and s is not None
        return r, s, self.p_l[il]

    def size_r_bytes(self) -> int:
        """Bytes of the R (conv / token-shift) buffers (llama_memory_recurrent::size_r_bytes)."""
        return sum(r.nbytes for r in self.r_l if r is not None)

    def size_s_bytes(self) -> int:
        """Bytes of the S (SSM / wkv) buffers (llama_memory_recurrent::size_s_bytes)."""
        return sum(s.nbytes for s in self.s_l if s is not None)

    def size_p_bytes(self) -> int:
        """Bytes of the PLE conv-history buffers, 0 without them (llama_memory_recurrent::size_p_bytes)."""
        return sum(p.nbytes for p in self.p_l if p is not None)

    def total_size(self, alignment: int = TENSOR_ALIGNMENT) -> int:
        """The backend buffer size: every tensor padded to the buffer alignment (CPU: 32 bytes)."""
        tensors = [t for trio in zip(self.r_l, self.s_l, self.p_l, strict=True) for t in trio if t is not None]
        return sum(_pad(t.nbytes, alignment) for t in tensors)

    def get_size(self) -> int:
        """The number of cells (llama_memory_recurrent::get_size)."""
        return self.size

    def get_can_shift(self) -> bool:
        """Always True (llama_memory_recurrent::get_can_shift)."""
        return True  # shifting a recurrent state is only moving its pos

    def _free(self, c: int) -> None:
        """A cell whose last sequence left: forget its state (it counted as used)."""
        self.pos[c] = -1
        self.src[c] = -1
        self.used -= 1

    # --- sequence operations ---------------------------------------------------------------------------

    def clear(self, data: bool = True) -> None:
        """llama_memory_recurrent::clear. ``src0`` is not reset (llama.cpp leaves it)."""
        for i in range(self.size):
            self.pos[i] = -1
            self.seq[i].clear()
            self.src[i] = -1
            self.tail[i] = -1
        self.head = 0
        self.used = 0
        if data:
            for bufs in (self.r_l, self.s_l, self.p_l):
                for b in bufs:
                    if b is not None:
                        b.fill(0)
        self.rs_idx = [0] * self.n_seq_max

    def _set_rs_idx(self, seq_id: int, idx: int) -> None:
        if seq_id < 0:
            self.rs_idx = [0] * self.n_seq_max
            return
        if seq_id >= len(self.rs_idx):  # set_rs_idx ignores an id out of range
            return
        self.rs_idx[seq_id] = idx

    def check_op(self, op: str, *args: object) -> tuple[int, ...]:
        """The arguments of sequence operation ``op`` normalised (`kvref.args`: int32 ids and positions), or the
        error ``op`` would raise for them; changes nothing. Composite memories check every part first."""
        if op == "seq_rm":
            return (as_seq_id(args[0]), *as_range(*args[1:]))
        if op == "seq_cp":
            return (as_seq_id(args[0], "seq_id_src"), as_seq_id(args[1], "seq_id_dst"), *as_range(*args[2:]))
        if op == "seq_keep":
            return (as_seq_id(args[0]),)
        if op in ("seq_add", "seq_div"):
            seq_id, (p0, p1), x = as_seq_id(args[0]), as_range(*args[1:3]), as_int32(args[3], args_name(op))
            a, b = 0 if p0 < 0 else p0, POS_MAX if p1 < 0 else p1
            if op == "seq_div" and x == 0 and a != b and self._tail_cell_in_range(seq_id, a, b) >= 0:
                raise SequenceError("seq_div by 0 of a position in range (llama.cpp dies of SIGFPE)")
            return seq_id, p0, p1, x
        raise KVRefError(f"unknown sequence operation {op!r}")

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions [p0, p1) of a sequence; False where llama.cpp refuses (nothing changes then).

        A recurrent state cannot forget its last tokens, so a range that cuts into the tail is refused
        (unless a rollback snapshot covers it); a range that misses the tail, or covers it whole, succeeds.
        """
        seq_id, p0, p1 = self.check_op("seq_rm", seq_id, p0, p1)
        return self._seq_rm(seq_id, p0, p1, apply=True)

    def seq_rm_refused(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Would ``seq_rm`` return False (and change nothing)? Changes nothing (a hybrid memory asks before its
        attention part checks the id: llama.cpp never reaches that part when the recurrent part refuses)."""
        seq_id, p0, p1 = self.check_op("seq_rm", seq_id, p0, p1)
        return not self._seq_rm(seq_id, p0, p1, apply=False)

    def _seq_rm(self, seq_id: int, p0: int, p1: int, apply: bool) -> bool:
        """seq_rm of checked arguments; with ``apply`` False only its answer, nothing changed."""
        new_head = self.size
        p0 = 0 if p0 < 0 else p0
        p1 = POS_MAX if p1 < 0 else p1
        current = self.profile.recurrent_seq_rm_rule == "cuts_tail"

        # the id is compared as unsigned: every negative id is refused too
        if self.profile.recurrent_seq_rm_checks_n_seq_max and (seq_id & 0xFFFFFFFF) >= self.n_seq_max:
            log.error("seq_rm: invalid seq_id (%d) - larger than n_seq_max (%d)", seq_id, self.n_seq_max)
            return False
        if current and p0 == 0 and p1 == POS_MAX and apply:
            self._set_rs_idx(seq_id, 0)  # before the id is checked: a negative id resets them all

        if seq_id >= self.size:
            return False
        if seq_id >= 0:
            t = self.tail[seq_id]
            if t >= 0:
                cpos = self.pos[t]
                if current:
                    if 0 < p0 <= cpos < p1:
                        # cuts into the tail: only a pending-free rollback within n_rs_seq can serve it
                        rollback = cpos - (p0 - 1)
                        # without the single-use rule a pending rollback index is replaced
                        pending = self.profile.recurrent_rollback_single_use and self.rs_idx[seq_id] != 0
                        if not pending and 1 <= rollback <= self.n_rs_seq:
                            if not apply:
                                return True
                            self._set_rs_idx(seq_id, rollback)
                            self.pos[t] = p0 - 1
                            return True
                        return False
                elif (0 < p0 <= cpos) or (0 < p1 <= cpos):
                    return False  # "any_end_inside": any partial intersection is refused
                if p0 <= cpos < p1 and apply:
                    self.tail[seq_id] = -1
        elif p0 != p1 and (p0 != 0 or p1 != POS_MAX):
            return False  # negative id: all or nothing (reachable only without recurrent_seq_rm_checks_n_seq_max)
        if not apply:
            return True

        for i in range(self.size):
            if not p0 <= self.pos[i] < p1:
                continue
            if seq_id < 0:
                self.seq[i].clear()
            elif seq_id in self.seq[i]:
                self.seq[i].discard(seq_id)
            else:
                continue
            if not self.seq[i]:
                if self.pos[i] >= 0:
                    self.used -= 1
                self.pos[i] = -1
                self.src[i] = -1
                if new_head == self.size:
                    new_head = i
        # start the next search at the first freed cell when that is earlier
        if new_head != self.size and new_head < self.head:
            self.head = new_head
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s tail cell (the range is ignored: a state is all or nothing)."""
        seq_id_src, seq_id_dst, p0, p1 = self.check_op("seq_cp", seq_id_src, seq_id_dst, p0, p1)
        if seq_id_src == seq_id_dst:
            return
        size = self.size
        if not (0 <= seq_id_dst < size and 0 <= seq_id_src < size):
            return  # llama.cpp compares as unsigned: out-of-range and negative ids do nothing
        td = self.tail[seq_id_dst]
        if td >= 0:
            # dst lets go of its own state first
            self.seq[td].discard(seq_id_dst)
            self.tail[seq_id_dst] = -1
            if not self.seq[td]:
                self._free(td)
        ts = self.tail[seq_id_src]
        if ts >= 0:
            self.seq[ts].add(seq_id_dst)
            self.tail[seq_id_dst] = ts

    def seq_keep(self, seq_id: int) -> None:
        """llama_memory_recurrent::seq_keep: free the cells without ``seq_id``, leave only ``seq_id`` in the others."""
        (seq_id,) = self.check_op("seq_keep", seq_id)
        new_head = self.size
        for i in range(self.size):
            if i != seq_id:
                self.tail[i] = -1
            if seq_id not in self.seq[i]:
                if self.pos[i] >= 0:
                    self.used -= 1
                self.pos[i] = -1
                self.src[i] = -1
                self.seq[i].clear()
                if new_head == self.size:
                    new_head = i
            else:
                self.seq[i] = {seq_id}
        if new_head != self.size and new_head < self.head:
            self.head = new_head

    def _tail_cell_in_range(self, seq_id: int, p0: int, p1: int) -> int:
        """The sequence's tail cell when it holds a position in [p0, p1), else -1 (seq_add / seq_div)."""
        if 0 <= seq_id < self.size:
            t = self.tail[seq_id]
            if t >= 0 and seq_id in self.seq[t] and p0 <= self.pos[t] < p1:
                return t
        return -1

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Shift the tail's pos only (a recurrent state has no per-token positions to rotate); the sum wraps as
        llama.cpp's int32 does (the cell stays, whatever its position)."""
        seq_id, p0, p1, shift = self.check_op("seq_add", seq_id, p0, p1, shift)
        if shift == 0:
            return
        p0 = 0 if p0 < 0 else p0
        p1 = POS_MAX if p1 < 0 else p1
        if p0 == p1:
            return
        t = self._tail_cell_in_range(seq_id, p0, p1)
        if t >= 0:
            self.pos[t] = (self.pos[t] + shift - INT32_MIN) % 2**32 + INT32_MIN

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the pos of the tail cell of ``seq_id`` by ``d`` (toward zero, as C) when it lies in [p0, p1).

        Like llama_memory_recurrent::seq_div; ``d == 0`` with the tail in range is a SequenceError (llama.cpp dies of
        SIGFPE), without it nothing happens.
        """
        seq_id, p0, p1, d = self.check_op("seq_div", seq_id, p0, p1, d)
        if d == 1:
            return
        p0 = 0 if p0 < 0 else p0
        p1 = POS_MAX if p1 < 0 else p1
        if p0 == p1:
            return
        t = self._tail_cell_in_range(seq_id, p0, p1)
        if t >= 0:
            q = abs(self.pos[t]) // abs(d)  # C integer division truncates toward zero
            self.pos[t] = -q if (self.pos[t] < 0) != (d < 0) else q

    def seq_pos_min(self, seq_id: int) -> int:
        """Like llama_memory_seq_pos_min: the smallest position of the cells of ``seq_id``, or -1 when it has none.

        llama.cpp's running minimum starts at INT32_MAX, which also stands for "none": a cell at INT32_MAX reads as -1.
        """
        result = min([POS_MAX, *(self.pos[i] for i in range(self.size) if seq_id in self.seq[i])])
        return -1 if result == POS_MAX else result

    def seq_pos_max(self, seq_id: int) -> int:
        """Like llama_memory_seq_pos_max: the largest position of the cells of ``seq_id``, or -1 when it has none
        (a position shifted below 0 also reads as -1).
        """
        # llama.cpp starts its running maximum at -1, so a cell shifted below zero (seq_add) reads as -1
        ps = [self.pos[i] for i in range(self.size) if seq_id in self.seq[i]]
        return max([-1, *ps])

    # --- slots -----------------------------------------------------------------------------------------

    def find_slot(self, ub: SlotUBatch) -> bool:
        """Give every sequence of the ubatch its own cell, contiguous from ``head``; llama.cpp's algorithm.

        A sequence keeps its tail cell when it owns it alone; a sequence whose tail is shared (after a
        ``seq_cp``) moves to the next empty cell, taking the shared state along as its ``src``; then the
        cells are swapped so that sequence s of the ubatch sits in cell ``min + s``. Cells in the touched
        range stage their copy source in ``src0`` (a cell without a source reads the zeroed row ``rs_z``).
        """
        n_seq_tokens = ub.n_seq_tokens
        n_seqs = ub.n_seqs
        size = self.size
        pos, src, seq, tail = self.pos, self.src, self.seq, self.tail

        # many unused cells before head: search from the start to fill the front
        if self.head > self.used + 2 * n_seqs:
            self.head = 0

        if not ub.equal_seqs:
            raise CellError("the recurrent memory needs equal-length sequence splits (split_equal / split_seq)")

        lo = size - 1
        hi = 0

        for s in range(n_seqs):
            ids = ub.seq_id[s * n_seq_tokens]
            for j, sid in enumerate(ids):
                if sid < 0 or sid >= size:
                    log.error("find_slot: seq_id=%d >= n_seq_max=%d", sid, self.n_seq_max)
                    return False
                if j > 0:
                    # a sequence that becomes shared by this ubatch drops its own state
                    t = tail[sid]
                    if t >= 0:
                        seq[t].discard(sid)
                        tail[sid] = -1
                        if not seq[t]:
                            self._free(t)

        # next empty cell, searching from head with wrap-around
        nec = self.head
        for _ in range(size):
            if nec >= size:
                nec -= size
            if not seq[nec]:
                break
            nec += 1

        for s in range(n_seqs):
            sid = ub.seq_id[s * n_seq_tokens][0]
            t = tail[sid]
            has_cell = False
            if t >= 0:
                if sid not in seq[t]:
                    raise CellError(f"tail of sequence {sid} is cell {t}, which does not hold it")
                has_cell = len(seq[t]) == 1  # owns its state alone
            if not has_cell:
                if nec >= size or seq[nec]:
                    raise CellError("no empty recurrent cell left (llama.cpp asserts here)")
                if t >= 0:
                    # the shared state moves with the sequence: the new cell starts from it
                    pos[nec] = pos[t]
                    src[nec] = src[t]
                    seq[t].discard(sid)
                    seq[nec].add(sid)
                    if not seq[t]:
                        raise CellError(f"cell {t} lost its last sequence while being copied")
                tail[sid] = nec
                if s + 1 < n_seqs:
                    for _ in range(size):
                        nec += 1
                        if nec >= size:
                            nec -= size
                        if not seq[nec]:
                            break
            lo = min(lo, tail[sid])
            hi = max(hi, tail[sid])

        # gather: sequence s of the ubatch goes to cell lo + s
        for s in range(n_seqs):
            dst = s + lo
            src_id = tail[ub.seq_id[s * n_seq_tokens][0]]
            if dst != src_id:
                pos[dst], pos[src_id] = pos[src_id], pos[dst]
                src[dst], src[src_id] = src[src_id], src[dst]
                seq[dst], seq[src_id] = seq[src_id], seq[dst]
                for j in range(size):
                    if tail[j] == src_id:
                        tail[j] = dst
                    elif tail[j] == dst:
                        tail[j] = src_id

        ub_pos = ub.pos
        for s in range(n_seqs):
            i = s * n_seq_tokens
            last_pos = int(ub_pos[i + n_seq_tokens - 1])
            c = s + lo
            if pos[c] >= 0 and last_pos != pos[c] + n_seq_tokens:
                # llama.cpp only warns: the state is advanced regardless
                log.warning(
                    "find_slot: non-consecutive token position %d after %d for sequence %d with %d new tokens",
                    last_pos,
                    pos[c],
                    ub.seq_id[i][0],
                    n_seq_tokens,
                )
            pos[c] = last_pos
            seq[c] = set(ub.seq_id[i])
            for sid in ub.seq_id[i]:
                tail[sid] = c

        # the first cell of the range nobody copies from becomes the zeroed state
        refcounts = [0] * size
        for i in range(size):
            if src[i] >= 0:
                refcounts[src[i]] += 1
        self.rs_z = -1
        for i in range(lo, hi + 1):
            if refcounts[i] == 0:
                self.rs_z = i
                break
        for i in range(lo, hi + 1):
            if src[i] < 0:
                if self.rs_z < 0:
                    raise CellError("no zeroed state available (llama.cpp asserts here)")
                self.src0[i] = self.rs_z
            else:
                self.src0[i] = src[i]  # staged for the graph input, so seq ops can keep using src
            src[i] = i  # copied once: the state now lives in its own cell

        self.head = lo
        self.n = hi - lo + 1
        self.used = sum(1 for c in seq if c)
        return self.n >= n_seqs

    def prepare(self, ubatches: Sequence[UBatch]) -> bool:
        """Try placing every ubatch, then put the cells back (llama.cpp restores cells, used and head only)."""
        snap = (
            list(self.pos),
            list(self.src),
            list(self.src0),
            list(self.tail),
            [set(s) for s in self.seq],
            self.used,
            self.head,
        )
        ok = True
        try:
            for ub in ubatches:
                if not self.find_slot(ub):
                    ok = False
                    break
        finally:
            self.pos, self.src, self.src0, self.tail, self.seq, self.used, self.head = snap
        return ok

    def s_copy(self, i: int) -> int:
        """The graph's ``s_copy[i]`` for cell ``head + i``; reading it consumes a pending rollback index."""
        c = i + self.head
        src0 = self.src0[c]
        if self.n_rs_seq == 0:
            return src0
        idx = 0
        if self.seq[c]:
            s = min(self.seq[c])
            if 0 <= s < len(self.rs_idx):
                idx = self.rs_idx[s]
                self.rs_idx[s] = 0
        return idx * self.size + src0

    def apply_ubatch(self, ub: UBatch) -> RecurrentSlot:
        """llama_memory_recurrent_context::apply + the graph's state gather for one ubatch.

        The rows of cells ``head .. head+n`` are filled from their ``s_copy`` rows after zeroing ``rs_z``
        (what ``build_rs`` does before the model runs). The model's own update of the advanced states is
        not reproduced: those rows hold the state the model starts from.
        """
        self.find_slot(ub)  # llama.cpp ignores the result here: prepare() already proved it fits
        s_copy = np.array([self.s_copy(i) for i in range(self.n)], dtype=np.int32)
        slot = RecurrentSlot(self.head, self.n, self.rs_z, ub.n_seqs, s_copy)
        self._gather_states(slot)
        return slot

    def _gather_states(self, slot: RecurrentSlot) -> None:
        # every cell reading its own row (a decode step of sequences that own their cells) gathers nothing new
        in_place = bool(np.array_equal(slot.s_copy, np.arange(slot.head, slot.head + slot.n)))
        for bufs in (self.r_l, self.s_l, self.p_l):
            for b in bufs:
                if b is None:
                    continue
                if slot.rs_z >= 0:
                    b[slot.rs_z] = 0
                if not in_place:
                    b[slot.head : slot.head + slot.n] = b[slot.s_copy]  # fancy indexing reads a copy first

    def init_batch(self, balloc: BatchAllocr, n_ubatch: int, embd_all: bool = False) -> list[tuple[UBatch, None]]:
        """llama_memory_recurrent::init_batch: split, then prepare; NoSlotError when either fails. Returns
        ``[(ubatch, None), ...]`` (the slot is found when each ubatch is applied).

        Split by sequence when every token is an output (``embd_all``), else equal sequential splits
        that keep the last ``1 + n_rs_seq`` tokens of a sequence together (rollback snapshots).
        """
        # with rollback snapshots (n_rs_seq > 0) split by sequence (recurrent_rollback_split "seq") or use
        # equal splits that keep the last 1 + n_rs_seq tokens of a sequence together ("equal")
        by_seq = embd_all or (self.n_rs_seq > 0 and self.profile.recurrent_rollback_split == "seq")
        if by_seq:
            ubatches = balloc.split_whole("seq", n_ubatch)
        else:
            sequential = self.profile.recurrent_split_sequential
            keep_tail = self.n_rs_seq + 1 if self.n_rs_seq > 0 else 0
            ubatches = balloc.split_whole("equal", n_ubatch, sequential=sequential, n_keep_tail=keep_tail)
        if ubatches is None:
            raise NoSlotError("the batch cannot be split for the recurrent memory (failed to prepare)")
        if not self.prepare(ubatches):
            raise NoSlotError("the batch does not fit in the recurrent memory (failed to prepare)")
        return [(ub, None) for ub in ubatches]  # nothing is placed before apply_ubatch

    def decode(
        self,
        batch: Batch,
        n_ubatch: int = 512,
        *,
        embd_all: bool = False,
        balloc: BatchAllocr | None = None,
        on_ubatch: Callable[[UBatch, RecurrentSlot], None] | None = None,
    ) -> list[tuple[UBatch, RecurrentSlot]]:
        """What llama_decode does to this memory (`kvref.memory.base.decode_batch`): validate the batch, prepare
        all ubatches (all or nothing: NoSlotError leaves the memory unchanged), then place them one by one."""
        if balloc is None and not embd_all and on_ubatch is None:  # _decode_owned leaves a batch over n_batch to it
            step = self._decode_owned(batch, n_ubatch)
            if step is not None:  # the common step, done at once: what decode_batch would have done
                return [step]
        return decode_batch(self, batch, n_ubatch, balloc=balloc, embd_all=embd_all, on_ubatch=on_ubatch)

    def _decode_owned(self, batch: Batch, n_ubatch: int) -> tuple[UBatch, RecurrentSlot] | None:
        """decode_batch for the common step: token ids (no embeddings, no M-RoPE, no rollback snapshots) of one
        sequence that owns its state's cell alone, one position each, continuing the sequence, in one ubatch: the
        slots twins' ``recurrent_owned_step`` checks the batch as the allocator does, places it as find_slot does
        and makes the ubatch ``split_equal`` makes, in one call. prepare's trial placement is skipped (the step
        always fits, and prepare puts back everything it changes but ``rs_z`` and ``n``, which apply's find_slot
        sets again). None, with nothing changed, for any other step: decode_batch then does each part in turn,
        raising its errors in its order."""
        if self.n_rs_seq or self._mrope or not one_call_batch(batch, n_ubatch, self.cparams):
            return None
        logits = batch.logits
        step = _kernels.impl.recurrent_owned_step(
            self, batch.tokens, batch.pos, batch.seq_ids, None if logits is None else np.array(logits), self._seq_bound
        )
        if step is None:
            return None
        fields, t, s_copy = step
        ub = object.__new__(UBatch)
        ub.__dict__ = fields
        slot = object.__new__(RecurrentSlot)  # RecurrentSlot(t, 1, rs_z, 1, s_copy), without the dataclass's __init__
        slot.__dict__ = {"head": t, "n": 1, "rs_z": self.rs_z, "n_seqs": 1, "s_copy": s_copy}
        if self.rs_z >= 0 or int(s_copy[0]) != t:  # else every row is read in place: nothing to gather
            self._gather_states(slot)
        return ub, slot

    # decode_batch's steps
    def _decode_n_seq_max(self) -> int:
        return self.n_seq_max

    def _apply(self, prepared: None, ubatch: UBatch) -> RecurrentSlot:
        return self.apply_ubatch(ubatch)

    def _owner(self, il: int, slot: RecurrentSlot) -> tuple[RowStore, SlotInfo]:
        # decode_batch asks only when given K/V rows, which a recurrent memory's decode does not take
        raise KVRefError(f"layer {il} has no KV cache (a recurrent memory)")

    def update(self) -> bool:
        """The recurrent memory never has pending updates (init_update returns NO_UPDATE)."""
        return False

    # --- state files (kvref.memory.recurrent_state) -----------------------------------------------------------

    def spec(self) -> RecurrentSpec:
        """This memory as kvref.state sees it: what a section must match to be restored here."""
        return _recurrent_state.spec(self)

    def state_section(self, seq_id: int = -1, flags: int = 0) -> RecurrentSection:
        """The recurrent section llama_memory_recurrent::state_write would write, as kvref.state objects."""
        return _recurrent_state.state_section(self, seq_id, flags)

    def state_sections(self, seq_id: int = -1, flags: int = 0, *, copy: bool = True) -> list[RecurrentSection]:
        """The sections ``state_write`` serializes, in order: one ``kvref.state.RecurrentSection`` (its rows are
        gathered: copies whatever ``copy`` says)."""
        seq_id, flags = as_state_args(seq_id, flags)
        return [_recurrent_state.state_section(self, seq_id, flags)]

    def state_write(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """The bytes of llama_memory_recurrent::state_write (``flags`` do not change them)."""
        seq_id, flags = as_state_args(seq_id, flags)
        return _recurrent_state.state_write(self, seq_id, flags)

    def state_size(self, seq_id: int = -1, flags: int = 0) -> int:
        """The byte count of ``state_write(seq_id, flags)``."""
        return sections_size(*self.state_sections(seq_id, flags))

    def state_write_into(self, dst: Buffer | BinaryIO, seq_id: int = -1, flags: int = 0) -> int:
        """``state_write`` into a writable buffer of at least ``state_size()`` bytes (or a binary file); returns
        the byte count."""
        return write_sections_into(dst, *self.state_sections(seq_id, flags))

    def parse_section(self, data: Buffer, seq_id: int = -1, offset: int = 0) -> tuple[RecurrentSection, int]:
        """Parse and format-check the recurrent section at ``offset``; returns it and its end offset."""
        return _recurrent_state.parse_section(self, data, seq_id, offset)

    def check_section(self, sec: RecurrentSection, seq_id: int = -1) -> _recurrent_state.Bookkeeping:
        """Replay state_read_meta on a copy of the bookkeeping; returns the bookkeeping after the restore.

        Nothing changes here: a refusal raises FormatError, success hands ``apply_section`` the result.
        """
        return _recurrent_state.check_section(self, sec, seq_id)

    def apply_section(self, sec: RecurrentSection, after: _recurrent_state.Bookkeeping, seq_id: int = -1) -> None:
        """Commit a section checked by ``check_section`` (``after`` is what it returned)."""
        _recurrent_state.apply_section(self, sec, after, seq_id)

    def stage_state(
        self, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Parse and check the section at ``offset`` without changing anything; returns ``(commit, end)``."""
        seq_id, flags = as_state_args(seq_id, flags)
        return _recurrent_state.stage_state(self, data, seq_id, flags, offset)

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Restore a section (see kvref.memory.recurrent_state); returns the bytes read. Everything is checked before
        anything changes: a failure leaves the memory untouched, or with ``atomic=False`` as llama.cpp leaves it
        (the sequence removed, or the whole memory cleared)."""
        seq_id, flags = as_state_args(seq_id, flags)
        return _recurrent_state.state_read(self, data, seq_id, flags, atomic=atomic)

    def state_read_failed(self, seq_id: int, exc: Exception) -> None:
        """Leave the memory as llama.cpp does after its section failed to restore: state_clear removes the
        destination sequence (clears everything for seq_id -1); rows are not zeroed (kvref.memory.recurrent_state)."""
        _recurrent_state.state_read_failed(self, seq_id, exc)

    # --- introspection ---------------------------------------------------------------------------------

    def cell(self, i: int) -> dict[str, int | list[int]]:
        """Cell ``i``'s bookkeeping as a dict: pos, seq (sorted), src, src0 and tail."""
        return {
            "pos": self.pos[i],
            "seq": sorted(self.seq[i]),
            "src": self.src[i],
            "src0": self.src0[i],
            "tail": self.tail[i],
        }

    @property
    def compat(self) -> str:
        """The name of the memory's profile (``self.profile.name``)."""
        return self.profile.name

    def __repr__(self) -> str:
        return f"RecurrentMemory(size={self.size}, used={self.used}, head={self.head}, layers={len(self.layers)})"


__all__ = ["POS_MAX", "RecurrentMemory", "RecurrentSlot"]
