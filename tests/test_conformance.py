"""The conformance suite as pytest tests: one test per golden case (plus ``invalid``), same checks as
``kvref conformance`` (kvref/jobs/conformance.py). Checks listed in conformance/expected_failures.json are
strict xfails with the manifest's reason, so an unexpected pass fails the run too."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvref
from kvref.jobs import conformance as C

ROOT = Path(__file__).resolve().parent.parent / "conformance"
CASES = C.all_case_ids(ROOT) if (ROOT / "golden").is_dir() else []
EXPECTED = C.load_expected_failures(ROOT) if CASES else {}


def _params() -> list:
    out = []
    for cid in CASES:
        checks = ["invalid"] if cid == C.INVALID_CASE else list(C.CHECKS)
        for check in checks:
            marks = []
            reason = EXPECTED.get(cid, {}).get(check)
            if reason is not None:
                marks.append(pytest.mark.xfail(strict=True, reason=reason))
            out.append(pytest.param(cid, check, id=f"{cid}:{check}", marks=marks))
    return out


_RESULTS: dict[str, C.CaseResult] = {}


def _result(cid: str) -> C.CaseResult:
    if cid not in _RESULTS:
        _RESULTS[cid] = C.run_case(ROOT, cid, expected={})
    return _RESULTS[cid]


@pytest.mark.skipif(not CASES, reason="no conformance/golden directory")
@pytest.mark.parametrize("case_id,check", _params())
def test_conformance(case_id: str, check: str) -> None:
    res = next(c for c in _result(case_id).checks if c.name == check)
    assert res.status == "pass", f"{case_id} {check}: {res.detail}"


def test_expected_failures_manifest_is_current() -> None:
    assert C.stale_expectations(ROOT) == []


def test_every_case_matches_the_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((ROOT / "case.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    for cid in C.list_cases(ROOT):
        case = C.load_case(ROOT, cid)
        errors = sorted(validator.iter_errors(case), key=lambda e: list(e.path))
        assert not errors, f"{cid}: {errors[0].message} at {list(errors[0].path)}"
        assert case["id"] == cid


def test_cli_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    from kvref.jobs.cli import main

    assert main(["conformance", "--root", str(ROOT), "--case", "llama-f16-single-seq", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["cases"][0]["case"] == "llama-f16-single-seq"
    assert out["backend"] == kvref.backend() and out["kvref"] == kvref.__version__
    assert (out["compat"], out["llama_cpp_python"], out["llama_cpp"]) == ("2026-10", "0.3.36", "0c1e570")


def test_cli_text_names_version_backend_and_era(capsys: pytest.CaptureFixture[str]) -> None:
    from kvref.jobs.cli import main

    assert main(["conformance", "--root", str(ROOT), "--case", "llama-f16-single-seq"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == kvref.about_line()
    assert f"({kvref.backend()} backend)" in first and "llama.cpp 0c1e570" in first and "'2026-10'" in first


def test_runner_fails_an_unexpected_pass(tmp_path: Path) -> None:
    """A listed check that passes makes the case fail (XPASS), like a strict xfail."""
    root = tmp_path / "conformance"
    (root / "golden").mkdir(parents=True)
    src = ROOT / "golden" / "llama-f16-single-seq"
    (root / "golden" / src.name).symlink_to(src)
    (root / "expected_failures.json").write_text(
        json.dumps({"cases": [{"id": src.name, "checks": ["parse"], "reason": "test"}]})
    )
    res = C.run_case(root, src.name)
    assert not res.ok and res.status == "XPASS"
    assert "unexpectedly passed" in res.first_problem()


def test_runner_reports_where_a_replay_differs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay that writes other cells is reported with the save point, section, stream and field."""
    import numpy as np

    from kvref.memory import kv_state

    def no_swa_mask(cache, stream, seq_id=-1):  # type: ignore[no-untyped-def]
        c = cache.cells(stream)
        idx = np.flatnonzero(np.asarray(c.pos) != -1)
        return idx if seq_id == -1 else np.array([i for i in idx if c.seq_has(int(i), seq_id)], np.int64)

    monkeypatch.setattr(kv_state, "written_cells", no_swa_mask)
    res = C.run_case(ROOT, "gemma2-swa-overflow", expected={})
    replay = next(c for c in res.checks if c.name == "replay")
    assert replay.status == "fail"
    assert "03-seq-seq0.ggsq" in replay.detail and "section 1 stream 0" in replay.detail


# ---------------------------------------------------------------------------------------------- one op vocabulary
def _schema_ops() -> dict[str, set[str]]:
    """case.schema.json: op name -> the fields its op object may have."""
    defs = json.loads((ROOT / "case.schema.json").read_text())["$defs"]
    return {name: set(defs[f"op_{name}"]["properties"]) for name in defs["op"]["properties"]["op"]["enum"]}


def _fuzz() -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location("kvref_conformance_fuzz", ROOT / "fuzz.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trace_vocabulary_is_one() -> None:
    """The schema, the README's op table, the replay (kvref.jobs.conformance.TRACE_OPS) and the recorder's dispatch
    (driver.Run.apply: every op but init) name the same operations."""
    import ast
    import re

    assert list(_schema_ops()) == list(C.TRACE_OPS)
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| op | fields | llama.cpp call |") :].split("\n\n")[0]
    assert re.findall(r"^\| `(\w+)` \|", table, re.M) == list(C.TRACE_OPS)
    tree = ast.parse((ROOT / "driver.py").read_text())
    apply = next(
        n.value for n in ast.walk(tree) if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "_APPLY"
    )
    assert isinstance(apply, ast.Dict)
    assert [ast.literal_eval(k) for k in apply.keys if k is not None] == list(C.TRACE_OPS[1:])


class _State:
    """What fuzz.resolve reads of a driver.Run: seq_pos_min / seq_pos_max (all sequences empty here)."""

    def pos_min(self, s: int) -> int:
        return -1

    def pos_max(self, s: int) -> int:
        return -1


def test_fuzz_plans_are_traces_without_results() -> None:
    """conformance/fuzz.py plans in case.json's ops and fields (plus its plan-only keys), and every plan op resolves
    to ops of the trace vocabulary that driver.Run.apply takes."""
    fuzz: Any = _fuzz()
    ops = _schema_ops()
    results = {"ret", "observed", "errors", "graph"}
    saved = {k: {"op": "save", "kind": k, "file": f"x-{k}", "flags": 1} for k in ("seq", "seq_data", "state_data")}
    for model in fuzz.MODELS:
        for seed in range(5):
            plan = fuzz.make_plan(model, seed)
            assert plan == fuzz.make_plan(model, seed)  # seeded
            for i, op in enumerate(plan["ops"]):
                where = f"{model} seed {seed} op {i}"
                assert op["op"] in C.TRACE_OPS[1:], where
                assert set(op) <= (ops[op["op"]] - results) | set(fuzz.PLAN_KEYS), (where, op)
                for r in fuzz.resolve(_State(), op, saved):
                    assert set(r) <= ops[r["op"]] - results, (where, r)
                    if r["op"] == "decode":
                        n = len(r["tokens"])
                        assert n and len(r["pos"]) == len(r["seq_ids"]) == len(r["logits"]) == n, (where, r)
