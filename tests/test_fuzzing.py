"""A bounded campaign of the fuzzers in fuzzing/ (issue 15): fails on any finding not in their KNOWN_ISSUES.

The long campaigns are documented in fuzzing/README.md; this one takes a few seconds per fuzzer.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

FUZZING = Path(__file__).resolve().parent.parent / "fuzzing"
sys.path.insert(0, str(FUZZING))

import fuzz_common  # noqa: E402
import misuse  # noqa: E402
import side_files  # noqa: E402
import state_inputs  # noqa: E402

# both twins when the Cython extensions are built (CI builds them), else the Python twins alone
BACKENDS = tuple(b for b in fuzz_common.BACKENDS if b == "python" or importlib.util.find_spec("kvref.memory._cells_c"))


def _fail_on_new(report: fuzz_common.Report, name: str) -> None:
    if report.new:
        lines = [report.summary_line(name)]
        for (cat, sig), fs in sorted(report.distinct(report.new).items()):
            f = next((x for x in fs if x.repro), fs[0])
            lines.append(f"[{cat}] {sig} x{len(fs)}: {f.message} (input {f.input_id}, {f.backend}, {f.repro})")
        pytest.fail("\n".join(lines))


def test_state_inputs_campaign(tmp_path):
    report = state_inputs.run_campaign(
        300, seed=0, jobs=2, backends=BACKENDS, batch=150, traced=True, out_dir=tmp_path, timeout=20
    )
    assert report.inputs == 300
    _fail_on_new(report, "state inputs")


def test_misuse_campaign(tmp_path):
    report = misuse.run_campaign(120, seed=0, jobs=2, backends=BACKENDS, batch=60, out_dir=tmp_path, timeout=30)
    assert report.inputs == 120 and report.extra["ops"] >= 1000
    _fail_on_new(report, "misuse")


def test_side_files_campaign():
    report = side_files.run_campaign(200, seed=0, jobs=2, batch=100, timeout=20)
    assert report.inputs == 200
    _fail_on_new(report, "side files")


def test_misuse_cells_campaign(tmp_path):
    """Programs on one KVCells: hostile and re-entrant arguments (issue 22 section 2)."""
    report = misuse.run_campaign(
        80, seed=0, jobs=2, backends=BACKENDS, batch=40, out_dir=tmp_path, timeout=30, target="cells"
    )
    assert report.inputs == 80 and report.extra["ops"] >= 1000
    _fail_on_new(report, "misuse cells")


def test_misuse_threads_campaign(tmp_path):
    """Threads on one KVCells racing resize(), a microsecond per switch."""
    report = misuse.run_campaign(
        12, seed=0, jobs=2, backends=BACKENDS, batch=6, out_dir=tmp_path, timeout=60, target="threads"
    )
    assert report.inputs == 12 and report.extra["ops"] >= 2000
    _fail_on_new(report, "misuse threads")


def test_hostile_gguf_campaign(tmp_path):
    """Committed tiny models with their metadata mutated, given as the model to every job that takes one."""
    report = state_inputs.run_campaign(
        150, seed=0, jobs=2, backends=BACKENDS, batch=75, out_dir=tmp_path, timeout=30, target="gguf"
    )
    assert report.inputs == 150
    _fail_on_new(report, "gguf models")


def test_mutations_reach_every_field_kind():
    """The structure-aware mutations know the fields of every golden (offsets from the parse)."""
    names: set[str] = set()
    for i in range(len(state_inputs.artefacts())):
        g = state_inputs.golden(i)
        assert g.fields and g.mem_off >= 0
        for f in g.fields:
            assert f.offset + f.size <= len(g.data), (g.art, f)
        names |= {f.name for f in g.fields}
    want = {"magic", "version", "tokens", "arch", "cell_count", "n_seq_id", "seq_id", "pos", "n_layer", "n_stream"}
    want |= {"k_type", "k_row_size", "v_type", "v_el_size", "n_embd_v_gqa", "r_row_size", "s_trans", "io_seq_id"}
    assert want <= names, want - names


def test_inputs_are_reproducible():
    a, b = state_inputs.make_input(3, 41), state_inputs.make_input(3, 41)
    assert (a.data, a.load_kw, a.ops) == (b.data, b.load_kw, b.ops)
    assert misuse.make_program(3, 41) == misuse.make_program(3, 41)
    src = misuse.program_source(misuse.make_program(3, 41))
    assert src.startswith("import numpy as np") and "mem = kvref.create_memory(" in src
    for target in ("cells", "threads"):
        assert misuse.make_cells_program(3, 41, target) == misuse.make_cells_program(3, 41, target)
    assert "c = KVCells(" in misuse.cells_source(misuse.make_cells_program(3, 41, "cells"))
    g1, g2 = state_inputs.make_gguf_input(3, 41), state_inputs.make_gguf_input(3, 41)
    assert (g1.data, g1.ops) == (g2.data, g2.ops) and g1.ops


CHILD = """
import json, os, sys, time
ids = json.loads(sys.stdin.read())
for i in ids:
    print(json.dumps({"start": i}), flush=True)
    if i == 3:
        os.abort()
    if i == 5:
        time.sleep(60)
    print(json.dumps({"done": i, "findings": [], "outcome": i}), flush=True)
print(json.dumps({"end": True}), flush=True)
"""


def test_harness_blames_crashes_and_hangs():
    """A child that aborts or stops making progress is blamed on its input, confirmed alone, and the batch goes on."""

    def on_kill(i, status, info, where):
        return fuzz_common.Finding(status, status, f"{info.splitlines()[0]} {where}", i, "python")

    results, outcomes = fuzz_common.run_batch([sys.executable, "-c", CHILD], list(range(8)), "python", 2.0, on_kill)
    assert sorted(results) == list(range(8))
    assert [f.category for f in results[3]] == ["crash"] and "SIGABRT" in results[3][0].message
    assert [f.category for f in results[5]] == ["hang"]
    assert "alone" in results[3][0].message
    assert all(not results[i] for i in (0, 1, 2, 4, 6, 7))
    assert outcomes[7] == 7 and outcomes[3] is None


CHILD_DIES_AT_EXIT = """
import json, os, sys
ids = json.loads(sys.stdin.read())
for i in ids:
    print(json.dumps({"start": i}), flush=True)
    print(json.dumps({"done": i, "findings": [], "outcome": i}), flush=True)
os.abort()  # after the last input, before the end line (a heap corrupted earlier, found when freed)
"""


def test_harness_blames_a_death_at_exit_on_the_last_input():
    def on_kill(i, status, info, where):
        return fuzz_common.Finding(status, status, f"{info.splitlines()[0]} {where}", i, "python")

    results, _ = fuzz_common.run_batch([sys.executable, "-c", CHILD_DIES_AT_EXIT], [0, 1, 2], "python", 5.0, on_kill)
    assert [f.category for f in results[2]] == ["crash"] and "at exit" in results[2][0].message
    assert not results[0] and not results[1]


def test_known_issues_are_explained():
    for known in (state_inputs.KNOWN_ISSUES, misuse.KNOWN_ISSUES):
        for pattern, reason in known.items():
            assert pattern.split(":", 1)[0] in fuzz_common.CATEGORIES and len(reason) > 20, pattern
    json.dumps([state_inputs.KNOWN_ISSUES, misuse.KNOWN_ISSUES])
