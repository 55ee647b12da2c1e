"""What auto-detection costs: ``kvref.state.load(src)`` against the same load with every option given.

Run: ``python benchmarks/bench_load_detect.py [--cells 32768,262144] [--rounds 7] [--dir DIR]``. Inputs are
built with kvref's own writer (random K/V bytes, one sequence id per cell unless said otherwise) and cached in
``--dir``; each row prints the median time of ``load(src)`` (kind and layout auto-detected, every option
inferred), of ``load(src, kind=, layout=)`` and of the fully pinned load (one reading: kind, layout, ext_size,
has_v, outputs, n_stream_field), and the ratio auto / pinned. The two loads of a row alternate (ABBA) so that
neither always runs on a warmer cache. Target (issue 14): auto <= 1.2x pinned.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import kvref.state as S
from kvref.ggml.types import GGMLType
from kvref.state.constants import LAYOUTS

N_LAYER = 32
ROW = 64  # bytes per K / V row (f16, 32 elements): small rows keep a 262k-cell file near 1 GiB


def _cells(rng: np.random.Generator, n: int, ext: int, shared: bool) -> S.Cells:
    pos = np.arange(n, dtype=np.int32)
    seqs = [[0, 1] if shared and i % 5 == 0 else [0] for i in range(n)]
    ext_arr = rng.integers(0, 50, (n, ext // 4)).astype(np.int32) if ext else None
    return S.Cells.from_lists(pos, seqs, ext=ext_arr, ext_size=ext)


def kv_stream(n: int, seed: int, ext: int = 0, shared: bool = False, v_trans: int = 0) -> S.KVStream:
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 256, (n, ROW), dtype=np.uint8)
    ks = [S.LayerRows(int(GGMLType.F16), ROW, k) for _ in range(N_LAYER)]
    vs: list[Any]
    if v_trans:
        vt = rng.integers(0, 256, (ROW // 2, n * 2), dtype=np.uint8)
        vs = [S.TransposedRows(int(GGMLType.F16), 2, ROW // 2, vt) for _ in range(N_LAYER)]
    else:
        vs = list(ks)
    return S.KVStream(_cells(rng, n, ext, shared), S.KVData(v_trans, ks, vs))


def recurrent_section(n: int, n_state: int) -> S.RecurrentSection:
    rng = np.random.default_rng(7)
    cells = S.Cells.from_lists(np.arange(n, dtype=np.int32), [[i % 4] for i in range(n)])
    r_rows, s_rows = rng.integers(0, 256, (n, 32), dtype=np.uint8), rng.integers(0, 256, (n, 64), dtype=np.uint8)
    r = [S.RecurrentLayer(int(GGMLType.F32), 32, r_rows) for _ in range(n_state)]
    s: list[Any] = [S.LayerRows(int(GGMLType.F32), 64, s_rows) for _ in range(n_state)]
    return S.RecurrentSection(cells, 0, N_LAYER, r, s)


ARCH = {"kv": "llama", "iswa": "gemma3", "recurrent": "mamba", "hybrid": "jamba", "hybrid_iswa": "lfm2"}


def build(
    kind: str, layout: str, n: int, n_stream: int = 1, ext: int = 0, shared: bool = False, v_trans: int = 0
) -> S.StateObject:
    """A state of ``n`` cells (split over the streams of each KV section; all of them in a recurrent-only
    layout, 4 in a hybrid's recurrent section)."""
    sections: list[Any] = []
    for i, part in enumerate(LAYOUTS[layout]):
        if part == "kv":
            streams = [kv_stream(n // n_stream, 10 * i + s, ext, shared, v_trans) for s in range(n_stream)]
            sections.append(S.KVSection(streams))
        else:
            sections.append(
                recurrent_section(n if layout == "recurrent" else 4, N_LAYER if layout == "recurrent" else 8)
            )
    memory = S.MemorySections(layout, sections)
    tokens = np.arange(4, dtype=np.int32)
    if kind == "session":
        return S.SessionFile(10, tokens, ARCH.get(layout, "llama"), None, memory)
    if kind == "seq":
        return S.SeqFile(3, tokens, memory)
    if kind == "state":
        return S.StateBlob(ARCH.get(layout, "llama"), None, memory)
    return S.SeqStateBlob(memory, seq_id=0)


# (kind, layout, options of build) per row; n is the total cell count
ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("session", "kv", {}),
    ("session", "kv", {"n_stream": 4}),
    ("session", "kv", {"ext": 12, "n_stream": 4}),
    ("session", "kv", {"v_trans": 1}),
    ("session", "kv", {"shared": True}),
    ("session", "iswa", {"n_stream": 2}),
    ("session", "recurrent", {}),
    ("session", "hybrid", {}),
    ("session", "hybrid", {"n_stream": 4}),
    ("seq", "kv", {}),
    ("state", "kv", {}),
    ("state", "hybrid", {}),
    ("seq_state", "kv", {}),
]


def pinned_options(kind: str, layout: str, obj: S.StateObject) -> dict[str, Any]:
    opts: dict[str, Any] = {"kind": kind, "layout": layout, "n_stream_field": True}
    if kind in ("session", "state"):
        opts["outputs"] = False
    if kind == "seq_state":
        opts["seq_header"] = True
    kv = obj.memory.kv_sections
    if kv:
        st = kv[0].streams[0]
        opts["ext_size"] = st.cells.ext_size if st.cells is not None else 0
        opts["has_v"] = True
    if "recurrent" in LAYOUTS[layout]:
        opts["n_state_layers"] = len(obj.memory.recurrent_sections[0].r)
    return opts


def abba(a: Callable[[], object], b: Callable[[], object], rounds: int) -> tuple[float, float]:
    times: tuple[list[float], list[float]] = ([], [])
    for r in range(rounds):
        for which in (0, 1) if r % 2 == 0 else (1, 0):
            fn = (a, b)[which]
            t = time.perf_counter()
            fn()
            times[which].append(time.perf_counter() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def run(
    load: Callable[..., S.StateObject], cells: list[int], rounds: int, directory: str, rows: Any = None
) -> list[dict[str, Any]]:
    """Time ``load`` (kvref.state.load or a stand-in with its signature) on every row; returns the rows."""
    out = []
    for n in cells:
        for kind, layout, kw in rows or ROWS:
            tag = "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
            path = os.path.join(directory, f"{kind}-{layout}-{n}-{tag}.bin")
            obj = S.load(path) if os.path.exists(path) else None
            if obj is None:
                obj = build(kind, layout, n, **kw)
                obj.save(path)
                obj = S.load(path, **pinned_options(kind, layout, obj))
            pinned = pinned_options(kind, layout, obj)
            src: Any = path
            if kind not in ("session", "seq"):  # blobs are bytes
                with open(path, "rb") as f:
                    src = f.read()
            load(src, **pinned)  # warm the page cache
            given = {"kind": kind, "layout": layout}
            slow = kw.get("shared", False)
            r = max(3, rounds // 3) if slow else rounds
            t_auto, t_pin = abba(lambda: load(src), lambda: load(src, **pinned), r)  # noqa: B023
            t_given, _ = abba(lambda: load(src, **given), lambda: None, r)  # noqa: B023
            row = {"kind": kind, "layout": layout, "cells": n, **kw, "auto_ms": t_auto * 1e3}
            row |= {"given_ms": t_given * 1e3, "pinned_ms": t_pin * 1e3, "ratio": t_auto / t_pin}
            out.append(row)
            opts = " ".join(f"{k}={v}" for k, v in kw.items())
            print(
                f"{kind:9s} {layout:10s} {n:7d} cells {opts:22s} auto {t_auto * 1e3:9.2f} ms  kind+layout "
                f"{t_given * 1e3:9.2f} ms  pinned {t_pin * 1e3:8.2f} ms  auto/pinned {t_auto / t_pin:7.2f}",
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="32768,262144", help="comma-separated total cell counts")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", default=None, help="where the inputs are built and kept (default: a temp dir)")
    args = ap.parse_args()
    cells = [int(x) for x in args.cells.split(",")]
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        run(S.load, cells, args.rounds, args.dir)
    else:
        with tempfile.TemporaryDirectory() as d:
            run(S.load, cells, args.rounds, d)


if __name__ == "__main__":
    main()
