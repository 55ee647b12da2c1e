#!/usr/bin/env python3
"""Misuse fuzzer of the memory API: random programs with hostile arguments, run under both backends.

A program builds one memory with ``kvref.create_memory`` (tiny llama / gemma2-iSWA / mamba / jamba-hybrid
hyper-parameters of the conformance goldens, random n_seq_max, unified or per-sequence streams, flash attention
or not) and calls its methods (decode(Batch(...)), seq_rm, seq_cp, seq_keep, seq_add, seq_div, seq_pos_min,
seq_pos_max, state_write, state_read, clear, update) with mostly sensible arguments and, often, hostile ones:
negative, huge (2**31, 2**32, -2**32, 2**63), NumPy integers (int8/int16/int32/uint8/int64), floats (1.5, nan,
inf), None, bools and strings; state_read gets earlier state_write results, cut or with flipped bytes, or no
bytes at all. Program ``i`` of seed ``S`` depends on nothing else.

Checks (each program in a capped, watched child process):

- no crash, no hang, no exception outside ``kvref.errors`` (TypeError / ValueError count only when they are
  kvref error classes);
- refused means unchanged: when a call raises a kvref error, ``state_write`` of the whole memory and of each
  sequence, and every sequence's ``seq_pos_min`` / ``seq_pos_max``, are what they were before the call;
- the twins agree: the same program gives the same results, errors (class and message) and states under
  KVREF_BACKEND=python and KVREF_BACKEND=cython.

    python fuzzing/misuse.py --programs 5000 --seed 1 --jobs 2
    python fuzzing/misuse.py --show 17 --seed 1            # print program 17 as Python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_common import (
    BACKENDS,
    ROOT,
    Finding,
    Report,
    apply_known,
    campaign,
    child_main,
    exception_signature,
    format_exc,
    twin_findings,
)

GOLDEN = ROOT / "conformance" / "golden"
DEFAULT_OUT = Path(tempfile.gettempdir()) / "kvref-fuzz" / "misuse"

# the goldens whose recorded hyper-parameters give each model family
MODELS = {
    "llama": "llama-f32-multi-seq",
    "gemma2": "gemma2-swa-multiseq-fa",
    "mamba": "mamba-multi-seq-batch",
    "jamba": "jamba-hybrid",
}

# Findings known but not fixed yet: "category:signature" fnmatch patterns (write a literal [ as [[]) -> why it is
# known and where it lives. Empty: every finding so far is fixed.
KNOWN_ISSUES: dict[str, str] = {}

NON_INT = {"float", "none", "str", "data"}
HUGE = [2**31, 2**31 - 1, -(2**31) - 1, 2**32, -(2**32), 2**63, -(2**63), 2**64]
NP_TYPES = ["int8", "int16", "int32", "uint8", "int64", "uint32", "uint64"]


# --------------------------------------------------------------------------------------------- arguments
# an argument is a JSON-able descriptor: ["int", v] ["np", dtype, v] ["float", "nan"|"inf"|"-inf"|v] ["none"]
# ["bool", b] ["str", s] ["blob", k, cut, flips] (the k-th state_write result of the program, cut to ``cut``
# bytes when not None, with (offset, value) byte flips) or ["data", what] (no state at all: None, "", 5, ...)
def weird(rng: random.Random) -> list[Any]:
    r = rng.random()
    if r < 0.25:
        return ["int", rng.choice([-2, -3, -100, *HUGE])]
    if r < 0.5:
        t = rng.choice(NP_TYPES)
        v = rng.choice([0, 1, 2, 3, 5, 127, 255])
        if t.startswith("int") and rng.random() < 0.3:
            v = -rng.choice([1, 2, 128])
        if t in ("int64", "uint64") and rng.random() < 0.3:
            v = rng.choice([2**32, 2**40, 2**63 - 1])
        return ["np", t, v]
    if r < 0.7:
        return ["float", rng.choice([1.5, 0.0, 2.0, -1.0, "nan", "inf", "-inf", 1e30])]
    if r < 0.8:
        return ["none"]
    if r < 0.9:
        return ["bool", rng.random() < 0.5]
    return ["str", rng.choice(["0", "1", "x", "", "-1"])]


def value(arg: list[Any], blobs: list[bytes]) -> Any:
    """The Python value a descriptor stands for."""
    import numpy as np

    kind = arg[0]
    if kind == "int":
        return int(arg[1])
    if kind == "np":
        t, v = np.dtype(arg[1]), arg[2]
        info = np.iinfo(t)
        lo, span = int(info.min), int(info.max) + 1 - int(info.min)
        return t.type((v - lo) % span + lo)  # wrapped into the type's range, as C would
    if kind == "float":
        return float(arg[1])
    if kind == "none":
        return None
    if kind == "bool":
        return bool(arg[1])
    if kind == "str":
        return str(arg[1])
    if kind == "blob":
        _, k, cut, flips = arg
        b = bytearray(blobs[k % len(blobs)]) if blobs else bytearray()
        if cut is not None:
            del b[cut % (len(b) + 1) :]
        for at, v in flips:
            if b:
                b[at % len(b)] = v
        return bytes(b)
    if kind == "data":
        return {
            "none": None,
            "str": "ggsn",
            "int": 5,
            "empty": b"",
            "bytearray": bytearray(8),
            "array": np.zeros(16, np.uint8),
            "list": [0, 1, 2],
        }[arg[1]]
    raise ValueError(f"unknown argument descriptor {arg!r}")


def kinds(args: Any) -> list[str]:
    """The hostile kinds among an op's argument descriptors: huge, np, np-huge, bool, or just "nonint" when one
    is not an integer at all (float, None, str, non-bytes state data)."""
    out: set[str] = set()

    def walk(x: Any) -> None:
        if isinstance(x, list) and x and isinstance(x[0], str):
            k = x[0]
            if k == "int" and not -(2**31) <= x[1] < 2**31:
                out.add("huge")
            elif k == "np" and x[2] >= 2**31:
                out.add("np-huge")
            elif k in ("np", "float", "none", "bool", "str", "data"):
                out.add(k)
        elif isinstance(x, list):
            for y in x:
                walk(y)

    walk(args)
    if out & NON_INT:  # not an integer at all: the rest does not matter
        return ["nonint"]
    return sorted(out)


def show(arg: list[Any]) -> str:
    """The descriptor as Python source (for the printed reproducer)."""
    kind = arg[0]
    if kind == "np":
        return f"np.{arg[1]}({arg[2]})"
    if kind == "float":
        return f"float({str(arg[1])!r})" if isinstance(arg[1], str) else repr(float(arg[1]))
    if kind == "none":
        return "None"
    if kind == "blob":
        return f"blob(blobs, {arg[1]}, cut={arg[2]}, flips={arg[3]})"
    if kind == "data":
        return {
            "none": "None",
            "str": "'ggsn'",
            "int": "5",
            "empty": "b''",
            "bytearray": "bytearray(8)",
            "array": "np.zeros(16, np.uint8)",
            "list": "[0, 1, 2]",
        }[arg[1]]
    return repr(arg[1])


# --------------------------------------------------------------------------------------------- programs
def make_program(seed: int, index: int) -> dict[str, Any]:
    """Program ``index`` of campaign ``seed``: a memory config and a list of ``[method, [args]]``."""
    rng = random.Random(f"misuse:{seed}:{index}")
    model = rng.choice(list(MODELS))
    n_seq = rng.choice([1, 2, 3, 4])
    cfg = {
        "model": model,
        "n_seq_max": n_seq,
        "kv_unified": rng.random() < 0.6,
        "flash_attn": rng.random() < 0.5,
        "n_ctx": rng.choice([256, 256, 512]),
        "n_ubatch": rng.choice([4, 8, 32, 512]),
    }
    hostile = rng.choice([0.05, 0.15, 0.3])  # how often an argument is hostile

    def seq() -> list[Any]:
        return weird(rng) if rng.random() < hostile else ["int", rng.randrange(-1, n_seq + 1)]

    def pos() -> list[Any]:
        if rng.random() < hostile:
            return weird(rng)
        return ["int", rng.choice([-1, -1, 0, 1, 2, 3, 5, 8, 13, 20, 40, rng.randrange(64)])]

    def small() -> list[Any]:
        return weird(rng) if rng.random() < hostile else ["int", rng.choice([-8, -3, -1, 0, 1, 2, 3, 7, 100])]

    def flags() -> list[Any]:
        return weird(rng) if rng.random() < hostile else ["int", rng.choice([0, 0, 0, 1, 2, 4, 3])]

    n_writes = 0
    next_pos = [0] * max(n_seq, 1)
    ops: list[list[Any]] = []
    for _ in range(rng.randint(4, 24)):
        r = rng.random()
        if r < 0.32:
            n = rng.randint(1, 6)
            seqs = rng.sample(range(n_seq), k=min(n_seq, rng.choice([1, 1, 1, 2])))
            s = seqs[0]
            if rng.random() < hostile:
                tok_seq: list[Any] = [[weird(rng) if rng.random() < 0.5 else ["int", x] for x in seqs]] * n
            else:
                tok_seq = [[["int", x] for x in seqs]] * n
            if rng.random() < 0.3:
                p: Any = None  # positions from the memory (llama_batch_allocr fills them)
            else:
                start = next_pos[s] if rng.random() < 0.8 else rng.choice([0, -1, next_pos[s] + 5, 2**31 - 2])
                p = [["int", start + k] for k in range(n)]
                if rng.random() < hostile:
                    p[rng.randrange(n)] = weird(rng)
            next_pos[s] += n
            nub = ["int", cfg["n_ubatch"]] if rng.random() >= hostile else weird(rng)
            ops.append(["decode", [n, p, tok_seq, nub]])
        elif r < 0.42:
            ops.append(["seq_rm", [seq(), pos(), pos()]])
        elif r < 0.5:
            ops.append(["seq_cp", [seq(), seq(), pos(), pos()]])
        elif r < 0.55:
            ops.append(["seq_keep", [seq()]])
        elif r < 0.62:
            ops.append(["seq_add", [seq(), pos(), pos(), small()]])
        elif r < 0.67:
            ops.append(["seq_div", [seq(), pos(), pos(), small()]])
        elif r < 0.72:
            ops.append([rng.choice(["seq_pos_min", "seq_pos_max"]), [seq()]])
        elif r < 0.8:
            ops.append(["state_write", [seq(), flags()]])
            n_writes += 1
        elif r < 0.9:
            if n_writes and rng.random() < 0.85:
                cut = None if rng.random() < 0.6 else rng.randrange(0, 4096)
                flips = [[rng.randrange(1 << 16), rng.randrange(256)] for _ in range(rng.choice([0, 0, 0, 1, 2]))]
                data: list[Any] = ["blob", rng.randrange(n_writes), cut, flips]
            else:
                data = ["data", rng.choice(["none", "str", "int", "empty", "bytearray", "array", "list"])]
            ops.append(["state_read", [data, seq(), flags()]])
        elif r < 0.95:
            ops.append(["clear", [["bool", True] if rng.random() >= hostile else weird(rng)]])
        else:
            ops.append(["update", []])
    return {"seed": seed, "index": index, "config": cfg, "ops": ops}


@cache
def _hparams(model: str) -> Any:
    from kvref.jobs import conformance as C

    case = json.loads((GOLDEN / MODELS[model] / "case.json").read_text())
    return C.hparams_from_case(case)


def build_memory(cfg: dict[str, Any]) -> Any:
    from kvref import create_memory

    return create_memory(
        _hparams(cfg["model"]),
        n_ctx=cfg["n_ctx"],
        n_seq_max=cfg["n_seq_max"],
        kv_unified=cfg["kv_unified"],
        flash_attn=cfg["flash_attn"],
        n_ubatch=512,
        n_batch=512,
    )


def call(mem: Any, name: str, args: list[Any], blobs: list[bytes]) -> Any:
    """Perform one op; the Batch of a decode is built inside (its own validation is part of the API)."""
    if name == "decode":
        from kvref.memory.batch import Batch

        n, p, tok_seq, nub = args
        batch = Batch(
            tokens=list(range(1, n + 1)),
            pos=None if p is None else [value(x, blobs) for x in p],
            seq_ids=[[value(x, blobs) for x in ids] for ids in tok_seq],
        )
        return mem.decode(batch, value(nub, blobs))
    return getattr(mem, name)(*(value(a, blobs) for a in args))


def program_source(prog: dict[str, Any]) -> str:
    """The program as a Python script (what a reproducer prints)."""
    cfg = prog["config"]
    lines = [
        "import numpy as np, kvref, json",
        "from kvref import conformance as C",
        "from kvref.memory.batch import Batch",
        f"case = json.load(open('conformance/golden/{MODELS[cfg['model']]}/case.json'))",
        f"mem = kvref.create_memory(C.hparams_from_case(case), n_ctx={cfg['n_ctx']}, n_seq_max={cfg['n_seq_max']}, "
        f"kv_unified={cfg['kv_unified']}, flash_attn={cfg['flash_attn']}, n_ubatch=512, n_batch=512)",
        "blobs = []",
        "def blob(blobs, k, cut, flips):",
        "    b = bytearray(blobs[k % len(blobs)]) if blobs else bytearray()",
        "    if cut is not None: del b[cut % (len(b) + 1):]",
        "    for at, v in flips:",
        "        if b: b[at % len(b)] = v",
        "    return bytes(b)",
    ]
    for name, args in prog["ops"]:
        if name == "decode":
            n, p, tok_seq, nub = args
            pos = "None" if p is None else "[" + ", ".join(show(x) for x in p) + "]"
            ids = "[" + ", ".join("[" + ", ".join(show(x) for x in t) + "]" for t in tok_seq) + "]"
            lines.append(f"mem.decode(Batch(tokens={list(range(1, n + 1))}, pos={pos}, seq_ids={ids}), {show(nub)})")
        elif name == "state_write":
            lines.append(f"blobs.append(mem.state_write({', '.join(show(a) for a in args)}))")
        else:
            lines.append(f"mem.{name}({', '.join(show(a) for a in args)})")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- running
def snapshot(mem: Any, n_seq: int) -> tuple[Any, ...]:
    seqs = range(n_seq)
    return (
        mem.state_write(-1),
        tuple(mem.state_write(s) for s in seqs),
        tuple((mem.seq_pos_min(s), mem.seq_pos_max(s)) for s in seqs),
    )


def _digest(snap: tuple[Any, ...]) -> str:
    h = hashlib.sha256(snap[0])
    for b in snap[1]:
        h.update(b)
    h.update(repr(snap[2]).encode())
    return h.hexdigest()[:16]


def _result(res: Any) -> Any:
    if isinstance(res, bytes):
        return f"bytes:{len(res)}:{hashlib.sha256(res).hexdigest()[:16]}"
    if isinstance(res, list):  # decode: (ubatch, slot) per ubatch
        return [f"ubatch:{getattr(u, 'n_tokens', '?')}" for u, _ in res]
    if isinstance(res, bool | int | float | type(None)) or type(res).__module__ == "numpy":
        return f"{type(res).__name__}:{res!r}"
    return type(res).__name__


def run_program(prog: dict[str, Any], backend: str) -> tuple[list[Finding], list[Any]]:
    """Run one program; returns the findings and the outcome (per op: result or error, and the state digest)."""
    from kvref.errors import KVRefError

    idx = prog["index"]
    found: list[Finding] = []
    outcome: list[Any] = []
    cfg = prog["config"]
    try:
        mem = build_memory(cfg)
    except KVRefError as e:
        return [], [{"op": "create_memory", "err": f"{type(e).__name__}: {e}"}]
    n_seq = cfg["n_seq_max"]
    blobs: list[bytes] = []
    snap = snapshot(mem, n_seq)
    for k, (name, args) in enumerate(prog["ops"]):
        rec: dict[str, Any] = {"op": name}
        try:
            res = call(mem, name, args, blobs)
            rec["ok"] = _result(res)
            if name == "state_write":
                blobs.append(res)
        except KVRefError as e:
            rec["err"] = f"{type(e).__name__}: {e}"
            try:
                after = snapshot(mem, n_seq)
            except Exception as e2:
                found.append(
                    Finding(
                        "exception",
                        f"snapshot:{exception_signature(e2)}",
                        f"after op {k} ({name}) refused, state_write/seq_pos raised {type(e2).__name__}: {e2}",
                        idx,
                        backend,
                        format_exc(e2),
                    )
                )
                outcome.append(rec)
                return found, outcome
            if after != snap:
                what = [
                    n
                    for n, a, b in zip(("state_write(-1)", "state_write(seq)", "seq_pos"), after, snap, strict=True)
                    if a != b
                ]
                tag = ",".join(kinds(args)) or "int"
                found.append(
                    Finding(
                        "partial",
                        f"{name}({tag}):{cfg['model']}:{type(e).__name__}",
                        f"op {k} {name} refused ({type(e).__name__}: {e}) but changed {', '.join(what)}",
                        idx,
                        backend,
                    )
                )
        except Exception as e:
            rec["err"] = f"{type(e).__name__}: {e}"
            tag = ",".join(kinds(args)) or "int"
            found.append(
                Finding(
                    "exception",
                    f"{name}({tag}):{exception_signature(e)}",
                    f"op {k} {name}: {type(e).__name__}: {e}",
                    idx,
                    backend,
                    format_exc(e),
                )
            )
        try:
            snap = snapshot(mem, n_seq)
        except Exception as e:
            found.append(
                Finding(
                    "exception",
                    f"snapshot:{exception_signature(e)}",
                    f"after op {k} ({name}), state_write/seq_pos raised {type(e).__name__}: {e}",
                    idx,
                    backend,
                    format_exc(e),
                )
            )
            outcome.append(rec)
            return found, outcome
        rec["state"] = _digest(snap)
        outcome.append(rec)
    return found, outcome


def _twin_signature(a: list[Any], b: list[Any]) -> str:
    for x, y in zip(a, b, strict=False):
        if x != y:
            keys = [k for k in ("ok", "err", "state") if x.get(k) != y.get(k)]
            return f"{x.get('op')}:{'/'.join(keys)}"
    return "length"


def save_reproducer(out_dir: Path, f: Finding, seed: int) -> str:
    prog = make_program(seed, f.input_id)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{f.category}-s{seed}-p{f.input_id}-{f.backend}"
    stem.with_suffix(".py").write_text(f"# {f.category} {f.signature}: {f.message}\n" + program_source(prog) + "\n")
    stem.with_suffix(".json").write_text(json.dumps({"program": prog, "finding": f.to_json()}, indent=1))
    return str(stem.with_suffix(".py"))


def run_campaign(
    programs: int,
    seed: int = 0,
    *,
    jobs: int = 1,
    backends: tuple[str, ...] = BACKENDS,
    batch: int = 200,
    timeout: float = 30.0,
    mem_cap_mb: int = 1024,
    start: int = 0,
    out_dir: Path | None = DEFAULT_OUT,
    known: dict[str, str] | None = None,
    progress: bool = False,
) -> Report:
    """Run programs ``start .. start + programs`` of ``seed`` under every backend in ``backends`` and compare."""

    def on_kill(i: int, backend: str, status: str, info: str, where: str) -> Finding:
        first = info.strip().splitlines()[0] if info.strip() else status
        return Finding(status, f"{status}:{first}", f"{status} ({first}), {where}", i, backend, info)

    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        "--seed",
        str(seed),
        "--mem-cap-mb",
        str(mem_cap_mb),
    ]
    results, outcomes = campaign(
        lambda b: argv, list(range(start, start + programs)), list(backends), jobs, batch, timeout, on_kill, progress
    )
    report = Report(inputs=len({i for _, i in results}))
    for fs in results.values():
        report.findings.extend(fs)
    report.findings.extend(twin_findings(outcomes, _twin_signature))
    report.extra["ops"] = sum(len(make_program(seed, i)["ops"]) for i in {i for _, i in results})
    apply_known(report.findings, KNOWN_ISSUES if known is None else known)
    if out_dir is not None:
        seen: set[tuple[str, str]] = set()
        for f in sorted(report.findings, key=lambda f: (len(make_program(seed, f.input_id)["ops"]), f.input_id)):
            if (f.category, f.signature) not in seen:
                seen.add((f.category, f.signature))
                f.repro = save_reproducer(out_dir, f, seed)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--batch", type=int, default=200, help="programs per child process")
    p.add_argument("--backend", choices=["both", *BACKENDS], default="both")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds one program may take")
    p.add_argument("--mem-cap-mb", type=int, default=1024, help="address space a child may add (RLIMIT_AS)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--show", type=int, help="print program SHOW of --seed as Python and exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.show is not None:
        print(program_source(make_program(a.seed, a.show)))
        return 0
    if a.child:
        from kvref._backend import requested

        backend = requested()
        return child_main(lambda i: run_program(make_program(a.seed, i), backend), a.mem_cap_mb)
    backends = BACKENDS if a.backend == "both" else (a.backend,)
    t0 = time.monotonic()
    report = run_campaign(
        a.programs,
        a.seed,
        jobs=a.jobs,
        backends=backends,
        batch=a.batch,
        timeout=a.timeout,
        mem_cap_mb=a.mem_cap_mb,
        start=a.start,
        out_dir=a.out,
        progress=True,
    )
    report.extra["seconds"] = round(time.monotonic() - t0)
    report.print("misuse")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
