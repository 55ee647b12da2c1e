"""Batches and ubatches (llama.cpp's llama_batch / llama_ubatch and llama_batch_allocr's splitter).

The flow mirrors llama.cpp (October 2026, ``src/llama-batch.cpp``):

1. ``Batch`` is the caller's ``llama_batch`` (tokens and/or embeddings, optional positions, sequence
   ids and output flags).
2. ``BatchAllocr.init`` first does what ``llama_batch_compat::init`` does (turn the old-style batch into
   per-entry records: default sequence 0, positions continuing from the memory, the last token as the
   only output), then what ``llama_batch_allocr::init`` does (validate rule by rule, compute the
   per-sequence bookkeeping). Every rejection raises ``BatchError`` with llama.cpp's reason.
3. ``split_simple`` / ``split_equal`` / ``split_seq`` cut the batch into ``UBatch`` es exactly like
   llama.cpp; ``split_whole`` runs the splitter a memory's ``init_batch`` picks.

The common batch (token ids, one sequence id per token) is checked in one pass by the slots twins' kernels
(``kvref.memory.slot_kernels``; ``kvref.memory._slots_py`` states them: ``single_seq_ids``, ``single_seq_batch``,
``seq_lists``); any other batch, and any batch that breaks a rule, goes through the general path below, which states
every rule in order and raises llama.cpp's reason. Both paths leave the allocator in the same state.

Sequence-id order inside a token: llama.cpp stores a token's sequence ids in a
``std::unordered_set<llama_seq_id>``, so ``ubatch.seq_id[i]`` lists them in that set's iteration
order, not in the caller's order, and duplicates collapse. ``seq_id[i][0]`` matters downstream (the
KQ mask and the recurrent cache read it), so by default kvref reproduces libstdc++'s order (the
Linux builds llama-cpp-python ships); ``seq_id_order="input"`` keeps the caller's order instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import numpy.typing as npt

from ..constants import LLAMA_MAX_SEQ
from ..errors import ArgumentError, BatchError
from . import slot_kernels as _kernels

if TYPE_CHECKING:
    from ..hparams import HParams

LLAMA_TOKEN_NULL = -1  # a batch entry whose token id is -1 carries no token
GGML_MROPE_SECTIONS = 4  # positions per entry under M-RoPE

_ALL_SEQS = (1 << LLAMA_MAX_SEQ) - 1  # std::bitset<LLAMA_MAX_SEQ>::set()
_NO_SEQ_IDX = np.full(LLAMA_MAX_SEQ, -1, np.int32)  # seq_idx of no sequence (copied, never written)
_NO_SEQ_IDX.flags.writeable = False


@dataclass
class UBatch:
    """One micro-batch as llama_ubatch holds it.

    ``pos`` has ``n_tokens * n_pos`` entries laid out as llama.cpp lays them: ``n_pos`` blocks of
    ``n_tokens`` (block 0 the sequential position; for M-RoPE blocks 1 and 2 are y and x).
    ``seq_id[i]`` is the list of sequence ids of token i. ``seq_idx`` maps a seq id to its index in
    ``seq_id_unq`` (-1 when absent), like llama.cpp's [LLAMA_MAX_SEQ] array.
    """

    equal_seqs: bool
    n_tokens: int
    n_seq_tokens: int
    n_seqs: int
    n_seqs_unq: int
    n_pos: int
    token: npt.NDArray[np.int32] | None  # int32[n_tokens]
    embd: npt.NDArray[np.float32] | None  # float32[n_tokens, n_embd]
    pos: npt.NDArray[np.int32]  # int32[n_tokens * n_pos]
    n_seq_id: npt.NDArray[np.int32]  # int32[n_tokens]
    seq_id: list[list[int]]
    seq_id_unq: list[int]
    seq_idx: npt.NDArray[np.int32]  # int32[LLAMA_MAX_SEQ]
    output: npt.NDArray[np.int8]  # int8[n_tokens]
    batch_idxs: npt.NDArray[np.int32]  # int32[n_tokens]: index of each token in the original batch

    def is_pos_2d(self) -> bool:
        """llama_ubatch::is_pos_2d: the positions carry the M-RoPE 2-D blocks (n_pos >= 3)."""
        return self.n_pos >= 3

    @classmethod
    def whole_single(
        cls,
        token: npt.NDArray[np.int32],
        pos: npt.NDArray[np.int32],
        seq: npt.NDArray[np.int32],
        logits: npt.NDArray[np.bool_] | None,
    ) -> UBatch:
        """The ubatch ``split_simple`` makes of a whole token batch of one sequence id per token (``token``, ``pos``
        and ``seq`` int32, one position each, the batch's ``logits``; the ubatch owns them), equal to the one the
        allocator builds. Its fields are made in one pass of the slots twin (``single_ubatch``): a decode step's caller
        reads them next (the KQ mask does)."""
        ub = object.__new__(cls)
        ub.__dict__ = _kernels.impl.single_ubatch(token, pos, seq, logits)  # the fields, in their order
        return ub

    @classmethod
    def whole_one_seq(
        cls,
        token: npt.NDArray[np.int32],
        pos: npt.NDArray[np.int32],
        seq: npt.NDArray[np.int32],
        logits: npt.NDArray[np.bool_] | None,
    ) -> UBatch:
        """The ubatch ``split_equal`` (and ``split_seq``) makes of a whole token batch of one sequence, one position
        per token: `whole_single`'s fields as one sequence set of ``n_tokens`` tokens (``equal_seqs``)."""
        ub = cls.whole_single(token, pos, seq, logits)
        fields = ub.__dict__
        fields["equal_seqs"] = True
        fields["n_seq_tokens"] = fields["n_tokens"]
        fields["n_seqs"] = 1
        return ub

    @classmethod
    def empty(cls) -> UBatch:
        """The value-initialised ``llama_ubatch{}`` the splitters return when nothing is left."""
        return cls(
            equal_seqs=False, n_tokens=0, n_seq_tokens=0, n_seqs=0, n_seqs_unq=0, n_pos=0,
            token=None, embd=None, pos=np.zeros(0, np.int32), n_seq_id=np.zeros(0, np.int32),
            seq_id=[], seq_id_unq=[], seq_idx=np.full(LLAMA_MAX_SEQ, -1, np.int32),
            output=np.zeros(0, np.int8), batch_idxs=np.zeros(0, np.int32),
        )  # fmt: skip


class SeqPosMemory(Protocol):
    """What the allocator needs from a memory: the position range each sequence holds (-1: empty)."""

    def seq_pos_min(self, seq_id: int) -> int: ...
    def seq_pos_max(self, seq_id: int) -> int: ...


_NARROW_INTS = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.uint8, np.uint16))


def _int32s(values: npt.ArrayLike, name: str) -> npt.NDArray[np.int64]:
    """``values`` as int64 after checking they are integers that fit llama.cpp's int32 (BatchError naming
    ``name[i]`` otherwise)."""
    fast: npt.NDArray[np.int64] | None = _kernels.impl.int32_values(values, -(2**31))  # checked at C speed
    if fast is not None:
        return fast
    arr = np.asarray(values).reshape(-1)
    if arr.dtype in _NARROW_INTS:
        return arr.astype(np.int64)  # every value fits
    if arr.size and arr.dtype.kind not in "iu" and not _all_ints(arr):
        raise BatchError(f"{name}: expected integers, got {arr.dtype} values")
    # compared as Python ints where NumPy could not hold them (object arrays) or would wrap (uint64)
    for i, v in enumerate(arr.tolist() if arr.dtype.kind in "uO" else []):
        if not -(2**31) <= v <= 2**31 - 1:
            raise BatchError(f"{name}[{i}] = {v} is outside int32 (llama.cpp's llama_token / llama_pos)")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero((arr < -(2**31)) | (arr > 2**31 - 1))
    if len(bad):
        i = int(bad[0])
        raise BatchError(f"{name}[{i}] = {int(arr[i])} is outside int32 (llama.cpp's llama_token / llama_pos)")
    return arr


def _all_ints(arr: npt.NDArray[np.generic[object]]) -> bool:
    # integers too wide for int64 arrive as an object array of Python ints
    return arr.dtype.kind == "O" and all(isinstance(v, int) and not isinstance(v, bool) for v in arr.flat)


def _seq_id(value: object, i: int, j: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise BatchError(f"seq_ids[{i}][{j}] = {value!r}: expected an integer sequence id")
    return int(value)


@dataclass
class Batch:
    """A caller's batch, as llama.cpp's ``llama_batch``; ``None`` fields get llama.cpp's defaults.

    - ``tokens``: token ids (``-1`` marks an entry without a token, like LLAMA_TOKEN_NULL);
    - ``embd``: float32 ``[n_tokens, n_embd]`` input embeddings (with or without tokens);
    - ``pos``: one position per entry, or for an embedding-only batch under M-RoPE ``n_pos`` blocks of
      ``n_tokens`` (section-major, as llama.cpp reads ``pos[j*n_tokens + i]``);
    - ``seq_ids``: per entry, the list of its sequence ids (default ``[0]``);
    - ``logits``: per entry, whether it is an output (default: only the last entry).
    """

    tokens: Sequence[int] | npt.NDArray[np.generic[int]] | None = None
    embd: Sequence[Sequence[float]] | npt.NDArray[np.generic[float]] | None = None
    pos: Sequence[int] | npt.NDArray[np.generic[int]] | None = None
    seq_ids: Sequence[Sequence[int]] | None = None
    logits: Sequence[int] | npt.NDArray[np.generic[int]] | None = None

    def __post_init__(self) -> None:
        if self.embd is None and self.logits is None:
            common = _kernels.impl.token_batch(self.tokens, self.pos, self.seq_ids)  # checked at C speed
            if common is not None:
                self.tokens, self.pos, self.seq_ids = common
                return
        if self.tokens is not None:
            self.tokens = _int32s(self.tokens, "tokens")
        if self.embd is not None:
            self.embd = np.asarray(self.embd, dtype=np.float32)
            if self.embd.ndim != 2:
                raise BatchError(f"embd must be 2-D [n_tokens, n_embd], got shape {self.embd.shape}")
        if self.tokens is None and self.embd is None:
            raise BatchError("batch has neither token ids nor embeddings")
        n = self.n_tokens
        if self.tokens is not None and self.embd is not None and len(self.embd) != n:
            raise BatchError(f"embd has {len(self.embd)} rows but the batch has {n} tokens")
        if n == 0:
            raise BatchError("n_tokens == 0")  # llama_context::decode rejects empty batches
        if self.pos is not None:
            self.pos = _int32s(self.pos, "pos")
            if self.pos.size and self.pos.min() < -1:
                # llama_batch_allocr::init: a sequence's positions start above -1 (its running position) and never
                # decrease, so a position below -1 is refused ("positions are decreasing"); -1 itself starts an empty
                # sequence (a KV cache refuses it when placing: kvref.errors.CorruptionError)
                i = int(np.flatnonzero(self.pos < -1)[0])
                raise BatchError(f"pos[{i}] = {int(self.pos[i])}: sequence positions are decreasing (not allowed)")
            if len(self.pos) < n or len(self.pos) % n:
                raise BatchError(f"pos has {len(self.pos)} entries, expected a multiple of n_tokens = {n}")
        if self.seq_ids is not None:
            plain = _kernels.impl.plain_seq_ids(self.seq_ids)  # lists of plain ints: copied at C speed
            self.seq_ids = (
                plain
                if plain is not None
                else [[_seq_id(s, i, j) for j, s in enumerate(ids)] for i, ids in enumerate(self.seq_ids)]
            )
            if len(self.seq_ids) != n:
                raise BatchError(f"seq_ids has {len(self.seq_ids)} entries, expected n_tokens = {n}")
        if self.logits is not None:
            self.logits = np.asarray(self.logits).reshape(-1).astype(bool)
            if len(self.logits) != n:
                raise BatchError(f"logits has {len(self.logits)} entries, expected n_tokens = {n}")

    @property
    def n_tokens(self) -> int:
        """The number of entries (llama_batch::n_tokens): tokens, or embedding rows without tokens."""
        return len(self.tokens) if self.tokens is not None else len(self.embd)  # type: ignore[arg-type]


def unordered_set_order(values: Sequence[int]) -> list[int]:
    """Iteration order of a libstdc++ ``std::unordered_set<int>`` after inserting ``values`` in order.

    Why: llama.cpp keeps a token's sequence ids in such a set, and ``seq_id[i][0]`` is whichever id
    the set yields first. libstdc++ hashes an int to itself, starts with 13 buckets (growing through
    the primes 29, 59, 127, 257 when the element count passes the bucket count), puts a node into an
    empty bucket at the front of its single node list and a node into a non-empty bucket right
    before that bucket's first node; a rehash re-inserts the list in order with the same rules.
    Duplicates are dropped.
    """
    if len(values) == 1:
        return [values[0]]  # the usual token of one sequence: nothing to order
    order: list[int] = []  # the node list, front first
    head_of: dict[int, int] = {}  # bucket -> its first value in ``order``
    n_bkt = 1
    next_resize = 0

    def place(v: int) -> None:
        # _M_insert_bucket_begin (a rehash re-inserts the old list in order the same way)
        b = v % n_bkt
        if b in head_of:
            order.insert(order.index(head_of[b]), v)
        else:
            order.insert(0, v)
        head_of[b] = v

    for v in values:
        if v in order:
            continue
        n_elt = len(order)
        if n_elt + 1 > next_resize:  # _Prime_rehash_policy::_M_need_rehash
            min_bkts = max(n_elt + 1, 0 if next_resize else 11)
            if min_bkts >= n_bkt:
                want = max(min_bkts + 1, n_bkt * 2)
                n_bkt = 13 if want <= 13 else next(p for p in (29, 59, 127, 257, 541) if p >= want)
                next_resize = n_bkt
                old, order, head_of = order, [], {}
                for u in old:
                    place(u)
            else:
                next_resize = n_bkt
        place(v)
    return order


@dataclass
class _Entry:
    """One llama_batch_ext::token: what llama_batch_compat::init builds per batch entry."""

    id: int
    has_embd: bool
    seq_ids: list[int]
    pos: list[int] = field(default_factory=lambda: [0] * GGML_MROPE_SECTIONS)
    output: bool = False


def output_flags(logits: npt.NDArray[np.generic[int]] | None, n: int) -> npt.NDArray[np.int8]:
    """The tokens that output, as int8 flags: ``logits``, or only the last token when the batch gives none."""
    if logits is not None:
        return logits.astype(np.int8)
    out = np.zeros(n, dtype=np.int8)
    out[-1] = 1
    return out


class BatchAllocr:
    """llama_batch_allocr: validates a batch, fills its defaults and splits it into ubatches.

    ``n_pos_per_embd`` is the model's (``HParams.n_pos_per_embd()``): 4 under M-RoPE, else 1.
    After ``init`` the llama.cpp bookkeeping is public: ``token``, ``embd``, ``pos``, ``n_seq_id``,
    ``seq_id``, ``output`` (the filled batch), ``seq_pos[s]`` (set of positions of sequence s in the
    batch), ``seq_cpl`` (``[s0, s1]`` true when s0 is coupled to s1), ``has_cpl``, ``seq_set[i]`` (the
    sequence set of token i as an int bitmask), ``seq_set_map`` (bitmask -> token indices),
    ``seq_id_unq``, ``seq_idx``, ``n_outputs``, ``out_ids``, ``used``, ``n_used``.
    """

    token: npt.NDArray[np.int32] | None
    embd: npt.NDArray[np.float32] | None
    out_ids: list[int]
    seq_id_unq: list[int]
    # after a one-sequence-per-token init (`_init_single`): token i's sequence id; the per-token bookkeeping below
    # (None) is then built when first read (the properties ``seq_id``, ``seq_pos``, ...)
    _seq1: npt.NDArray[np.int32] | None
    _seq_id: list[list[int]] | None
    _seq_pos: list[set[int]] | None
    _seq_cpl: npt.NDArray[np.bool_] | None
    _seq_set: list[int] | None
    _seq_set_map: dict[int, list[int]] | None

    def __init__(self, n_pos_per_embd: int = 1) -> None:
        self.n_pos_per_embd = int(n_pos_per_embd)
        self.n_embd = 0
        self.n_seq_max = 0
        self._clear()
        self.split_reset()

    # ------------------------------------------------------------------ init

    def init(
        self,
        batch: Batch,
        memory: SeqPosMemory | None = None,
        *,
        n_vocab: int | None = None,
        n_seq_max: int = 1,
        n_embd: int | None = None,
        output_all: bool = False,
        seq_id_order: Literal["libstdc++", "input"] = "libstdc++",
    ) -> None:
        """Fill, validate and index ``batch`` (llama_batch_compat::init + llama_batch_allocr::init).

        ``n_vocab=None`` skips the upper bound of the token-id check; ``n_embd`` (the decoder's input
        width), when given, must match the embedding row width like llama_context::decode requires.
        Raises ``BatchError`` with llama.cpp's reason when llama.cpp would reject the batch.
        """
        self._clear()
        self.n_seq_max = int(n_seq_max)
        if self._init_single(batch, memory, n_vocab, n_embd, output_all):
            return
        self._clear()
        self._seq_pos = [set() for _ in range(LLAMA_MAX_SEQ)]
        self._seq_cpl = np.zeros((LLAMA_MAX_SEQ, LLAMA_MAX_SEQ), dtype=bool)
        self._seq_set, self._seq_set_map = [], {}
        entries = self._compat_entries(batch, memory, seq_id_order)
        n_tok = len(entries)

        if batch.embd is not None:
            width = batch.embd.shape[1]  # type: ignore[union-attr]
            if n_embd is not None and n_embd > 0 and width != n_embd:
                raise BatchError(f"embd row width {width} does not match the decoder input {n_embd}")
            self.n_embd = width
        else:
            self.n_embd = int(n_embd or 0)

        if self.n_seq_max > LLAMA_MAX_SEQ:
            raise BatchError(f"n_seq_max = {self.n_seq_max} > {LLAMA_MAX_SEQ}")

        # every entry must carry the same combination of token id / embedding
        has_token = entries[0].id != LLAMA_TOKEN_NULL
        has_embd = entries[0].has_embd
        for e in entries[1:]:
            if (e.id != LLAMA_TOKEN_NULL) != has_token or e.has_embd != has_embd:
                raise BatchError("all entries in the batch must have the same content types")
        if not has_token and not has_embd:
            raise BatchError("batch has neither token ids nor embeddings")

        if has_token:
            for i, e in enumerate(entries):
                if e.id < 0 or (n_vocab is not None and e.id >= n_vocab):
                    raise BatchError(f"invalid token[{i}] = {e.id}")
            self.token = np.array([e.id for e in entries], dtype=np.int32)
        self.embd = np.ascontiguousarray(batch.embd, dtype=np.float32) if has_embd else None

        # a token batch has one position per entry (broadcast to every M-RoPE section when a ubatch
        # is built); an embedding batch has n_pos_per_embd blocks of n_tok (section-major)
        last = max((p for e in entries for p in e.pos), default=0)
        if last > 2**31 - 1:
            i = next(i for i, e in enumerate(entries) if max(e.pos) == last)
            raise BatchError(f"pos[{i}] = {last}: the positions continuing the memory pass int32 (llama_pos)")
        if has_token:
            pos = np.array([e.pos[0] for e in entries], dtype=np.int32)
        else:
            pos = np.zeros(n_tok * self.n_pos_per_embd, dtype=np.int32)
            for i, e in enumerate(entries):
                for j in range(self.n_pos_per_embd):
                    pos[j * n_tok + i] = e.pos[j]
        self.pos = pos

        self.n_seq_id = np.array([len(e.seq_ids) for e in entries], dtype=np.int32)
        self._seq_id = [list(e.seq_ids) for e in entries]
        self._n_tokens = n_tok
        for i, ids in enumerate(self.seq_id):
            for s, sid in enumerate(ids):
                if sid < 0 or sid >= self.n_seq_max:
                    raise BatchError(f"invalid seq_id[{i}][{s}] = {sid} >= {self.n_seq_max}")

        out = np.array([1 if e.output else 0 for e in entries], dtype=np.int8)
        if output_all and not out.all():
            out[:] = 1  # llama.cpp warns "embeddings required ... -> overriding" and outputs all
        self.output = out
        self.n_outputs = int(np.count_nonzero(out))

        self._compute_stats(n_tok)
        self._check_consistency(n_tok, memory)
        self.split_reset()

    def _init_single(
        self, batch: Batch, memory: SeqPosMemory | None, n_vocab: int | None, n_embd: int | None, output_all: bool
    ) -> bool:
        """``init`` of the common batch in one pass: token ids, one sequence id per token, given or automatic
        positions. False (nothing done) when the batch is of another shape or breaks any rule: ``init``'s general
        path below then states every rule and raises llama.cpp's error. The bookkeeping that only the other
        splitters and inspection read (``seq_id``, ``seq_pos``, ``seq_cpl``, ``seq_set``, ``seq_set_map``) is
        built when first read."""
        tokens, pos, logits = batch.tokens, batch.pos, batch.logits
        if (
            batch.embd is not None
            or type(tokens) is not np.ndarray
            or not (pos is None or type(pos) is np.ndarray)
            or self.n_seq_max > LLAMA_MAX_SEQ
            or not (n_vocab is None or (type(n_vocab) is int and n_vocab > 0))
        ):
            return False
        n = tokens.shape[0]
        if not (logits is None or (type(logits) is np.ndarray and logits.dtype == np.bool_ and logits.shape == (n,))):
            return False
        ids = _kernels.impl.single_seq_ids(batch.seq_ids, n, self.n_seq_max)
        if ids is None:
            return False
        seq, present, seq_idx = ids
        try:
            mem_pos_max = [-1] * len(present) if memory is None else _seq_pos_max_all(memory, present)
        except Exception:
            return False  # the general path asks the memory again, where llama.cpp would
        p = _kernels.impl.single_seq_batch(tokens, pos, seq, present, mem_pos_max, -1 if n_vocab is None else n_vocab,
                                self.n_pos_per_embd > 1)  # fmt: skip
        if p is None:
            return False
        self.token = tokens.astype(np.int32)
        self.n_embd = int(n_embd or 0)
        self.pos = p
        self.n_seq_id = np.ones(n, dtype=np.int32)
        self._seq1 = seq
        self._seq_id = None
        self._n_tokens = n
        out = output_flags(logits, n)
        if output_all:
            out[:] = 1
        self.output = out
        self.n_outputs = int(np.count_nonzero(out))
        self.seq_id_unq = present
        self.seq_idx = seq_idx
        self.split_reset()
        return True

    def _compat_entries(self, batch: Batch, memory: SeqPosMemory | None, seq_id_order: str) -> list[_Entry]:
        """llama_batch_compat::init: one record per entry, with llama.cpp's defaults filled in."""
        n = batch.n_tokens
        has_token = batch.tokens is not None
        has_embd = batch.embd is not None
        # auto-generated positions continue each sequence after what the memory holds (-1 + 1 = 0
        # without a memory); only the entry's first sequence id advances
        pos_next: dict[int, int] = {}

        def next_pos(s: int) -> int:
            if s not in pos_next:
                pos_next[s] = (memory.seq_pos_max(s) if memory is not None else -1) + 1
            p = pos_next[s]
            pos_next[s] = p + 1
            return p

        entries = []
        for i in range(n):
            sids = list(batch.seq_ids[i]) if batch.seq_ids is not None else [0]
            if not sids:
                # llama.cpp reads seq_id[i][0] unconditionally (undefined behaviour): refuse instead
                raise BatchError(f"token {i} has no sequence id")
            ordered = unordered_set_order(sids) if seq_id_order == "libstdc++" else list(dict.fromkeys(sids))
            e = _Entry(
                id=int(batch.tokens[i]) if has_token else LLAMA_TOKEN_NULL,  # type: ignore[index]
                has_embd=has_embd,
                seq_ids=ordered,
            )
            if batch.pos is not None:
                if has_token:
                    e.pos[0] = int(batch.pos[i])
                else:
                    npe = self.n_pos_per_embd
                    if len(batch.pos) < npe * n:
                        raise BatchError(
                            f"pos has {len(batch.pos)} entries, an embedding batch needs "
                            f"n_pos_per_embd * n_tokens = {npe * n}"
                        )
                    for j in range(npe):
                        e.pos[j] = int(batch.pos[j * n + i])
            else:
                if not 0 <= sids[0] < self.n_seq_max:
                    # llama.cpp would index its position table out of bounds here
                    raise BatchError(f"invalid seq_id[{i}][0] = {sids[0]} >= {self.n_seq_max}")
                e.pos[0] = next_pos(sids[0])
            e.output = bool(batch.logits[i]) if batch.logits is not None else i == n - 1
            entries.append(e)
        return entries

    def _compute_stats(self, n_tok: int) -> None:
        self.has_cpl = False
        for i in range(n_tok):
            s0 = self.seq_id[i][0]
            for s, s1 in enumerate(self.seq_id[i]):
                self.seq_pos[s1].add(int(self.pos[i]))
                if s > 0:
                    # s1 shares a token with the entry's first sequence s0: they are coupled
                    self.seq_cpl[s1, s0] = True
                    self.has_cpl = True

        seq_set_unq = 0
        for i in range(n_tok):
            cur = 0
            for sid in self.seq_id[i]:
                cur |= 1 << sid
            seq_set_unq |= cur
            self.seq_set.append(cur)
            self.seq_set_map.setdefault(cur, []).append(i)

        for s in range(self.n_seq_max):
            if seq_set_unq >> s & 1:
                self.seq_idx[s] = len(self.seq_id_unq)
                self.seq_id_unq.append(s)

    def _check_consistency(self, n_tok: int, memory: SeqPosMemory | None) -> None:
        for s in range(self.n_seq_max):
            if not self.seq_pos[s]:
                continue
            p0 = memory.seq_pos_max(s) if memory is not None else -1
            y = self.seq_pos_min(s)
            head = (
                f"the tokens of sequence {s} in the input batch have inconsistent sequence positions: "
                f"the last position stored in the memory for sequence {s} is X = {p0}, "
                f"the tokens for sequence {s} in the input batch have a starting position of Y = {y}; "
            )
            if self.n_pos_per_embd > 1:
                # M-RoPE: positions may jump forward; tokens must start after the memory, embeddings
                # (image patches) may repeat the last stored position
                if self.token is not None:
                    if p0 >= 0 and p0 >= y:
                        raise BatchError(head + "for M-RoPE, it is required that the position satisfies: X < Y")
                elif p0 >= 0 and p0 > y:
                    raise BatchError(head + "for M-RoPE, it is required that the position satisfies: X <= Y")
            else:
                if p0 >= 0 and y != p0 + 1:
                    raise BatchError(head + "it is required that the sequence positions remain consecutive: Y = X + 1")
                if self.seq_pos_max(s) - y + 1 > len(self.seq_pos[s]):
                    raise BatchError(f"sequence {s} positions are not continuous")

        if memory is not None:
            for s0, s1 in zip(*np.nonzero(self.seq_cpl[: self.n_seq_max, : self.n_seq_max]), strict=True):
                if memory.seq_pos_min(int(s0)) != memory.seq_pos_min(int(s1)) or memory.seq_pos_max(
                    int(s0)
                ) != memory.seq_pos_max(int(s1)):
                    raise BatchError(f"sequence {s0} is coupled to {s1} in the input batch, but have diverged")

        # each sequence must stay within one sequence set (no partial subsets) and its positions
        # must not decrease along the batch
        cur_seq_set = [_ALL_SEQS] * self.n_seq_max
        cur_seq_pos = [-1] * self.n_seq_max
        for i in range(n_tok):
            p = int(self.pos[i])
            for sid in self.seq_id[i]:
                cur_seq_set[sid] &= self.seq_set[i]
                if cur_seq_set[sid] == 0:
                    raise BatchError(f"sequence {sid} belongs to incompatible sequence sets (not allowed)")
                if p < cur_seq_pos[sid]:
                    raise BatchError(f"sequence {sid} positions are decreasing (not allowed)")
                cur_seq_pos[sid] = p

    # ------------------------------------------------------------- accessors

    def get_n_tokens(self) -> int:
        """Tokens in the batch given to ``init`` (llama_batch_allocr::get_n_tokens)."""
        return self._n_tokens

    # the per-token bookkeeping, built when first read after a one-sequence-per-token init (see `_init_single`)
    @property
    def seq_id(self) -> list[list[int]]:
        """``seq_id[i]``: the sequence ids of token i (in the order ``seq_id_order`` gives)."""
        if self._seq_id is None:
            self._seq_id = _kernels.impl.seq_lists(self._single())[0]
        return self._seq_id

    @property
    def seq_pos(self) -> list[set[int]]:
        """``seq_pos[s]``: the set of positions of sequence s in the batch."""
        if self._seq_pos is None:
            self._seq_pos = [set() for _ in range(LLAMA_MAX_SEQ)]
            seq = self._single()
            order = np.argsort(seq, kind="stable")
            starts = np.flatnonzero(np.diff(seq[order], prepend=-1))
            for grp in np.split(order, starts[1:]):
                if grp.size:
                    self._seq_pos[int(seq[grp[0]])] = set(self.pos[grp].tolist())
        return self._seq_pos

    @property
    def seq_cpl(self) -> npt.NDArray[np.bool_]:
        """``seq_cpl[s1, s0]``: s1 shares a token with that token's first sequence s0 (they are coupled)."""
        if self._seq_cpl is None:
            self._seq_cpl = np.zeros((LLAMA_MAX_SEQ, LLAMA_MAX_SEQ), dtype=bool)  # one sequence per token: none
        return self._seq_cpl

    @property
    def seq_set(self) -> list[int]:
        """``seq_set[i]``: the sequence set of token i, as an int bitmask."""
        if self._seq_set is None:
            self._seq_set = [1 << s for s in self._single().tolist()]
        return self._seq_set

    @property
    def seq_set_map(self) -> dict[int, list[int]]:
        """Sequence set (bitmask) -> the indices of the tokens that have it, ascending."""
        if self._seq_set_map is None:
            self._seq_set_map = {}
            for i, cur in enumerate(self.seq_set):
                self._seq_set_map.setdefault(cur, []).append(i)
        return self._seq_set_map

    def _single(self) -> npt.NDArray[np.int32]:
        return self._seq1 if self._seq1 is not None else np.zeros(0, np.int32)

    def get_n_outputs(self) -> int:
        """Tokens of the batch that produce an output (llama_batch_allocr::get_n_outputs)."""
        return self.n_outputs

    def get_n_used(self) -> int:
        """Tokens put into ubatches since the last ``split_reset`` (llama_batch_allocr::get_n_used)."""
        return self.n_used

    def get_out_ids(self) -> list[int]:
        """Batch indices of the outputs, in the order the splitting met them."""
        return self.out_ids

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of ``seq_id`` in the batch (-1 when absent)."""
        return min(self.seq_pos[seq_id]) if self.seq_pos[seq_id] else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of ``seq_id`` in the batch (-1 when absent)."""
        return max(self.seq_pos[seq_id]) if self.seq_pos[seq_id] else -1

    # -------------------------------------------------------------- splitting

    def split_reset(self) -> None:
        """Forget previous splits: every token is unused again."""
        self.out_ids = []
        self.n_used = 0
        self.used = [False] * self.get_n_tokens()
        self._unused_from = 0  # no token before this one is unused (the splitters keep it so: no rescans)

    def split_simple(self, n_ubatch: int) -> UBatch:
        """The next up to ``n_ubatch`` unused tokens in batch order (one stream)."""
        cur = self._first_unused()
        if cur is None:
            return UBatch.empty()
        # from the first unused token on, the next tokens in batch order (used or not, as llama.cpp takes them)
        end = min(cur + max(n_ubatch, 1), len(self.used))
        self.used[cur:end] = [True] * (end - cur)
        self.n_used += end - cur
        return self._ubatch_add(range(cur, end), end - cur, equal_seqs=False)

    def split_equal(self, n_ubatch: int, sequential: bool, n_keep_tail: int = 0) -> UBatch:
        """Equal-length runs of several non-overlapping sequence sets.

        With ``sequential`` the sets must have consecutive first sequence ids (one stream per
        sequence); coupled sequences then cannot be split and an empty ubatch comes back.
        ``n_keep_tail`` keeps the last ``n_keep_tail`` tokens of each sequence set together.
        Note: like llama.cpp, when more than ``n_ubatch`` sets are available the ubatch takes
        ``n_ubatch + 1`` of them (one token each).
        """
        if sequential and self.has_cpl:
            # llama.cpp: "sequential split is not supported when there are coupled sequences in the
            # input batch (you may need to use the -kvu flag)"
            return UBatch.empty()

        cur_seq_set: list[int] = []
        last_seq_id = -1
        for i in range(self.get_n_tokens()):
            if self.used[i]:
                continue
            add = all(cs & self.seq_set[i] == 0 for cs in cur_seq_set)
            if sequential:
                add = add and (not cur_seq_set or self.seq_id[i][0] == last_seq_id + 1)
            if add:
                cur_seq_set.append(self.seq_set[i])
                last_seq_id = self.seq_id[i][0]
                if len(cur_seq_set) > n_ubatch:
                    break

        n_seqs = len(cur_seq_set)
        if n_seqs == 0:
            return UBatch.empty()

        lists = [self.seq_set_map[cs] for cs in cur_seq_set]
        cur_idx = [0] * n_seqs
        for s in range(n_seqs):
            while self.used[lists[s][cur_idx[s]]]:
                cur_idx[s] += 1

        idxs_per_seq: list[list[int]] = [[] for _ in range(n_seqs)]
        while True:
            # grow every set by one token while all of them still have one and n_ubatch allows
            if any(cur_idx[s] >= len(lists[s]) for s in range(n_seqs)):
                break
            for s in range(n_seqs):
                idx = lists[s][cur_idx[s]]
                idxs_per_seq[s].append(idx)
                self.used[idx] = True
                self.n_used += 1
                cur_idx[s] += 1
            if (len(idxs_per_seq[0]) + 1) * n_seqs > n_ubatch:
                break

        if n_keep_tail > 0:
            if n_ubatch <= n_keep_tail:
                raise ArgumentError(f"n_ubatch ({n_ubatch}) must exceed n_keep_tail ({n_keep_tail})")

            def remaining(s: int) -> int:
                return len(lists[s]) - cur_idx[s]

            # keep the longest prefix of sets that finish here or leave at least n_keep_tail tokens
            n_keep = 0
            while n_keep < n_seqs:
                r = remaining(n_keep)
                if r != 0 and r < n_keep_tail:
                    break
                n_keep += 1

            if n_keep == 0:
                # every set violates it: settle the first set alone, by finishing or shortening it
                idxs = idxs_per_seq[0]
                if len(idxs) + remaining(0) <= n_ubatch:
                    while remaining(0) > 0:
                        idx = lists[0][cur_idx[0]]
                        idxs.append(idx)
                        self.used[idx] = True
                        self.n_used += 1
                        cur_idx[0] += 1
                else:
                    while remaining(0) < n_keep_tail:
                        idx = idxs.pop()
                        self.used[idx] = False
                        self._unused_from = min(self._unused_from, idx)
                        self.n_used -= 1
                        cur_idx[0] -= 1
                n_keep = 1

            for s in range(n_keep, n_seqs):  # the deferred sets go back to the pool
                for idx in idxs_per_seq[s]:
                    self.used[idx] = False
                    self._unused_from = min(self._unused_from, idx)
                    self.n_used -= 1
            n_seqs = n_keep

        idxs = [idx for s in range(n_seqs) for idx in idxs_per_seq[s]]
        return self._ubatch_add(idxs, n_seqs, equal_seqs=True)

    def split_seq(self, n_ubatch: int) -> UBatch:
        """Tokens of one sequence set: the first unused token's set, narrowing to subsets."""
        cur = self._first_unused()
        if cur is None:
            return UBatch.empty()
        n = self.get_n_tokens()
        cur_seq_set = self.seq_set[cur]
        idxs = []
        while True:
            idxs.append(cur)
            self.used[cur] = True
            self.n_used += 1
            if len(idxs) >= n_ubatch:
                break
            cur += 1
            # skip used tokens and tokens whose set is not a subset of the current set
            while cur < n and (self.used[cur] or (cur_seq_set & self.seq_set[cur]) != self.seq_set[cur]):
                cur += 1
            if cur == n:
                break
            cur_seq_set = self.seq_set[cur]
        return self._ubatch_add(idxs, 1, equal_seqs=True)

    def split_all(
        self,
        kind: Literal["simple", "equal", "seq"],
        n_ubatch: int,
        *,
        sequential: bool = False,
        n_keep_tail: int = 0,
    ) -> list[UBatch]:
        """``split_reset`` then split with ``kind`` until an empty ubatch, as init_batch loops.

        The list may not cover the batch (see ``get_n_used``); ``split_whole`` checks that.
        """
        self.split_reset()
        res: list[UBatch] = []
        while True:
            if self._first_unused() is None:
                # every splitter answers an empty ubatch once every token is used: stop without building it
                if kind not in ("simple", "equal", "seq"):
                    raise ArgumentError(f"unknown split kind {kind!r}")
                return res
            if kind == "simple":
                ub = self.split_simple(n_ubatch)
            elif kind == "equal":
                ub = self.split_equal(n_ubatch, sequential, n_keep_tail)
            elif kind == "seq":
                ub = self.split_seq(n_ubatch)
            else:
                raise ArgumentError(f"unknown split kind {kind!r}")
            if ub.n_tokens == 0:
                return res
            res.append(ub)

    def split_whole(
        self,
        kind: Literal["simple", "equal", "seq"],
        n_ubatch: int,
        *,
        sequential: bool = False,
        n_keep_tail: int = 0,
    ) -> list[UBatch] | None:
        """`split_all`, or ``None`` when the ubatches do not use every token: llama.cpp's "failed to find a
        suitable split", which makes a memory's init_batch fail to prepare. Each memory picks ``kind``."""
        res = self.split_all(kind, n_ubatch, sequential=sequential, n_keep_tail=n_keep_tail)
        return None if self.get_n_used() < self.get_n_tokens() else res

    def ubatch_reserve(self, n_seq_tokens: int, n_seqs: int) -> UBatch:
        """A zero-filled ubatch of ``n_seqs`` x ``n_seq_tokens`` (llama.cpp uses it to restore state).

        Like llama.cpp it resets the allocator. ``seq_id`` entries start empty; callers fill them.
        """
        self._clear()
        self.split_reset()
        n = n_seq_tokens * n_seqs
        seq_idx = np.full(LLAMA_MAX_SEQ, -1, np.int32)
        seq_idx[:n_seqs] = np.arange(n_seqs, dtype=np.int32)
        return UBatch(
            equal_seqs=True, n_tokens=n, n_seq_tokens=n_seq_tokens, n_seqs=n_seqs, n_seqs_unq=n_seqs,
            n_pos=self.n_pos_per_embd, token=np.zeros(n, np.int32), embd=None,
            pos=np.zeros(n * self.n_pos_per_embd, np.int32), n_seq_id=np.zeros(n, np.int32),
            seq_id=[[] for _ in range(n)], seq_id_unq=list(range(n_seqs)), seq_idx=seq_idx,
            output=np.zeros(n, np.int8), batch_idxs=np.zeros(0, np.int32),
        )  # fmt: skip

    # ------------------------------------------------------------- internals

    def _clear(self) -> None:
        self.n_outputs = 0
        self.token = None
        self.embd = None
        self.pos = np.zeros(0, np.int32)
        self.n_seq_id = np.zeros(0, np.int32)
        self.seq_id_unq = []
        self.seq_idx = _NO_SEQ_IDX.copy()
        self.output = np.zeros(0, np.int8)
        self.has_cpl = False
        self._n_tokens = 0
        self._seq1 = None
        self._seq_id = []
        self._seq_pos = None
        self._seq_cpl = None
        self._seq_set = None
        self._seq_set_map = None

    def _first_unused(self) -> int | None:
        try:
            self._unused_from = self.used.index(False, self._unused_from)
        except ValueError:
            self._unused_from = len(self.used)
            return None
        return self._unused_from

    def _ubatch_add(self, idxs: Sequence[int], n_seqs: int, equal_seqs: bool) -> UBatch:
        """Gather the tokens ``idxs`` (in this order) into a ubatch of ``n_seqs`` sequence sets."""
        n_tokens = len(idxs)
        # the tokens' batch indices: a run of consecutive tokens (split_simple) is sliced, any other list gathered
        ix: slice[int, int, None] | npt.NDArray[np.int64]
        if isinstance(idxs, range):
            ix = slice(idxs.start, idxs.stop)
            batch_idxs = np.arange(idxs.start, idxs.stop, dtype=np.int32)
        else:
            ix = np.asarray(idxs, dtype=np.int64)
            batch_idxs = ix.astype(np.int32)
        npe = self.n_pos_per_embd
        if self.token is not None:
            # a token batch broadcasts its single position to every M-RoPE section
            pos = self.pos[ix].copy() if npe == 1 else np.tile(self.pos[ix], npe)
        else:
            # an embedding batch copies each section as given
            pos = self.pos.reshape(npe, self.get_n_tokens())[:, ix].reshape(-1).copy()

        output = self.output[ix].copy()
        self.out_ids.extend(batch_idxs[output != 0].tolist())

        if self._seq1 is not None:
            seq_id, seq_id_unq, seq_idx = _kernels.impl.seq_lists(self._seq1[ix])
        else:
            seq_set_unq = 0
            for i in idxs:
                for sid in self.seq_id[i]:
                    seq_set_unq |= 1 << sid
            seq_id_unq = [s for s in range(self.n_seq_max) if seq_set_unq >> s & 1]
            seq_id = [list(self.seq_id[i]) for i in idxs]
            seq_idx = _NO_SEQ_IDX.copy()
            _index_seqs(seq_idx, seq_id_unq)

        return UBatch(
            equal_seqs=equal_seqs,
            n_tokens=n_tokens,
            n_seq_tokens=n_tokens // n_seqs,
            n_seqs=n_seqs,
            n_seqs_unq=len(seq_id_unq),
            n_pos=npe,
            token=self.token[ix].copy() if self.token is not None else None,
            embd=self.embd[ix].copy() if self.embd is not None else None,
            pos=pos,
            n_seq_id=self.n_seq_id[ix].copy(),
            seq_id=seq_id,
            seq_id_unq=seq_id_unq,
            seq_idx=seq_idx,
            output=output,
            batch_idxs=batch_idxs,
        )


def _seq_pos_max_all(memory: SeqPosMemory, seq_ids: list[int]) -> Sequence[int]:
    """``memory.seq_pos_max(s)`` of every listed sequence, in one call when the memory has ``seq_pos_max_many``."""
    many = getattr(memory, "seq_pos_max_many", None)
    if many is not None:
        res: Sequence[int] = many(seq_ids)
        return res
    return [memory.seq_pos_max(s) for s in seq_ids]


def _index_seqs(seq_idx: npt.NDArray[np.int32], seq_id_unq: list[int]) -> None:
    """``seq_idx[s]`` = the index of s in ``seq_id_unq`` (ascending ids), for every listed sequence."""
    if len(seq_id_unq) <= 4:
        for k, s in enumerate(seq_id_unq):
            seq_idx[s] = k
    else:
        seq_idx[seq_id_unq] = np.arange(len(seq_id_unq), dtype=np.int32)


MemoryKind = Literal["kv", "iswa", "recurrent", "hybrid", "hybrid_iswa"]


def allocr_for(hparams: HParams) -> BatchAllocr:
    """A ``BatchAllocr`` with the model's positions per embedding (as llama_context creates it)."""
    return BatchAllocr(hparams.n_pos_per_embd())


__all__ = [
    "GGML_MROPE_SECTIONS",
    "LLAMA_MAX_SEQ",
    "LLAMA_TOKEN_NULL",
    "Batch",
    "BatchAllocr",
    "SeqPosMemory",
    "UBatch",
    "allocr_for",
    "unordered_set_order",
]
