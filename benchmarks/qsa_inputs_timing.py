"""Time qwen4exp's QSA input fill (`kvref.memory.qsa.qsa_inputs`) over a few thousand cells:

    python benchmarks/qsa_inputs_timing.py                      # this checkout's qsa_inputs
    python benchmarks/qsa_inputs_timing.py --against OLD.py     # and a copy of another qsa.py, with the ratio

Workloads (an indexer cache of 4096 cells, ratio 4, causal): a 1-token decode step after 3583 cells of two
sequences, and a 512-token ubatch ending at 3584 cells; each with the per-block bias (``blk_bias``, what
qwen4exp's graph takes) and the per-cell bias. Then the ranked layout's order (``rank_order``, libstdc++'s std::sort
of 4096 cells of M-RoPE images: 64 x 64 cells per position, many equal keys) with each twin and their ratio.
Times are the best of a few repeats; the machine may be busy.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit
from pathlib import Path
from types import ModuleType

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from golden import load_case

import kvref.memory.qsa as qsa
from kvref.jobs import conformance as C
from kvref.memory.batch import Batch
from kvref.memory.factory import create_memory
from kvref.memory.hybrid_idx import HybridIdxMemory

N_CELLS = 4096
RATIO = 4


def workloads() -> list[tuple[str, HybridIdxMemory, object, object]]:
    """(name, memory, ubatch, slot) after each workload's decodes."""
    hp = C.hparams_from_case(load_case("qwen4exp-hybrid-idx"))
    out = []
    for name, n_prefill, n_last in (("decode step, 1 token", 3583, 1), ("ubatch of 512 tokens", 3072, 512)):
        mem = create_memory(hp, N_CELLS, 2, True)
        assert isinstance(mem, HybridIdxMemory)
        half = n_prefill // 2
        for s, n in ((0, half), (1, n_prefill - half)):
            mem.decode(Batch(tokens=[5] * n, pos=list(range(n)), seq_ids=[[s]] * n), n_ubatch=512)
        p0 = n_prefill - half
        placed = mem.decode(
            Batch(tokens=[5] * n_last, pos=list(range(p0, p0 + n_last)), seq_ids=[[1]] * n_last), n_ubatch=512
        )
        ub, slot = placed[-1]
        out.append((name, mem, ub, slot))
    return out


def best(mod: ModuleType, mem: HybridIdxMemory, ub: object, slot: object, blk_bias: bool) -> float:
    def call() -> object:
        return mod.qsa_inputs(mem.idx, ub, slot.attn, RATIO, blk_bias=blk_bias, causal=True)  # type: ignore[attr-defined]

    n = 1
    while timeit.timeit(call, number=n) < 0.2 and n < 1000:
        n *= 4
    return min(timeit.repeat(call, number=n, repeat=3)) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="another qsa.py to time side by side")
    args = ap.parse_args()
    other = None
    if args.against:
        spec = importlib.util.spec_from_file_location("kvref.memory._qsa_other", args.against)
        assert spec is not None and spec.loader is not None
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
    for name, mem, ub, slot in workloads():
        for blk_bias in (True, False):
            t = best(qsa, mem, ub, slot, blk_bias)
            row = f"{name:22s} bias per {'block' if blk_bias else 'cell ':5s}  this: {t * 1e3:9.3f} ms"
            if other is not None:
                a = qsa.qsa_inputs(mem.idx, ub, slot.attn, RATIO, blk_bias=blk_bias, causal=True)  # type: ignore[attr-defined]
                b = other.qsa_inputs(mem.idx, ub, slot.attn, RATIO, blk_bias=blk_bias, causal=True)
                same = all(np.array_equal(a[k], b[k]) for k in a)
                t2 = best(other, mem, ub, slot, blk_bias)
                row += f"  other: {t2 * 1e3:9.3f} ms  other/this: {t2 / t:7.1f}x  same: {same}"
            print(row, flush=True)
    rank_twins()


def rank_twins() -> None:
    from kvref._backend import _load_compiled
    from kvref.memory import _qsa_py

    rng = np.random.default_rng(0)
    n = N_CELLS
    cells = np.arange(n, dtype=np.int64)
    pos = np.repeat(np.arange(n // 64), 64).astype(np.int64)
    y = rng.integers(0, 8, n).astype(np.int64)
    x = rng.integers(0, 8, n).astype(np.int64)
    times = {}
    for name, mod in (("python", _qsa_py), ("cython", _load_compiled("memory.qsa"))):
        if mod is None:
            print("rank_order: the Cython twin is not built")
            return
        times[name] = best_call(lambda mod=mod: mod.rank_order(cells, pos, y, x))
    print(
        f"rank_order, {n} cells       python: {times['python'] * 1e3:9.3f} ms  cython: {times['cython'] * 1e3:9.3f} ms"
        f"  python/cython: {times['python'] / times['cython']:7.1f}x",
        flush=True,
    )


def best_call(call: object) -> float:
    n = 1
    while timeit.timeit(call, number=n) < 0.2 and n < 100000:  # type: ignore[arg-type]
        n *= 4
    return min(timeit.repeat(call, number=n, repeat=3)) / n  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
