"""The golden cases (conformance/golden/<case>/) for the tests, read through ``kvref.jobs.conformance``.

One place knows how a case's artefacts are read (``load_hints``: kind, layout, cell ext and the producer's
format generation: sequence-blob prefix, v9 output block, ext size), how its memory is built
(``memory_for``) and how its trace is replayed (``replay``: the runner's ``replay_trace``, so the tests and
``kvref.jobs.conformance`` make the same checks). Checks listed in conformance/expected_failures.json are strict
xfails here too (``params``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvref.jobs import conformance as C

ROOT = Path(__file__).resolve().parent.parent / "conformance"
GOLDEN = ROOT / "golden"
ALL_CASES = C.list_cases(ROOT) if GOLDEN.is_dir() else []
EXPECTED = C.load_expected_failures(ROOT) if GOLDEN.is_dir() else {}


def tiny_model(name: str) -> Path:
    """conformance/models/<name>.gguf when committed, else built with conformance/tinymodels.py into the
    conformance model cache (generate.py's default, $XDG_CACHE_HOME/kvref-conformance): never into the checkout,
    whose models/ is what the GGUF reader's tests walk."""
    p = ROOT / "models" / f"{name}.gguf"
    if p.exists():
        return p
    import os
    import sys

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvref-conformance"
    p = cache / f"{name}.gguf"
    if not p.exists():
        sys.path.insert(0, str(ROOT))
        import tinymodels  # type: ignore[import-not-found]

        cache.mkdir(parents=True, exist_ok=True)
        tinymodels.BUILDERS[name.removesuffix("-tiny")](cache)
    return p


def load_case(case_id: str) -> dict:
    return C.load_case(ROOT, case_id)


def params(case_ids: list[str], check: str) -> list[Any]:
    """``case_ids`` as pytest params, strict xfail where the manifest lists ``check`` for the case."""
    out = []
    for cid in case_ids:
        reason = EXPECTED.get(cid, {}).get(check)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason is not None else []
        out.append(pytest.param(cid, id=cid, marks=marks))
    return out


def load_hints(path: Path) -> dict:
    """kvref.state.load options for a golden artefact, from its case's save op and producer ({} if unknown)."""
    case_json = path.parent / "case.json"
    if not case_json.exists():
        return {}
    case = load_case(path.parent.name)
    op = C.save_ops(case).get(path.name)
    if op is None:
        return {}
    return {k: v for k, v in C.artefact_hints(op, case.get("producer")).items() if v is not None}


def compat_for(case: dict) -> Any:
    """The kvref.profile.Profile of the case's producer (llama-cpp-python 0.3.16 -> the "2025" profile)."""
    return C.compat_for(case)


def memory_for(case: dict) -> Any:
    """The memory ``create_memory`` builds for the case's hyper-parameters and context."""
    return C.create_memory_for(case, C.hparams_from_case(case))


def replay(case_id: str, mem: Any) -> dict[str, int]:
    """Replay the case's trace on ``mem`` (the runner's checks; a difference raises AssertionError)."""
    case = load_case(case_id)
    return C.replay_trace(case, mem, C.Artefacts(ROOT, case))


def observed_ranges(op: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """What llama.cpp reported for each sequence right after a save op (seq_pos_min / seq_pos_max)."""
    obs = op["observed"]
    return {
        s: (lo, hi) for s, (lo, hi) in enumerate(zip(obs["seq_pos_min"], obs["seq_pos_max"], strict=True)) if hi >= 0
    }


def sequence_ranges(obj: Any) -> dict[int, tuple[int, int]]:
    """seq id -> (pos_min, pos_max) over the cells of every section of a loaded state."""
    from kvref import state

    out: dict[int, tuple[int, int]] = {}
    for sec in obj.memory.sections:
        for part in sec.streams if isinstance(sec, state.KVSection) else [sec]:
            for sid, r in ({} if part.cells is None else part.cells.sequences()).items():
                lo, hi = out.get(sid, (r.pos_min, r.pos_max))
                out[sid] = (min(lo, r.pos_min), max(hi, r.pos_max))
    return out
