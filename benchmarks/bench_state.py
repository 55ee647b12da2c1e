"""State-file benchmarks: kvref's load and save against a plain read / write of the same bytes.

Run: ``python -m pytest benchmarks/bench_state.py --benchmark-only -s``. The input is a synthetic 1 GiB
session (f16 K/V, 32 layers, n_embd_k_gqa = n_embd_v_gqa = 1024, 4 sequences in one stream, 8192 cells) built
in a temp dir with kvref's writer from a hand-built object (``KVREF_BENCH_STATE_MIB`` scales it). Only ratios
measured in the same run mean anything, so each kvref call is timed interleaved with its baseline:

  load   kvref.state.load(path) (memory-mapped) + walking every cell's metadata (positions, seq ids,
         per-sequence ranges) and every layer header,  vs  reading the file into memory (f.read()).
  save   kvref.state.save(obj, path) of the loaded object (rows stream from the mapping),
         vs  writing the same bytes (from a mapping of the source file) to a new file.

Targets: load+metadata >= 0.8x plain-read throughput with peak memory < 1.2x the file size; save >= 0.8x
plain write. Peak memory is reported as the process's peak RSS growth (VmHWM after a clear_refs reset, Linux)
and as tracemalloc's peak of Python allocations.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import kvref.state as S
from kvref.ggml.types import GGMLType, row_size

MIB = int(os.environ.get("KVREF_BENCH_STATE_MIB", "1024"))
ROUNDS = int(os.environ.get("KVREF_BENCH_ROUNDS", "4"))
N_LAYER, N_EMBD, N_SEQ = 32, 1024, 4
RESULTS: dict[str, dict[str, float]] = {}


@pytest.fixture(autouse=True)
def _only_when_benchmarking(request: pytest.FixtureRequest) -> None:
    if not request.config.getoption("benchmark_only", False):
        pytest.skip("benchmark: run with --benchmark-only")


def _build(path: Path) -> int:
    rs = row_size(GGMLType.F16, N_EMBD)
    n_cells = max(N_SEQ, MIB * (1 << 20) // (2 * N_LAYER * rs))
    per_seq = n_cells // N_SEQ
    pos = np.tile(np.arange(per_seq, dtype=np.int32), N_SEQ)[:n_cells]
    seqs = np.repeat(np.arange(N_SEQ), per_seq)[:n_cells]
    cells = S.Cells.from_lists(pos, ([int(s)] for s in seqs))
    n = cells.n
    # one shared block of rows per tensor kind keeps the builder's own memory small
    k = np.random.default_rng(0).integers(0, 256, (n, rs), dtype=np.uint8)
    layers = [S.LayerRows(int(GGMLType.F16), rs, k) for _ in range(N_LAYER)]
    data = S.KVData(0, layers, list(layers))
    memory = S.MemorySections("kv", [S.KVSection([S.KVStream(cells, data)])])
    obj = S.SessionFile(10, np.arange(n, dtype=np.int32), "llama", None, memory)
    return obj.save(path)


@pytest.fixture(scope="module")
def session_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("state") / "big.ggsn"
    _build(path)
    return path


def _reset_peak() -> int | None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _hwm()
    except OSError:
        return None


def _hwm() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _walk(obj: S.SessionFile) -> int:
    """Touch every cell's metadata and every layer header, as `kvref inspect` does."""
    total = 0
    for sec in obj.memory.kv_sections:
        for st in sec.streams:
            if st.cells is None:
                continue
            total += int(st.cells.pos.sum()) + int(st.cells.seq_id.sum()) + len(st.cells.sequences())
            total += sum(x.row_size + x.type for x in st.data.k + st.data.v)
    return total


def _load(path: Path) -> S.SessionFile:
    obj = S.load(path, kind="session", layout="kv", ext_size=0, has_v=True)
    _walk(obj)
    return obj


def _plain_read(path: Path) -> None:
    with open(path, "rb") as f:
        f.read()


def _plain_write(src: Path, dst: Path) -> None:
    with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, open(dst, "wb") as out:
        out.write(m)


def _interleave(a, b, rounds: int, before=None) -> tuple[float, float]:
    """Median times of ``a`` and ``b`` run alternately, ABBA order so neither always inherits the other's
    dirty pages; ``before`` runs untimed ahead of each call."""
    times: dict[int, list[float]] = {0: [], 1: []}
    fns = (a, b)
    for r in range(rounds):
        for k in (0, 1) if r % 2 == 0 else (1, 0):
            if before is not None:
                before()
            t = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def _peak_memory(fn, *args):
    """Call ``fn(*args)`` once; return its result, the peak RSS growth (None off Linux) and tracemalloc's peak."""
    base = _reset_peak()
    tracemalloc.start()
    res = fn(*args)
    _, py_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = (_hwm() - base) if base is not None else None
    return res, rss, py_peak


def _record(name: str, size: int, t_kv: float, t_plain: float, rss: int | None, py_peak: int) -> None:
    RESULTS[name] = {
        "size": size,
        "kvref_s": t_kv,
        "plain_s": t_plain,
        "ratio": t_plain / t_kv,
        "rss_growth": rss,
        "py_peak": py_peak,
    }


def test_load_metadata(benchmark, session_file: Path) -> None:
    size = session_file.stat().st_size
    _plain_read(session_file)  # warm the page cache for both sides
    t_kv, t_plain = _interleave(lambda: _load(session_file), lambda: _plain_read(session_file), ROUNDS)
    obj, rss, py_peak = _peak_memory(_load, session_file)
    benchmark.pedantic(_load, args=(session_file,), rounds=ROUNDS, iterations=1)
    _record("load+metadata", size, t_kv, t_plain, rss, py_peak)
    del obj


def test_save(benchmark, session_file: Path, tmp_path: Path) -> None:
    size = session_file.stat().st_size
    obj = _load(session_file)
    out_kv, out_plain = tmp_path / "kv.ggsn", tmp_path / "plain.ggsn"

    # the previous round's outputs are deleted untimed: freeing 1 GiB (a TRIM on a discard-mounted disk) costs
    # as much as writing it, and would land on whichever writer replaces or truncates it
    def drop_outputs() -> None:
        out_kv.unlink(missing_ok=True)
        out_plain.unlink(missing_ok=True)

    t_kv, t_plain = _interleave(
        lambda: S.save(obj, out_kv), lambda: _plain_write(session_file, out_plain), ROUNDS, before=drop_outputs
    )
    assert out_kv.read_bytes()[:4096] == session_file.read_bytes()[:4096]
    assert out_kv.stat().st_size == size
    _, rss, py_peak = _peak_memory(S.save, obj, out_kv)
    benchmark.pedantic(S.save, args=(obj, out_kv), rounds=ROUNDS, iterations=1)
    _record("save", size, t_kv, t_plain, rss, py_peak)


@pytest.fixture(scope="module", autouse=True)
def _table(request: pytest.FixtureRequest):
    """Print the same-run ratio table at the end of the session (shown without ``-s``)."""
    yield
    if not RESULTS:
        return
    lines = ["", "kvref.state vs plain I/O (medians, same run; ratio = plain time / kvref time, >= 0.8 is the target)"]
    for name, r in RESULTS.items():
        rss = "n/a" if r["rss_growth"] is None else f"{r['rss_growth'] / r['size']:.3f}x file"
        lines.append(
            f"  {name:14s} {r['size'] / (1 << 30):.2f} GiB  kvref {r['kvref_s'] * 1e3:9.1f} ms  "
            f"plain {r['plain_s'] * 1e3:9.1f} ms  ratio {r['ratio']:7.2f}  peak RSS growth {rss}  "
            f"python peak {r['py_peak'] / (1 << 20):.1f} MiB"
        )
    text = "\n".join(lines)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        request.config.add_cleanup(lambda: reporter.write_line(text))
