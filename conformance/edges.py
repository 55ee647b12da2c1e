#!/usr/bin/env python3
"""Edge arguments of every sequence operation on every memory kind, asked of the real llama.cpp: the goldens
``golden/edges-<kind>/``.

Each edge case is a plan in fuzz.py's format (ops of case.json's vocabulary, positions of plain decodes resolved
while it runs) run by fuzz.py's child (`child.run_child`): where llama.cpp dies (GGML_ASSERT, SIGFPE, an uncaught
exception) the op is recorded with ``"ret": "aborts"`` and the run goes on without it, so one trace holds what
llama.cpp returns and where it aborts. `kvref conformance` replays it: kvref must return llama.cpp's values and
leave the memory as llama.cpp does, and raise (a kvref.errors class, changing nothing) exactly where it aborts.

The edge arguments (`seq_ids`, `RANGES`, `DELTAS`, `DIVISORS`) are also what fuzz.py's random plans draw from.

    python conformance/edges.py                 # every edge case into conformance/golden/
    python conformance/edges.py kv recurrent    # only these kinds
    python conformance/edges.py --list
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
LLAMA_MAX_SEQ = 256

# kind -> (tiny model, context params, what it is); n_batch 32 so that a batch over n_batch stays small
KINDS: dict[str, tuple[str, dict, str]] = {
    "kv": ("llama", dict(n_seq_max=3), "a unified KV cache (llama)"),
    "kv-ms": ("llama", dict(n_seq_max=3, kv_unified=False), "a KV cache with one stream per sequence (llama)"),
    "iswa": ("gemma2", dict(n_seq_max=2), "an iSWA cache (gemma2, window 4)"),
    "iswa-ms": ("gemma2", dict(n_seq_max=2, kv_unified=False), "an iSWA cache with one stream per sequence"),
    "recurrent": ("mamba", dict(n_seq_max=3), "a recurrent memory (mamba)"),
    "hybrid": ("lfm2", dict(n_seq_max=3), "a hybrid memory (lfm2: short conv + attention)"),
    "hybrid-iswa": ("lfm2-swa", dict(n_seq_max=3), "a hybrid iSWA memory (lfm2 with a window of 4)"),
    "hybrid-idx": ("glm5-next", dict(n_seq_max=3), "a hybrid_idx memory (glm5-next: KDA, K-only MLA, k-pool indexer)"),
}
N_BATCH = 32
N_VOCAB = 128


def seq_ids(n_seq_max: int) -> list[int]:
    """Sequence ids at and past every bound: -1 (every sequence), below it, n_seq_max, LLAMA_MAX_SEQ and int32's."""
    return [-1, -2, I32_MIN, n_seq_max, LLAMA_MAX_SEQ - 1, LLAMA_MAX_SEQ, I32_MAX]


# (p0, p1): open ends, negative and reversed ranges, empty ones, int32's bounds
RANGES = [
    (-1, -1),
    (-5, 3),
    (5, 2),
    (3, 3),
    (2, -1),
    (-1, 4),
    (0, I32_MAX),
    (I32_MAX, -1),
    (I32_MAX, I32_MAX),
    (I32_MIN, I32_MAX),
    (I32_MIN, -1),
    (-2, -7),
]
# seq_add deltas: none, small, and past the position range both ways (a position passing INT32_MAX wraps negative)
DELTAS = [0, 1, -1, -3, -100, 2**30, I32_MAX - 5, I32_MAX, I32_MIN]
# seq_div divisors: 1 (nothing), 0 (SIGFPE where a cell is in range), negative ones, int32's bounds
DIVISORS = [1, 0, -1, -2, -3, 2, 7, I32_MAX, I32_MIN]


def _tokens(n: int, salt: int) -> list[int]:
    return [4 + (salt * 31 + 7 * i) % (N_VOCAB - 4) for i in range(n)]


def plan_for(kind: str) -> dict:
    """The edge plan of one memory kind (a fuzz.py plan: decodes without ``pos`` continue their sequence)."""
    arch, extra, what = KINDS[kind]
    n_seq = extra["n_seq_max"]
    recurrent = arch == "mamba"
    cp = dict(
        n_ctx=256,
        n_batch=N_BATCH,
        n_ubatch=N_BATCH,
        kv_unified=True,
        flash_attn=False,
        type_k="f16",
        type_v="f16",
        swa_full=False,
        n_rs_seq=0,
        n_threads=1,
    )
    cp.update(extra)
    ops: list[dict] = []
    salt = [0]

    def decode(seq: int, n: int, **kw) -> dict:
        salt[0] += 1
        op = {"op": "decode", "tokens": _tokens(n, salt[0]), "seq_ids": [[seq]] * n, "logits": [0] * (n - 1) + [1]}
        op.update(kw)
        return op

    filled = [False]

    def fill() -> None:
        """seq 0 at positions 0..7 and seq 1 at 0..4 (separate batches: a recurrent memory takes one sequence per
        cell), decoded once and saved as a session file; later fills restore that file."""
        if filled[0]:
            ops.append({"op": "state_load", "kind": "session"})
            return
        ops.append({"op": "clear", "data": True})
        ops.append(decode(0, 8))
        ops.append(decode(1, 5))
        ops.append({"op": "save", "kind": "session", "tokens": [4, 5]})
        filled[0] = True

    def observe(ids) -> None:
        """seq_pos_min / seq_pos_max of ids the observation after every op (ids below n_seq_max) does not cover."""
        for s in ids:
            ops.append({"op": "seq_pos_min", "seq_id": s})
            ops.append({"op": "seq_pos_max", "seq_id": s})

    checkpoint = {"op": "save", "kind": "state_data"}  # the whole memory's cells, compared cell by cell
    seq0 = {"op": "save", "kind": "seq_data", "seq_id": 0, "flags": 0}  # seq 0's cells only (a smaller artefact)
    bad_ids = seq_ids(n_seq)
    last = n_seq - 1  # the last sequence: empty after fill() when n_seq_max > 2, in another stream when not unified

    # --- on an empty memory: every op with ordinary and edge ids
    for s in [0, *bad_ids]:
        observe([s])
        ops.append({"op": "seq_rm", "seq_id": s, "p0": -1, "p1": -1})
        ops.append({"op": "seq_keep", "seq_id": s})
        ops.append({"op": "seq_add", "seq_id": s, "p0": -1, "p1": -1, "delta": 3})
        ops.append({"op": "seq_div", "seq_id": s, "p0": -1, "p1": -1, "d": 2})
        ops.append({"op": "seq_div", "seq_id": s, "p0": -1, "p1": -1, "d": 0})
        ops.append({"op": "seq_cp", "seq_id_src": s, "seq_id_dst": 1, "p0": -1, "p1": -1})
        ops.append({"op": "seq_cp", "seq_id_src": 0, "seq_id_dst": s, "p0": -1, "p1": -1})

    # --- sequence ids past every bound, on a filled memory (each op on a fresh fill)
    for s in bad_ids:
        fill()
        ops.append({"op": "seq_rm", "seq_id": s, "p0": 2, "p1": 4})
        ops.append({"op": "seq_rm", "seq_id": s, "p0": -1, "p1": -1})
        ops.append({"op": "seq_add", "seq_id": s, "p0": -1, "p1": -1, "delta": -2})
        ops.append({"op": "seq_div", "seq_id": s, "p0": -1, "p1": -1, "d": 2})
        ops.append({"op": "seq_cp", "seq_id_src": s, "seq_id_dst": last, "p0": -1, "p1": -1})
        ops.append({"op": "seq_cp", "seq_id_src": 0, "seq_id_dst": s, "p0": -1, "p1": -1})
        ops.append({"op": "seq_keep", "seq_id": s})

    # --- ranges: seq_rm, seq_cp, seq_add, seq_div of each range on a fresh fill
    for n, (p0, p1) in enumerate(RANGES):
        fill()
        ops.append({"op": "seq_rm", "seq_id": 1, "p0": p0, "p1": p1})
        ops.append({"op": "seq_cp", "seq_id_src": 0, "seq_id_dst": 1, "p0": p0, "p1": p1})
        ops.append({"op": "seq_cp", "seq_id_src": 0, "seq_id_dst": 0, "p0": p0, "p1": p1})
        ops.append({"op": "seq_add", "seq_id": 0, "p0": p0, "p1": p1, "delta": 2})
        ops.append({"op": "seq_div", "seq_id": 0, "p0": p0, "p1": p1, "d": 2})
        ops.append({"op": "seq_rm", "seq_id": -1, "p0": p0, "p1": p1})
        ops.append(decode(0, 2))
        ops.append(decode(last, 2))
        if n % 4 == 0:  # the decodes' KQ masks already compare every cell's position and sequences
            ops.append(checkpoint)

    # --- deltas past the position range, then a decode that continues the shifted sequence
    for delta in DELTAS:
        for p0, p1 in ((-1, -1), (4, -1)):
            fill()
            ops.append({"op": "seq_add", "seq_id": 0, "p0": p0, "p1": p1, "delta": delta})
            ops.append(decode(0, 1))
            ops.append(decode(0, 1, start=0))
            if delta in (I32_MAX - 5, I32_MIN):
                ops.append(seq0)

    # --- divisors <= 1 and large ones, where no cell is in range and where cells are
    for d in DIVISORS:
        for p0, p1 in ((-1, -1), (3, 8), (50, 60)):
            fill()
            ops.append({"op": "seq_div", "seq_id": 0, "p0": p0, "p1": p1, "d": d})
            ops.append(decode(0, 1))
            if d in (-1, -2) and p0 < 50:
                ops.append(seq0)

    # --- decodes: positions -1 and below on an empty sequence and on a filled one, over n_batch, bad ids
    fill()
    ops.append({"op": "seq_rm", "seq_id": last, "p0": -1, "p1": -1})
    for pos in ([-1], [-1, 0, 1], [-2], [-2, -1], [I32_MIN]):
        ops.append({"op": "decode", "tokens": _tokens(len(pos), 99), "pos": pos, "seq_ids": [[last]] * len(pos),
                    "logits": [0] * (len(pos) - 1) + [1]})  # fmt: skip
        ops.append(decode(last, 2))
        ops.append({"op": "save", "kind": "seq_data", "seq_id": last, "flags": 0})
        ops.append({"op": "seq_rm", "seq_id": last, "p0": -1, "p1": -1})
    ops.append({"op": "decode", "tokens": [5], "pos": [-1], "seq_ids": [[0]], "logits": [1]})
    ops.append(decode(0, N_BATCH + 3))
    ops.append(decode(1, N_BATCH))
    ops.append(checkpoint)
    for s in bad_ids:
        ops.append({"op": "decode", "tokens": [5], "pos": [0], "seq_ids": [[s]], "logits": [1]})
    ops.append({"op": "decode", "tokens": [5, 6], "pos": [20, 21], "seq_ids": [[0, 1], [0, 1]], "logits": [0, 1]})
    ops.append({"op": "decode", "tokens": [5], "pos": [I32_MAX], "seq_ids": [[last]], "logits": [1]})
    ops.append(checkpoint)

    # --- saves and restores of edge sequence ids
    fill()
    ops.append({"op": "save", "kind": "seq_data", "seq_id": 0, "flags": 0})
    ops.append({"op": "save", "kind": "seq", "seq_id": 1, "tokens": [4, 5, 6]})
    for s in [0, last, *bad_ids]:
        ops.append({"op": "seq_restore", "kind": "seq_data", "dest_seq_id": s})
        ops.append({"op": "seq_restore", "kind": "seq", "dest_seq_id": s})
    ops.append(checkpoint)
    for s in bad_ids:
        ops.append({"op": "save", "kind": "seq_data", "seq_id": s, "flags": 0})

    # --- a recurrent memory's position at INT32_MAX, seq_pos_min of it
    if recurrent:
        fill()
        ops.append({"op": "seq_add", "seq_id": 0, "p0": -1, "p1": -1, "delta": I32_MAX - 7})  # tail at INT32_MAX
        ops.append({"op": "seq_add", "seq_id": 0, "p0": -1, "p1": -1, "delta": 1})

    # --- a cross-stream seq_cp with every range (partial ones assert, so do ends past int32 in p + 1)
    for p0, p1 in [*RANGES, (I32_MAX, 0), (0, I32_MAX - 1), (255, 255), (254, -1)]:
        fill()
        ops.append({"op": "seq_cp", "seq_id_src": 0, "seq_id_dst": last, "p0": p0, "p1": p1})
        ops.append(decode(last, 1))

    return {
        "model": kind,
        "seed": None,
        "arch": arch,
        "cparams": cp,
        "ops": ops,
        "description": f"Edge arguments of every sequence operation on {what} (conformance/edges.py): ids past "
        "every bound, negative, reversed and empty ranges, int32's bounds, deltas past the position range, "
        "divisors <= 1, decodes at position -1 and below and over n_batch, saves and restores of edge ids. "
        'An op llama.cpp dies in has "ret": "aborts".',
        "covers": ["edges", "aborts"],
    }


def write_case(kind: str, golden: Path, model_dir: Path) -> tuple[bool, str, dict]:
    """Run ``kind``'s plan in llama.cpp (child.run_child) and write golden/edges-<kind>/."""
    import child

    with tempfile.TemporaryDirectory() as tmp:
        plan_file = Path(tmp) / "plan.json"
        plan_file.write_text(json.dumps(plan_for(kind)))
        cmd = [sys.executable, str(HERE / "fuzz.py"), "--model", kind, "--seed", "0", "--plan-file", str(plan_file)]
        cmd += ["--case-out", str(golden / f"edges-{kind}"), "--check-every", "0", "--model-dir", str(model_dir)]
        return child.run_child(cmd, timeout=3600)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kinds", nargs="*", help=f"memory kinds (default all): {', '.join(KINDS)}")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--golden", type=Path, default=HERE / "golden")
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "kvref-edges-models")
    a = ap.parse_args(argv)
    kinds = a.kinds or list(KINDS)
    if a.list:
        for k in kinds:
            print(f"edges-{k:12s} {len(plan_for(k)['ops']):4d} plan ops  {KINDS[k][2]}")
        return 0
    bad = 0
    for k in kinds:
        ok, why, aborts = write_case(k, a.golden, a.model_dir)
        print(f"edges-{k}: {'ok' if ok else 'FAILED: ' + why}, {len(aborts)} ops abort", flush=True)
        bad += not ok
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
