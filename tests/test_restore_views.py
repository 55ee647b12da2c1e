"""kvref.restore reads a file's memory section in place when no conversion changes it (no copy of the sections).

The view it restores from must hold exactly the bytes the loaded sections serialize to, for every golden file
(any kind, layout and era); a restore from a path, from the file's bytes and from the loaded object must leave the
same memory.
"""

from __future__ import annotations

import glob
import json
import warnings
from pathlib import Path

import pytest

import kvref
from kvref import state
from kvref.jobs.conformance import hparams_from_case, save_ops
from kvref.jobs.restore import _memory_bytes
from kvref.state.eras import convert_sections, matching_eras

G = Path(__file__).resolve().parent.parent / "conformance" / "golden"
FILES = sorted(Path(p) for p in glob.glob(str(G / "*" / "0*")) if not p.endswith(".json"))


@pytest.mark.parametrize("path", FILES, ids=[f"{p.parent.name}/{p.name}" for p in FILES])
def test_the_view_holds_the_serialized_sections(path: Path) -> None:
    try:
        obj = state.load(path)
    except state.FormatError:
        pytest.skip("needs load options (its case says which)")
    eras = matching_eras(obj)
    if not eras:
        pytest.skip("no era writes this layout as it is")
    same = convert_sections(obj.memory, eras[-1]).sections
    view = _memory_bytes(path, obj.memory.sections, same)
    want = state.section_bytes(*same)
    if view is not None:
        assert bytes(view) == want
    raw = path.read_bytes()
    from_bytes = _memory_bytes(raw, obj.memory.sections, same)
    assert from_bytes is None or bytes(from_bytes) == want
    assert _memory_bytes(obj, obj.memory.sections, same) is None  # a loaded object: serialized


@pytest.mark.parametrize("case_id", ["llama-shared-prefix", "gemma3-iswa", "jamba-hybrid", "qwen2vl-mrope"])
def test_restore_from_a_path_bytes_or_object_leaves_the_same_memory(case_id: str) -> None:
    case = json.loads((G / case_id / "case.json").read_text())
    hp = hparams_from_case(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for file, op in save_ops(case).items():
            seq = op.get("seq_id") if op["kind"] in ("seq", "seq_data") else None
            path = G / case_id / file
            got = [
                kvref.restore(src, hparams=hp, seq_id=seq)
                for src in (path, path.read_bytes(), bytearray(path.read_bytes()), state.load(path))
            ]
            written = {r.memory.state_write(r.seq_id, r.flags) for r in got}
            assert len(written) == 1, file
