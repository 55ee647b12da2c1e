"""Every artefact a real llama.cpp wrote (conformance/golden/<case>/) reads and writes back byte for byte."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
from golden import GOLDEN, ROOT
from golden import load_hints as _hints

import kvref.state as S

_STATE_SUFFIXES = {".bin", ".session", ".ggsn", ".ggsq", ".state", ".seq"}


def _artefacts() -> list[Path]:
    if not GOLDEN.is_dir():
        return []
    return sorted(
        p for p in GOLDEN.glob("*/*") if p.is_file() and (p.suffix in _STATE_SUFFIXES) and p.name != "case.json"
    )


ARTEFACTS = _artefacts()


@pytest.mark.skipif(not ARTEFACTS, reason="no golden state files under conformance/golden/ yet")
@pytest.mark.parametrize("path", ARTEFACTS, ids=[f"{p.parent.name}/{p.name}" for p in ARTEFACTS])
def test_golden_round_trip(path: Path) -> None:
    hints = _hints(path)
    obj = S.load(path, **hints)
    assert obj.to_bytes() == path.read_bytes()
    assert obj.summary()["layout"] == hints.get("layout", obj.memory.layout)


@pytest.mark.skipif(not ARTEFACTS, reason="no golden state files under conformance/golden/ yet")
@pytest.mark.parametrize("path", ARTEFACTS, ids=[f"{p.parent.name}/{p.name}" for p in ARTEFACTS])
def test_golden_auto(path: Path) -> None:
    """Without hints, inference finds the same reading (or says it cannot decide, never a wrong one)."""
    hints = _hints(path)
    obj = S.load(path)
    assert obj.to_bytes() == path.read_bytes()
    if "layout" in hints:
        from kvref.state import LAYOUTS

        if getattr(obj, "arch", None) is None and obj.memory.layout != hints["layout"]:
            # no arch string (a sequence save): layouts of the same sections read alike (llama_kv_cache_dsa's and
            # llama_kv_cache_msa's two KV sections are an iSWA pair's bytes): the sections must be the same
            assert LAYOUTS[obj.memory.layout] == LAYOUTS[hints["layout"]]
        else:
            assert obj.memory.layout == hints["layout"]


INVALID = ROOT / "invalid"
_INVALID_FILES = (
    json.loads((INVALID / "manifest.json").read_text())["files"] if (INVALID / "manifest.json").exists() else []
)


@pytest.mark.skipif(not _INVALID_FILES, reason="no conformance/invalid/manifest.json yet")
@pytest.mark.parametrize("entry", _INVALID_FILES, ids=[e["file"] for e in _INVALID_FILES])
def test_invalid_manifest(entry: dict) -> None:
    """Each corrupt file fails with the manifest's field, read with what the source case says about its layout."""
    src = GOLDEN / entry["source"]["case"] / entry["source"]["file"]
    hints = _hints(src)
    path = INVALID / entry["file"]
    if entry.get("needs_hparams"):
        # only a reader that knows the model can see these; without it any FormatError (or success) is fine
        with contextlib.suppress(S.FormatError):
            S.load(path, **hints)
        return
    with pytest.raises(S.FormatError) as ei:
        S.load(path, **hints)
    assert ei.value.field in [entry["field"], *entry.get("also_accept", [])], ei.value
