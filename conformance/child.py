"""Run a llama.cpp trace in a child process until it is complete (`run_child`): where llama.cpp dies inside an op
(GGML_ASSERT, an uncaught exception, SIGFPE), the op is recorded as aborting and the child runs again, skipping it.
fuzz.py (random plans) and edges.py (edge plans) both run their children through it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path

# a trace may record this many ops that kill llama.cpp (each costs one more child run)
MAX_ABORTS = 200


def _abort_message(stderr: str) -> str | None:
    """The GGML_ASSERT / GGML_ABORT line a dead llama.cpp printed ("<file>:<line>: <message>", the build path cut
    to the llama.cpp tree), or the last line of an uncaught exception's report."""
    for line in stderr.splitlines():
        if re.search(r"\.(c|cpp|h):\d+: ", line):
            return re.sub(r"^.*?vendor/llama\.cpp/", "", line).strip()
    for line in reversed(stderr.splitlines()):
        if "terminate called" in line or "what()" in line:
            return line.strip()
    return None


def run_child(cmd: list[str], timeout: int = 600) -> tuple[bool, str, dict[str, dict]]:
    """Run a child (``cmd``: fuzz.py with --case-out) until its trace is complete. When llama.cpp kills it
    (a signal: GGML_ASSERT, an uncaught exception, SIGFPE) inside an op, that op is recorded as aborting and the
    child runs again, skipping it there (fuzz.py's `execute`); returns (ok, why not, the aborting ops by key)."""
    aborts: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kvref-child-") as tmp:
        a_file, progress = Path(tmp) / "aborts.json", Path(tmp) / "progress.jsonl"
        while True:
            a_file.write_text(json.dumps(aborts))
            progress.unlink(missing_ok=True)
            argv = [*cmd, "--aborts-file", str(a_file), "--progress", str(progress)]
            env = {**os.environ, "GGML_NO_BACKTRACE": "1"}  # ggml would run gdb on the dying process
            p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
            if p.returncode == 0:
                return True, "", aborts
            lines = progress.read_text().splitlines() if progress.exists() else []
            last = json.loads(lines[-1]) if lines else {}
            key = last.get("calling")
            if p.returncode < 0 and key is not None and key not in aborts and len(aborts) < MAX_ABORTS:
                aborts[key] = {"signal": signal.Signals(-p.returncode).name, "message": _abort_message(p.stderr)}
                continue
            tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
            where = f" in op {key}" if key is not None else ""
            return False, f"llama.cpp run failed{where} (rc {p.returncode}): {' | '.join(tail)}", aborts
