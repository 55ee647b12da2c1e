"""Where a ubatch's tokens land in the KV cache: llama_kv_cache's find_slot, apply_ubatch and prepare.

The functions take the cache and work through its public surface (``cells(stream)``, ``heads``,
``seq_to_stream``, ``n_swa``/``swa_type``, ``seq_rm``); ``KVCache`` exposes them as methods. The per-cell
work (find_slot's walk over one stream, the checks on apply_ubatch's target cells) is done by a twin module
that ``KVREF_BACKEND`` picks, ``_slots_c`` or ``_slots_py`` (see ``kvref._backend``); ``kvref/_slots_py.py``
states it in full.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from . import _slots_py
from ._backend import select
from .cells import LLAMA_MAX_SEQ, TOKEN_NULL, KVCells
from .errors import BatchError, KVRefError

if TYPE_CHECKING:
    from .batch import UBatch
    from .kv_cache import KVCache

_impl = select("slots")
BACKEND = "cython" if _impl.__name__.endswith("_c") else "python"


@dataclass
class SlotInfo:
    """llama_kv_cache::slot_info: the cells a ubatch occupies, per stream.

    ``strm[s]`` is the stream of the ubatch's s-th sequence group and ``idxs[s]`` its cell indices (one per
    token of that group, in token order); ``s0``/``s1`` the lowest and highest stream used.
    """

    s0: int = LLAMA_MAX_SEQ
    s1: int = 0
    strm: list[int] = field(default_factory=list)
    idxs: list[list[int]] = field(default_factory=list)

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
        if len(self.idxs) != 1 or not self.idxs[0]:
            raise KVRefError("SlotInfo.head() needs exactly one non-empty stream")
        return self.idxs[0][0]

    def is_contiguous(self) -> bool:
        """slot_info::is_contiguous: one stream of consecutive cells (an empty slot counts as contiguous)."""
        if not self.idxs or not self.idxs[0]:
            return True
        if len(self.idxs) > 1:
            return False
        h = self.idxs[0][0]
        return self.idxs[0] == list(range(h, h + len(self.idxs[0])))


# ---------------------------------------------------------------------------------------------- helpers
def usable_cells(cache: KVCache, stream: int) -> npt.NDArray[np.bool_]:
    """find_slot's "can use" test for every cell of a stream (bool array), for inspection.

    find_slot itself tests only the cells it walks over (see ``kvref/_slots_py.py``).
    """
    cells = cache.cells(stream)
    return _slots_py.Usable(cells, cache.n_swa, int(cache.swa_type), cells.size()).can_use(0, cells.size())


# ---------------------------------------------------------------------------------------------- find_slot
def find_slot(cache: KVCache, ubatch: UBatch, cont: bool = False) -> SlotInfo | None:
    """Find cells for every token of the ubatch without changing anything; None when it does not fit."""
    n_tokens = int(ubatch.n_tokens)
    n_seqs = 1
    if cache.get_n_stream() > 1:
        if n_tokens % ubatch.n_seqs_unq:
            raise BatchError(f"ubatch of {n_tokens} tokens is not split evenly over {ubatch.n_seqs_unq} sequences")
        n_seqs = int(ubatch.n_seqs_unq)
        n_tokens //= n_seqs

    res = SlotInfo()
    for s in range(n_seqs):
        seq_id = int(ubatch.seq_id_unq[s])
        cache.check_seq(seq_id)
        # a multi-stream ubatch comes from split_equal: groups of n_tokens tokens, one sequence each
        if cache.get_n_stream() > 1 and (
            ubatch.n_seq_id[s * n_tokens] != 1 or ubatch.seq_id[s * n_tokens][0] != seq_id
        ):
            raise BatchError("multi-stream ubatch is not grouped by sequence (use split_equal)")
        strm = cache.seq_to_stream[seq_id]
        res.s0 = min(res.s0, strm)
        res.s1 = max(res.s1, strm)
        res.strm.append(strm)

        idxs = _impl.find_cells(cache.cells(strm), cache.heads[strm], n_tokens, cont, cache.n_swa, int(cache.swa_type))
        if idxs is None:
            return None
        res.idxs.append(idxs)
    return res


# ---------------------------------------------------------------------------------------------- apply
def _check_seq_ids(cache: KVCache, seq_ids: list[list[int]]) -> None:
    """``cache.check_seq`` of every sequence id of these tokens (their range is checked in one go first)."""
    flat = [sid for ids in seq_ids for sid in ids]
    try:
        if not flat or (min(flat) >= 0 and max(flat) < len(cache.seq_to_stream)):
            return
    except TypeError:
        pass
    for sid in flat:
        cache.check_seq(int(sid))


def _ubatch_rows(ubatch: UBatch, i0: int, n: int) -> tuple[npt.NDArray[np.int64], list[list[int]]]:
    pos = np.asarray(ubatch.pos, dtype=np.int64)[i0 : i0 + n]
    return pos, [list(ubatch.seq_id[i]) for i in range(i0, i0 + n)]


def apply_ubatch(cache: KVCache, sinfo: SlotInfo, ubatch: UBatch) -> None:
    """Write the ubatch's tokens into the cells of ``sinfo`` (llama_kv_cache::apply_ubatch)."""
    size = sinfo.size()
    if int(ubatch.n_tokens) != sinfo.n_stream() * size:
        raise BatchError(f"slot holds {sinfo.n_stream() * size} cells for a ubatch of {ubatch.n_tokens} tokens")
    # validate before touching anything: llama.cpp asserts a used target holds exactly one sequence
    for s in range(sinfo.n_stream()):
        _impl.used_targets(cache.cells(sinfo.strm[s]), sinfo.idxs[s], size)
        _check_seq_ids(cache, ubatch.seq_id[s * size : (s + 1) * size])

    hp = cache.hparams
    n_tok = int(ubatch.n_tokens)
    pos_all = np.asarray(ubatch.pos, dtype=np.int64)
    # ext is written when the batch has 2-D positions, token ids, or the model has per-layer embeddings (PLE);
    # builds with the 8-byte ext (Profile.cell_ext_size) wrote it for 2-D positions only, which their state
    # never shows (only M-RoPE caches save an ext there). Otherwise the cell's ext is left as is.
    ple_n_heads = hp.ple_n_heads
    write_ext = ubatch.is_pos_2d() or ubatch.token is not None or ple_n_heads > 0

    seq_pos_max_rm: dict[int, int] = {}  # overwritten sequence -> highest position removed
    for s in range(sinfo.n_stream()):
        cells = cache.cells(sinfo.strm[s])
        idxs = sinfo.idxs[s]
        for idx, sid, p in _impl.used_targets(cells, idxs, size):
            seq_pos_max_rm[sid] = max(seq_pos_max_rm.get(sid, -1), p)
            cells.rm(idx)
        rows = slice(s * size, (s + 1) * size)
        cells.pos_set_many(idxs, pos_all[rows])
        if write_ext:
            xs = ys = [0] * size
            if ubatch.is_pos_2d():
                xs = pos_all[2 * n_tok + rows.start : 2 * n_tok + rows.stop].tolist()
                ys = pos_all[n_tok + rows.start : n_tok + rows.stop].tolist()
            toks = [TOKEN_NULL] * size
            if ubatch.token is not None:
                toks = np.asarray(ubatch.token)[rows].tolist()
            elif ple_n_heads > 0:
                # an embedding batch gets the model's image (or EOS) token for the PLE layers
                toks = [hp.ple_image_token_id if hp.ple_image_token_id != 0 else hp.ple_eos_token_id] * size
            for idx, x, y, tok in zip(idxs, xs, ys, toks, strict=True):
                cells.ext_set(idx, x, y, tok)
        seq_ids = ubatch.seq_id[rows]
        if all(len(ids) == 1 for ids in seq_ids):
            cells.seq_add_many(idxs, [ids[0] for ids in seq_ids])
        else:
            cell_of = [idx for idx, ids in zip(idxs, seq_ids, strict=True) for _ in ids]
            cells.seq_add_many(cell_of, [int(sid) for ids in seq_ids for sid in ids])

    # keep every sequence's positions gap-free: drop what lies below a position we overwrote
    for sid in sorted(seq_pos_max_rm):
        cells = cache.cells(cache.seq_to_stream[sid])
        p_min = cells.seq_pos_min(sid)
        if p_min <= seq_pos_max_rm[sid]:
            cache.seq_rm(sid, p_min, seq_pos_max_rm[sid] + 1)

    for s in range(sinfo.n_stream()):
        cache.heads[sinfo.strm[s]] = sinfo.idxs[s][-1] + 1


# ---------------------------------------------------------------------------------------------- prepare
def prepare(cache: KVCache, ubatches: list[UBatch]) -> list[SlotInfo]:
    """Check that all ubatches fit, one after the other; returns their slots, or [] when one does not fit.

    The cells and heads are restored afterwards (see the module docstring for what is not restored).
    """
    if not ubatches:
        raise KVRefError("prepare: no ubatches")  # llama.cpp asserts on an empty list
    res: list[SlotInfo] = []
    states: list[tuple[SlotInfo, list[int], list[KVCells]]] = []
    pending_shift: str | None = None
    for ub in ubatches:
        sinfo = find_slot(cache, ub, False)
        if sinfo is None:
            break
        shifted = [
            st for st, ix in zip(sinfo.strm, sinfo.idxs, strict=True) if np.any(np.asarray(cache.cells(st).shift)[ix])
        ]
        if shifted:
            # llama.cpp asserts this never happens (decode applies pending shifts before preparing)
            pending_shift = f"stream {shifted[0]} has a pending K-shift in a target cell: call update() first"
            break
        res.append(sinfo)
        saved = [cache.cells(sinfo.strm[s]).cp(sinfo.idxs[s]) for s in range(sinfo.n_stream())]
        states.append((sinfo, list(cache.heads), saved))
        apply_ubatch(cache, sinfo, ub)

    for sinfo, heads_old, saved in reversed(states):
        for s in range(sinfo.n_stream()):
            cache.cells(sinfo.strm[s]).set(sinfo.idxs[s], saved[s])
            cache.heads[sinfo.strm[s]] = heads_old[s]  # sic: indexed by the slot's stream index

    if pending_shift is not None:
        raise KVRefError(pending_shift)
    if len(res) != len(ubatches):
        return []
    return res


__all__ = ["SlotInfo", "apply_ubatch", "find_slot", "prepare", "usable_cells"]
