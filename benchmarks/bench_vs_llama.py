"""kvref against llama.cpp's own code, in the same run: ``python benchmarks/bench_vs_llama.py [--quick]``.

llama.cpp's functions are cut from the llama-cpp-python 0.3.36 sdist at run time and compiled with the system
g++ (``benchmarks/llama_ref.py`` says exactly what is cut and what is stubbed); each row runs kvref (its public
API) and llama.cpp alternately, ABBA, on identical cache contents, and reports the ratio of medians
(kvref / llama.cpp) with both sides' median and p10. Between the two sides the heap is consolidated (`consolidate`:
decode, server and mask rows) or settled (`settle`: allocation-heavy state rows), so that neither side's clock
holds the other's frees; a kvref decode step's clock ends after its ubatches' fields are read
(`read_ubatch`: the KQ mask fill reads them next), and the unread step is reported beside it. Rows 2r / 2h put
kvref's recurrent (Mamba) and hybrid (Jamba) decode steps beside llama_memory_recurrent's, cut into the harness
too. The state rows use llama-cpp-python's real ``llama_state_*`` functions (the installed ``llama_cpp`` wheel) on
``conformance/models/llama-tiny.gguf``: llama.cpp's state read/write go through ggml backend buffers and io objects
that are not worth stubbing. The real-model rows (10-11) restore a session of Gemma 3 270M (``KVREF_GEMMA3_GGUF`` or
``~/.cache/kvref-models``) with ``kvref.restore`` and ``llama_state_load_file``; without the model they are skipped
with a note.

When the sdist, a compiler or the wheel is missing the script says so and exits 0: it is not part of CI.
Under pytest (``pytest benchmarks/bench_vs_llama.py --benchmark-only``) the quick run happens in one test that
skips with the reason when llama.cpp's side cannot be built. ``KVREF_LLAMA_SRC`` uses an unpacked llama.cpp
tree instead of the sdist.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import ctypes
import gc
import mmap
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_ref

import kvref
import kvref.state as S
from kvref.memory.mask import fill_kq_mask

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "conformance" / "models" / "llama-tiny.gguf"
ROWS: list[tuple[str, str]] = []  # (label, formatted line)
NOTES: list[str] = []
_LOG_CB = None  # keeps the ctypes log callback alive


def _hparams() -> kvref.HParams:
    # one small layer: the memory work does not depend on the K/V row size
    return kvref.HParams(arch="llama", n_layer=1, n_embd=8, n_head=1, n_ctx_train=1 << 20)


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def report(label: str, a: list[float], b: list[float] | None, unit: float = 1e3, note: str = "") -> None:
    """One row: kvref's and llama.cpp's medians and p10 (ms), and kvref / llama.cpp of both."""
    ma, pa = statistics.median(a) * unit, _pct(a, 10) * unit
    if b:
        mb, pb = statistics.median(b) * unit, _pct(b, 10) * unit
        line = f"{label:<54} {ma:>11.4f} {pa:>11.4f} {mb:>11.4f} {pb:>11.4f} {ma / mb:>9.3g}x {pa / pb:>9.3g}x  {note}"
    else:
        line = f"{label:<54} {ma:>11.4f} {pa:>11.4f} {'-':>11} {'-':>11} {'-':>10} {'-':>10}  {note}"
    ROWS.append((label, line))
    print(line, flush=True)


def report_ratio(label: str, a: list[float], b: list[float], what: str) -> None:
    """A kvref-only ratio row: ``a`` over ``b`` (medians and p10)."""
    ma, mb = statistics.median(a), statistics.median(b)
    line = (
        f"{label:<54} {ma * 1e3:>11.4f} {_pct(a, 10) * 1e3:>11.4f} {mb * 1e3:>11.4f} {_pct(b, 10) * 1e3:>11.4f} "
        f"{ma / mb:>9.2f}x {_pct(a, 10) / _pct(b, 10):>9.2f}x  ({what})"
    )
    ROWS.append((label, line))
    print(line, flush=True)


def header(title: str) -> None:
    print(f"\n{title}", flush=True)
    print(
        f"{'row':<54} {'kvref med':>11} {'kvref p10':>11} {'llama med':>11} {'llama p10':>11} "
        f"{'med ratio':>10} {'p10 ratio':>10}",
        flush=True,
    )


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def settle() -> None:
    """Between the two sides of an allocation-heavy row, untimed: collect garbage and return what each side freed
    to the system (glibc's malloc_trim), so that neither side's clock pays for the other's frees (glibc gives freed
    memory back at a later allocation, which may be the other side's)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc() -> Any:
    try:
        lib = ctypes.CDLL(None)
        lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        lib.malloc.restype, lib.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        lib.free.restype, lib.free.argtypes = None, [ctypes.c_void_p]
        return lib
    except (OSError, AttributeError):  # not glibc
        return None


_LIBC = _libc()


def consolidate() -> None:
    """Between the two sides of a small step, untimed: one largebin-sized malloc and free, so that glibc consolidates
    now the chunks the side that just ran freed, not in the other side's next allocation (glibc merges freed small
    chunks lazily, at the next large request). Lighter than `settle`, whose malloc_trim would make the next small
    allocations fault their pages in again: the decode, server and mask rows use this one."""
    if _LIBC is not None:
        _LIBC.free(_LIBC.malloc(1 << 16))


def abba(
    rounds: int, a: Callable[[int], float], b: Callable[[int], float], between: Callable[[], None] | None = None
) -> tuple[list[float], list[float]]:
    """Run a and b alternately (ABBA); each returns its own elapsed seconds for step r. ``between`` (untimed) runs
    before every call: `settle` for rows whose sides allocate and free much."""
    ta, tb = [], []
    r = 0
    while r < rounds:
        for first in (True, False) if r % 2 == 0 else (False, True):
            if between is not None:
                between()
            if first:
                ta.append(a(r))
            else:
                tb.append(b(r))
        r += 1
    return ta, tb


def timed_keep(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes; its result is freed after the clock stops (a caller frees it later)."""
    t = time.perf_counter()
    res = fn()
    dt = time.perf_counter() - t
    del res
    return dt


def read_ubatch(ub: Any) -> tuple:
    """Read the ubatch fields the KQ mask fill reads next (`kvref.memory.mask.fill_kq_mask`): the honest end of a
    kvref decode step, whose ubatches could build their fields when first read (llama.cpp's clock holds the building
    of its ubatches)."""
    return ub.n_tokens, ub.n_seqs_unq, ub.n_pos, ub.pos, ub.seq_id_unq, ub.seq_id


# ----------------------------------------------------------------------------------------- cache pairs
class Pair:
    """A kvref KVCache and llama.cpp's stand-in cache with the same cells."""

    def __init__(self, size: int, n_seq: int) -> None:
        self.mem = kvref.create_memory(_hparams(), n_ctx=size, n_seq_max=n_seq, kv_unified=True)
        assert self.mem.get_size() == size, self.mem.get_size()
        self.ref = llama_ref.LlamaRef(size, 1, n_seq, self.mem.n_pad)
        self.last: list = []
        self.last_unread = 0.0

    def fill(self, n_seq: int, per_seq: int) -> None:
        """Sequences interleaved cell by cell, per_seq positions each, as a server's parallel slots leave them."""
        n = n_seq * per_seq
        idx = np.arange(n, dtype=np.int32)
        pos, seq = idx // n_seq, idx % n_seq
        cells = self.mem.cells(0)
        cells.pos_set_many(idx.astype(np.int64), pos.astype(np.int64))
        cells.seq_add_many(idx.astype(np.int64), seq.astype(np.int64))
        self.mem.heads[0] = n
        self.ref.fill(0, idx, pos, seq, n)
        assert cells.get_used() == self.ref.used() == n

    def batch(self, seqs: np.ndarray, n_per_seq: int) -> tuple[dict, tuple[np.ndarray, ...]]:
        """The next n_per_seq positions of each sequence in ``seqs`` (kvref positions, as both agree): the arguments
        of kvref's Batch and llama.cpp's arrays."""
        pos, seq = [], []
        for s in seqs.tolist():
            p0 = self.mem.seq_pos_max(s) + 1
            pos.extend(range(p0, p0 + n_per_seq))
            seq.extend([s] * n_per_seq)
        pos_a, seq_a = np.asarray(pos, np.int32), np.asarray(seq, np.int32)
        tok = (np.arange(len(pos)) % 100).astype(np.int32)
        b = dict(tokens=tok, pos=pos_a, seq_ids=[[int(s)] for s in seq])
        return b, (tok, pos_a, seq_a)

    def kv_decode(self, b: dict) -> float:
        """A decode step as a kvref user writes it: the Batch from the step's arrays, then decode (llama.cpp's side
        fills its llama_batch from the same arrays inside its clock too), then the ubatches' fields read (`read_ubatch`:
        llama.cpp's clock holds the building of its ubatches). The unread step's time is kept in ``last_unread``."""
        t = time.perf_counter()
        self.last = self.mem.decode(kvref.Batch(**b), n_ubatch=512)
        t1 = time.perf_counter()
        for ub, _slot in self.last:
            read_ubatch(ub)
        t2 = time.perf_counter()
        self.last_unread = t1 - t
        return t2 - t

    def check_slot(self) -> None:
        _ub, sinfo = self.last[-1]
        mine = np.concatenate([np.asarray(x) for x in sinfo.idxs])
        if not np.array_equal(mine, self.ref.last_idxs()):
            raise AssertionError("kvref and llama.cpp placed the ubatch in different cells")


def decode_rows(size: int, n_tokens: int, rounds: int) -> None:
    """Rows 1-2: one sequence almost filling a cache of `size` cells, decode n_tokens per step."""
    pair = Pair(size, 1)
    margin = max(4096, n_tokens * (rounds + 4))
    pair.fill(1, size - margin)
    # the batch follows kvref's seq_pos_max, so it is built before either side runs its step
    ta, tb, tu = [], [], []
    for r in range(rounds):
        b, arrs = pair.batch(np.array([0]), n_tokens)
        consolidate()
        if r % 2 == 0:
            ta.append(pair.kv_decode(b))
            consolidate()
            tb.append(pair.ref.decode(*arrs))
        else:
            tb.append(pair.ref.decode(*arrs))
            consolidate()
            ta.append(pair.kv_decode(b))
        tu.append(pair.last_unread)
        if r == 0:
            pair.check_slot()
    assert pair.mem.cells(0).get_used() == pair.ref.used()
    report(f"1/2 decode {n_tokens:>3} tok, {size >> 10}k cells (split+slot+apply+read)", ta, tb)
    report(f"1/2 decode {n_tokens:>3} tok:   ubatch not read", tu, tb, note="(kvref's step without the read)")


def iswa_decode_rows(size: int, n_tokens: int, rounds: int) -> None:
    """Row 2b: an iSWA memory (Gemma 3's: a window of 512, one SWA and one full layer) holding one sequence of
    most of `size` cells, so the SWA cache reuses its window-masked cells every step; decode n_tokens per step.
    llama.cpp: llama_kv_cache_iswa's step over two of its caches (the batch checked once, prepare in both, apply
    to both)."""
    hp = kvref.HParams(arch="gemma3", n_layer=2, n_embd=8, n_head=1, n_ctx_train=1 << 20, n_swa=512,
                       swa_type=kvref.SWAType.STANDARD, swa_layers=[True, False])  # fmt: skip
    mem = kvref.create_memory(hp, n_ctx=size, n_seq_max=1)
    assert isinstance(mem, kvref.KVCacheISWA)
    base = llama_ref.LlamaRef(mem.base.get_size(), 1, 1, mem.base.n_pad)
    swa = llama_ref.LlamaRef(mem.swa.get_size(), 1, 1, mem.swa.n_pad, hp.n_swa, int(hp.swa_type))
    tok = np.arange(512, dtype=np.int32) % 100
    for p0 in range(0, size - max(4096, n_tokens * (rounds + 4)), 512):  # the same prefill on both sides
        pos = np.arange(p0, p0 + 512, dtype=np.int32)
        mem.decode(kvref.Batch(tokens=tok, pos=pos, seq_ids=[[0]] * 512))
        base.decode_iswa(swa, tok, pos, np.zeros(512, np.int32))
    ta, tb, tu = [], [], []
    for r in range(rounds):
        p0 = mem.seq_pos_max(0) + 1
        pos, seq, t = np.arange(p0, p0 + n_tokens, dtype=np.int32), np.zeros(n_tokens, np.int32), tok[:n_tokens]
        b = dict(tokens=t, pos=pos, seq_ids=[[0]] * n_tokens)
        consolidate()
        if r % 2:
            tb.append(base.decode_iswa(swa, t, pos, seq))
            consolidate()
        t0 = time.perf_counter()
        placed = mem.decode(kvref.Batch(**b), n_ubatch=512)
        t1 = time.perf_counter()
        for ub, _slot in placed:
            read_ubatch(ub)
        ta.append(time.perf_counter() - t0)
        tu.append(t1 - t0)
        if r % 2 == 0:
            consolidate()
            tb.append(base.decode_iswa(swa, t, pos, seq))
        slot = placed[0][1]
        for part, ref in ((slot.base, base), (slot.swa, swa)):
            if np.concatenate([np.asarray(x) for x in part.idxs]).tolist() != ref.last_idxs().tolist():
                raise AssertionError("kvref and llama.cpp placed the iSWA ubatch in different cells")
    for part, ref in ((mem.base, base), (mem.swa, swa)):
        if (part.cells(0).get_used(), part.heads[0]) != (ref.used(), ref.head()):
            raise AssertionError("kvref and llama.cpp left different iSWA caches")
    report(f"2b iSWA decode {n_tokens:>3} tok, {size >> 10}k cells (both caches, +read)", ta, tb)
    report(f"2b iSWA decode {n_tokens:>3} tok:   ubatch not read", tu, tb, note="(kvref's step without the read)")


def _mamba() -> kvref.HParams:
    # mamba-tiny of the conformance suite: the memory's bookkeeping does not depend on the state's size
    return kvref.HParams(arch="mamba", n_layer=2, n_embd=32, n_head=0, n_head_kv=0, recurrent_layers=True,
                         rope_type=kvref.RopeType.NONE, ssm_d_conv=4, ssm_d_inner=64, ssm_d_state=8)  # fmt: skip


def _jamba() -> kvref.HParams:
    # a jamba-like hybrid: recurrent layers 0 and 2, attention layers 1 and 3
    return kvref.HParams(arch="jamba", n_layer=4, n_embd=64, n_head=2, n_embd_head_k=32, n_embd_head_v=32,
                         n_head_kv=[0, 1, 0, 1], recurrent_layers=[True, False, True, False], ssm_d_conv=4,
                         ssm_d_inner=128, ssm_d_state=8, rope_type=kvref.RopeType.NONE,
                         n_ctx_train=1 << 20)  # fmt: skip


def recurrent_rows(kind: str, n_ctx: int, n_seq: int, n_tokens: int, rounds: int) -> None:
    """Rows 2r / 2h: a recurrent (Mamba) or hybrid (Jamba: one KV cache of ``n_ctx`` cells plus the recurrent states)
    memory holding ``n_seq`` sequences after a 64-token prompt each; every step decodes ``n_tokens`` tokens of each
    sequence, its ubatches read. llama.cpp: llama_memory_recurrent::init_batch (split_equal, prepare), then per ubatch
    the context's apply (find_slot) and the graph's s_copy input; for the hybrid llama_memory_hybrid::init_batch's
    steps over both parts (recurrent prepare, then the KV cache's) and each ubatch applied to both."""
    hp = _mamba() if kind == "recurrent" else _jamba()
    mem = kvref.create_memory(hp, n_ctx=n_ctx, n_seq_max=n_seq, kv_unified=True)
    recr = mem if kind == "recurrent" else mem.recr  # type: ignore[attr-defined]
    attn = None if kind == "recurrent" else llama_ref.LlamaRef(mem.attn.get_size(), 1, n_seq, mem.attn.n_pad)  # type: ignore[attr-defined]
    ref = llama_ref.RecurrentRef(recr.size, n_seq, attn)

    def step(n_per_seq: int) -> tuple[dict, tuple[np.ndarray, ...]]:
        pos, seq = [], []
        for s in range(n_seq):
            p0 = mem.seq_pos_max(s) + 1
            pos.extend(range(p0, p0 + n_per_seq))
            seq.extend([s] * n_per_seq)
        pos_a, seq_a = np.asarray(pos, np.int32), np.asarray(seq, np.int32)
        tok = (np.arange(len(pos)) % 100).astype(np.int32)
        return dict(tokens=tok, pos=pos_a, seq_ids=[[int(x)] for x in seq]), (tok, pos_a, seq_a)

    def check(placed: list) -> None:
        _ub, slot = placed[-1]
        rslot = slot if kind == "recurrent" else slot.recr
        mine = (rslot.head, rslot.n, rslot.rs_z, [int(x) for x in rslot.s_copy])
        if mine != ref.last():
            raise AssertionError(f"kvref and llama.cpp placed the {kind} ubatch differently: {mine} {ref.last()}")
        if attn is not None and np.concatenate([np.asarray(x) for x in slot.attn.idxs]).tolist() != (
            attn.last_idxs().tolist()
        ):
            raise AssertionError("kvref and llama.cpp placed the hybrid's attention ubatch in different cells")

    b, arrs = step(64)  # the prompts, on both sides
    first = mem.decode(kvref.Batch(**b), n_ubatch=512)
    ref.decode(*arrs)
    check(first)
    ta, tb, tu = [], [], []
    for r in range(rounds):
        b, arrs = step(n_tokens)
        placed: list = []

        def kv(b: dict = b, placed: list = placed) -> float:
            t0 = time.perf_counter()
            placed[:] = mem.decode(kvref.Batch(**b), n_ubatch=512)
            t1 = time.perf_counter()
            for ub, _slot in placed:
                read_ubatch(ub)
            t2 = time.perf_counter()
            tu.append(t1 - t0)
            return t2 - t0

        consolidate()
        if r % 2 == 0:
            ta.append(kv())
            consolidate()
            tb.append(ref.decode(*arrs))
        else:
            tb.append(ref.decode(*arrs))
            consolidate()
            ta.append(kv())
        check(placed)
    if [mem.seq_pos_max(s) for s in range(n_seq)] != [ref.seq_pos_max(s) for s in range(n_seq)]:
        raise AssertionError(f"kvref and llama.cpp left different {kind} memories")
    name = "2r Mamba" if kind == "recurrent" else f"2h Jamba ({n_ctx >> 10}k KV cells)"
    lab = f"{name} decode {n_seq} seq x {n_tokens} tok"
    report(f"{lab} (+read)", ta, tb)
    report(f"{lab}:   ubatch not read", tu, tb, note="(kvref's step without the read)")


def server_rows(size: int, n_seq: int, per_seq: int, rounds: int) -> Pair:
    """Row 3: n_seq sequences interleaved in `size` cells; every step decodes one token per sequence (its ubatch
    read) and fills the f32 KQ mask of that ubatch into a buffer kept from the previous steps (``fill_kq_mask(...,
    out=buf)``), as llama.cpp refills its mask tensor."""
    pair = Pair(size, n_seq)
    pair.fill(n_seq, per_seq)
    seqs = np.arange(n_seq)
    td_a, td_b, tm_a, tm_b = [], [], [], []
    out: dict[tuple, np.ndarray] = {}
    bufs: dict[tuple, np.ndarray] = {}  # kvref's mask buffers by shape, reused as llama.cpp reuses its own

    def mask_buf(shape: tuple) -> np.ndarray:
        buf = bufs.get(shape)
        if buf is None:  # a new n_kv (every n_pad cells): a new buffer, as llama.cpp's graph gets a new tensor
            buf = bufs[shape] = np.empty(shape, np.float32)
        return buf

    for r in range(rounds):
        b, arrs = pair.batch(seqs, 1)

        def kv_step(b=b) -> tuple[float, float]:
            td = pair.kv_decode(b)
            ub, sinfo = pair.last[-1]
            t = time.perf_counter()
            n_kv = pair.mem.get_n_kv(sinfo)
            m = fill_kq_mask(pair.mem, ub, mask_buf((1, ub.n_tokens, n_kv)), sinfo=sinfo, n_kv=n_kv)
            tm = time.perf_counter() - t
            out["kv"] = m
            return td, tm

        def ll_step(arrs=arrs) -> tuple[float, float]:
            td = pair.ref.decode(*arrs)
            tm, _ = pair.ref.mask(False)
            return td, tm

        first, second = (kv_step, ll_step) if r % 2 == 0 else (ll_step, kv_step)
        consolidate()
        x = first()
        consolidate()
        y = second()
        (ka, kb), (la, lb) = (x, y) if r % 2 == 0 else (y, x)
        td_a.append(ka)
        tm_a.append(kb)
        td_b.append(la)
        tm_b.append(lb)
        if r == 0:
            pair.check_slot()
            m = out["kv"]
            if pair.ref.mask_bytes(m.nbytes) != m.tobytes():
                raise AssertionError("kvref's and llama.cpp's KQ masks differ")
    tot_a = [x + y for x, y in zip(td_a, tm_a, strict=True)]
    tot_b = [x + y for x, y in zip(td_b, tm_b, strict=True)]
    lab = f"3 server {n_seq} seq x 1 tok, {size >> 10}k cells"
    report(lab + ": decode+mask", tot_a, tot_b)
    report(lab + ":   decode part", td_a, td_b)
    report(lab + ":   mask part (f32)", tm_a, tm_b)
    return pair


def mask_rows(pair: Pair, label: str, rounds: int) -> None:
    """Row 8: the mask of the pair's last ubatch, f32 and f16: kvref vs llama.cpp and kvref vs the memory floor."""
    ub, sinfo = pair.last[-1]
    for f16 in (False, True):
        dt = np.float16 if f16 else np.float32
        m0 = fill_kq_mask(pair.mem, ub, sinfo=sinfo, dtype=dt)
        buf = np.empty_like(m0)
        pair.ref.mask(f16)
        if pair.ref.mask_bytes(m0.nbytes) != m0.tobytes():
            raise AssertionError(f"kvref's and llama.cpp's {dt.__name__} masks differ")
        ninf = dt(-np.inf)

        def kv(_r: int, buf=buf) -> float:
            t = time.perf_counter()
            fill_kq_mask(pair.mem, ub, out=buf, sinfo=sinfo)
            return time.perf_counter() - t

        def floor(_r: int, buf=buf, ninf=ninf) -> float:
            t = time.perf_counter()
            buf.fill(ninf)
            return time.perf_counter() - t

        def ll(_r: int, f16=f16) -> float:
            return pair.ref.mask(f16)[0]

        ta, tb = abba(rounds, kv, ll, consolidate)
        # the floor interleaved with kvref (ABBA), apart from llama.cpp's runs, whose own buffer would evict
        # kvref's between its calls but not the floor's
        tk, tf = abba(rounds, kv, floor, consolidate)
        name = "f16" if f16 else "f32"
        shape = "x".join(map(str, m0.shape))
        report(f"8 mask {label} {name} ({shape})", ta, tb)
        report_ratio(f"8 mask {label} {name} / memory floor", tk, tf, "kvref fill / numpy fill of the same buffer")


def prefill_mask_pair(n_cells: int, n_tok: int) -> Pair:
    pair = Pair(n_cells, 1)
    pair.fill(1, n_cells - n_tok)
    b, arrs = pair.batch(np.array([0]), n_tok)
    pair.kv_decode(b)
    pair.ref.decode(*arrs)
    pair.check_slot()
    return pair


def micro_rows(pair: Pair, n_seq: int, rounds: int) -> None:
    """Row 9: seq_rm of a sequence's last 8 positions (each round another sequence), and get_n_kv."""
    ta, tb = [], []
    for r in range(rounds):
        s = r % n_seq
        p0 = pair.mem.seq_pos_max(s) - 7
        if p0 != pair.ref.seq_pos_max(s) - 7:
            raise AssertionError("kvref and llama.cpp disagree on seq_pos_max")

        def kv(_r: int, s=s, p0=p0) -> float:
            t = time.perf_counter()
            pair.mem.seq_rm(s, p0, -1)
            return time.perf_counter() - t

        def ll(_r: int, s=s, p0=p0) -> float:
            return pair.ref.seq_rm(s, p0, -1)

        x, y = (kv(r), ll(r)) if r % 2 == 0 else (ll(r), kv(r))
        ta.append(x if r % 2 == 0 else y)
        tb.append(y if r % 2 == 0 else x)
    assert pair.mem.cells(0).get_used() == pair.ref.used()
    size = pair.mem.get_size()
    report(f"9 seq_rm(s, max-7, -1), {n_seq} seq, {size >> 10}k cells", ta, tb)

    _, sinfo = pair.last[-1]
    iters = 2000
    ta, tb = [], []
    for _r in range(max(5, rounds // 10)):
        t = time.perf_counter()
        for _ in range(iters):
            n_kv = pair.mem.get_n_kv(sinfo)
        ta.append((time.perf_counter() - t) / iters)
        t_ll, n_ll = pair.ref.get_n_kv(0, iters)
        tb.append(t_ll)
        if n_kv != n_ll:
            raise AssertionError(f"get_n_kv: kvref {n_kv}, llama.cpp {n_ll}")
    report(f"9 get_n_kv (per call, {iters} calls), {size >> 10}k cells", ta, tb, unit=1e6, note="(us per call)")
    # the same cells in a cache of each cells twin: get_n_kv's twin ratio (the Python twin keeps used_max_p1 until
    # its cells change; after a change it finds it again, O(size))
    from kvref.memory import _cells_py

    twins = {}
    for name, cls in (("Python", _cells_py.KVCells), ("Cython", type(pair.mem.cells(0)))):
        m = kvref.KVCache(_hparams(), kv_size=size, n_seq_max=pair.mem.n_seq_max, n_pad=pair.mem.n_pad,
                          cells_cls=cls)  # fmt: skip
        m.cells(0).set(0, pair.mem.cells(0))  # set() reads the other cells' arrays, of either twin
        twins[name] = m
    ta, tb = [], []
    for _r in range(max(5, rounds // 10)):
        for name, out in (("Python", ta), ("Cython", tb)):
            m = twins[name]
            t = time.perf_counter()
            for _ in range(iters):
                m.get_n_kv(sinfo)
            out.append((time.perf_counter() - t) / iters)
    if not twins["Python"].get_n_kv(sinfo) == twins["Cython"].get_n_kv(sinfo) == n_kv:
        raise AssertionError("the twins' get_n_kv differ")
    report_ratio(f"9 get_n_kv twins: Python / Cython, {size >> 10}k cells", ta, tb, "kvref only; cells unchanged")


def cells_rows(rounds: int) -> None:
    """Rows 14e-14i2: the bulk cell workloads of benchmarks/bench_cells.py on 32,768 cells (16 sequences
    interleaved), kvref's KVCells (the active twin, bulk calls) against llama_kv_cells running the loops llama.cpp
    runs for them; each round on fresh copies made outside the clock."""
    import bench_cells as W

    cls = kvref.memory.cells.KVCells
    ref = llama_ref.CellsRef(W.N_CELLS)
    ref.fill(W.POSITIONS, W.SEQS)
    mine = W.filled(cls)

    def fill_kv(_r: int) -> float:
        c = cls(W.N_CELLS)
        return timed(lambda: (c.pos_set_many(W.IDXS, W.POSITIONS), c.seq_add_many(W.IDXS, W.SEQS)))

    def fill_ll(_r: int) -> float:
        return llama_ref.CellsRef(W.N_CELLS).fill(W.POSITIONS, W.SEQS)

    def on_copy(work: Callable[[Any], object]) -> Callable[[int], float]:
        def run(_r: int) -> float:
            c = W.filled(cls)
            return timed(lambda: work(c))

        return run

    other = cls(W.N_CELLS)
    other.pos_set_many(W.IDXS, W.POSITIONS + 1)
    other.seq_add_many(W.IDXS, W.SEQS)
    saved = other.cp(W.IDXS)
    other_ref = llama_ref.CellsRef(W.N_CELLS)
    other_ref.fill(W.POSITIONS + 1, W.SEQS)
    saved_ref = other_ref.cp_all()
    h_ll = ref.seq_pos_max(W.QUERIES)[1]
    if not np.array_equal(mine.seq_pos_max_many(W.QUERIES), h_ll):
        raise AssertionError("kvref and llama.cpp answer seq_pos_max differently")
    rows = [
        ("14e fill: pos_set + seq_add of 32k cells", fill_kv, fill_ll),
        ("14f seq_rm of one sequence's cells (range op)", on_copy(lambda c: c.seq_rm_range(3, 0, W.POS_MAX)),
         lambda _r: ref.clone().seq_rm(3, 0, W.POS_MAX)),
        ("14g pos_add(-100) on every used cell", on_copy(lambda c: c.pos_add_many(c.used_cells(), -100)),
         lambda _r: ref.clone().pos_add_used(-100)),
        ("14h 1e5 seq_pos_max queries", lambda _r: timed(lambda: mine.seq_pos_max_many(W.QUERIES)),
         lambda _r: ref.seq_pos_max(W.QUERIES)[0]),
        ("14i cp + set of every cell (same cells back)", on_copy(lambda c: c.set(W.IDXS, c.cp(W.IDXS))),
         lambda _r: ref.clone().cp_set()),
        ("14i2 cp + set of every cell (other cells)", on_copy(lambda c: (c.cp(W.IDXS), c.set(W.IDXS, saved))),
         lambda _r: ref.clone().cp_set(saved_ref)),
    ]  # fmt: skip
    for label, a, b in rows:
        ta, tb = abba(rounds, a, b)
        report(label, ta, tb)


# ----------------------------------------------------------------------------------------- state rows
def _llama_cpp():
    try:
        import llama_cpp
    except Exception as exc:
        return None, f"the llama_cpp wheel cannot be imported ({exc})"
    if not MODEL.is_file():
        return None, f"{MODEL} is missing"
    return llama_cpp, ""


def state_rows(n_ctx: int, n_seq: int, rounds: int) -> None:
    """Rows 4-7 with llama-cpp-python's real llama_state_* on llama-tiny.gguf; each llama.cpp context is
    filled by llama_state_set_data (or llama_state_seq_set_data) of a blob kvref writes (decoding 100k+ tokens
    would take minutes)."""
    L, why = _llama_cpp()
    if L is None:
        NOTES.append(f"rows 4-7 skipped: {why}")
        print(f"rows 4-7 skipped: {why}")
        return
    L.llama_backend_init()
    global _LOG_CB
    _LOG_CB = L.llama_log_callback(lambda _level, _text, _ud: None)  # llama.cpp's log is silenced
    L.llama_log_set(_LOG_CB, None)
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(MODEL).encode(), mp)
    try:
        with _context(L, model, n_ctx, n_seq, True) as ctx:
            _state_rows(L, ctx, n_ctx, n_seq, rounds)
        # 5c: one sequence in one contiguous run (llama.cpp's block copy), a quarter of the cells above
        n_c = max(4096, n_ctx // 4)
        with _context(L, model, n_c, 1, True) as ctx:
            _seq_rows(L, ctx, n_c, 1, 0, n_c - 256, rounds, "5c seq state_read, one contiguous seq")
        # 5s: a small sequence (1000 cells, 0.5 MiB) in a 256-stream cache (kv_unified=false, 2048 cells a stream)
        with _context(L, model, 256 * 2048, 256, False) as ctx:
            _seq_rows(L, ctx, 256 * 2048, 256, 7, 1000, rounds, "5s seq state_read, 1000 cells, 256 streams", True)
        write_many_seq_rows(n_ctx, rounds)
    finally:
        L.llama_model_free(model)


class _context:
    """A llama.cpp context on llama-tiny (``with``: freed after), V transposed as kvref's default."""

    def __init__(self, L, model, n_ctx: int, n_seq: int, unified: bool) -> None:
        cp = L.llama_context_default_params()
        # a small ubatch keeps the compute buffer (n_ctx x n_ubatch mask) small: only 4 tokens are ever decoded
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, max(64, n_seq), max(64, n_seq), n_seq
        cp.kv_unified = unified
        cp.flash_attn_type = 0  # disabled: V transposed, as kvref's default
        cp.n_threads = cp.n_threads_batch = 1
        self.L, self.ctx = L, L.llama_init_from_model(model, cp)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {n_ctx}, n_seq_max {n_seq})")

    def __enter__(self):
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        self.L.llama_free(self.ctx)


def _random_rows(mem, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for layer in mem.layers:
        layer.k[...] = rng.integers(0, 256, layer.k.shape, dtype=np.uint8)
        layer.v[...] = rng.integers(0, 256, layer.v.shape, dtype=np.uint8)


def _copy_floor(label: str, blob: bytes, restore: Callable[[], object], rounds: int) -> None:
    """kvref's restore over a plain copy of the blob's bytes into a buffer allocated once (the limit), ABBA."""
    src = np.frombuffer(blob, np.uint8)
    dst = np.empty_like(src)
    ta, tb = abba(rounds, lambda _r: timed(restore), lambda _r: timed(lambda: np.copyto(dst, src)), settle)
    report_ratio(label, ta, tb, "kvref restore / np.copyto of the blob's bytes")


def _state_rows(L, ctx, n_ctx: int, n_seq: int, rounds: int) -> None:
    hp = kvref.HParams.from_gguf(MODEL)
    mem = kvref.create_memory(hp, n_ctx=n_ctx, n_seq_max=n_seq, kv_unified=True)
    # a small real state from llama.cpp gives the blob's header (arch, outputs); kvref fills the memory
    toks = (ctypes.c_int32 * 4)(1, 2, 3, 4)
    if L.llama_decode(ctx, L.llama_batch_get_one(toks, 4)) != 0:
        raise RuntimeError("llama_decode failed")
    size0 = L.llama_state_get_size(ctx)
    small = (ctypes.c_uint8 * size0)()
    L.llama_state_get_data(ctx, small, size0)
    blob_obj = S.load(bytes(small), kind="state")
    n_used = mem.get_size() - 256
    per_seq = n_used // n_seq
    idx = np.arange(per_seq * n_seq, dtype=np.int64)
    cells = mem.cells(0)
    cells.pos_set_many(idx, idx // n_seq)
    cells.seq_add_many(idx, idx % n_seq)
    mem.heads[0] = int(idx.size)
    _random_rows(mem)
    blob_obj.memory = S.MemorySections("kv", mem.state_sections())
    blob = blob_obj.to_bytes()
    cbuf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    if L.llama_state_set_data(ctx, cbuf, len(blob)) != len(blob):
        raise RuntimeError("llama_state_set_data refused kvref's blob")
    if L.llama_memory_seq_pos_max(L.llama_get_memory(ctx), 0) != per_seq - 1:
        raise RuntimeError("llama.cpp did not restore the cells kvref wrote")
    kv_state = mem.state_write()
    mib = len(kv_state) / (1 << 20)
    ll_size = L.llama_state_get_size(ctx)
    ll_buf = (ctypes.c_uint8 * ll_size)()

    # 6: save into a buffer the caller allocated once (llama_state_get_size + llama_state_get_data), like for like;
    # 6b: state_write(), which returns a new bytes object each time (freed after the clock, as a caller frees it)
    kv_buf = bytearray(mem.state_size())
    ta, tb = abba(
        rounds,
        lambda _r: timed(lambda: mem.state_write_into(kv_buf)),
        lambda _r: timed(lambda: L.llama_state_get_data(ctx, ll_buf, ll_size)),
    )
    assert bytes(ll_buf)[-len(kv_state) :] == kv_state, "llama.cpp's state does not end with kvref's memory section"
    assert kv_buf == kv_state, "state_write_into wrote other bytes than state_write"
    report(f"6 state_write_into(buf) vs llama_state_get_data ({mib:.0f} MiB)", ta, tb)
    ta, tb = abba(
        rounds,
        lambda _r: timed_keep(mem.state_write),
        lambda _r: timed(lambda: L.llama_state_get_data(ctx, ll_buf, ll_size)),
    )
    report(f"6b state_write() -> new bytes vs llama_state_get_data ({mib:.0f} MiB)", ta, tb)
    # 6b2: like for like, both return new memory: llama.cpp's side fills a new buffer (llama-cpp-python's
    # Llama.save_state allocates one per call), whose fresh pages the kernel zeroes as they are first written, as
    # it does the new bytes object's; 6bf: what the fresh pages cost kvref (state_write() over state_write_into)
    ta, tb = abba(
        rounds,
        lambda _r: timed_keep(mem.state_write),
        lambda _r: timed_keep(lambda: _get_data_new(L, ctx, ll_size)),
        settle,
    )
    report(f"6b2 state_write() vs a new buffer + get_data ({mib:.0f} MiB)", ta, tb, note="both write new memory")
    ta, tb = abba(
        rounds, lambda _r: timed_keep(mem.state_write), lambda _r: timed(lambda: mem.state_write_into(kv_buf))
    )
    report_ratio("6bf state_write() / state_write_into(buf)", ta, tb, "kvref only: the new pages' share")
    # 4: whole-state restore
    ta, tb = abba(
        rounds,
        lambda _r: timed(lambda: mem.state_read(kv_state)),
        lambda _r: timed(lambda: L.llama_state_set_data(ctx, ll_buf, ll_size)),
        settle,
    )
    report(f"4 state_read vs llama_state_set_data ({mib:.0f} MiB)", ta, tb)
    _copy_floor("4f state_read / plain copy of the blob", kv_state, lambda: mem.state_read(kv_state), rounds)
    # 5: one sequence's restore (1/n_seq of the cells, interleaved with the others cell by cell: llama.cpp's
    # per-element path for a transposed V)
    seq_kv = mem.state_write(1)
    seq_size = L.llama_state_seq_get_size(ctx, 1)
    seq_buf = (ctypes.c_uint8 * seq_size)()
    L.llama_state_seq_get_data(ctx, seq_buf, seq_size, 1)
    ta, tb = abba(
        rounds,
        lambda _r: timed(lambda: mem.state_read(seq_kv, 1)),
        lambda _r: timed(lambda: L.llama_state_seq_set_data(ctx, seq_buf, seq_size, 1)),
        settle,
    )
    assert mem.seq_pos_max(1) == L.llama_memory_seq_pos_max(L.llama_get_memory(ctx), 1)
    report(f"5 seq state_read(seq 1 of {n_seq}, interleaved) vs seq_set_data ({len(seq_kv) / (1 << 20):.0f} MiB)",
           ta, tb)  # fmt: skip
    _copy_floor("5f seq state_read (interleaved) / plain copy", seq_kv, lambda: mem.state_read(seq_kv, 1), rounds)
    # 5m / 4m: what a restore allocates beyond the blob it reads, the blob a memory-mapped file (kvref only)
    memory_rows(mem, [("5m seq state_read(seq 1)", seq_kv, 1), ("4m state_read (whole)", kv_state, -1)])
    # 7: kvref.state.load(path) auto-detected vs told the kind and layout (kvref only), on llama.cpp's files
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "state.ggsn")
        ntok = (ctypes.c_int32 * 4)(1, 2, 3, 4)
        if not L.llama_state_save_file(ctx, path.encode(), ntok, 4):
            raise RuntimeError("llama_state_save_file failed")
        auto = lambda: S.load(path)  # noqa: E731
        given = lambda: S.load(path, kind="session", layout="kv")  # noqa: E731
        ta, tb = abba(rounds, lambda _r: timed(auto), lambda _r: timed(given))
        report_ratio("7 state.load(session) auto / layout given", ta, tb, "kvref only; llama.cpp file")
        seq_path = os.path.join(d, "seq.ggsq")
        if not L.llama_state_seq_save_file(ctx, seq_path.encode(), 1, ntok, 4):
            raise RuntimeError("llama_state_seq_save_file failed")
        auto = lambda: S.load(seq_path)  # noqa: E731
        given = lambda: S.load(seq_path, kind="seq", layout="kv")  # noqa: E731
        ta, tb = abba(rounds, lambda _r: timed(auto), lambda _r: timed(given))
        n_cells = per_seq
        report_ratio(f"7b state.load(seq file, {n_cells} cells) auto / given", ta, tb, "kvref only; llama.cpp file")


def _get_data_new(L, ctx, size: int) -> Any:
    """llama_state_get_data into a buffer allocated for it (returned: freed by the caller)."""
    buf = (ctypes.c_uint8 * size)()
    if L.llama_state_get_data(ctx, buf, size) != size:
        raise RuntimeError("llama_state_get_data wrote another size")
    return buf


def _seq_rows(
    L, ctx, n_ctx: int, n_seq: int, seq: int, n: int, rounds: int, label: str, back_to_back: bool = False
) -> None:
    """A sequence restore: ``n`` cells of sequence ``seq`` (positions 0 .. n-1, one contiguous run of its stream)
    in a memory of ``n_seq`` sequences (one stream per sequence unless ``n_seq`` is 1), kvref's state_read against
    llama_state_seq_set_data of the same blob; and against a plain copy of the blob. With ``back_to_back`` also
    without `settle` between the calls: for a small restore its gc.collect (which walks every Python object and
    evicts the CPU caches) costs more than the restore, on both sides, most on the side with more code."""
    hp = kvref.HParams.from_gguf(MODEL)
    mem = kvref.create_memory(hp, n_ctx=n_ctx, n_seq_max=n_seq, kv_unified=n_seq == 1)
    strm = mem.seq_to_stream[seq]
    idx = np.arange(n, dtype=np.int64)
    cells = mem.cells(strm)
    cells.pos_set_many(idx, idx)
    cells.seq_add_many(idx, np.full(n, seq, np.int64))
    mem.heads[strm] = n
    _random_rows(mem)
    blob = mem.state_write(seq)  # the memory's section; llama.cpp's blob has a header before it
    ll_blob = kvref.save_memory(mem, kind="seq_state", seq_id=seq).to_bytes()
    cbuf = (ctypes.c_uint8 * len(ll_blob)).from_buffer_copy(ll_blob)
    if L.llama_state_seq_set_data(ctx, cbuf, len(ll_blob), seq) != len(ll_blob):
        raise RuntimeError("llama_state_seq_set_data refused kvref's blob")
    got = (ctypes.c_uint8 * len(ll_blob))()
    if L.llama_state_seq_get_data(ctx, got, len(ll_blob), seq) != len(ll_blob) or bytes(got) != ll_blob:
        raise AssertionError("llama.cpp's sequence state differs from kvref's")
    ta, tb = abba(
        rounds,
        lambda _r: timed(lambda: mem.state_read(blob, seq)),
        lambda _r: timed(lambda: L.llama_state_seq_set_data(ctx, cbuf, len(ll_blob), seq)),
        settle,
    )
    if mem.state_write(seq) != blob:
        raise AssertionError("kvref's restore changed the sequence")
    report(f"{label} ({len(blob) / (1 << 20):.1f} MiB)", ta, tb, note="settled: gc + malloc_trim before each")
    if back_to_back:
        ta, tb = abba(
            rounds,
            lambda _r: timed(lambda: mem.state_read(blob, seq)),
            lambda _r: timed(lambda: L.llama_state_seq_set_data(ctx, cbuf, len(ll_blob), seq)),
        )
        report(f"{label[:2].strip()}w {label[3:]}, back to back", ta, tb, note="no settle between calls")
    _copy_floor(f"{label[:2].strip()}f {label[3:]} / plain copy", blob, lambda: mem.state_read(blob, seq), rounds)


def write_many_seq_rows(n_ctx: int, rounds: int) -> None:
    """Row 6c (kvref only): state_write_into of a unified cache of n_seq_max 256 whose cells are interleaved over
    the 256 sequences, against the same number of cells at n_seq_max 1 (one id per cell both times)."""
    hp = kvref.HParams.from_gguf(MODEL)
    bufs, mems = [], []
    for n_seq in (256, 1):
        mem = kvref.create_memory(hp, n_ctx=n_ctx, n_seq_max=n_seq, kv_unified=True)
        idx = np.arange(mem.get_size() - 256, dtype=np.int64)
        mem.cells(0).pos_set_many(idx, idx // n_seq)
        mem.cells(0).seq_add_many(idx, idx % n_seq)
        mem.heads[0] = int(idx.size)
        _random_rows(mem)
        mems.append(mem)
        bufs.append(bytearray(mem.state_size()))
    ta, tb = abba(
        rounds,
        lambda _r: timed(lambda: mems[0].state_write_into(bufs[0])),
        lambda _r: timed(lambda: mems[1].state_write_into(bufs[1])),
    )
    report_ratio(f"6c state_write_into, n_seq_max 256 / 1 ({len(bufs[1]) >> 20} MiB)", ta, tb, "kvref only")


def memory_rows(mem, cases: list[tuple[str, bytes, int]]) -> None:
    """Peak Python allocations (tracemalloc: NumPy's buffers included) of ``mem.state_read`` from a read-only
    mapping of the blob, over the blob's size; the best of three restores."""
    with tempfile.TemporaryDirectory() as d:
        for label, blob, seq_id in cases:
            path = os.path.join(d, "blob.bin")
            with open(path, "wb") as f:
                f.write(blob)
            peaks = []
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                for _ in range(3):
                    tracemalloc.start()
                    base = tracemalloc.get_traced_memory()[0]
                    mem.state_read(view, seq_id)
                    peaks.append(tracemalloc.get_traced_memory()[1] - base)
                    tracemalloc.stop()
                view.release()
            peak = min(peaks)
            mib, blob_mib = peak / (1 << 20), len(blob) / (1 << 20)
            line = (
                f"{label + ': peak memory / mapped blob':<54} {mib:>9.2f} MiB of {blob_mib:.0f} MiB {'':>21} "
                f"{peak / len(blob):>9.3f}x  (kvref only; tracemalloc peak beyond the mapping)"
            )
            ROWS.append((label, line))
            print(line, flush=True)


# ----------------------------------------------------------------------------------------- real model
def real_model_rows(n_tok: int, rounds: int) -> None:
    """Rows 10-11 on Gemma 3 270M (the model CI's live tests fetch; ``KVREF_GEMMA3_GGUF`` or
    ``~/.cache/kvref-models``): ``HParams.from_gguf``'s time and peak memory, and restoring a session of n_tok tokens
    that llama.cpp decoded (made once, ~95 s for 30,000 tokens, kept in `llama_ref.cache_dir()`: ``KVREF_BENCH_CACHE``,
    else ``$XDG_CACHE_HOME/kvref-bench`` or ``~/.cache/kvref-bench``) with
    ``kvref.restore`` against ``llama_state_load_file`` into a context of the same size."""
    L, why = _llama_cpp()
    if L is None:
        NOTES.append(f"rows 10-11 skipped: {why}")
        return
    sys.path.insert(0, str(ROOT / "conformance"))
    import gen_real_kshift as g

    gguf = g.find_model()
    if gguf is None:
        NOTES.append(f"rows 10-11 skipped: no {g.MODEL_NAME} (python conformance/gen_real_kshift.py --fetch-only)")
        return
    times = []
    for _ in range(max(rounds, 3)):
        t = time.perf_counter()
        hp = kvref.HParams.from_gguf(gguf)
        times.append(time.perf_counter() - t)
    tracemalloc.start()  # apart from the timed calls: tracing slows every allocation down
    kvref.HParams.from_gguf(gguf)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    report("10 HParams.from_gguf(Gemma 3 270M, 262k-token vocab)", times, None,
           note=f"(kvref only; peak {peak / (1 << 20):.2f} MiB; targets 100 ms, 50 MB)")  # fmt: skip
    n_ctx = -(-n_tok // 256) * 256 + 256
    cache = llama_ref.cache_dir()  # KVREF_BENCH_CACHE, else $XDG_CACHE_HOME/kvref-bench or ~/.cache/kvref-bench
    path = cache / f"gemma3-270m-{n_tok}tok-llama-cpp-python-{L.__version__}.ggsn"
    tokens = [int(t) for t in np.random.default_rng(0).integers(1000, 20000, n_tok)]
    with g.Run(gguf, n_ctx=n_ctx, n_seq_max=1, n_threads=os.cpu_count() or 1) as run:
        if not path.is_file():
            print(f"decoding {n_tok} tokens with llama.cpp for the session file {path} (once) ...", flush=True)
            for i in range(0, n_tok, 512):
                run.decode(tokens[i : i + 512])
            cache.mkdir(parents=True, exist_ok=True)
            arr = (L.llama_token * n_tok)(*tokens)
            tmp = path.with_suffix(".partial")
            if not L.llama_state_save_file(run.ctx, str(tmp).encode(), arr, n_tok):
                raise RuntimeError("llama_state_save_file failed")
            tmp.replace(path)
        out = (L.llama_token * n_ctx)()
        n_out = ctypes.c_size_t(0)

        def ll(_r: int) -> float:
            t = time.perf_counter()
            if not L.llama_state_load_file(run.ctx, str(path).encode(), out, n_ctx, ctypes.byref(n_out)):
                raise RuntimeError("llama_state_load_file failed")
            return time.perf_counter() - t

        got: list = []

        def drop() -> None:
            """Free the previous restore's result, and both sides' frees (`settle`), outside either clock."""
            got.clear()
            settle()

        def kv(_r: int, **how: object) -> float:
            got.clear()  # the previous memory is freed outside the clock
            t = time.perf_counter()
            got.append(kvref.restore(path, **how))
            return time.perf_counter() - t

        mib = path.stat().st_size / (1 << 20)
        mem = kvref.restore(path, hparams=hp).memory
        # 11: the same work as llama.cpp's: the file into a memory that exists (its buffers already touched)
        ta, tb = abba(rounds, lambda r: kv(r, into=mem), ll, drop)
        if mem.seq_pos_max(0) != L.llama_memory_seq_pos_max(run.mem, 0) or n_out.value != n_tok:
            raise AssertionError("kvref and llama.cpp restored different sessions")
        size = L.llama_state_get_size(run.ctx)
        ll_state = (ctypes.c_uint8 * size)()
        L.llama_state_get_data(run.ctx, ll_state, size)
        if not bytes(ll_state).endswith(mem.state_write()):
            raise AssertionError("llama.cpp's restored state does not end with kvref's memory section")
        report(f"11 restore({n_tok}-token session, into=mem) vs state_load_file ({mib:.0f} MB)", ta, tb)
        file_buf = bytearray(path.stat().st_size)

        def plain_read(_r: int) -> float:
            t = time.perf_counter()
            with open(path, "rb", buffering=0) as f:
                f.readinto(file_buf)
            return time.perf_counter() - t

        tk, tf = abba(rounds, lambda r: kv(r, into=mem), plain_read, drop)
        report_ratio("11f restore(into=mem) / plain read of the file", tk, tf, "kvref / readinto a buffer made once")
        ta, tb = abba(rounds, lambda r: kv(r, hparams=hp), ll, drop)
        report("11b restore(session, hparams): a new memory each call", ta, tb, note="(fresh pages fault in)")
        ta, tb = abba(rounds, lambda r: kv(r, model=gguf), ll, drop)
        report("11c restore(session, model=GGUF path)", ta, tb, note="(+ from_gguf each call)")
        _save_rows(L, run, mem, path, n_tok, rounds)


def _save_rows(L, run, mem, path: Path, n_tok: int, rounds: int) -> None:
    """Rows 12-13: the restored session saved again (kvref.save_memory vs llama_state_save_file, each replacing its
    own file of the previous round), and the memory's state into a buffer allocated once."""
    tokens = [int(t) for t in S.load(path).tokens]
    arr = (L.llama_token * n_tok)(*tokens)
    with tempfile.TemporaryDirectory(dir=path.parent) as d:
        out_kv, out_ll = Path(d) / "kv.ggsn", Path(d) / "ll.ggsn"

        def ll(_r: int) -> float:
            t = time.perf_counter()
            if not L.llama_state_save_file(run.ctx, str(out_ll).encode(), arr, n_tok):
                raise RuntimeError("llama_state_save_file failed")
            return time.perf_counter() - t

        def kv(_r: int, durable: bool) -> float:
            t = time.perf_counter()
            kvref.save_memory(mem, out_kv, tokens=tokens, durable=durable)
            return time.perf_counter() - t

        ta, tb = abba(rounds, lambda r: kv(r, False), ll, settle)
        if out_kv.read_bytes() != out_ll.read_bytes():
            raise AssertionError("kvref and llama.cpp saved different session files")
        report("12 save_memory(path, durable=False) vs state_save_file", ta, tb, note="(both: write, no fsync)")
        # the default, its two fsyncs included, and in the same run the same save without them (ABBA, kvref only)
        td, tn = abba(rounds, lambda r: kv(r, True), lambda r: kv(r, False), settle)
        ta, tb = abba(rounds, lambda r: kv(r, True), ll, settle)
        share = 1 - statistics.median(tn) / statistics.median(td)
        report("12b save_memory(path): fsync of file and directory", ta, tb,
               note=f"(kvref's default; the fsyncs are {share:.0%} of it)")  # fmt: skip
        report_ratio("12c save_memory(path) durable / durable=False", td, tn, "kvref only: the fsyncs' cost")
    size = L.llama_state_get_size(run.ctx)
    ll_buf = (ctypes.c_uint8 * size)()
    kv_buf = bytearray(mem.state_size())

    ta, tb = abba(
        rounds,
        lambda _r: timed(lambda: mem.state_write_into(kv_buf)),
        lambda _r: timed(lambda: L.llama_state_get_data(run.ctx, ll_buf, size)),
    )
    if not bytes(ll_buf).endswith(kv_buf):
        raise AssertionError("llama.cpp's state does not end with kvref's memory section")
    report(f"13 state_write_into(buf) vs state_get_data, iSWA ({len(kv_buf) / (1 << 20):.0f} MiB)", ta, tb)


# ----------------------------------------------------------------------------------------- main
# rows 2r / 2h: (memory, n_ctx, sequences, tokens per sequence and step)
RECURRENT_ROWS = [("recurrent", 4096, 1, 1), ("recurrent", 4096, 1, 16), ("recurrent", 4096, 8, 1),
                  ("hybrid", 32768, 1, 1), ("hybrid", 32768, 4, 1)]  # fmt: skip
SIZES = {
    "full": dict(big=1 << 20, iswa=1 << 17, dec_rounds=41, server=(32768, 64, 448), server_rounds=41,
                 prefill=(8192, 512), mask_rounds=41, micro_rounds=200, state=(393216, 4), state_rounds=7,
                 real=(30000, 9), cells_rounds=15),
    "quick": dict(big=1 << 18, iswa=1 << 15, dec_rounds=15, server=(8192, 16, 448), server_rounds=15,
                  prefill=(4096, 256), mask_rounds=15, micro_rounds=60, state=(32768, 4), state_rounds=3,
                  real=(4096, 5), cells_rounds=5),
}  # fmt: skip


def run(quick: bool) -> int:
    cfg = SIZES["quick" if quick else "full"]
    try:
        lib = llama_ref.prepare()
    except llama_ref.Unavailable as exc:
        print(f"bench_vs_llama: llama.cpp's side is unavailable, nothing measured:\n  {exc}")
        return 0
    print(f"kvref {kvref.__version__} ({kvref.backend()} backend) vs llama.cpp from llama-cpp-python "
          f"{llama_ref.LLAMA_CPP_PYTHON} ({lib})")  # fmt: skip
    print("times in ms; ratio = kvref / llama.cpp (>1: kvref slower); ABBA-interleaved, same run")
    t0 = time.perf_counter()
    header(
        "decode steps (kvref: mem.decode(Batch(...)); llama.cpp: fill a llama_batch, llama_batch_compat, "
        "llama_batch_allocr::init, split, prepare, apply_ubatch)"
    )
    for n_tok in (1, 256):
        decode_rows(cfg["big"], n_tok, cfg["dec_rounds"])
    for n_tok in (1, 256):
        iswa_decode_rows(cfg["iswa"], n_tok, cfg["dec_rounds"])
    header(
        "recurrent and hybrid decode steps (llama.cpp: llama_memory_recurrent's init_batch, prepare, find_slot, "
        "s_copy; llama_memory_hybrid's steps over both parts)"
    )
    for kind, n_ctx, n_seq, n_tok in RECURRENT_ROWS:
        recurrent_rows(kind, n_ctx, n_seq, n_tok, cfg["dec_rounds"])
    header("server loop, KQ mask, micro-ops")
    size, n_seq, per_seq = cfg["server"]
    pair = server_rows(size, n_seq, per_seq, cfg["server_rounds"])
    mask_rows(pair, f"server {n_seq}x1 tok", cfg["mask_rounds"])
    n_cells, n_tok = cfg["prefill"]
    mask_rows(prefill_mask_pair(n_cells, n_tok), f"prefill {n_tok} tok", cfg["mask_rounds"])
    micro_rows(pair, n_seq, cfg["micro_rounds"])
    header("cells (benchmarks/bench_cells.py's workloads; llama.cpp: llama_kv_cells, its loops)")
    cells_rows(cfg["cells_rounds"])
    header("state (llama-cpp-python's llama_state_* on llama-tiny.gguf, n_seq_max 4, unified)")
    n_ctx, n_seq_state = cfg["state"]
    state_rows(n_ctx, n_seq_state, cfg["state_rounds"])
    header("real model (Gemma 3 270M Q4_K_M, llama-cpp-python's llama_state_load_file)")
    real_model_rows(*cfg["real"])
    for note in NOTES:
        print("note:", note)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller caches and fewer rounds (under 2 minutes)")
    args = ap.parse_args(argv)
    return run(args.quick)


def test_vs_llama_quick(benchmark, request) -> None:  # pragma: no cover - a benchmark, not a test
    """pytest entry: the quick run once, skipped with the reason when llama.cpp's side cannot be built."""
    import pytest

    if not request.config.getoption("benchmark_only", False):
        pytest.skip("benchmark: run with --benchmark-only")
    try:
        llama_ref.prepare()
    except llama_ref.Unavailable as exc:
        pytest.skip(f"llama.cpp reference unavailable: {exc}")
    benchmark.pedantic(run, args=(True,), rounds=1, iterations=1)


if __name__ == "__main__":
    sys.exit(main())
