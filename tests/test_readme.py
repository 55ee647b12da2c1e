"""The README's tour runs as written (from the checkout root, where its paths point)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tour_runs(monkeypatch):
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert lines[2].strip().startswith("pip install . && kvref conformance")
    assert lines[3].strip().startswith("pip install '.[test]' && pytest")
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    monkeypatch.chdir(ROOT)
    scope: dict = {}
    exec(compile(code.group(1), "README.md", "exec"), scope)
    assert scope["mask"].shape == (1, 10, 256)  # one stream, ten tokens, n_kv padded to 256 as llama.cpp pads it
    # sequence 1 (positions 0..9 shifted by -2 from position 2 on: max 7) restored over sequence 0
    assert scope["mem"].seq_pos_max(0) == 7


def test_readme_tour_leaks_no_resource():
    """The tour as a newcomer pastes it, under ``-W error::ResourceWarning`` (files and maps closed)."""
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert code is not None
    out = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error::ResourceWarning", "-c", code.group(1)],
        cwd=ROOT,
        env={**os.environ, "PYTHONSAFEPATH": "1"},  # the installed kvref, not a checkout's kvref/ in cwd
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "ResourceWarning" not in out.stderr, out.stderr
