#!/usr/bin/env python3
"""Differential fuzzing of kvref against llama.cpp (CI runs a bounded campaign when the llama-cpp-python wheel is
in ../shared/wheels; see .ci/run).

A seeded random *plan* of memory operations (decodes of random multi-sequence batches, seq_rm / seq_cp /
seq_keep / seq_add / seq_div / clear, cache-overflowing and invalid batches, state saves and restores) is a
trace without results: ops of case.json's vocabulary (case.schema.json), so the one llama.cpp-side interpreter
(driver.Run.apply) runs it and records every return value and seq_pos_min/max after every op, and the one
kvref-side interpreter (kvref.jobs.conformance.replay_trace, through run_case: parse, replay, graph, restore)
replays the resulting case directory (golden format: case.json + artefacts). Positions and restored files are
resolved while the plan runs (PLAN_KEYS), from llama.cpp's own seq_pos_max, so any subset of a plan is again
a valid plan: that is how failures are minimised (--keep).

    python conformance/fuzz.py --models all --seeds 0-39            # fuzz; report mismatches
    python conformance/fuzz.py --models every --seeds 0-11 --minimise   # CI's live campaign (.ci/run)
    python conformance/fuzz.py --models every --seeds 0-999 --minimise  # a long campaign (hours)
    python conformance/fuzz.py --models llama,mamba --seeds 0-9 --minimise
    python conformance/fuzz.py --model llama --seed 7 --case-out conformance/golden/fuzz-llama-seed7
    python conformance/fuzz.py --model llama --seed 7 --keep 3,5,9-12 --case-out conformance/golden/fuzz-llama-x

--case-out writes one case (its directory name is the case id; by default without the extra
whole-state saves --check-every adds during fuzzing, to keep committed goldens small).
Each llama.cpp run happens in a child process: where llama.cpp dies (GGML_ASSERT, SIGFPE, an uncaught exception) the
op is recorded with "ret": "aborts" and the child runs the plan again without it (`run_child`), so kvref is checked
to refuse exactly there (a kvref.errors class, nothing changed). Plans carry a few edge operations (`insert_edges`,
conformance/edges.py's arguments); --no-edges leaves them out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import child  # noqa: E402  (beside this script)

# model key -> (tiny model, context params); n_ubatch is drawn per seed
MODELS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", dict(n_seq_max=4)),
    "llama-ms": ("llama", dict(n_seq_max=3, kv_unified=False)),
    "llama-fa": ("llama", dict(n_seq_max=3, flash_attn=True)),
    "gemma2": ("gemma2", dict(n_seq_max=2)),
    "gemma2-ms": ("gemma2", dict(n_seq_max=3, kv_unified=False, flash_attn=True)),
    "mamba": ("mamba", dict(n_seq_max=3)),
    "jamba": ("jamba", dict(n_seq_max=3)),
    "qwen2vl": ("qwen2vl", dict(n_seq_max=2)),
    # wider setups
    "llama-6": ("llama", dict(n_seq_max=6, n_ctx=512)),
    "gemma2-3": ("gemma2", dict(n_seq_max=3, n_ctx=512)),
    "mamba-1": ("mamba", dict(n_seq_max=1)),
    "qwen2vl-ms": ("qwen2vl", dict(n_seq_max=3, kv_unified=False)),
    # the other architectures of the goldens: one key per memory kind they add
    "gemma3": ("gemma3", dict(n_seq_max=2)),
    "qwen3": ("qwen3", dict(n_seq_max=3)),
    "llama4": ("llama4", dict(n_seq_max=2)),
    "mamba2": ("mamba2", dict(n_seq_max=2)),
    "rwkv6": ("rwkv6", dict(n_seq_max=2)),
    "lfm2": ("lfm2", dict(n_seq_max=2)),
    # llama.cpp 0.3.36 aborts in the first decode after a shift (GGML_ASSERT(buffer) in ggml-backend.cpp: its iSWA
    # base cache has no layer, so the K-shift input gets no buffer): recorded as "aborts", the trace goes on
    "lfm2-swa": ("lfm2-swa", dict(n_seq_max=2)),
    # DeepSeek sparse attention: llama_kv_cache_dsa (and its MTP draft context), llama_kv_cache_dsa_iswa
    "glm-dsa": ("glm-dsa", dict(n_seq_max=3)),
    "glm-dsa-ms": ("glm-dsa", dict(n_seq_max=3, kv_unified=False, flash_attn=True)),
    "glm-dsa-mtp": ("glm-dsa", dict(n_seq_max=2, ctx_type="mtp")),
    "deepseek32": ("deepseek32", dict(n_seq_max=2)),
    "deepseek32-mtp-ms": ("deepseek32", dict(n_seq_max=3, kv_unified=False, ctx_type="mtp")),
    "hy_v4": ("hy_v4", dict(n_seq_max=3)),
    "dots3note": ("dots3note", dict(n_seq_max=2)),
    "dots3note-ms": ("dots3note", dict(n_seq_max=3, kv_unified=False)),
    # llama_memory_hybrid_idx (attention + recurrent + indexer cache), M-RoPE: QSA graph inputs
    "qwen4exp": ("qwen4exp", dict(n_seq_max=3)),
    "qwen4exp-ms": ("qwen4exp", dict(n_seq_max=2, kv_unified=False)),
    # the same with glm5-next's k-pool indexer (K-only MLA cache, KDA recurrent layers)
    "glm5-next": ("glm5-next", dict(n_seq_max=3)),
    "glm5-next-ms": ("glm5-next", dict(n_seq_max=2, kv_unified=False)),
    # llama_kv_cache_msa (minimax-m3): dense attention (FA off), MSA over one stream per sequence (FA on, the MSA
    # graph inputs captured), and the unified dense fallback
    "minimax-m3": ("minimax-m3", dict(n_seq_max=2)),
    "minimax-m3-fa-ms": ("minimax-m3", dict(n_seq_max=2, kv_unified=False, flash_attn=True)),
    "minimax-m3-fa-1": ("minimax-m3", dict(n_seq_max=1, flash_attn=True)),
    # dflash's default memory (plain KV cache, non-causal); the plans decode tokens (no KV-injection batches)
    "dflash": ("dflash", dict(n_seq_max=2)),
    # a draft context over gemma4's (ctx_other): about half of the ops go to the target ("ctx": "other")
    "gemma4-assistant": ("gemma4-assistant", dict(n_seq_max=2, other_model="gemma4")),
    "gemma4-assistant-fa-ms": (
        "gemma4-assistant",
        dict(n_seq_max=2, kv_unified=False, flash_attn=True, other_model="gemma4"),
    ),
    # deepseek4: llama_kv_cache_dsv4 (a stream per sequence whatever kv_unified says), with compressor-state
    # rollback, and the MTP draft context's iSWA cache
    "deepseek4": ("deepseek4", dict(n_seq_max=2, flash_attn=True)),
    "deepseek4-rs": ("deepseek4", dict(n_seq_max=1, n_rs_seq=2, flash_attn=True)),
    "deepseek4-mtp": ("deepseek4", dict(n_seq_max=2, flash_attn=True, ctx_type="mtp")),
}
N_VOCAB = 128
UBATCHES = (3, 5, 8, 16, 32, 256)

# A plan is a trace without results: ops of case.json's vocabulary (case.schema.json, conformance/README.md) with
# the fields the call takes, run by driver.Run.apply. What depends on the state the plan meets (so that any
# subset of a plan is a plan) is resolved at run time (``resolve``), from llama.cpp's seq_pos_min / seq_pos_max
# and the saves made so far; these plan-only keys say how, and never reach the trace:
#   decode without pos   each token continues its first sequence: seq_pos_max + 1, or ``start`` (default 0)
#                        when the sequence is empty, plus ``jump`` (default 0, M-RoPE) once per batch; a token
#                        of several sequences keeps those in the first's state (same seq_pos_min / max) and is
#                        left out when fewer than two are, and the others then continue one past the first;
#                        the kept tokens take their ids from ``tokens`` in order
#   decode with after    ``pos`` counts from max(seq_pos_max(after) + 1, 0)
#   state_load,          without ``file``: the plan's last save of that ``kind`` (a seq_data restore takes its
#   seq_restore          flags); left out when there is none; ``rm_first``: seq_rm(dest_seq_id, -1, -1) first
PLAN_KEYS = ("start", "jump", "after", "rm_first")
# the whole-state save --check-every adds after every N plan ops
CHECK_POINT = {"op": "save", "kind": "state_data"}


# ------------------------------------------------------------------ plans (pure, no llama.cpp)


def make_plan(model: str, seed: int, n_ops: tuple[int, int] = (20, 60), edges: bool = True) -> dict:
    """A seeded plan: context params and a list of ops in case.json's vocabulary, without results (see PLAN_KEYS
    for what is resolved at run time); with ``edges``, a few edge operations inserted (`insert_edges`)."""
    arch, extra = MODELS[model]
    rng = random.Random(f"{model}:{seed}")
    n_seq = extra["n_seq_max"]
    cp = dict(
        n_ctx=256,
        n_batch=extra.get("n_ctx", 256),
        n_ubatch=rng.choice(UBATCHES),
        kv_unified=True,
        flash_attn=False,
        type_k="f16",
        type_v="f16",
        swa_full=False,
        n_rs_seq=0,
        n_threads=1,
    )
    cp.update(extra)
    mrope = arch in ("qwen2vl", "qwen4exp")
    # PARTIAL_ONLY means something
    layered = arch in ("gemma2", "jamba", "dots3note", "qwen4exp", "glm5-next", "deepseek4")

    def seq(neg=False):
        return rng.randrange(-1 if neg else 0, n_seq)

    def p():
        return -1 if rng.random() < 0.3 else rng.randrange(0, 48)

    def toks(n):
        return [rng.randrange(4, N_VOCAB) for _ in range(n)]

    def decode(seqs, n, shared, start, jump, order, pool):
        """A decode whose positions are resolved at run time: ``shared`` tokens of all ``seqs``, then ``n[i]``
        tokens of ``seqs[i]`` in an order shuffled by ``order``."""
        rest = [s for s, k in zip(seqs, n, strict=True) for _ in range(k)]
        random.Random(order).shuffle(rest)
        seq_ids = [list(seqs)] * shared + [[s] for s in rest]
        op = {"op": "decode", "tokens": pool[: len(seq_ids)], "seq_ids": seq_ids}
        op["logits"] = [0] * (len(seq_ids) - 1) + [1]
        if start:
            op["start"] = start
        if jump:
            op["jump"] = jump
        return op

    def bad(s, how):
        """An invalid batch: a gap, a decrease, a bad seq id or token id (positions after ``s``'s last)."""
        op = {"op": "decode", "tokens": [5, 6], "pos": [0, 2], "seq_ids": [[s], [s]], "logits": [0, 1], "after": s}
        if how == "decrease":
            op["pos"] = [1, 0]
        elif how == "seq_id":
            op = {"op": "decode", "tokens": [5], "pos": [0], "seq_ids": [[n_seq]], "logits": [1]}
        elif how == "token":
            op = {"op": "decode", "tokens": [N_VOCAB + 3], "pos": [0], "seq_ids": [[s]], "logits": [1], "after": s}
        return op

    ops: list[dict] = []
    weights = {
        "decode": 40,
        "big": 3,
        "seq_rm": 10,
        "seq_cp": 8,
        "seq_keep": 2,
        "seq_add": 0 if mrope else 8,
        "seq_div": 0 if mrope else 3,
        "clear": 2,
        "save": 6,
        "restore": 5,
        "bad": 2,
    }
    kinds, w = zip(*weights.items(), strict=True)
    # the draws below (their order included) are what a seed has always meant: keep them so seeds replay
    for _ in range(rng.randint(*n_ops)):
        k = rng.choices(kinds, w)[0]
        if k == "decode":
            seqs = rng.sample(range(n_seq), rng.choice([1, 1, 1, 2, 2, 3][: 2 * n_seq]) if n_seq > 1 else 1)
            n = [rng.randint(1, 12) for _ in seqs]
            shared = rng.randint(1, 4) if len(seqs) > 1 and rng.random() < 0.35 else 0
            start = 0 if rng.random() < 0.7 else rng.randrange(0, 30)
            jump = rng.randrange(0, 5) if mrope and rng.random() < 0.3 else 0
            order = rng.randrange(1 << 30)
            ops.append(decode(seqs, n, shared, start, jump, order, toks(64)))
        elif k == "big":  # a batch that may overflow the cache
            s = seq()
            ops.append(decode([s], [rng.randint(60, 250)], 0, 0, 0, 0, toks(256)))
        elif k == "bad":
            s = seq()
            ops.append(bad(s, rng.choice(["gap", "decrease", "seq_id", "token"])))
        elif k == "seq_rm":
            s = seq(neg=True)
            p0 = p()
            ops.append({"op": "seq_rm", "seq_id": s, "p0": p0, "p1": p()})
        elif k == "seq_cp":
            src, dst = seq(), seq()
            p0, p1 = p(), p()
            if not cp["kv_unified"] and src != dst:
                p0 = p1 = -1  # llama.cpp asserts on partial cross-stream copies
            ops.append({"op": "seq_cp", "seq_id_src": src, "seq_id_dst": dst, "p0": p0, "p1": p1})
        elif k == "seq_keep":
            ops.append({"op": "seq_keep", "seq_id": seq()})
        elif k == "seq_add":
            s, p0, p1 = seq(), p(), p()
            ops.append(
                {"op": "seq_add", "seq_id": s, "p0": p0, "p1": p1, "delta": rng.choice([-1, 1]) * rng.randint(1, 12)}
            )
        elif k == "seq_div":
            s, p0, p1 = seq(), p(), p()
            ops.append({"op": "seq_div", "seq_id": s, "p0": p0, "p1": p1, "d": rng.randint(2, 4)})
        elif k == "clear":
            ops.append({"op": "clear", "data": rng.random() < 0.8})
        elif k == "save":
            kind = rng.choice(["seq", "seq_data", "seq_data", "session", "state_data"])
            s = seq()
            flags = 1 if layered and rng.random() < 0.4 else 0
            ops.append(
                {"op": "save", "kind": kind, "seq_id": s, "tokens": [4, 5, 6]}
                if kind == "seq"
                else {"op": "save", "kind": kind, "seq_id": s, "flags": flags}
                if kind == "seq_data"
                else {"op": "save", "kind": kind, "tokens": [4, 5]}
                if kind == "session"
                else {"op": "save", "kind": kind}
            )
        elif k == "restore":
            kind = rng.choice(["seq", "seq_data", "session", "state_data"])
            d = seq()
            rm_first = rng.random() < 0.6
            if kind in ("seq", "seq_data"):
                ops.append({"op": "seq_restore", "kind": kind, "dest_seq_id": d, "rm_first": rm_first})
            else:
                ops.append({"op": "state_load", "kind": kind})
    if edges:
        # llama.cpp sizes minimax-m3's MSA graph (flash attention on) by the largest position in the cache: a position
        # near INT32_MAX asks for a compute buffer of ~100 GB and the decode fails with -2, an allocation failure that
        # depends on the host (kvref models no allocation failure): those setups get no such positions
        huge_pos = not (arch == "minimax-m3" and cp["flash_attn"])
        ops = insert_edges(ops, model, seed, n_seq, cp, mrope, huge_pos)
    if extra.get("other_model"):
        for op in ops:  # the target context gets about half of the ops (a restore takes that context's saves)
            if rng.random() < 0.5:
                op["ctx"] = "other"
    return {"model": model, "seed": seed, "arch": arch, "cparams": cp, "ops": ops}


def insert_edges(
    ops: list[dict], model: str, seed: int, n_seq: int, cp: dict, mrope: bool, huge_pos: bool = True
) -> list[dict]:
    """``ops`` with a few edge operations inserted at random places (conformance/edges.py's arguments: ids past every
    bound, negative, reversed and int32-wide ranges, deltas past the position range, divisors <= 1, decodes at -1 and
    over n_batch, saves and restores of edge ids). Their own random stream: the ops drawn before keep their draws.
    Where llama.cpp dies in one, the trace records ``"ret": "aborts"`` and goes on (`run_child`). Without
    ``huge_pos`` no edge op moves a position past 2**20 (a decode at INT32_MAX becomes one below, a big delta 3)."""
    import edges as E

    rng = random.Random(f"{model}:{seed}:edges")
    ids = E.seq_ids(n_seq)

    def seq(edge_share: float = 0.5) -> int:
        return rng.choice(ids) if rng.random() < edge_share else rng.randrange(n_seq)

    def rng_range() -> tuple[int, int]:
        return rng.choice(E.RANGES) if rng.random() < 0.6 else (rng.randrange(-1, 40), rng.randrange(-1, 40))

    def one() -> dict:
        k = rng.choice(["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "seq_pos", "decode", "restore", "save"])
        p0, p1 = rng_range()
        if k == "seq_rm":
            return {"op": "seq_rm", "seq_id": seq(), "p0": p0, "p1": p1}
        if k == "seq_cp":
            return {"op": "seq_cp", "seq_id_src": seq(0.3), "seq_id_dst": seq(0.3), "p0": p0, "p1": p1}
        if k == "seq_keep":
            return {"op": "seq_keep", "seq_id": seq(0.3)}
        if k == "seq_add" and not mrope:
            delta = rng.choice(E.DELTAS)
            if not huge_pos and delta >= 2**20:
                delta = 3  # far above becomes small (below the range stays: it frees cells)
            return {"op": "seq_add", "seq_id": seq(0.3), "p0": p0, "p1": p1, "delta": delta}
        if k == "seq_div" and not mrope:
            return {"op": "seq_div", "seq_id": seq(0.3), "p0": p0, "p1": p1, "d": rng.choice(E.DIVISORS)}
        if k == "seq_pos":
            return {"op": rng.choice(["seq_pos_min", "seq_pos_max"]), "seq_id": seq()}
        if k == "decode":
            how = rng.choice(["minus1", "below", "over_n_batch", "int32_max"])
            if how == "over_n_batch":  # continues a sequence (positions resolved at run time)
                s, n = rng.randrange(n_seq), cp["n_batch"] + rng.randint(1, 4)
                toks = [rng.randrange(4, N_VOCAB) for _ in range(n)]
                return {"op": "decode", "tokens": toks, "seq_ids": [[s]] * n, "logits": [0] * (n - 1) + [1]}
            if how == "int32_max" and not huge_pos:
                how = "below"
            pos = {"minus1": [-1, 0], "below": [-2], "int32_max": [E.I32_MAX]}[how]
            s = rng.randrange(n_seq)
            return {"op": "decode", "tokens": [rng.randrange(4, N_VOCAB) for _ in pos], "pos": pos,
                    "seq_ids": [[s]] * len(pos), "logits": [0] * (len(pos) - 1) + [1]}  # fmt: skip
        if k == "restore":
            return {"op": "seq_restore", "kind": rng.choice(["seq", "seq_data"]), "dest_seq_id": seq()}
        if k == "save":
            return {"op": "save", "kind": "seq_data", "seq_id": seq(), "flags": 0}
        return {"op": "seq_pos_max", "seq_id": seq()}

    out = list(ops)
    for _ in range(rng.randint(3, 8)):
        out.insert(rng.randrange(len(out) + 1), one())
    return out


def parse_ranges(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b) + 1) if b else [int(a)])
    return out


def fmt_ranges(xs: list[int]) -> str:
    out, xs = [], sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


# ------------------------------------------------------------------ running a plan in llama.cpp (child side)


def _llama_pos(p: int) -> int:
    """``p`` as the llama_pos (int32) the llama_batch holds: a position continuing one at INT32_MAX wraps."""
    return (p + 2**31) % 2**32 - 2**31


def resolve(r, op: dict, saved: dict[str, dict]) -> list[dict]:
    """The case.json ops one plan op stands for, now, on driver.Run ``r`` (see PLAN_KEYS); ``saved``: the last
    plan save of each kind (its recorded op)."""
    o = {k: v for k, v in op.items() if k not in PLAN_KEYS}
    k = o["op"]
    if k == "decode" and "pos" not in o:
        nxt: dict[int, int] = {}
        for ids in o["seq_ids"]:
            for s in ids:
                if s not in nxt:
                    nxt[s] = (r.pos_max(s) + 1 if r.pos_max(s) >= 0 else op.get("start", 0)) + op.get("jump", 0)
        seq_ids, pos, logits = [], [], []
        for ids, lg in zip(o["seq_ids"], o["logits"], strict=True):
            s0 = ids[0]
            if len(ids) > 1:
                ids = [s for s in ids if (r.pos_min(s), r.pos_max(s)) == (r.pos_min(s0), r.pos_max(s0))]
                if len(ids) < 2:
                    continue
            seq_ids.append(list(ids))
            pos.append(nxt[s0])
            for s in ids:  # the others then continue one past the first (what fuzz.py has always done)
                nxt[s] = nxt[s0] + 1
            logits.append(lg)
        pos = [_llama_pos(p) for p in pos]
        return [{**o, "tokens": o["tokens"][: len(seq_ids)], "pos": pos, "seq_ids": seq_ids, "logits": logits}]
    if k == "decode" and "after" in op:
        p = max(r.pos_max(op["after"]) + 1, 0)
        return [{**o, "pos": [_llama_pos(p + x) for x in o["pos"]]}]
    if k in ("state_load", "seq_restore") and "file" not in o:
        src = saved.get(o["kind"] if "ctx" not in o else f"{o['ctx']}:{o['kind']}")  # that context's last save
        if src is None:
            return []  # nothing of this kind saved yet
        o["file"] = src["file"]
        if o["kind"] == "seq_data":
            o["flags"] = src.get("flags", 0)
        if op.get("rm_first"):
            ctx = {"ctx": o["ctx"]} if "ctx" in o else {}
            return [{"op": "seq_rm", "seq_id": o["dest_seq_id"], "p0": -1, "p1": -1, **ctx}, o]
    return [o]


def execute(
    r, plan: dict, keep: list[int] | None, check_every: int, aborts: dict[str, dict] | None = None, progress=None
) -> list[int]:
    """Run the plan's ops (only ``keep`` when given) on driver.Run ``r``; return, per trace op, its plan index.

    Every case.json op a plan op stands for has a key, ``"<plan index>.<k>"`` (``k`` its place among the ops the
    plan op resolved to, ``c`` for the check point after it): an op whose key is in ``aborts`` is recorded as one
    that kills llama.cpp (driver.Run.record_abort, with the recorded abort) instead of being performed; before and
    after every op it performs, a JSON line goes to ``progress`` (an open text file), so that the parent knows
    which op a dead child died in (`run_child`)."""
    aborts = aborts or {}
    saved: dict[str, dict] = {}  # kind -> the recorded op of the plan's last save of that kind
    owner: list[int] = [-1]  # trace[0] is init
    idx = keep if keep is not None else list(range(len(plan["ops"])))
    done = 0

    def mark(i):
        owner.extend([i] * (len(r.trace) - len(owner)))

    def perform(key: str, op: dict) -> None:
        if key in aborts:
            r.record_abort(op, aborts[key])
            return
        if progress is not None:
            progress.write(json.dumps({"calling": key, "op": op}) + "\n")
            progress.flush()
        r.apply(op)
        if progress is not None:
            progress.write(json.dumps({"done": key}) + "\n")
            progress.flush()

    for i in idx:
        ops = resolve(r, plan["ops"][i], saved)
        if not ops:
            continue  # a restore with nothing to restore: not an op of the trace
        for k, op in enumerate(ops):
            perform(f"{i}.{k}", op)
            if op["op"] == "save" and r.trace[-1]["ret"] not in ("aborts", 0):  # 0 bytes: no artefact
                saved[op["kind"] if "ctx" not in op else f"{op['ctx']}:{op['kind']}"] = r.trace[-1]
        mark(i)
        done += 1
        if check_every and done % check_every == 0:
            perform(f"{i}.c", CHECK_POINT)  # a whole-memory cell-table check point for the replay
            mark(i)
    if check_every and done % check_every:
        perform("end.c", CHECK_POINT)
        mark(idx[-1] if idx else -1)
    return owner


def child_main(a) -> int:
    import driver
    import generate
    import tinymodels

    if a.plan_file:
        plan = json.loads(Path(a.plan_file).read_text())
    else:
        plan = make_plan(a.model, a.seed, (a.min_ops, a.max_ops), edges=not a.no_edges)
    keep = parse_ranges(a.keep) if a.keep is not None else None
    aborts = json.loads(Path(a.aborts_file).read_text()) if a.aborts_file else {}
    out = Path(a.case_out).resolve()
    cid = out.name
    vers = generate.versions()
    model_dir = Path(a.model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    m = tinymodels.BUILDERS[plan["arch"]](model_dir)
    m.committed = plan["arch"] in generate.COMMITTED_MODELS
    cp = plan["cparams"]
    models = {plan["arch"]: m}
    if cp.get("other_model"):  # the ctx_other context's model (gemma4-assistant's target)
        models[cp["other_model"]] = tinymodels.BUILDERS[cp["other_model"]](model_dir)
    owner: list[int] = []

    def script(r, _tok):
        if a.progress:
            with open(a.progress, "w") as progress:
                owner.extend(execute(r, plan, keep, a.check_every, aborts, progress))
        else:
            owner.extend(execute(r, plan, keep, a.check_every, aborts))

    if plan.get("description"):
        desc = f"{plan['description']} {a.description}"
    else:
        desc = (
            f"fuzz.py plan for model {a.model}, seed {a.seed}"
            + (f", ops {a.keep}" if keep is not None else f", {len(plan['ops'])} ops")
            + f" (n_ubatch {cp['n_ubatch']}). {a.description}".rstrip()
        )
    covers = plan.get("covers", ["fuzz"])
    case = generate.Case(cid, plan["arch"], desc.strip(), covers, script, **{k: v for k, v in cp.items()})
    doc = generate.run_case(case, m, vers, golden_dir=out.parent, models=models)
    if a.meta_out:
        Path(a.meta_out).write_text(json.dumps({"owner": owner, "n_plan": len(plan["ops"])}))
    print(f"{cid}: {len(doc['trace'])} ops, {sum(op['op'] == 'save' for op in doc['trace'])} saves")
    del driver
    return 0


# ------------------------------------------------------------------ the fuzz loop (parent side)


def gen_case(
    model: str, seed: int, out: Path, keep: list[int] | None, check_every: int, args, meta: Path | None = None
) -> tuple[bool, str]:
    cmd = [
        sys.executable,
        __file__,
        "--model",
        model,
        "--seed",
        str(seed),
        "--case-out",
        str(out),
        "--check-every",
        str(check_every),
        "--min-ops",
        str(args.min_ops),
        "--max-ops",
        str(args.max_ops),
        "--model-dir",
        str(args.model_dir),
    ]
    if keep is not None:
        cmd += ["--keep", fmt_ranges(keep) if keep else ""]
    if meta is not None:
        cmd += ["--meta-out", str(meta)]
    if args.no_edges:
        cmd += ["--no-edges"]
    ok, why, _aborts = child.run_child(cmd)
    return ok, why


def replay(root: Path, cid: str) -> tuple[str, str]:
    """('pass'|'fail'|'unsupported', detail) for kvref on the case."""
    from kvref.jobs import conformance as C

    res = C.run_case(root, cid, expected={})
    for c in res.checks:
        if c.status == "fail":
            return "fail", f"{c.name}: {c.detail}"
    for c in res.checks:
        if c.status != "pass":
            return c.status, f"{c.name}: {c.detail}"
    return "pass", ""


def signature(detail: str) -> str:
    """A coarse failure class, kept while minimising: the check and the kind of difference."""
    import re

    check, _, rest = detail.partition(":")
    m = re.search(r"\((\w+)", rest)
    what = (
        "observed"
        if "observed" in rest
        else "returned"
        if "returned" in rest
        else "cells"
        if "cell #" in rest or "cells" in rest
        else "bytes"
        if "bytes" in rest
        else rest[-40:]
    )
    return f"{check}/{m.group(1) if m else ''}/{what}"


def minimise(model: str, seed: int, root: Path, args, sig: str, n_plan: int) -> tuple[list[int], str]:
    """Greedy chunk removal over the plan's op indices while the failure keeps its signature."""
    keep = list(range(n_plan))
    last = ""
    tries = 0

    def fails(k: list[int]) -> str | None:
        nonlocal tries
        tries += 1
        cid = f"min-{model}-{seed}"
        ok, _why = gen_case(model, seed, root / "golden" / cid, k, args.check_every, args)
        if not ok:
            return None
        st, d = replay(root, cid)
        return d if st == "fail" and signature(d) == sig else None

    chunk = max(1, len(keep) // 2)
    while chunk >= 1 and tries < args.max_tries:
        i, removed = 0, False
        while i < len(keep) and tries < args.max_tries:
            cand = keep[:i] + keep[i + chunk :]
            d = fails(cand) if cand else None
            if d is not None:
                keep, last, removed = cand, d, True
            else:
                i += chunk
        if not removed:
            chunk //= 2
    return keep, last


def fuzz_main(a) -> int:
    models = list(MODELS)[:8] if a.models == "all" else list(MODELS) if a.models == "every" else a.models.split(",")
    seeds = parse_ranges(a.seeds)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="kvref-fuzz-"))
    (work / "golden").mkdir(parents=True, exist_ok=True)
    print(f"work dir {work}")
    counts: dict[str, int] = {}
    found: list[str] = []
    t0 = time.time()
    for model in models:
        for seed in seeds:
            cid = f"fuzz-{model}-seed{seed}"
            ok, why = gen_case(model, seed, work / "golden" / cid, None, a.check_every, a)
            if not ok:
                st, d = "llama-abort", why
            else:
                st, d = replay(work, cid)
            counts[st] = counts.get(st, 0) + 1
            if st == "pass":
                if not a.keep_passing:
                    shutil.rmtree(work / "golden" / cid, ignore_errors=True)
                continue
            line = f"{cid}: {st}: {d}"
            print(line[:400])
            sys.stdout.flush()
            if st == "fail" and a.minimise:
                n_plan = len(make_plan(model, seed, (a.min_ops, a.max_ops), edges=not a.no_edges)["ops"])
                keep, last = minimise(model, seed, work, a, signature(d), n_plan)
                msg = f"  minimised: --model {model} --seed {seed} --keep {fmt_ranges(keep)}  ({len(keep)} ops): {last}"
                print(msg[:500])
                found.append(msg)
    print(f"{sum(counts.values())} traces in {time.time() - t0:.0f}s: {counts}")
    return 1 if counts.get("fail") else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="all", help="comma-separated keys of MODELS, all (the first 8) or every")
    ap.add_argument("--seeds", default="0-9", help="e.g. 0-49,77")
    ap.add_argument("--model", help="with --case-out: the model key")
    ap.add_argument("--seed", type=int, help="with --case-out: the seed")
    ap.add_argument("--keep", default=None, help="with --case-out: only these plan op indices (e.g. 0-3,7)")
    ap.add_argument("--case-out", help="write one case directory (its name is the case id)")
    ap.add_argument("--description", default="", help="with --case-out: text appended to the description")
    ap.add_argument(
        "--check-every",
        type=int,
        default=None,
        help="add a whole-state save every N ops (default 5 when fuzzing, 0 with --case-out)",
    )
    ap.add_argument("--no-edges", action="store_true", help="plans without the edge operations (insert_edges)")
    ap.add_argument("--min-ops", type=int, default=20)
    ap.add_argument("--max-ops", type=int, default=60)
    ap.add_argument("--work", help="fuzz work dir (default: a new temp dir)")
    ap.add_argument("--keep-passing", action="store_true", help="keep passing traces in the work dir")
    ap.add_argument("--minimise", action="store_true", help="minimise every failing trace")
    ap.add_argument("--max-tries", type=int, default=80, help="llama.cpp runs per minimisation")
    ap.add_argument("--meta-out", help=argparse.SUPPRESS)
    ap.add_argument("--plan-file", help=argparse.SUPPRESS)  # with --case-out: a plan (JSON) instead of make_plan's
    ap.add_argument("--aborts-file", help=argparse.SUPPRESS)  # with --case-out: ops to record as aborting (run_child)
    ap.add_argument("--progress", help=argparse.SUPPRESS)  # with --case-out: where execute() reports each op
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / f"kvref-fuzz-models-{os.getuid()}",
        help="where the tiny models are (re)written (default: a private temp dir)",
    )
    a = ap.parse_args(argv)
    if a.case_out:
        if a.check_every is None:
            a.check_every = 0
        return child_main(a)
    if a.check_every is None:
        a.check_every = 5
    return fuzz_main(a)


if __name__ == "__main__":
    sys.exit(main())
