#!/usr/bin/env python3
"""Regenerate every conformance golden from scratch (a maintainer's step, not CI).

    python conformance/generate.py                 # all cases
    python conformance/generate.py -k llama-f16    # cases whose id contains the text
    python conformance/generate.py --list          # ids and descriptions
    python conformance/generate.py --crashes       # only conformance/crashes/ (configurations llama.cpp dies in)

Needs llama-cpp-python 0.3.36 (the llama.cpp it vendors writes the goldens) and gguf.
Tiny random-weight models are written into a cache directory (default
$XDG_CACHE_HOME/kvref-conformance, override with --model-dir); those under 200 KB are also
copied to conformance/models/ (COMMITTED_MODELS) so kvref can test HParams.from_gguf on them.  Every random
choice comes from a fixed seed, so a rerun on the same machine writes the same files.

Each case gets conformance/golden/<case-id>/ with case.json (see case.schema.json) and
the artefacts its save operations wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import driver  # noqa: E402
import tinymodels  # noqa: E402
from driver import FLAGS_PARTIAL_ONLY  # noqa: E402

CURRENT_PRODUCER = "0.3.36"
# cases replayed with an older llama-cpp-python (installed in its own venv) for the legacy
# layouts; their ids get the prefix "legacy-<version>-"
LEGACY_CASES = (
    "llama-f16-single-seq",
    "llama-f16-multistream",
    "gemma2-swa-overflow",
    "mamba-seq-cp-rm",
    "qwen2vl-mrope",
)
SCHEMA_VERSION = 1
COMMIT_MODEL_MAX = 200 * 1024
# committed under conformance/models/ (each < COMMIT_MODEL_MAX) for HParams.from_gguf tests;
# the others are only written to the model cache
COMMITTED_MODELS = (
    "llama",
    "mamba",
    "qwen2vl",
    "gemma3",
    "qwen3",
    "llama4",
    "mamba2",
    "rwkv6",
    "lfm2",
    "lfm2-swa",
    "bloom",
    "t5",
    "llama-h64",
    "qwen3-h128",
    "stablelm-rot32",
    "glm-dsa",
    "dots3note",
    "deepseek32",
    "hy_v4",
    "hy_v4-full",
    "qwen4exp",
    "minimax-m3",
)


# ------------------------------------------------------------------ case table


@dataclass
class Case:
    id: str
    model: str
    description: str
    covers: list[str]
    script: Callable
    n_ctx: int = 256
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 1
    kv_unified: bool = True
    flash_attn: bool = False
    type_k: str = "f16"
    type_v: str = "f16"
    swa_full: bool = False
    n_rs_seq: int = 0
    n_threads: int = 1
    ctx_type: str = "default"  # llama_context_params.ctx_type ("mtp": a draft context of the NextN blocks)
    capture_rows: bool = False  # also record the K/V rows before/after the attention rotation (driver.ROWS_FILE)
    ctx_type: str = "default"  # llama_context_params.ctx_type: "mtp" for a NextN draft context
    # the model of ctx_other (gemma4-assistant's target), run with the same context parameters; its ops are
    # in the trace marked "ctx": "other", its model and context under case.json's "other"
    other_model: str | None = None
    ctx_type: str = "default"  # llama_context_params.ctx_type: "mtp" for a draft context of the MTP blocks

    def cparams(self) -> dict:
        extra = {} if self.ctx_type == "default" else {"ctx_type": self.ctx_type}
        return extra | {
            k: getattr(self, k)
            for k in (
                "n_ctx",
                "n_batch",
                "n_ubatch",
                "n_seq_max",
                "kv_unified",
                "flash_attn",
                "type_k",
                "type_v",
                "swa_full",
                "n_rs_seq",
                "n_threads",
            )
        }


class Tokens:
    """Deterministic token ids for a case (never the special ids 0..3)."""

    def __init__(self, case_id: str):
        self.rng = np.random.default_rng(zlib.crc32(case_id.encode()))

    def __call__(self, n: int) -> list[int]:
        return [int(t) for t in self.rng.integers(4, tinymodels.N_VOCAB, size=n)]


# Every script receives (run, tok) and performs the case's operations in order.
# `hist` dicts keep the token list of each sequence so session/seq files carry the
# tokens a real program would store with them.


def s_single_seq(r, tok):
    hist = {0: tok(12)}
    r.decode_seq(0, hist[0])
    for _ in range(3):
        t = tok(1)
        hist[0] += t
        r.decode_seq(0, t)
    r.save_all(hist)
    # restore the whole context from the session file and from the raw blob
    r.clear()
    r.load_session(r.latest("session"))
    r.clear()
    r.set_state_data(r.latest("state"))
    # restore the sequence file into seq 0 after removing it
    r.seq_rm(0, -1, -1)
    r.load_seq(r.latest("seq", 0), 0)
    t = tok(1)
    hist[0] += t
    r.decode_seq(0, t)
    r.save_session(hist[0])


def s_multi_seq(r, tok):
    # three sequences decoded in one interleaved batch, the first token shared by 0 and 1
    n = 6
    hist = {0: tok(n), 1: None, 2: tok(n)}
    shared = hist[0][0]
    hist[1] = [shared, *tok(n - 1)]
    toks, pos, ids = [shared, hist[2][0]], [0, 0], [[0, 1], [2]]
    for i in range(1, n):
        for s in (0, 1, 2):
            toks.append(hist[s][i])
            pos.append(i)
            ids.append([s])
    logits = [0] * len(toks)
    logits[-1] = 1
    r.decode(toks, pos, ids, logits)
    for s in (0, 1, 2):
        t = tok(1)
        hist[s] += t
        r.decode_seq(s, t)
    r.save_all(hist)
    r.clear()
    r.load_session(r.latest("session"))
    r.seq_rm(1, -1, -1)
    r.load_seq(r.latest("seq", 1), 3)
    r.save_all({3: hist[1]}, session_tokens=hist[0])


def s_multistream(r, tok):
    # kv_unified = false: one stream per sequence
    hist = {0: tok(10), 1: tok(7), 2: tok(4)}
    for s in (0, 1, 2):
        r.decode_seq(s, hist[s])
    # one batch touching two streams
    t0, t1 = tok(1), tok(1)
    hist[0] += t0
    hist[1] += t1
    r.decode(t0 + t1, [r.pos_max(0) + 1, r.pos_max(1) + 1], [[0], [1]], [1, 1])
    r.save_all(hist)
    # copy a whole sequence across streams (queued, applied on the next update)
    r.seq_cp(0, 2, -1, -1)
    t = tok(1)
    hist[0] += t
    r.decode_seq(0, t)
    hist[2] = hist[0][:-1]
    r.save_session(hist[0])
    # restore seq 1's file into seq 2, which lives in another stream
    r.load_seq(r.latest("seq", 1), 2)
    r.seq_keep(2)
    r.save_all({2: hist[1]}, session_tokens=hist[1])
    if driver.PRODUCER.get("whole_restore_last_stream"):
        # llama.cpp before October 2026 (0.3.16 .. 0.3.35): every stream's whole restore began with
        # clear(true), so only the last non-empty stream (here seq 2's) survives; legacy runs only
        r.set_state_data(r.latest("state"))


def s_shared_prefix(r, tok):
    prefix = tok(8)
    r.decode_seq(0, prefix)
    r.seq_cp(0, 1, -1, -1)
    r.seq_cp(0, 2, 0, 4)  # only positions [0, 4)
    hist = {0: prefix + tok(3), 1: prefix + tok(2), 2: prefix[:4] + tok(2)}
    r.decode_seq(0, hist[0][8:])
    r.decode_seq(1, hist[1][8:])
    r.decode_seq(2, hist[2][4:])
    r.save_all(hist)
    r.seq_rm(1, 5, -1)
    r.seq_rm(0, 2, 6)
    r.save_all({0: hist[0], 1: hist[1][:5]})


def s_seq_rm_ranges(r, tok):
    hist = {0: tok(16), 1: tok(9)}
    r.decode_seq(0, hist[0])
    r.decode_seq(1, hist[1])
    r.seq_rm(0, 3, 7)  # a hole in the middle
    r.seq_rm(0, 14, -1)  # the tail
    r.seq_rm(1, -1, 2)  # p0 < 0 means from the start
    r.seq_rm(-1, 8, 9)  # every sequence
    r.seq_rm(0, 20, 30)  # nothing there: still true
    r.save_all(hist)
    r.seq_rm(-1, -1, -1)  # all sequences, all positions
    r.save_session([])
    r.save_state_data()


def s_context_shift(r, tok):
    hist = {0: tok(24)}
    r.decode_seq(0, hist[0][:16])
    r.decode_seq(0, hist[0][16:])
    # discard positions [4, 12) and shift the rest back by 8 (a context shift)
    r.seq_rm(0, 4, 12)
    r.seq_add(0, 12, -1, -8)
    r.save_all(hist)  # shift pending, positions already moved
    t = tok(1)
    r.decode_seq(0, t)  # applies the K-shift before placing the token
    hist[0] = hist[0][:4] + hist[0][12:] + t
    r.save_all(hist)
    # a shift that pushes positions below zero removes those cells
    r.seq_add(0, 0, 6, -3)
    r.decode_seq(0, tok(1))
    r.save_session([])


def s_seq_div(r, tok):
    hist = {0: tok(20), 1: tok(6)}
    r.decode_seq(0, hist[0])
    r.decode_seq(1, hist[1])
    r.seq_div(0, 8, -1, 2)  # positions >= 8 halved (self-extend style)
    r.seq_div(1, 0, 4, 3)
    r.save_all(hist)
    r.decode_seq(0, tok(1))
    r.save_all({0: []})


def s_seq_keep(r, tok):
    hist = {0: tok(5), 1: tok(6), 2: tok(7)}
    shared = tok(3)
    r.decode(shared, [0, 1, 2], [[0, 1, 2]] * 3)
    for s in (0, 1, 2):
        r.decode_seq(s, hist[s])
        hist[s] = shared + hist[s]
    r.save_all(hist)
    r.seq_keep(1)
    r.save_all({1: hist[1]}, session_tokens=hist[1])


def s_cache_full(r, tok):
    # n_ctx 256 rounds to a 256-cell cache; fill 250, then a 10-token batch cannot fit
    hist = {0: tok(250)}
    r.decode_seq(0, hist[0][:128])
    r.decode_seq(0, hist[0][128:])
    ret = r.decode_seq(0, tok(10))
    assert ret == 1, ret
    r.decode_seq(0, tok(6))  # exactly the 6 free cells
    r.decode_seq(0, tok(1))  # full again
    # invalid batches are refused before touching the memory
    r.decode([tinymodels.N_VOCAB + 5], [r.pos_max(0) + 1], [[0]])  # token id out of range
    r.decode(tok(1), [r.pos_max(0) + 1], [[1]])  # seq id >= n_seq_max
    r.decode(tok(2), [0, 2], [[0], [0]])  # positions not continuous
    p = r.pos_max(0) + 1
    r.decode(tok(2), [p + 1, p], [[0], [0]])  # positions decreasing
    r.save_session([])


def s_clear(r, tok):
    r.decode_seq(0, tok(9))
    r.clear(True)
    hist = {0: tok(5)}
    r.decode_seq(0, hist[0])
    r.clear(False)  # metadata only
    r.decode_seq(0, hist[0])
    r.save_all(hist)


def s_restore_failures(r, tok):
    hist = {0: tok(6), 1: tok(4)}
    r.decode_seq(0, hist[0])
    r.decode_seq(1, hist[1])
    r.save_all(hist)
    # token capacity too small: the file is refused before the memory is touched
    r.load_session(r.latest("session"), capacity=2)
    r.load_seq(r.latest("seq", 0), 1, capacity=2)
    # a sequence blob restored into another sequence id
    r.set_seq_data(r.latest("seqdata", 0), 1)
    r.save_all({1: hist[0]}, session_tokens=hist[0])


def s_swa_overflow(r, tok):
    hist = {0: tok(13)}
    r.decode_seq(0, hist[0][:10])
    r.decode_seq(0, hist[0][10:])
    r.save_all(hist, seq_data_flags=(0, FLAGS_PARTIAL_ONLY))
    r.seq_rm(0, -1, -1)
    r.load_seq(r.latest("seq", 0), 0)
    t = tok(2)
    hist[0] += t
    r.decode_seq(0, t)
    r.save_all(hist)


def s_swa_multiseq(r, tok):
    hist = {0: tok(9)}
    r.decode_seq(0, hist[0])
    r.seq_cp(0, 1, -1, -1)
    hist[1] = hist[0] + tok(5)
    r.decode_seq(1, hist[1][9:])
    t = tok(3)
    hist[0] += t
    r.decode_seq(0, t)
    r.save_all(hist, seq_data_flags=(0, FLAGS_PARTIAL_ONLY))
    r.seq_rm(1, 10, -1)
    r.seq_rm(0, 0, 3)
    r.save_all({0: hist[0], 1: hist[1][:10]}, seq_data_flags=(0, FLAGS_PARTIAL_ONLY))


def s_swa_wraparound(r, tok):
    # 300 tokens through a 256-cell SWA cache: SWA cells are reused once masked
    hist = {0: tok(300)}
    for i in range(0, 300, 32):
        r.decode_seq(0, hist[0][i : i + 32])
    r.save_session(hist[0])
    r.save_seq(0, hist[0])
    r.save_seq_data(0, FLAGS_PARTIAL_ONLY)


def s_recurrent(r, tok):
    hist = {0: tok(7)}
    r.decode_seq(0, hist[0])
    r.seq_cp(0, 1, -1, -1)
    hist[1] = hist[0] + tok(3)
    r.decode_seq(1, hist[1][7:])
    hist[2] = tok(4)
    r.decode_seq(2, hist[2])
    r.save_all(hist)
    r.seq_rm(0, 3, -1)  # drops the tail including the last position: refused
    r.seq_rm(1, 5, 8)  # a range before the last position: nothing removed, accepted
    r.seq_rm(1, 10, -1)  # past the last position: nothing removed, accepted
    r.seq_rm(2, -1, -1)  # whole sequence: accepted
    r.load_seq(r.latest("seq", 1), 3)
    r.save_all({3: hist[1]}, session_tokens=hist[1])
    r.seq_keep(3)
    r.save_session(hist[1])
    r.clear()
    r.set_state_data(r.latest("state"))
    r.save_state_data()


def s_recurrent_multi_batch(r, tok):
    # a batch whose token belongs to several sequences is refused by the recurrent memory's
    # equal split (llama_decode returns 1); the same prefix is then decoded once and copied
    shared = tok(2)
    r.decode(shared + tok(1), [0, 1, 2], [[0, 1, 2], [0, 1, 2], [0]])
    r.decode_seq(0, shared)
    r.seq_cp(0, 1, -1, -1)
    r.seq_cp(0, 2, -1, -1)
    hist = {0: list(shared), 1: list(shared), 2: list(shared)}
    # then three sequences advanced together in one batch (split_equal, one token each per ubatch)
    toks, pos, ids = [], [], []
    for i in range(2, 5):
        for s in (0, 1, 2):
            t = tok(1)
            hist[s] += t
            toks += t
            pos.append(i)
            ids.append([s])
    r.decode(toks, pos, ids, [1] * len(toks))
    r.save_all(hist)
    r.seq_keep(1)
    r.seq_div(1, 0, -1, 2)
    r.seq_add(1, 0, -1, 5)
    r.save_all({1: hist[1]}, session_tokens=hist[1])


def s_hybrid(r, tok):
    hist = {0: tok(8)}
    r.decode_seq(0, hist[0])
    r.seq_cp(0, 1, -1, -1)
    hist[1] = hist[0] + tok(3)
    r.decode_seq(1, hist[1][8:])
    r.save_all(hist, seq_data_flags=(0, FLAGS_PARTIAL_ONLY))
    r.seq_rm(0, 4, -1)  # refused: the recurrent half cannot drop a tail
    r.seq_rm(0, -1, -1)
    r.load_seq(r.latest("seq", 1), 0)
    r.seq_rm(1, -1, -1)
    r.set_seq_data(r.latest("seqdata", 1), 2)
    r.save_all({0: hist[1], 2: hist[1]}, session_tokens=hist[1])


def s_mrope(r, tok):
    hist = {0: tok(10), 1: tok(5)}
    r.decode_seq(0, hist[0])
    r.decode_seq(1, hist[1])
    r.save_all(hist)
    r.seq_rm(1, -1, -1)
    r.load_seq(r.latest("seq", 0), 1)
    r.seq_rm(0, 6, -1)
    r.save_all({0: hist[0][:6], 1: hist[0]})


def s_arch(r, tok):
    """The compact case every extra architecture gets: two sequences (one a seq_cp of the
    other, then diverging), all artefacts, a partial seq_rm, a sequence file restored into a
    third sequence, and the artefacts again."""
    hist = {0: tok(10)}
    r.decode_seq(0, hist[0])
    r.seq_cp(0, 1, -1, -1)
    hist[1] = hist[0] + tok(3)
    r.decode_seq(1, hist[1][10:])
    t = tok(2)
    hist[0] += t
    r.decode_seq(0, t)
    # PARTIAL_ONLY only changes what an iSWA or hybrid memory writes
    flags = (0, FLAGS_PARTIAL_ONLY) if r.kind in ("iswa", "hybrid", "hybrid_iswa", "hybrid_idx") else (0,)
    r.save_all(hist, seq_data_flags=flags)
    kept = hist[0][:6] if r.seq_rm(0, 6, -1) else hist[0]  # recurrent memory refuses a tail
    r.seq_rm(1, -1, -1)
    r.load_seq(r.latest("seq", 1), 2)
    r.save_all({0: kept, 2: hist[1]})


def s_qsa(r, tok):
    """qwen4exp's QSA blocks (ratio 4) as they fill: a 14-token prompt in ubatches of 4, a copy continued on its
    own, a prompt shared by two sequences (its cells carry both: blocks group by sequence set), both sequences
    advanced in one batch, a tail seq_rm refused, a whole removal, a sequence file restored elsewhere."""
    hist = {0: tok(14)}
    r.decode_seq(0, hist[0])
    r.seq_cp(0, 1, -1, -1)
    hist[1] = hist[0] + tok(5)
    r.decode_seq(1, hist[1][14:])
    hist[2] = tok(6)
    r.decode_seq(2, hist[2], also=(3,))
    hist[3] = list(hist[2])
    a, b = tok(3), tok(3)
    p2, p3 = r.pos_max(2) + 1, r.pos_max(3) + 1
    r.decode([a[0], b[0], a[1], b[1], a[2], b[2]], [p2, p3, p2 + 1, p3 + 1, p2 + 2, p3 + 2],
             [[2], [3], [2], [3], [2], [3]])  # fmt: skip
    hist[2] += a
    hist[3] += b
    r.save_all(hist, seq_data_flags=(0, FLAGS_PARTIAL_ONLY))
    r.seq_rm(0, 9, -1)  # refused: the recurrent part cannot drop a tail
    r.seq_rm(0, -1, -1)
    r.load_seq(r.latest("seq", 1), 0)
    t = tok(2)
    r.decode_seq(0, t)
    hist[0] = hist[1] + t
    r.save_all(hist)


def s_non_causal(r, tok):
    """llama_set_causal_attn(false) between causal decodes, as the image path of a vision model does: a prompt,
    an "image" batch decoded non-causally (its tokens attend each other both ways), two sequences in one
    non-causal batch, a context shift whose K-shift is applied by a non-causal decode, then causal again."""
    hist = {0: tok(5)}
    r.decode_seq(0, hist[0])
    r.set_causal(False)
    img = tok(6)
    hist[0] += img
    r.decode_seq(0, img)
    r.seq_cp(0, 1, 0, 3)
    a, b = tok(4), tok(2)
    hist[1] = hist[0][:3] + a
    hist[0] += b
    p1, p0 = r.pos_max(1) + 1, r.pos_max(0) + 1
    # interleaved: seq 1 gets 4 tokens, seq 0 two
    toks = [a[0], b[0], a[1], b[1], a[2], a[3]]
    pos = [p1, p0, p1 + 1, p0 + 1, p1 + 2, p1 + 3]
    ids = [[1], [0], [1], [0], [1], [1]]
    r.decode(toks, pos, ids, [0, 0, 0, 1, 0, 1])
    r.set_causal(True)
    t = tok(3)
    hist[0] += t
    r.decode_seq(0, t)
    r.save_all(hist)
    # drop positions [2, 5) of seq 0 and shift the rest back: the next (non-causal) decode applies the K-shift
    r.seq_rm(0, 2, 5)
    r.seq_add(0, 5, -1, -3)
    r.set_causal(False)
    r.decode_seq(0, tok(4))
    r.set_causal(True)
    r.decode_seq(0, tok(1))
    r.save_session([])


def s_t5(r, tok):
    """llama_encode of a 30-token source (bidirectional buckets, distances past max_exact), then the decoder:
    the start token and 24 more in batches, a tail removal and more tokens into the freed cells."""
    src = tok(30)
    r.encode(src, list(range(30)), [[0]] * 30)
    hist = {0: [0]}
    r.decode_seq(0, [0])  # decoder_start_token_id
    for n in (10, 1, 13):
        t = tok(n)
        hist[0] += t
        r.decode_seq(0, t)
    r.save_all(hist)
    r.seq_rm(0, 12, -1)
    t = tok(6)
    hist[0] = hist[0][:12] + t
    r.decode_seq(0, t)
    r.save_all(hist)


def s_rot_kshift(r, tok):
    """A context shift on a quantized, rotated K cache: whole-state saves before the shift, with it pending (rows
    not yet moved) and after the decode that applied it, then a seq_div shift the same way. With two streams
    (n_seq_max 2, not unified) the shift graph ropes the other stream's cells too (shift 0)."""
    n_seq = r.n_seq_max
    hist = {0: tok(24)}
    r.decode_seq(0, hist[0][:16])
    r.decode_seq(0, hist[0][16:])
    if n_seq > 1:
        hist[1] = tok(10)
        r.decode_seq(1, hist[1])
    r.save_state_data()
    r.seq_rm(0, 4, 12)
    r.seq_add(0, 12, -1, -8)
    r.save_state_data()  # the shift pending: positions moved, rows not yet
    t = tok(1)
    r.decode_seq(0, t)  # the memory update ropes every cell of the K cache, then the token is stored
    hist[0] = hist[0][:4] + hist[0][12:] + t
    r.save_state_data()
    last = n_seq - 1
    r.seq_div(last, 6, -1, 2)
    r.save_state_data()
    t = tok(1)
    r.decode_seq(last, t)
    hist[last] = hist[last] + t
    r.save_all(hist)


def s_msa(r, tok):
    """minimax-m3 (llama_kv_cache_msa): prompts in batches (graphs with cell_blk) and one-token decodes (graphs
    with pos_slot_f) crossing an indexer block, a second sequence (a seq_cp, then diverging), every artefact, a
    partial seq_rm and a K-shift (seq_add) applied by the next decode, a sequence file restored into another
    sequence, a whole-state restore, and the artefacts again."""
    n_seq = r.n_seq_max
    hist = {0: tok(11)}
    r.decode_seq(0, hist[0])
    for _ in range(2):
        t = tok(1)
        hist[0] += t
        r.decode_seq(0, t)
    if n_seq > 1:
        r.seq_cp(0, 1, -1, -1)
        hist[1] = hist[0] + tok(6)
        r.decode_seq(1, hist[1][len(hist[0]) :])
        t = tok(1)
        hist[1] += t
        r.decode_seq(1, t)
        # both sequences in one batch: two tokens each (a batch graph over two streams), then one each (decode)
        for n in (2, 1):
            a, b = tok(n), tok(n)
            p0, p1 = r.pos_max(0) + 1, r.pos_max(1) + 1
            toks = [x for pair in zip(a, b, strict=True) for x in pair]
            pos = [p for i in range(n) for p in (p0 + i, p1 + i)]
            r.decode(toks, pos, [[0], [1]] * n, [0] * (2 * n - 2) + [1, 1])
            hist[0] += a
            hist[1] += b
    r.save_all(hist)
    r.seq_rm(0, 3, 6)
    r.seq_add(0, 6, -1, -3)
    t = tok(5)
    r.decode_seq(0, t)
    hist[0] = hist[0][:3] + hist[0][6:] + t
    last = n_seq - 1
    r.seq_rm(last, -1, -1)
    r.load_seq(r.latest("seq", 0), last)
    t = tok(1)
    r.decode_seq(last, t)
    r.save_all({0: hist[0]})
    r.clear()
    r.set_state_data(r.latest("state"))
    t = tok(3)
    r.decode_seq(0, t)
    r.save_state_data()


def s_assistant(r, tok):
    """gemma4-assistant reading gemma4-tiny's cache (ctx_other): the target decodes prompts (its ops are marked
    "ctx": "other"), the draft decodes tokens and hidden states continuing them, several times at the same
    positions (it never stores a cell: every layer and cell is the target's, its masks read the target's cells), one
    batch in two ubatches; the draft's sequence ops do nothing (seq_rm returns true), its saves hold no memory
    section and restore nothing; a target seq_rm + seq_add (its K-shift pending while the draft decodes: the draft
    applies nothing); the draft's clear, which resets the target's cells (llama_kv_cache::clear is not guarded)."""
    t = r.other
    n_seq = r.n_seq_max
    hist = {0: tok(9)}
    t.decode_seq(0, hist[0])
    if n_seq > 1:
        hist[1] = tok(5)
        t.decode_seq(1, hist[1])
    for _ in range(2):
        r.decode_seq(0, tok(3))  # draft positions after the target's: the same ones every time
    r.decode_seq(0, tok(1))
    if n_seq > 1:
        r.decode(tok(2), [r.pos_max(0) + 1, r.pos_max(1) + 1], [[0], [1]], [1, 1])
    t.decode_seq(0, tok(2))
    r.seq_rm(0, 2, 4)
    r.seq_cp(0, 1, -1, -1)
    r.seq_add(0, 4, -1, 3)
    r.seq_keep(0)
    r.seq_rm(5, -1, -1)
    t.save_all(hist)
    r.save_all({0: []})
    t.seq_rm(0, 3, 6)
    t.seq_add(0, 6, -1, -3)
    r.decode_seq(0, tok(2))  # the target's shift is pending: the draft's update applies nothing
    t.decode_seq(0, tok(1))  # the target applies it
    r.decode_seq(0, tok(1))
    r.load_seq(r.latest("seq", 0), 0)
    r.set_state_data(r.latest("state"))
    r.save_state_data()
    t.save_state_data()
    r.clear()  # resets the shared cells: the target's
    t.save_state_data()
    t.set_state_data(t.latest("state"))
    r.decode_seq(0, tok(2))


def s_dflash(r, tok):
    """DFlash's two batch kinds on its plain KV cache: KV-injection batches (target features, no token ids: K/V
    stored, no mask) and noise blocks of tokens (non-causal attention over the cache), each block removed again
    (seq_rm) before the next injection, as the speculative loop does; a second sequence, artefacts, restores."""
    n_seq = r.n_seq_max
    width = r.hp["n_embd_inp_enc"]
    hist: dict[int, list[int]] = {}
    for s in range(n_seq):
        n = 6 - s
        r.decode([0] * n, list(range(n)), [[s]] * n, embd=width)
        hist[s] = tok(n)  # what a session stores with the positions the features stand for
    for _ in range(2):
        p0 = r.pos_max(0) + 1
        r.decode_seq(0, tok(4))  # the noise block
        r.seq_rm(0, p0, -1)
        n = 3
        r.decode([0] * n, list(range(p0, p0 + n)), [[0]] * n, embd=width)
        hist[0] += tok(n)
    if n_seq > 1:
        p0, p1 = r.pos_max(0) + 1, r.pos_max(1) + 1
        r.decode(tok(4), [p0, p1, p0 + 1, p1 + 1], [[0], [1], [0], [1]], [0, 0, 1, 1])
        r.seq_rm(0, p0, -1)
        r.seq_rm(1, p1, -1)
    r.save_all(hist)
    r.seq_rm(0, -1, -1)
    r.load_seq(r.latest("seq", 0), 0)
    r.clear()
    r.set_state_data(r.latest("state"))
    r.decode_seq(0, tok(2))
    r.save_state_data()


def s_dsv4_single(r, tok):
    # deepseek4 (llama_kv_cache_dsv4), one sequence: 140 tokens in ubatches of 64 complete 35 CSA / indexer rows and
    # one HCA row (ratio 128); then single tokens, every save kind (PARTIAL_ONLY: the raw SWA section and the
    # compressor states only), restores, and the sequence operations DSV4 refuses or does differently
    hist = {0: tok(140)}
    r.decode_seq(0, hist[0][:100])
    r.decode_seq(0, hist[0][100:])
    for _ in range(3):
        t = tok(1)
        hist[0] += t
        r.decode_seq(0, t)
    r.save_all(hist, seq_data_flags=(0, FLAGS_PARTIAL_ONLY))
    r.seq_rm(0, 3, 7)  # a bounded range: refused (false)
    r.seq_rm(0, 200, -1)  # past the end: true, nothing removed
    r.seq_rm(0, 130, -1)  # inside the sequence without rollback room: false
    r.clear()
    r.load_session(r.latest("session"))
    r.clear()
    r.set_state_data(r.latest("state"))
    r.seq_rm(0, -1, -1)
    r.load_seq(r.latest("seq", 0), 0)
    t = tok(1)
    hist[0] += t
    r.decode_seq(0, t)
    r.save_all(hist)


def s_dsv4_multiseq(r, tok):
    # two sequences, a stream each (DSV4 never unifies): separate and joint decodes, seq_cp of a whole sequence
    # (the compressor states copied at the next update), seq_keep, restores into the other sequence
    hist = {0: tok(21), 1: tok(9)}
    r.decode_seq(0, hist[0])
    r.decode_seq(1, hist[1])
    t0, t1 = tok(1), tok(1)
    hist[0] += t0
    hist[1] += t1
    r.decode(t0 + t1, [r.pos_max(0) + 1, r.pos_max(1) + 1], [[0], [1]], [1, 1])
    r.save_all(hist, seq_data_flags=(0, FLAGS_PARTIAL_ONLY))
    r.seq_cp(0, 1, -1, -1)
    hist[1] = list(hist[0])
    t = tok(2)
    hist[1] += t
    r.decode_seq(1, t)
    r.save_state_data()
    r.save_seq_data(1)
    r.seq_rm(1, -1, -1)
    r.load_seq(r.latest("seq", 0), 1)
    r.seq_keep(1)
    r.save_seq(1, hist[0])
    r.save_seq_data(1)


def s_dsv4_rollback(r, tok):
    # n_rs_seq 2: removing the last 1..2 positions arms a rollback of the compressor state (once); a sequence save
    # writes the snapshot plane; the next decode of the sequence consumes it
    hist = {0: tok(14)}
    r.decode_seq(0, hist[0])
    r.seq_rm(0, 13, -1)  # the last token: rollback 1
    r.seq_rm(0, 12, -1)  # a second pending rollback: false
    r.save_all({0: hist[0][:13]})
    t = tok(3)
    hist[0] = hist[0][:13] + t
    r.decode_seq(0, t)
    r.save_seq_data(0)


def s_dsv4_mtp(r, tok):
    # the MTP draft context of deepseek4: a llama_kv_cache_iswa over the MTP block only
    hist = {0: tok(10)}
    r.decode_seq(0, hist[0])
    r.seq_cp(0, 1, -1, -1)
    hist[1] = hist[0] + tok(2)
    r.decode_seq(1, hist[1][10:])
    r.save_all(hist, seq_data_flags=(0, FLAGS_PARTIAL_ONLY))


def s_init_refused(r, tok):
    # nothing to do: the context was refused
    pass


CASES: list[Case] = [
    # ---- llama: plain attention KV cache
    Case(
        "llama-f16-single-seq",
        "llama",
        "One sequence, f16 K/V, flash attention off (V transposed); all four artefact kinds, "
        "then restored from the session file, the raw state and the sequence file.",
        ["single-seq", "v_trans", "session", "seq-file", "state-data", "seq-data", "state-load", "seq-restore"],
        s_single_seq,
    ),
    Case(
        "llama-f16-fa-single-seq",
        "llama",
        "The llama-f16-single-seq operations with flash attention on (V stored row-wise).",
        ["single-seq", "flash-attn", "session", "seq-file", "state-data", "seq-data", "state-load", "seq-restore"],
        s_single_seq,
        flash_attn=True,
    ),
    Case(
        "llama-f32-multi-seq",
        "llama",
        "f32 K/V, unified cache, three sequences in one interleaved batch sharing the first token; "
        "seq 1 restored into seq 3.",
        ["multi-seq", "unified", "f32", "shared-cells", "seq-restore"],
        s_multi_seq,
        n_seq_max=4,
        type_k="f32",
        type_v="f32",
    ),
    Case(
        "llama-f16-multistream",
        "llama",
        "kv_unified false with 3 sequences (3 streams); a cross-stream seq_cp and a sequence file "
        "restored into another stream.",
        ["multi-seq", "multi-stream", "seq-cp", "seq-restore", "seq-keep"],
        s_multistream,
        n_seq_max=3,
        kv_unified=False,
    ),
    Case(
        "llama-q8_0-fa-multistream",
        "llama",
        "q8_0 K and V with flash attention, kv_unified false with 3 streams.",
        ["multi-seq", "multi-stream", "q8_0", "flash-attn", "seq-cp", "seq-restore"],
        s_multistream,
        n_seq_max=3,
        kv_unified=False,
        flash_attn=True,
        type_k="q8_0",
        type_v="q8_0",
    ),
    Case(
        "llama-q4_0-fa-single-seq",
        "llama",
        "q4_0 K and V with flash attention, one sequence.",
        ["single-seq", "q4_0", "flash-attn", "state-load", "seq-restore"],
        s_single_seq,
        flash_attn=True,
        type_k="q4_0",
        type_v="q4_0",
    ),
    Case(
        "llama-q8_0-k-f16-v",
        "llama",
        "q8_0 K with f16 V and flash attention off (a quantized K needs no flash attention; V transposed).",
        ["single-seq", "q8_0", "v_trans", "mixed-types"],
        s_single_seq,
        type_k="q8_0",
        type_v="f16",
    ),
    Case(
        "llama-q8_0-v-nofa-refused",
        "llama",
        "A q8_0 V cache with flash attention off: llama_init_from_model refuses the context.",
        ["init-refused"],
        s_init_refused,
        type_k="q8_0",
        type_v="q8_0",
    ),
    Case(
        "qwen3-q8_0-k-fa-head16-refused",
        "qwen3",
        "A q8_0 K cache with flash attention on, on a model whose head size (16) is not a multiple of q8_0's block "
        "(32): llama_init_from_model refuses the context (only an `init` op). With flash attention off llama.cpp "
        "aborts creating it instead (GGML_ASSERT in ggml_view); kvref refuses both.",
        ["init-refused"],
        s_init_refused,
        n_seq_max=1,
        flash_attn=True,
        type_k="q8_0",
        type_v="f16",
    ),
    Case(
        "llama-shared-prefix",
        "llama",
        "A prefix decoded once and shared by seq_cp (whole and partial range), three continuations, "
        "then partial removals.",
        ["multi-seq", "seq-cp", "shared-cells", "seq-rm"],
        s_shared_prefix,
        n_seq_max=3,
    ),
    Case(
        "llama-seq-rm-ranges",
        "llama",
        "seq_rm with a middle hole, a tail, an open start, every sequence (-1), an empty range and everything.",
        ["seq-rm", "multi-seq"],
        s_seq_rm_ranges,
        n_seq_max=2,
    ),
    Case(
        "llama-context-shift",
        "llama",
        "Context shift: seq_rm of a middle range and seq_add -8 on the tail, saved while the "
        "K-shift is pending and after the decode that applies it; then a shift below zero.",
        ["seq-add", "k-shift", "seq-rm"],
        s_context_shift,
    ),
    Case(
        "llama-seq-div",
        "llama",
        "seq_div on a tail (d=2) and on a head range of another sequence (d=3), then a decode.",
        ["seq-div", "k-shift", "multi-seq"],
        s_seq_div,
        n_seq_max=2,
    ),
    Case(
        "llama-seq-keep",
        "llama",
        "Three sequences sharing a 3-token prefix; seq_keep(1) drops the others.",
        ["seq-keep", "shared-cells", "multi-seq"],
        s_seq_keep,
        n_seq_max=3,
    ),
    Case(
        "llama-cache-full",
        "llama",
        "A 256-cell cache filled to 250: a 10-token batch is refused (llama_decode returns 1), "
        "6 tokens fit; invalid batches (bad token, bad seq id, gap or decrease in positions) "
        "return -1.",
        ["cache-full", "decode-refused", "invalid-batch"],
        s_cache_full,
        n_ubatch=256,
    ),
    Case("llama-clear", "llama", "llama_memory_clear with data and without, then a fresh decode.", ["clear"], s_clear),
    Case(
        "llama-restore-failures",
        "llama",
        "Session and sequence files refused for too small a token capacity; a raw sequence blob "
        "restored into another sequence id.",
        ["restore-refused", "seq-restore", "seq-data"],
        s_restore_failures,
        n_seq_max=2,
    ),
    # ---- gemma2: interleaved SWA (layer 0 SWA with n_swa 4, layer 1 full)
    Case(
        "gemma2-swa-overflow",
        "gemma2",
        "iSWA cache, window 4 overflowed by 13 tokens; sequence artefacts keep only the unmasked "
        "SWA cells; PARTIAL_ONLY blob holds the SWA cache alone.",
        ["iswa", "swa-masked", "partial-only", "seq-restore"],
        s_swa_overflow,
    ),
    Case(
        "gemma2-swa-full",
        "gemma2",
        "The gemma2-swa-overflow operations with swa_full (SWA cache as large as the base cache).",
        ["iswa", "swa-full", "partial-only", "seq-restore"],
        s_swa_overflow,
        swa_full=True,
    ),
    Case(
        "gemma2-swa-multiseq-fa",
        "gemma2",
        "iSWA with flash attention and two sequences sharing a prefix by seq_cp, then removals.",
        ["iswa", "flash-attn", "multi-seq", "seq-cp", "seq-rm", "partial-only"],
        s_swa_multiseq,
        n_seq_max=2,
        flash_attn=True,
    ),
    Case(
        "gemma2-swa-wraparound",
        "gemma2",
        "300 tokens in 32-token ubatches through a 256-cell SWA cache (base cache 512): masked SWA cells are reused.",
        ["iswa", "swa-masked", "cell-reuse"],
        s_swa_wraparound,
        n_ctx=512,
        n_batch=32,
        n_ubatch=32,
    ),
    # ---- mamba: recurrent memory
    Case(
        "mamba-seq-cp-rm",
        "mamba",
        "Recurrent memory with 4 sequence slots: seq_cp, partial seq_rm refused (returns false), "
        "whole removal, a sequence file restored into another slot, seq_keep, raw restore.",
        ["recurrent", "seq-cp", "seq-rm-refused", "seq-restore", "seq-keep", "state-load"],
        s_recurrent,
        n_seq_max=4,
    ),
    Case(
        "mamba-multi-seq-batch",
        "mamba",
        "A batch coupling sequences (tokens in several sequences) is refused with 1; a copied "
        "prefix then three sequences advanced in one batch; seq_keep, seq_div, seq_add on "
        "recurrent cells.",
        ["recurrent", "multi-seq", "decode-refused", "seq-cp", "seq-keep", "seq-div", "seq-add"],
        s_recurrent_multi_batch,
        n_seq_max=3,
    ),
    # ---- jamba: hybrid (attention + recurrent)
    Case(
        "jamba-hybrid",
        "jamba",
        "Hybrid memory (1 attention layer, 2 Mamba layers): seq_cp, refused tail removal, "
        "sequence file and blob restored into other sequences; PARTIAL_ONLY blob holds the "
        "recurrent part alone.",
        ["hybrid", "seq-cp", "seq-rm-refused", "seq-restore", "partial-only"],
        s_hybrid,
        n_seq_max=3,
    ),
    # ---- qwen2vl: M-RoPE, cells carry ext (x, y, tok)
    # ---- more architectures, one compact case each (s_arch)
    Case(
        "gemma3-iswa",
        "gemma3",
        "gemma3: 6 layers, default SWA pattern 6 (5 SWA + 1 full, window 4), head dim 16 != "
        "n_embd / n_head, rope base 1e6 / SWA base 1e4; two sequences, partial seq_rm, a sequence "
        "file restored into a third sequence.",
        ["arch", "iswa", "swa-masked", "seq-cp", "seq-rm", "seq-restore", "partial-only"],
        s_arch,
        n_seq_max=3,
    ),
    Case(
        "qwen3-gqa",
        "qwen3",
        "qwen3: GQA 4:1 with head dim 16 != n_embd / n_head; two sequences, partial seq_rm, a "
        "sequence file restored into a third sequence.",
        ["arch", "seq-cp", "seq-rm", "seq-restore"],
        s_arch,
        n_seq_max=3,
    ),
    Case(
        "llama4-chunked",
        "llama4",
        "llama4: chunked attention (swa_type chunked, chunk fixed at 8192) on 3 of 4 layers; "
        "flash attention; two sequences, partial seq_rm, a sequence file restored into a third "
        "sequence.",
        ["arch", "iswa", "flash-attn", "seq-cp", "seq-rm", "seq-restore", "partial-only"],
        s_arch,
        n_seq_max=3,
        flash_attn=True,
    ),
    Case(
        "mamba2-groups",
        "mamba2",
        "mamba2 with n_group 2 (n_embd_r 288, n_embd_s 512): seq_cp, tail seq_rm refused, a "
        "sequence file restored into a third slot.",
        ["arch", "recurrent", "seq-cp", "seq-rm-refused", "seq-restore"],
        s_arch,
        n_seq_max=3,
    ),
    Case(
        "rwkv6-recurrent",
        "rwkv6",
        "rwkv6: token-shift and wkv state (n_embd_r 64, n_embd_s 512): seq_cp, tail seq_rm "
        "refused, a sequence file restored into a third slot.",
        ["arch", "recurrent", "seq-cp", "seq-rm-refused", "seq-restore"],
        s_arch,
        n_seq_max=3,
    ),
    Case(
        "lfm2-hybrid",
        "lfm2",
        "lfm2: hybrid of short-conv (n_embd_r 64, n_embd_s 0) and attention layers alternating; "
        "seq_cp, tail seq_rm refused, a sequence file restored into a third sequence; "
        "PARTIAL_ONLY blob holds the recurrent part.",
        ["arch", "hybrid", "seq-cp", "seq-rm-refused", "seq-restore", "partial-only"],
        s_arch,
        n_seq_max=3,
    ),
    Case(
        "lfm2-swa-hybrid-iswa",
        "lfm2-swa",
        "lfm2 with a window of 4 on every attention layer: llama_memory_hybrid_iswa whose base "
        "cache has no layer (sections: base with n_layer 0, SWA, recurrent; PARTIAL_ONLY: SWA "
        "and recurrent); seq_cp, tail seq_rm refused, a sequence file restored into a third "
        "sequence.",
        [
            "arch",
            "hybrid",
            "hybrid-iswa",
            "iswa",
            "swa-masked",
            "seq-cp",
            "seq-rm-refused",
            "seq-restore",
            "partial-only",
        ],
        s_arch,
        n_seq_max=3,
    ),
    # ---- llama_memory_hybrid_idx: attention + recurrent + indexer key cache
    Case(
        "qwen4exp-hybrid-idx",
        "qwen4exp",
        "qwen4exp with a QSA indexer (1 GDN layer, 1 attention layer with ratio-4 blocks): "
        "llama_memory_hybrid_idx (sections: attention, recurrent, indexer; PARTIAL_ONLY: recurrent); "
        "seq_cp, tail seq_rm refused, a sequence file restored into a third sequence; the QSA "
        "block inputs and the indexer's row indices captured per ubatch.",
        ["arch", "hybrid", "hybrid-idx", "mrope", "seq-cp", "seq-rm-refused", "seq-restore", "partial-only"],
        s_arch,
        n_seq_max=3,
    ),
    Case(
        "qwen4exp-hybrid-idx-streams",
        "qwen4exp",
        "qwen4exp's hybrid_idx memory with one stream per sequence (kv_unified off): the indexer "
        "cache follows the attention cache's streams; QSA inputs per stream.",
        ["arch", "hybrid", "hybrid-idx", "mrope", "multistream", "seq-cp", "seq-restore", "partial-only"],
        s_arch,
        n_seq_max=3,
        kv_unified=False,
    ),
    Case(
        "qwen4exp-qsa-blocks",
        "qwen4exp",
        "qwen4exp's QSA inputs as blocks of 4 fill over ubatches of 4 tokens and 4 sequences (a copy, a prompt "
        "shared by two sequences, an interleaved batch); tail seq_rm refused, a sequence file restored.",
        [
            "arch",
            "hybrid",
            "hybrid-idx",
            "mrope",
            "multi-seq",
            "seq-cp",
            "seq-rm-refused",
            "seq-restore",
            "partial-only",
            "multi-ubatch",
        ],
        s_qsa,
        n_seq_max=4,
        n_ubatch=4,
    ),
    Case(
        "glm5-next-hybrid-idx",
        "glm5-next",
        "glm5-next (1 KDA layer, 1 nope-MLA layer with a k-pool indexer, a NextN block the trunk context leaves "
        "out): llama_memory_hybrid_idx with a K-only MLA cache and a key | gate | pooled indexer cache; seq_cp, "
        "tail seq_rm refused, a sequence file restored into a third sequence; the k-pool inputs per ubatch.",
        ["arch", "hybrid", "hybrid-idx", "mla", "seq-cp", "seq-rm-refused", "seq-restore", "partial-only"],
        s_arch,
        n_seq_max=3,
    ),
    Case(
        "glm5-next-hybrid-idx-rs-rollback",
        "glm5-next",
        "glm5-next's hybrid_idx memory with n_rs_seq 2 (the recurrent part keeps rollback snapshots, the equal "
        "split keeps each sequence's last 3 tokens together) over ubatches of 4: the k-pool inputs as pools fill.",
        ["arch", "hybrid", "hybrid-idx", "rs-rollback", "seq-cp", "seq-rm-refused", "seq-restore", "partial-only"],
        s_arch,
        n_seq_max=3,
        n_ubatch=4,
        n_rs_seq=2,
    ),
    Case(
        "glm5-next-mtp-refused",
        "glm5-next",
        "glm5-next's MTP draft context: llama.cpp builds its memory (a hybrid_idx over the NextN block alone), then "
        "llama_init_from_model fails: the NextN graph is not implemented in 0.3.36.",
        ["init-refused", "mtp"],
        s_init_refused,
        ctx_type="mtp",
    ),
    # ---- non-causal decodes (llama_set_causal_attn), ALiBi
    Case(
        "llama-non-causal",
        "llama",
        "llama_set_causal_attn(false) between causal decodes (the image path of vision models): an 'image' batch "
        "whose tokens attend each other both ways, two sequences interleaved in one non-causal batch, a K-shift "
        "applied by a non-causal decode, then causal again; every KQ mask captured.",
        ["non-causal", "multi-seq", "seq-cp", "seq-rm", "seq-add", "k-shift"],
        s_non_causal,
        n_seq_max=2,
    ),
    Case(
        "gemma2-non-causal-swa",
        "gemma2",
        "The llama-non-causal operations on gemma2's iSWA cache (window 4, non_causal_type ALL): the base mask "
        "attends the whole sequence both ways, the SWA mask keeps the window behind a token (p1 - p0 < 4) and "
        "everything after it.",
        ["non-causal", "iswa", "swa-masked", "multi-seq", "seq-cp", "seq-rm", "seq-add", "k-shift"],
        s_non_causal,
        n_seq_max=2,
    ),
    Case(
        "gemma4-non-causal-swa-only",
        "gemma4",
        "The llama-non-causal operations on gemma4 (non_causal_type SWA_ONLY, window 4, 3 SWA layers + 1 full): "
        "with set_causal false only the SWA cache's mask is bidirectional, the base cache's stays causal.",
        ["non-causal", "iswa", "swa-masked", "multi-seq", "seq-cp", "seq-rm", "seq-add", "k-shift"],
        s_non_causal,
        n_seq_max=2,
    ),
    Case(
        "bloom-alibi",
        "bloom",
        "bloom (ALiBi: f_max_alibi_bias 8, no rope): the f32 KQ mask holds -|p0 - p1| for attended cells; two "
        "sequences, partial seq_rm, a sequence file restored into a third sequence.",
        ["arch", "alibi", "seq-cp", "seq-rm", "seq-restore"],
        s_arch,
        n_seq_max=3,
    ),
    Case(
        "bloom-alibi-fa-non-causal",
        "bloom",
        "The llama-non-causal operations on bloom with flash attention: the f16 ALiBi mask holds -|p0 - p1| "
        "for cells before and after a token.",
        ["alibi", "flash-attn", "non-causal", "multi-seq", "seq-cp", "seq-rm", "seq-add"],
        s_non_causal,
        n_seq_max=2,
        flash_attn=True,
    ),
    Case(
        "t5-pos-bucket",
        "t5",
        "T5 encoder-decoder: llama_encode fills the bidirectional pos_bucket_enc (32 buckets, distances past "
        "max_exact), the decoder's KV cache set_input_pos_bucket (one-directional, key = cell position); a tail "
        "removal and more tokens into the freed cells.",
        ["arch", "encoder-decoder", "pos-bucket", "seq-rm"],
        s_t5,
    ),
    # ---- attention rotation (head size a multiple of 64, quantized cache) and the quantized K-shift
    Case(
        "llama-h64-q8_0-rot-kshift",
        "llama-h64",
        "Head size 64 with q8_0 K and V (flash attention): llama.cpp rotates both (attn_rot_k / attn_rot_v, 64-wide "
        "Walsh-Hadamard). Two streams; a context shift (seq_rm + seq_add -8) and a seq_div, each saved pending and "
        "after the decode that applies it: the shift dequantizes, unrotates, ropes, rotates and requantizes K. "
        "rows.npz holds every decode's K/V rows before and after the rotation.",
        ["q8_0", "flash-attn", "attn-rot", "k-shift", "quantized-k-shift", "multi-stream", "seq-div"],
        s_rot_kshift,
        n_seq_max=2,
        kv_unified=False,
        flash_attn=True,
        type_k="q8_0",
        type_v="q8_0",
        capture_rows=True,
    ),
    Case(
        "qwen3-h128-q4_0-k-rot-kshift",
        "qwen3-h128",
        "Head size 128 (rope neox) with a q4_0 K and an f16 V (flash attention off): K rotated 128 wide, V not. "
        "The same context shift and seq_div on the quantized K.",
        ["q4_0", "v_trans", "attn-rot", "k-shift", "quantized-k-shift", "seq-div"],
        s_rot_kshift,
        type_k="q4_0",
        type_v="f16",
        capture_rows=True,
    ),
    # ---- minimax-m3: llama_kv_cache_msa (base KV cache + MSA indexer key cache)
    Case(
        "minimax-m3-msa",
        "minimax-m3",
        "minimax-m3 (llama_kv_cache_msa: base KV cache over 3 layers, indexer key cache of 8-wide keys over the 2 "
        "sparse layers), flash attention off: the model runs dense attention (no MSA inputs, the indexer keys stay "
        "zero); one sequence, seq_rm + seq_add K-shift, sequence and whole-state restores; state = base then "
        "indexer section.",
        ["arch", "msa", "v_trans", "k-shift", "seq-rm", "seq-restore", "state-load"],
        s_msa,
    ),
    Case(
        "minimax-m3-msa-fa",
        "minimax-m3",
        "The minimax-m3-msa operations with flash attention on and one sequence: the graph runs MSA, so every "
        "decode also reads the indexer cache's row indices (k_idxs_idx) and llm_graph_input_msa's pos -> cell "
        "maps, position mask, local-force bias and cell -> block map, all captured.",
        ["arch", "msa", "flash-attn", "k-shift", "seq-rm", "seq-restore", "state-load"],
        s_msa,
        flash_attn=True,
    ),
    Case(
        "minimax-m3-msa-fa-streams",
        "minimax-m3",
        "The minimax-m3-msa operations with flash attention on, two sequences in two streams (kv_unified false): "
        "MSA runs per stream; a seq_cp across streams, a batch per stream, a sequence file restored into the "
        "other stream.",
        ["arch", "msa", "flash-attn", "multi-stream", "seq-cp", "k-shift", "seq-rm", "seq-restore"],
        s_msa,
        n_seq_max=2,
        kv_unified=False,
        flash_attn=True,
    ),
    Case(
        "minimax-m3-msa-fa-unified",
        "minimax-m3",
        "The minimax-m3-msa operations with flash attention on, two sequences in one unified cache: the graph falls "
        "back to dense attention (no MSA inputs), both caches still placed alike.",
        ["arch", "msa", "flash-attn", "multi-seq", "seq-cp", "k-shift", "seq-rm", "seq-restore"],
        s_msa,
        n_seq_max=2,
        flash_attn=True,
    ),
    # ---- gemma4-assistant: a draft context over gemma4's cache (ctx_other)
    Case(
        "gemma4-assistant-ctx-other",
        "gemma4-assistant",
        "gemma4-assistant (2 NextN layers: SWA, full) over a gemma4-tiny context (ctx_other): llama.cpp builds a "
        "llama_kv_cache_iswa whose layers are the target's last SWA / full layers and whose cells are the "
        "target's; draft decodes place nothing and their KQ masks read the target's cells; draft sequence ops do "
        "nothing; draft saves hold no memory section; the draft's clear empties the target's cells.",
        ["arch", "ctx-other", "iswa", "seq-rm", "k-shift", "clear", "state-load", "seq-restore"],
        s_assistant,
        other_model="gemma4",
    ),
    Case(
        "gemma4-assistant-ctx-other-fa-ms",
        "gemma4-assistant",
        "The gemma4-assistant-ctx-other operations with flash attention on and two sequences in two streams (both "
        "contexts kv_unified false): a draft batch over both streams.",
        ["arch", "ctx-other", "iswa", "flash-attn", "multi-stream", "seq-rm", "k-shift", "clear"],
        s_assistant,
        n_seq_max=2,
        kv_unified=False,
        flash_attn=True,
        other_model="gemma4",
    ),
    # ---- dflash: a block-diffusion draft (default memory: a plain KV cache without hyper-connections)
    Case(
        "dflash-kv-injection",
        "dflash",
        "dflash (own token_embd and output, no ctx_other; non-causal; plain KV cache): KV-injection batches of "
        "target features (embd batches: K/V stored, no KQ mask) and noise blocks of tokens removed again, two "
        "sequences, artefacts, sequence and whole-state restores.",
        ["arch", "dflash", "embd-batch", "non-causal", "multi-seq", "seq-rm", "seq-restore", "state-load"],
        s_dflash,
        n_seq_max=2,
    ),
    Case(
        "qwen2vl-mrope",
        "qwen2vl",
        "M-RoPE KV cache (n_pos_per_embd 4): every cell carries the ext record; a sequence file "
        "restored into another sequence.",
        ["mrope", "cell-ext", "multi-seq", "seq-restore"],
        s_mrope,
        n_seq_max=2,
    ),
    # ---- glm-dsa: llama_kv_cache_dsa (MLA cache + lightning-indexer key cache), and its MTP draft context
    Case(
        "glm-dsa-single-seq",
        "glm-dsa",
        "DSA memory: the MLA cache (K only, trunk layers 0-1) and the indexer key cache (layer 0, the only full "
        "indexer) placed together; whole, session and sequence saves (MLA then indexer section), restores.",
        ["dsa", "mla", "indexer", "seq-restore", "state-load"],
        s_single_seq,
    ),
    Case(
        "glm-dsa-multi-seq",
        "glm-dsa",
        "DSA memory with three sequences in one interleaved batch, a shared token; a sequence file restored into "
        "another sequence of both caches.",
        ["dsa", "multi-seq", "seq-restore"],
        s_multi_seq,
        n_seq_max=4,
    ),
    Case(
        "glm-dsa-context-shift",
        "glm-dsa",
        "DSA memory: seq_rm then seq_add (a context shift); both caches K-shift on the next decode (the indexer "
        "cache with NEOX over its last n_rot dims).",
        ["dsa", "k-shift", "seq-add"],
        s_context_shift,
    ),
    Case(
        "glm-dsa-multistream",
        "glm-dsa",
        "DSA memory with one stream per sequence (kv_unified false): a whole-sequence seq_cp across streams is "
        "queued in both caches; a sequence file restored into another stream.",
        ["dsa", "multistream", "seq-cp", "seq-restore"],
        s_multistream,
        n_seq_max=3,
        kv_unified=False,
    ),
    Case(
        "glm-dsa-bf16",
        "glm-dsa",
        "DSA memory with bf16 K and V types (an MLA model needs K and V of one type; its 48-wide heads take no "
        "32-element quantization block): three sequences, saves and restores.",
        ["dsa", "bf16", "multi-seq", "seq-restore"],
        s_multi_seq,
        n_seq_max=4,
        type_k="bf16",
        type_v="bf16",
    ),
    Case(
        "glm-dsa-mixed-kv-types-refused",
        "glm-dsa",
        "An MLA model with a q8_0 K and an f16 V cache: llama_init_from_model refuses the context (different K and "
        "V cache types).",
        ["dsa", "init-refused"],
        s_init_refused,
        type_k="q8_0",
    ),
    # an MTP graph reads the hidden state of the target model (mtp_h_input), which a token batch never sets: the
    # K rows this case's llama.cpp stores come from uninitialised memory and differ from run to run (the cells,
    # positions and sizes do not)
    Case(
        "glm-dsa-mtp",
        "glm-dsa",
        "MTP draft context (ctx_type LLAMA_CONTEXT_TYPE_MTP, load_mtp): a plain K-only KV cache of the NextN "
        "block (layer 2) alone.",
        ["mtp", "mla", "seq-restore", "state-load"],
        s_single_seq,
        ctx_type="mtp",
    ),
    # ---- deepseek32: llama_kv_cache_dsa whose indexer cache keeps every trunk layer
    Case(
        "deepseek32-dsa-multi-seq",
        "deepseek32",
        "DSA memory of deepseek32 (indexer cache over both trunk layers): three sequences in one batch, saves, a "
        "sequence file restored into another sequence.",
        ["dsa", "mla", "indexer", "multi-seq", "seq-restore"],
        s_multi_seq,
        n_seq_max=4,
    ),
    Case(
        "deepseek32-dsa-seq-div",
        "deepseek32",
        "DSA memory of deepseek32: seq_div on both caches (pending K-shift of the MLA and the indexer cache), then "
        "a decode applies it.",
        ["dsa", "seq-div", "k-shift"],
        s_seq_div,
        n_seq_max=2,
    ),
    Case(
        "deepseek32-mtp-multistream",
        "deepseek32",
        "deepseek32's MTP draft context with one stream per sequence: the NextN block's plain K-only cache.",
        ["mtp", "mla", "multistream", "seq-cp", "seq-restore"],
        s_multistream,
        n_seq_max=3,
        kv_unified=False,
        ctx_type="mtp",
    ),
    # ---- hy_v4 with an indexer: llama_kv_cache_dsa (indexer cache over the full-indexer layers, keys not rotated)
    Case(
        "hy_v4-dsa-single-seq",
        "hy_v4",
        "hy_v4's DSA memory (MLA cache over both layers, indexer cache over layer 0): saves and restores of the "
        "whole context and of a sequence.",
        ["dsa", "mla", "indexer", "seq-restore", "state-load"],
        s_single_seq,
    ),
    Case(
        "hy_v4-dsa-context-shift",
        "hy_v4",
        "hy_v4's DSA memory: a context shift K-shifts both caches (the indexer cache as NEOX over its last n_rot "
        "dims).",
        ["dsa", "k-shift", "seq-add"],
        s_context_shift,
    ),
    Case(
        "hy_v4-full-attention-kv",
        "hy_v4-full",
        "hy_v4 without an indexer (indexer_top_k 0, the all-full-attention checkpoints): a plain K-only MLA KV cache "
        "over both layers.",
        ["mla", "seq-restore", "state-load"],
        s_single_seq,
    ),
    # ---- dots3note: llama_kv_cache_dsa_iswa (MLA + indexer caches over the full layers, SWA cache, window 4)
    Case(
        "dots3note-dsa-iswa-overflow",
        "dots3note",
        "DSA-iSWA memory, window 4 overflowed by 13 tokens: MLA, indexer and SWA sections; sequence artefacts keep "
        "only the unmasked SWA cells; the PARTIAL_ONLY blob holds the SWA cache alone.",
        ["dsa-iswa", "dsa", "iswa", "swa-masked", "partial-only", "seq-restore"],
        s_swa_overflow,
    ),
    Case(
        "dots3note-dsa-iswa-multiseq-fa",
        "dots3note",
        "DSA-iSWA with flash attention (an f16 MLA mask; the indexer mask is f16 either way) and two sequences "
        "sharing a prefix by seq_cp, then removals.",
        ["dsa-iswa", "flash-attn", "multi-seq", "seq-cp", "seq-rm", "partial-only"],
        s_swa_multiseq,
        n_seq_max=2,
        flash_attn=True,
    ),
    Case(
        "dots3note-dsa-iswa-shift-swa-full",
        "dots3note",
        "DSA-iSWA with swa_full (the SWA cache as large as the MLA cache, so the memory can shift): a context "
        "shift K-shifts the MLA, indexer and SWA caches.",
        ["dsa-iswa", "swa-full", "k-shift", "seq-add"],
        s_context_shift,
        swa_full=True,
    ),
    Case(
        "deepseek4-dsv4-single-seq",
        "deepseek4",
        "deepseek4 (llama_kv_cache_dsv4: raw SWA cache over 4 layers, CSA + indexer caches over layer 1, HCA over "
        "layer 2, their compressor states), one sequence of 143 tokens: every save kind with PARTIAL_ONLY, the "
        "seq_rm DSV4 refuses, whole and sequence restores.",
        ["arch", "dsv4", "single-seq", "seq-rm-refused", "partial-only", "state-load", "seq-restore", "flash-attn"],
        s_dsv4_single,
        n_ubatch=64,
        flash_attn=True,
    ),
    Case(
        "deepseek4-dsv4-multiseq",
        "deepseek4",
        "deepseek4 with two sequences (a stream each, kv_unified ignored): joint decode, whole-sequence seq_cp with "
        "the compressor states copied at the next update, seq_keep, a sequence file restored into the other one.",
        ["arch", "dsv4", "multi-seq", "seq-cp", "seq-keep", "seq-restore", "partial-only", "flash-attn"],
        s_dsv4_multiseq,
        n_seq_max=2,
        flash_attn=True,
    ),
    Case(
        "deepseek4-dsv4-rollback",
        "deepseek4",
        "deepseek4 with n_rs_seq 2: a tail seq_rm of the last position arms a compressor-state rollback (a second "
        "one is refused), a sequence save writes the rollback plane, the next decode consumes it.",
        ["arch", "dsv4", "rollback", "seq-rm"],
        s_dsv4_rollback,
        n_rs_seq=2,
        flash_attn=True,
    ),
    Case(
        "deepseek4-mtp-iswa",
        "deepseek4",
        "The MTP draft context of deepseek4 (ctx_type mtp): a llama_kv_cache_iswa over the MTP block only (layer "
        "3, window 8; the base cache has no layer); seq_cp, PARTIAL_ONLY saves.",
        ["arch", "mtp", "iswa", "seq-cp", "partial-only"],
        s_dsv4_mtp,
        n_seq_max=2,
        flash_attn=True,
        ctx_type="mtp",
    ),
]


# ------------------------------------------------------------------ crashes

# Configurations where llama.cpp itself dies (a signal or an abort, not an error return): each is run in a child
# process (`--crash-child`), op by op, and conformance/crashes/<id>.json records the ops it got through, the op it
# died in, the signal and what it printed (and, when gdb is installed, the innermost frames). kvref refuses these
# configurations with an error that names the reason (tests/test_kshift_quant.py replays the traces).
CRASH_DIR = HERE / "crashes"


def _crash_kshift_ops(tok) -> list[dict]:
    """16 tokens of seq 0, a context shift (seq_rm [4, 8), seq_add -4), then one token: the decode's memory
    update builds the K-shift graph."""
    toks = tok(17)
    return [
        {"op": "decode", "tokens": toks[:16], "pos": list(range(16)), "seq_ids": [[0]] * 16},
        {"op": "seq_rm", "seq_id": 0, "p0": 4, "p1": 8},
        {"op": "seq_add", "seq_id": 0, "p0": 8, "p1": -1, "delta": -4},
        {"op": "decode", "tokens": toks[16:], "pos": [12], "seq_ids": [[0]]},
    ]


@dataclass
class Crash:
    id: str
    model: str
    description: str
    ops: Callable
    env: dict = field(default_factory=dict)
    context: dict = field(default_factory=dict)  # Case fields overriding the defaults

    def case(self) -> Case:
        return Case(self.id, self.model, self.description, [], s_init_refused, **self.context)


CRASHES: list[Crash] = [
    Crash(
        "llama-q8_0-kshift-head32",
        "llama",
        "A q8_0 K cache on llama-tiny (head size 32: no attention rotation, attn_rot_k 0) with a context shift: the "
        "K-shift graph hands a null rotation tensor to llama_mul_mat_hadamard.",
        _crash_kshift_ops,
        context={"type_k": "q8_0", "type_v": "f16"},
    ),
    Crash(
        "llama-h64-q8_0-kshift-rot-disabled",
        "llama-h64",
        "The same on llama-h64-tiny (head size 64, so the rotation would be on) with LLAMA_ATTN_ROT_DISABLE=1.",
        _crash_kshift_ops,
        env={"LLAMA_ATTN_ROT_DISABLE": "1"},
        context={"type_k": "q8_0", "type_v": "f16"},
    ),
    Crash(
        "stablelm-rot32-q8_0-kshift-partial-rotary",
        "stablelm-rot32",
        "A q8_0 K cache on stablelm-rot32-tiny (head size 64, rotation on, but rope over 32 of the 64 dims): the "
        "shifted view of the K tensor is not contiguous, so ggml-cpu cannot copy the f32 result back into it.",
        _crash_kshift_ops,
        context={"type_k": "q8_0", "type_v": "f16"},
    ),
    Crash(
        "llama-bf16-kshift",
        "llama",
        "A bf16 K cache on llama-tiny with a context shift: bf16 is not quantized, so the K view is roped in place, "
        "and ggml-cpu's rope has f32 and f16 kernels only.",
        _crash_kshift_ops,
        context={"type_k": "bf16", "type_v": "bf16"},
    ),
]


def _crash_child(crash_id: str, model_path: Path, progress: Path) -> None:
    """Run one Crash op by op, appending a JSON line to ``progress`` before each call and after it."""
    import tempfile

    c = next(x for x in CRASHES if x.id == crash_id)
    hp = json.loads((progress.parent / f"{crash_id}.hparams.json").read_text())
    with open(progress, "w") as out, tempfile.TemporaryDirectory() as tmp:
        r = driver.Run(Path(tmp), model_path, hp, c.case().cparams())
        out.write(json.dumps({"observed_context": r.observed_ctx}) + "\n")
        out.write(json.dumps({"done": r.trace[-1]}) + "\n")
        out.flush()
        for op in c.ops(Tokens(c.id)):
            out.write(json.dumps({"calling": op}) + "\n")
            out.flush()
            r.apply(op)
            out.write(json.dumps({"done": r.trace[-1]}) + "\n")
            out.flush()
        r.close()


def _gdb_frames(argv: list[str], env: dict) -> list[str] | None:
    """The function names of the innermost frames when the child dies under gdb (None without gdb)."""
    import re
    import subprocess

    gdb = shutil.which("gdb")
    if gdb is None:
        return None
    cmd = [gdb, "-q", "-batch", "-ex", "run", "-ex", "bt 8", "--args", *argv]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    frames = []
    for line in res.stdout.splitlines():
        m = re.match(r"^#\d+\s+(?:0x[0-9a-f]+ in )?(.+?) \(", line)
        if m:
            frames.append(m.group(1))
    return frames


def record_crash(c: Crash, m: tinymodels.TinyModel, vers: dict) -> dict:
    """Run ``c`` in a child process and write conformance/crashes/<id>.json."""
    import re
    import signal
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        progress = Path(tmp) / "progress.jsonl"
        (Path(tmp) / f"{c.id}.hparams.json").write_text(json.dumps(m.hparams))
        argv = [sys.executable, str(Path(__file__).resolve()), "--crash-child", c.id, str(m.path), str(progress)]
        env = {**os.environ, **c.env}
        res = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
        lines = [json.loads(x) for x in progress.read_text().splitlines() if x.strip()]
        frames = _gdb_frames(argv, env)
    done = [x["done"] for x in lines if "done" in x]
    calling = [x["calling"] for x in lines if "calling" in x]
    crashed = calling[-1] if len(calling) >= len(done) and calling else None
    rc = res.returncode
    doc = {
        "id": c.id,
        "description": c.description,
        "producer": vers,
        "model": {
            "file": m.path.name,
            "sha256": m.sha256,
            "committed": m.committed,
            "path": f"models/{m.path.name}" if m.committed else None,
            "hparams": m.hparams,
        },
        "context": c.case().cparams(),
        "env": c.env,
        "observed_context": next((x["observed_context"] for x in lines if "observed_context" in x), None),
        "trace": done,
        "crashed_op": crashed,
        "crashed_op_index": len(done) if crashed is not None else None,
        "returncode": rc,
        "signal": signal.Signals(-rc).name if rc < 0 else None,
        # GGML_ABORT / GGML_ASSERT print "<file>:<line>: <message>" (the build path cut to the llama.cpp tree)
        "message": next(
            (
                re.sub(r"^.*?vendor/llama\.cpp/", "", x)
                for x in res.stderr.splitlines()
                if re.search(r"\.(c|cpp|h):\d+: ", x)
            ),
            None,
        ),
        "stderr": [
            re.sub(r"^.*?vendor/llama\.cpp/", "", x)
            for x in res.stderr.splitlines()
            if re.search(r"\.(c|cpp|h):\d+: |GGML_ASSERT", x)
        ],
        "gdb_frames": frames,
    }
    CRASH_DIR.mkdir(exist_ok=True)
    (CRASH_DIR / f"{c.id}.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


# ------------------------------------------------------------------ running


def versions() -> dict:
    from importlib.metadata import version

    import llama_cpp

    pr = driver.PRODUCER
    return {
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_commit": pr["llama_cpp_commit"],
        "llama_cpp_commit_date": pr["llama_cpp_commit_date"],
        "gguf": version("gguf"),
        "session_version": pr["session_version"],
        "seq_version": pr["seq_version"],
        "cell_ext_size": pr["cell_ext_size"],
        "output_block": pr["output_block"],
        "seq_data_prefix": pr["seq_data_prefix"],
        "swa_masked_in_seq": pr["swa_masked_in_seq"],
        "n_stream_field": pr.get("n_stream_field", True),
    }


def build_models(model_dir: Path, copy: bool = True) -> dict[str, tinymodels.TinyModel]:
    model_dir.mkdir(parents=True, exist_ok=True)
    committed = HERE / "models"
    committed.mkdir(exist_ok=True)
    models = {}
    for name, build in tinymodels.BUILDERS.items():
        m = build(model_dir)
        m.committed = name in COMMITTED_MODELS
        if m.committed and copy:
            assert m.size <= COMMIT_MODEL_MAX, (name, m.size)
            shutil.copyfile(m.path, committed / m.path.name)
        elif copy and (committed / m.path.name).exists():
            (committed / m.path.name).unlink()
        models[name] = m
    return models


def _pad(x: int, n: int) -> int:
    return (x + n - 1) // n * n


def memory_block(case: Case, hp: dict, octx: dict | None) -> dict:
    """The memory llama.cpp builds for this case, with the cache sizes it reported."""
    kind = driver.memory_kind(hp, case.ctx_type)
    if kind == "dsv4":
        # llama_kv_cache_dsv4: every part keeps a stream per sequence; the raw iSWA's sizes (the compressed caches
        # and compressor states follow from them, kvref.memory.kv_cache_dsv4)
        log = (octx or {}).get("memory_log", {})
        return {
            "type": kind, "v_trans": not case.flash_attn, "n_stream": case.n_seq_max, "cell_ext": False,
            "kv_size": log.get("kv_size_base"), "kv_size_swa": log.get("kv_size_swa"), "rs_size": None,
        }  # fmt: skip
    mem = {
        "type": kind,
        "v_trans": (not case.flash_attn) if kind != "recurrent" else None,
        "n_stream": 1 if case.kv_unified or not driver.PRODUCER.get("n_stream_field", True) else case.n_seq_max,
        "cell_ext": bool(hp["has_cell_ext"]) and driver.PRODUCER["cell_ext_size"] > 0,
        "kv_size": None,
        "kv_size_swa": None,
        "rs_size": None,
    }
    if octx is None:
        return mem
    if octx["n_ctx_seq"] is None:
        # older bindings cannot ask: take the sizes llama.cpp logged
        caches = octx["memory_log"]["caches"]
        if kind in ("iswa", "hybrid_iswa"):
            mem["kv_size"] = octx["memory_log"].get("kv_size_base")
            mem["kv_size_swa"] = octx["memory_log"].get("kv_size_swa")
        elif kind in ("kv", "hybrid"):
            mem["kv_size"] = next((c["cells"] for c in caches if "recurrent" not in c["module"]), None)
        if kind in ("recurrent", "hybrid", "hybrid_iswa"):
            mem["rs_size"] = next((c["cells"] for c in caches if "recurrent" in c["module"]), None)
        return mem
    n_ctx_seq = octx["n_ctx_seq"]
    if kind in ("dsa", "dsa_iswa"):
        # llama_kv_cache_dsa: the MLA and the indexer cache both of n_ctx_seq cells; dsa_iswa adds the SWA cache,
        # sized as llama_kv_cache_iswa's
        mem["kv_size"] = n_ctx_seq
        expect = [n_ctx_seq, n_ctx_seq]
        if kind == "dsa_iswa":
            n_seqs = case.n_seq_max if case.kv_unified else 1
            swa = n_ctx_seq if case.swa_full else min(n_ctx_seq, _pad(hp["n_swa"] * n_seqs + octx["n_ubatch"], 256))
            mem["kv_size_swa"] = swa
            expect.append(swa)
        sizes = [c["cells"] for c in octx["memory_log"]["caches"]]
        assert sorted(sizes) == sorted(expect), (case.id, sizes, expect)
        return mem
    if kind in ("kv", "iswa", "hybrid", "hybrid_iswa", "hybrid_idx", "msa"):
        mem["kv_size"] = n_ctx_seq
    if kind in ("iswa", "hybrid_iswa"):
        # llama_kv_cache_iswa: the SWA cache holds n_swa tokens per sequence (all of them when
        # unified) plus a ubatch, padded to 256, never more than the base cache; swa_full = base size
        swa = (
            n_ctx_seq
            if case.swa_full
            else min(n_ctx_seq, _pad(hp["n_swa"] * (case.n_seq_max if case.kv_unified else 1) + octx["n_ubatch"], 256))
        )
        mem["kv_size_swa"] = swa
        assert octx["memory_log"].get("kv_size_swa") == swa, (case.id, octx["memory_log"], swa)
    if kind in ("recurrent", "hybrid", "hybrid_iswa", "hybrid_idx"):
        mem["rs_size"] = max(1, case.n_seq_max)
    sizes = [c["cells"] for c in octx["memory_log"]["caches"]]
    expect = [x for x in (mem["kv_size"], mem["kv_size_swa"], mem["rs_size"]) if x is not None]
    if kind in ("iswa", "hybrid_iswa"):
        expect = [mem["kv_size"], mem["kv_size_swa"]] + ([mem["rs_size"]] if kind == "hybrid_iswa" else [])
    if kind == "hybrid_idx":
        expect.append(mem["kv_size"])  # the indexer cache: as many cells as the attention cache
    if kind == "msa":
        expect = [mem["kv_size"], mem["kv_size"]]  # llama_kv_cache_msa: the base and the indexer cache, same size
    assert sorted(sizes) == sorted(expect), (case.id, sizes, expect)
    return mem


def run_case(
    case: Case,
    m: tinymodels.TinyModel,
    vers: dict,
    golden_dir: Path | None = None,
    models: dict[str, tinymodels.TinyModel] | None = None,
) -> dict:
    """Run the case in llama.cpp and write golden_dir/<case-id>/ (default conformance/golden/); ``models`` (the
    built tiny models by key) gives a case's ``other_model``."""
    legacy = vers["llama_cpp_python"] != CURRENT_PRODUCER
    cid = f"legacy-{vers['llama_cpp_python']}-{case.id}" if legacy else case.id
    cdir = (HERE / "golden" if golden_dir is None else Path(golden_dir)) / cid
    if cdir.exists():
        shutil.rmtree(cdir)
    cdir.mkdir(parents=True)
    ro = mo = None
    if case.other_model is not None:
        assert models is not None, f"{case.id}: run_case needs the models for its other_model"
        mo = models[case.other_model]
        ro = driver.Run(cdir, mo.path, mo.hparams, case.cparams(), tag="other")
    r = driver.Run(cdir, m.path, m.hparams, case.cparams(), capture_rows=case.capture_rows, other=ro)
    try:
        if r.ctx is not None:
            case.script(r, Tokens(case.id))
        else:
            assert case.script is s_init_refused, f"{case.id}: context refused"
    finally:
        r.close()
        if ro is not None:
            ro.close()
    doc = {
        "schema_version": SCHEMA_VERSION,
        "id": cid,
        "description": (
            f"Written by llama-cpp-python {vers['llama_cpp_python']} (session v{vers['session_version']}, "
            f"sequence v{vers['seq_version']}): "
            if legacy
            else ""
        )
        + case.description,
        "covers": case.covers,
        "producer": vers,
        "model": _model_doc(case.model, m),
        "context": case.cparams(),
        "observed_context": r.observed_ctx,
        "observed_model": r.observed_model,
        "memory": memory_block(case, m.hparams, r.observed_ctx),
        "trace": r.trace,
    }
    if ro is not None and mo is not None:
        doc["other"] = {
            "model": _model_doc(case.other_model, mo),
            "context": case.cparams(),
            "init": r.other_init,
            "observed_context": ro.observed_ctx,
            "observed_model": ro.observed_model,
            "memory": memory_block(case, mo.hparams, ro.observed_ctx),
        }
    (cdir / "case.json").write_text(dump_case(doc))
    return doc


def _model_doc(key: str, m: tinymodels.TinyModel) -> dict:
    return {
        "file": m.path.name,
        "committed": m.committed,
        "path": f"models/{m.path.name}" if m.committed else None,
        "sha256": m.sha256,
        "size": m.size,
        "builder": f"tinymodels.{tinymodels.BUILDERS[key].__name__}",
        "hparams": m.hparams,
    }


def dump_case(doc: dict) -> str:
    """case.json text: indented, except each decode's graph inputs, which stay on one line."""
    graphs = {}
    trace = []
    for k, op in enumerate(doc["trace"]):
        if "graph" in op:
            tag = f"@@graph-{k}@@"
            graphs[tag] = json.dumps(op["graph"], separators=(",", ":"))
            op = {**op, "graph": tag}
        trace.append(op)
    text = json.dumps({**doc, "trace": trace}, indent=1) + "\n"
    for tag, g in graphs.items():
        text = text.replace(json.dumps(tag), g, 1)
    return text


def _shim_2024() -> None:
    """Bindings of autumn 2024 (0.3.0: session v9, still no memory API) take shim_2024.py's shim, cache record (the
    view's cell count) and memory block, as 0.2.x's do (generate_legacy.py)."""
    global memory_block
    import shim_2024

    shim_2024.install_shim()
    memory_block = shim_2024.memory_block
    shim_2024.record_caches()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", default="", help="only cases whose id contains this text")
    ap.add_argument("--list", action="store_true")
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvref-conformance",
    )
    ap.add_argument("--crash-child", nargs=3, metavar=("ID", "MODEL", "PROGRESS"), help=argparse.SUPPRESS)
    ap.add_argument("--crashes", action="store_true", help="only (re)record conformance/crashes/ (-k filters)")
    a = ap.parse_args(argv)
    if a.crash_child:
        _crash_child(a.crash_child[0], Path(a.crash_child[1]), Path(a.crash_child[2]))
        return 0
    import llama_cpp

    legacy = llama_cpp.__version__ != CURRENT_PRODUCER
    if legacy:
        driver.CAPTURE_GRAPHS = True  # capture.py declares every legacy release's struct ggml_tensor too
    if legacy and not hasattr(llama_cpp, "llama_get_memory"):
        _shim_2024()
    cases = [
        c
        for c in CASES
        if a.k in c.id and (not legacy or c.id in LEGACY_CASES) and c.id not in driver.PRODUCER.get("skip_cases", {})
    ]
    if a.list:
        for c in cases:
            print(f"{c.id:32s} {c.description}")
        return 0
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case id"
    vers = versions()
    if "seq_kv_ids" in driver.PRODUCER:  # 2024: a sequence save's KV cells carry no seq id
        vers["seq_kv_ids"] = driver.PRODUCER["seq_kv_ids"]
    models = build_models(a.model_dir, copy=not legacy)
    for m in models.values():
        if m.committed and (HERE / "models" / m.path.name).exists():
            assert m.sha256 == driver.sha256(HERE / "models" / m.path.name), f"{m.name} differs from the committed one"
    if not legacy:
        for cr in CRASHES:
            if a.k in cr.id:
                doc = record_crash(cr, models[cr.model], vers)
                print(f"{cr.id:32s} crashed in op {doc['crashed_op_index']} ({doc['signal'] or doc['returncode']})")
    if a.crashes:
        return 0
    for c in cases:
        doc = run_case(c, models[c.model], vers, models=models)
        n_art = sum(1 for op in doc["trace"] if op["op"] == "save")
        print(f"{c.id:32s} {len(doc['trace']):3d} ops {n_art:3d} artefacts")
    if not a.k and not legacy:
        # the invalid files are derived from the goldens, so they follow every full run
        import make_invalid

        print(f"walked {make_invalid.check_goldens()} golden artefacts")
        entries = make_invalid.build()
        make_invalid.llama_check(entries, a.model_dir, os.environ.get("KVREF_LEGACY_PYTHON"))
        make_invalid.write_manifest(entries)
        print(f"wrote {len(entries)} invalid files (conformance/invalid/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
