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

Two more attack classes go at one ``KVCells`` (``kvref.cells``, the twin KVREF_BACKEND picks) directly:

- ``--target cells``: programs over the whole KVCells API with the hostile arguments above plus integers whose
  ``__index__`` calls back into the same cells (resize, reset, rm, a range removal, a read, a place; the refusal
  propagates or is caught by the argument), set() sources whose ``pos`` does the same, and lists and NumPy arrays
  of all of these. Checks: only kvref errors; a refused call changes nothing (the full state: arrays, used set,
  every sequence's index); the cells stay whole after every call (used count, used set and per-sequence index
  agree with the arrays); the twins agree on every result, error and state.
- ``--target threads``: 2-4 threads run such programs on one KVCells while another resizes it, with a switch
  interval of a microsecond (and, on the Cython cells, the slot kernels' find_cells / place_single among the
  calls). Checks: no crash, no hang, only kvref errors, the cells whole at the end. Interleavings are not
  reproducible, so the twins are not compared; a finding re-runs its program alone to confirm.

    python fuzzing/misuse.py --programs 5000 --seed 1 --jobs 2
    python fuzzing/misuse.py --target cells --programs 5000 --seed 1 --jobs 2
    python fuzzing/misuse.py --target threads --programs 300 --seed 1 --jobs 2
    python fuzzing/misuse.py --show 17 --seed 1            # print program 17 as Python
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import tempfile
import threading
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
        "from kvref.jobs import conformance as C",
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


# --------------------------------------------------------------------------------------------- cells programs
# an argument of a cells op is a descriptor as above, or ["reenter", v, action, swallow] (an int v whose __index__
# first runs ``action`` on the cells under test), ["list", [descriptors]], ["nparr", dtype, [ints]] or, for set(),
# ["other", kind, n]
REENTER_ACTIONS = ["resize", "resize0", "reset", "rm0", "seq_rm_all", "read", "place"]
TARGETS = ("memory", "cells", "threads")


def _action(cells: Any, action: str) -> Any:
    if action == "resize":
        return cells.resize(3)
    if action == "resize0":
        return cells.resize(0)
    if action == "reset":
        return cells.reset()
    if action == "rm0":
        return cells.rm(0)
    if action == "seq_rm_all":
        return cells.seq_rm_range(-1, 0, 1 << 30)
    if action == "read":
        return cells.seq_pos_max(0)
    return cells.place([0], [1], [0])


class Reenter:
    """An integer whose ``__index__`` calls back into the cells first: the nested call must be refused."""

    def __init__(self, cells: Any, value: int, action: str, swallow: bool) -> None:
        self.cells, self.value, self.action, self.swallow = cells, value, action, swallow

    def __index__(self) -> int:
        from kvref.errors import KVRefError

        try:
            _action(self.cells, self.action)
        except KVRefError:
            if not self.swallow:
                raise
        return self.value

    def __repr__(self) -> str:
        return f"Reenter({self.value})"


class OtherCells:
    """set()'s other: another cells' arrays, whose ``pos`` first calls back into the target cells."""

    def __init__(self, src: Any, target: Any, action: str) -> None:
        self.src, self.target, self.action = src, target, action

    @property
    def pos(self) -> Any:
        _action(self.target, self.action)
        return self.src.pos

    @property
    def ext(self) -> Any:
        return self.src.ext

    @property
    def seq(self) -> Any:
        return self.src.seq


def _pattern_cells(cls: type, n: int) -> Any:
    c = cls(n)
    for i in range(n):
        c.pos_set(i, i + 1)
        c.seq_add(i, i % 3)
    return c


def cvalue(arg: Any, cells: Any) -> Any:
    """The Python value a cells-op descriptor stands for (``cells``: the cells under test)."""
    import numpy as np

    kind = arg[0]
    if kind == "reenter":
        return Reenter(cells, arg[1], arg[2], arg[3])
    if kind == "list":
        return [cvalue(x, cells) for x in arg[1]]
    if kind == "nparr":
        return np.array(arg[2], dtype=np.int64).astype(arg[1])
    if kind == "other":
        _, what, n = arg
        if what == "cells":
            return _pattern_cells(type(cells), n)
        if what == "evil":
            return OtherCells(_pattern_cells(type(cells), n), cells, "resize")
        return {"none": None, "array": np.zeros(3), "int": 5}[what]
    return value(arg, [])


def cshow(arg: Any) -> str:
    kind = arg[0]
    if kind == "reenter":
        return f"Reenter(c, {arg[1]}, {arg[2]!r}, {arg[3]})"
    if kind == "list":
        return "[" + ", ".join(cshow(x) for x in arg[1]) + "]"
    if kind == "nparr":
        return f"np.array({arg[2]}, dtype=np.int64).astype({arg[1]!r})"
    if kind == "other":
        _, what, n = arg
        if what == "cells":
            return f"_pattern_cells(type(c), {n})"
        if what == "evil":
            return f"OtherCells(_pattern_cells(type(c), {n}), c, 'resize')"
        return {"none": "None", "array": "np.zeros(3)", "int": "5"}[what]
    return show(arg)


def make_cells_ops(rng: random.Random, size: int, n_ops: int, hostile: float, slot_ops: bool) -> list[list[Any]]:
    """``n_ops`` cells ops on cells of about ``size`` cells, a share ``hostile`` of their arguments hostile."""

    def h(normal: int) -> list[Any]:
        r = rng.random()
        if r < hostile * 0.45:
            return weird(rng)
        if r < hostile:
            return ["reenter", normal, rng.choice(REENTER_ACTIONS), rng.random() < 0.5]
        return ["int", normal]

    def idx() -> list[Any]:
        return h(rng.choice([rng.randrange(max(size, 1)), rng.randrange(-1, size + 2)]))

    def pos() -> list[Any]:
        return h(rng.choice([rng.randrange(40), rng.randrange(-2, 3), 2**31 - 1, 2**31]))

    def seq() -> list[Any]:
        return h(rng.choice([0, 0, 1, 1, 2, 3, rng.randrange(-1, 257)]))

    def small() -> list[Any]:
        return h(rng.choice([-5, -2, -1, 0, 1, 2, 3, 7, 40]))

    def many(gen: Any) -> list[Any]:
        k = rng.choice([0, 1, 2, 3, 5, 8])
        r = rng.random()
        if r < 0.15:
            dtype = rng.choice(["int64", "int32", "uint8", "int8", "uint64"])
            return ["nparr", dtype, [rng.randrange(4) for _ in range(k)]]
        if r < 0.2 and hostile:
            return weird(rng)
        return ["list", [gen() for _ in range(k)]]

    ops: list[list[Any]] = []
    for _ in range(n_ops):
        r = rng.random()
        if r < 0.03:
            ops.append(["resize", [h(rng.choice([0, 1, 8, 16, 32, 64]))]])
        elif r < 0.05:
            ops.append([rng.choice(["reset", "reset_shift"]), []])
        elif r < 0.22:
            ops.append(["pos_set", [idx(), pos()]])
        elif r < 0.35:
            ops.append(["seq_add", [idx(), seq()]])
        elif r < 0.38:
            ops.append([rng.choice(["seq_rm", "seq_keep", "seq_has"]), [idx(), seq()]])
        elif r < 0.42:
            one = ["rm", "pos_get", "ext_get", "is_empty", "seq_get", "seq_count", "seq_get_all", "get_shift"]
            ops.append([rng.choice(one), [idx()]])
        elif r < 0.47:
            ops.append([rng.choice(["pos_add", "pos_div"]), [idx(), small()]])
        elif r < 0.50:
            ops.append(["pos_set_shifted", [idx(), pos(), small()]])
        elif r < 0.53:
            ops.append(["ext_set", [idx(), small(), small(), pos()]])
        elif r < 0.56:
            ops.append(["pos_in", [idx(), pos(), pos()]])
        elif r < 0.60:
            name = rng.choice(["seq_pos_min", "seq_pos_max", "seq_pos_get", "seq_keep_all"])
            ops.append([name, [seq()]])
        elif r < 0.62:
            ops.append(["seq_pos_tok_le", [seq(), pos()]])
        elif r < 0.66:
            ops.append(["pos_set_many", [many(idx), many(pos)]])
        elif r < 0.69:
            ops.append(["seq_add_many", [many(idx), seq() if rng.random() < 0.3 else many(seq)]])
        elif r < 0.71:
            ops.append(["ext_set_many", [many(idx), small(), many(small), pos()]])
        elif r < 0.73:
            ops.append(["pos_add_many", [many(idx), small()]])
        elif r < 0.75:
            ops.append([rng.choice(["seq_pos_min_many", "seq_pos_max_many"]), [many(seq)]])
        elif r < 0.79:
            k = rng.choice([1, 2, 3])
            ext = ["list", [many(small), small(), many(pos)]] if rng.random() < 0.5 else ["none"]
            ops.append(
                [
                    "place",
                    [
                        ["list", [idx() for _ in range(k)]],
                        ["list", [pos() for _ in range(k)]],
                        ["list", [seq() for _ in range(k)]],
                        ext,
                        ["bool", rng.random() < 0.2],
                    ],
                ]
            )
        elif r < 0.83:
            ops.append(["seq_rm_range", [h(rng.choice([-1, 0, 1, 2])), pos(), pos()]])
        elif r < 0.85:
            ops.append(["seq_cp_range", [seq(), seq(), pos(), pos()]])
        elif r < 0.88:
            ops.append([rng.choice(["seq_add_range", "seq_div_range"]), [seq(), pos(), pos(), small()]])
        elif r < 0.91:
            ops.append(["cp", [idx(), h(rng.randrange(0, 5))] if rng.random() < 0.5 else [many(idx)]])
        elif r < 0.94:
            n = rng.choice([0, 1, 2, 4])
            other = ["other", rng.choice(["cells", "cells", "evil", "none", "array", "int"]), n]
            ops.append(["set", [idx() if rng.random() < 0.6 else many(idx), other]])
        elif r < 0.97 or not slot_ops:
            ops.append([rng.choice(["used_cells", "used_min", "used_max_p1", "get_used", "size"]), []])
        else:
            n = rng.randrange(1, 6)
            ops.append([rng.choice(["find_cells", "place_single"]), [rng.randrange(size + 2), n, rng.random() < 0.5]])
    return ops  # fmt: skip


def make_cells_program(seed: int, index: int, target: str = "cells") -> dict[str, Any]:
    """Program ``index`` of a ``--target cells`` (or ``threads``) campaign ``seed``."""
    rng = random.Random(f"misuse-{target}:{seed}:{index}")
    size = rng.choice([4, 8, 16, 33, 64])
    hostile = rng.choice([0.05, 0.15, 0.3])
    if target == "cells":
        return {"seed": seed, "index": index, "target": target, "size": size,
                "ops": make_cells_ops(rng, size, rng.randint(8, 40), hostile, False)}  # fmt: skip
    n_threads = rng.choice([2, 3, 4])
    return {
        "seed": seed,
        "index": index,
        "target": target,
        "size": size,
        "switch": rng.choice([1e-6, 1e-6, 1e-5]),
        "resizes": [rng.choice([0, 1, 8, 16, 64, 128]) for _ in range(rng.choice([50, 200, 500]))],
        "threads": [make_cells_ops(rng, size, rng.randint(50, 300), hostile, True) for _ in range(n_threads)],
    }


def call_cells(cells: Any, name: str, args: list[Any]) -> Any:
    if name in ("find_cells", "place_single"):  # the slot kernels on these cells (the Cython cells only)
        import numpy as np

        from kvref.memory import slot_kernels

        head, n, cont = args
        if name == "find_cells":
            return slot_kernels.impl.find_cells(cells, head, n, cont, 4, 1)
        return slot_kernels.impl.place_single(cells, head, np.arange(n, dtype=np.int64), None, [[2]] * n, 4, 4, 1)
    return getattr(cells, name)(*(cvalue(a, cells) for a in args))


def cells_source(prog: dict[str, Any]) -> str:
    """A ``--target cells`` program as a Python script."""
    lines = [
        "import numpy as np",
        "from kvref.cells import KVCells",
        "import sys; sys.path.insert(0, 'fuzzing')",
        "from misuse import Reenter, OtherCells, _pattern_cells",
        f"c = KVCells({prog['size']})",
    ]
    for name, args in prog["ops"]:
        lines.append(f"c.{name}({', '.join(cshow(a) for a in args)})")
    return "\n".join(lines)


def cells_state(c: Any) -> tuple[Any, ...]:
    """Everything observable about a KVCells."""
    import numpy as np

    pmin = c.seq_pos_min_many(np.arange(256))
    return (
        c.size(),
        c.get_used(),
        c.get_has_shift(),
        c.used_min(),
        c.used_max_p1(),
        c.used_cells().tobytes(),
        np.asarray(c.pos).tobytes(),
        np.asarray(c.shift).tobytes(),
        np.asarray(c.ext).tobytes(),
        np.asarray(c.seq).tobytes(),
        pmin.tobytes(),
        c.seq_pos_max_many(np.arange(256)).tobytes(),
        tuple(tuple(c.seq_pos_get(int(s))) for s in np.flatnonzero(pmin != -1)),
    )


def cells_torn(c: Any) -> str | None:
    """What does not agree with the arrays (None: the cells are whole)."""
    import numpy as np

    n = c.size()
    pos, ext, seq = np.asarray(c.pos), np.asarray(c.ext), np.asarray(c.seq)
    if pos.shape != (n,) or ext.shape != (n, 3) or seq.shape != (n, 4):
        return f"size {n} but arrays {pos.shape} {ext.shape} {seq.shape}"
    used = np.flatnonzero(pos != -1)
    if c.get_used() != used.size or c.used_cells().tolist() != used.tolist():
        return f"get_used {c.get_used()} / used_cells for {used.size} used cells"
    if np.any(seq[pos == -1] != 0):
        return "an empty cell holds sequences"
    for s in range(256):
        held = np.flatnonzero((seq[:, s >> 6] >> np.uint64(s & 63)) & np.uint64(1))
        want = sorted(zip(pos[held].tolist(), held.tolist(), strict=True))
        if c.seq_pos_get(s) != want:
            return f"the index of sequence {s} is out of step with the arrays"
    return None


def _cresult(res: Any) -> Any:
    import numpy as np

    if isinstance(res, np.ndarray):
        return f"{res.dtype}:{hashlib.sha256(res.tobytes()).hexdigest()[:16]}:{res.shape}"
    if hasattr(res, "seq_pos_get"):
        return "cells:" + _cdigest(cells_state(res))
    if isinstance(res, tuple):  # place_single's plan
        return [_cresult(x) for x in res]
    return f"{type(res).__name__}:{res!r}"


def _cdigest(state: tuple[Any, ...]) -> str:
    return hashlib.sha256(repr(state).encode()).hexdigest()[:16]


def run_cells_program(prog: dict[str, Any], backend: str) -> tuple[list[Finding], list[Any]]:
    """One ``--target cells`` program: findings and the outcome (per op: result or error, and the state digest)."""
    from kvref.cells import KVCells
    from kvref.errors import KVRefError

    idx = prog["index"]
    found: list[Finding] = []
    outcome: list[Any] = []
    c = KVCells(prog["size"])
    for k, (name, args) in enumerate(prog["ops"]):
        rec: dict[str, Any] = {"op": name}
        before = cells_state(c)
        tag = ",".join(kinds(args)) or ("reenter" if "reenter" in repr(args) else "int")
        try:
            rec["ok"] = _cresult(call_cells(c, name, args))
        except KVRefError as e:
            rec["err"] = f"{type(e).__name__}: {e}"
            if cells_state(c) != before:
                msg = f"op {k} {name} refused ({type(e).__name__}: {e}) but changed the cells"
                found.append(Finding("partial", f"cells.{name}({tag}):{type(e).__name__}", msg, idx, backend))
        except Exception as e:
            rec["err"] = f"{type(e).__name__}: {e}"
            msg = f"op {k} {name}: {type(e).__name__}: {e}"
            sig = f"cells.{name}({tag}):{exception_signature(e)}"
            found.append(Finding("exception", sig, msg, idx, backend, format_exc(e)))
        torn = cells_torn(c)
        if torn is not None:
            found.append(Finding("partial", f"cells.{name}:torn", f"after op {k} {name}: {torn}", idx, backend))
            outcome.append(rec)
            return found, outcome
        rec["state"] = _cdigest(cells_state(c))
        outcome.append(rec)
    return found, outcome


def run_threads_program(prog: dict[str, Any], backend: str) -> tuple[list[Finding], None]:
    """One ``--target threads`` program: every thread's ops and the resizes at once, a microsecond per switch."""
    from kvref.cells import KVCells
    from kvref.errors import KVRefError

    idx = prog["index"]
    c = KVCells(prog["size"])
    errors: list[tuple[str, BaseException]] = []
    slot_ops = backend == "cython"  # the Python slot twin reads the cells through calls it does not hold together

    def work(ops: list[list[Any]]) -> None:
        for name, args in ops:
            if name in ("find_cells", "place_single") and not slot_ops:
                continue
            try:
                call_cells(c, name, args)
            except KVRefError:
                pass
            except Exception as e:
                errors.append((name, e))

    def resize() -> None:
        for n in prog["resizes"]:
            try:
                c.resize(n)
            except KVRefError:
                pass
            except Exception as e:
                errors.append(("resize", e))

    old = sys.getswitchinterval()
    sys.setswitchinterval(prog["switch"])
    try:
        threads = [threading.Thread(target=work, args=(ops,)) for ops in prog["threads"]]
        threads.append(threading.Thread(target=resize))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    found = [
        Finding("exception", f"threads.{name}:{exception_signature(e)}", f"{name}: {type(e).__name__}: {e}", idx,
                backend, format_exc(e))
        for name, e in errors
    ]  # fmt: skip
    torn = cells_torn(c)
    if torn is not None:
        found.append(Finding("partial", "threads:torn", f"after the threads: {torn}", idx, backend))
    return found, None


def run_any(seed: int, index: int, target: str, backend: str) -> tuple[list[Finding], Any]:
    if target == "memory":
        return run_program(make_program(seed, index), backend)
    if target == "cells":
        return run_cells_program(make_cells_program(seed, index, target), backend)
    return run_threads_program(make_cells_program(seed, index, target), backend)


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


def make_any(seed: int, index: int, target: str) -> dict[str, Any]:
    return make_program(seed, index) if target == "memory" else make_cells_program(seed, index, target)


def n_ops(prog: dict[str, Any]) -> int:
    if prog.get("target") == "threads":
        return sum(len(ops) for ops in prog["threads"]) + len(prog["resizes"])
    return len(prog["ops"])


def save_reproducer(out_dir: Path, f: Finding, seed: int, target: str = "memory") -> str:
    prog = make_any(seed, f.input_id, target)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{target}-{f.category}-s{seed}-p{f.input_id}-{f.backend}"
    if target == "memory":
        src = program_source(prog)
    elif target == "cells":
        src = cells_source(prog)
    else:  # an interleaving is not reproducible: the script re-runs the program in this process
        src = (
            "import sys; sys.path.insert(0, 'fuzzing')\nimport misuse\nfrom kvref._backend import requested\n"
            f"print(misuse.run_threads_program(misuse.make_cells_program({seed}, {f.input_id}, 'threads'), "
            "requested()))"
        )
    stem.with_suffix(".py").write_text(f"# {f.category} {f.signature}: {f.message}\n" + src + "\n")
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
    target: str = "memory",
) -> Report:
    """Run programs ``start .. start + programs`` of ``seed`` (of ``target``: memory, cells or threads) under every
    backend in ``backends`` and compare."""

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
        "--target",
        target,
    ]
    results, outcomes = campaign(
        lambda b: argv, list(range(start, start + programs)), list(backends), jobs, batch, timeout, on_kill, progress
    )
    report = Report(inputs=len({i for _, i in results}))
    for fs in results.values():
        report.findings.extend(fs)
    report.findings.extend(twin_findings(outcomes, _twin_signature))
    report.extra["ops"] = sum(n_ops(make_any(seed, i, target)) for i in {i for _, i in results})
    apply_known(report.findings, KNOWN_ISSUES if known is None else known)
    if out_dir is not None:
        seen: set[tuple[str, str]] = set()
        for f in sorted(report.findings, key=lambda f: (n_ops(make_any(seed, f.input_id, target)), f.input_id)):
            if (f.category, f.signature) not in seen:
                seen.add((f.category, f.signature))
                f.repro = save_reproducer(out_dir, f, seed, target)
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
    p.add_argument("--target", choices=TARGETS, default="memory", help="what the programs attack (see above)")
    p.add_argument("--show", type=int, help="print program SHOW of --seed as Python and exit")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.show is not None:
        prog = make_any(a.seed, a.show, a.target)
        print(program_source(prog) if a.target == "memory" else cells_source(prog) if a.target == "cells" else prog)
        return 0
    if a.child:
        from kvref._backend import requested

        backend = requested()
        return child_main(lambda i: run_any(a.seed, i, a.target, backend), a.mem_cap_mb)
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
        target=a.target,
    )
    report.extra["seconds"] = round(time.monotonic() - t0)
    report.print("misuse" if a.target == "memory" else f"misuse {a.target}")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
