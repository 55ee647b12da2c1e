"""`kvref inspect` (console script and python -m kvref)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvref.cli import main

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "state"


def test_inspect_text(capsys) -> None:
    assert main(["inspect", str(FIXTURES / "state_hybrid.bin")]) == 0
    out = capsys.readouterr().out
    assert "arch: jamba" in out and "memory layout: hybrid" in out
    assert "2 of 3 layers with state" in out and "seq   0: pos 0..1" in out


def test_inspect_json(capsys) -> None:
    assert main(["inspect", "--json", str(FIXTURES / "session_v10_kv_multistream_vtrans_ext12.bin")]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["version"] == 10 and s["layout"] == "kv"
    st = s["sections"][0]["streams"]
    assert st[0]["ext_size"] == 12 and st[1]["cell_count"] == 0
    assert st[0]["layers"][0]["v"]["transposed"] is True


def test_inspect_error_exit(capsys) -> None:
    assert main(["inspect", "--layout", "kv", str(FIXTURES / "huge_token_count.bin")]) == 2
    assert "n_token_count" in capsys.readouterr().err


def test_python_m_kvref() -> None:
    r = subprocess.run([sys.executable, "-m", "kvref"], capture_output=True, text=True, check=True)
    assert "kvref backend:" in r.stdout and "inspect" in r.stdout
