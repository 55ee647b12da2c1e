"""What both fuzzers share: findings, known issues, and running inputs in capped, watched child processes.

A campaign is a list of integer input ids; input ``i`` of seed ``S`` is a pure function of ``(S, i)``, so a
child process can rebuild it from the two numbers and any finding is reproducible from them alone. The parent
hands each child a batch of ids on stdin; the child prints one JSON line before (``{"start": i}``) and one after
(``{"done": i, "findings": [...]}``) every input. A child that dies (signal, exit) or goes quiet for longer
than the timeout is blamed on the input it started last; that input is re-run alone in a fresh child to confirm,
and the rest of the batch continues in another child.
"""

from __future__ import annotations

import fnmatch
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ("python", "cython")

# finding categories, in the order the summary line prints them
CATEGORIES = ("crash", "hang", "exception", "roundtrip", "partial", "memory", "twin")
SUMMARY_NAMES = {
    "crash": "crashes",
    "hang": "hangs",
    "exception": "non-kvref exceptions",
    "roundtrip": "round-trip mismatches",
    "partial": "partial changes",
    "memory": "memory blow-ups",
    "twin": "twin disagreements",
}


@dataclass
class Finding:
    """One problem found on one input. ``signature`` groups findings with the same cause (the known-issue key)."""

    category: str
    signature: str
    message: str
    input_id: int
    backend: str
    detail: str = ""  # traceback or diff
    repro: str | None = None  # path of the saved reproducer
    known: str | None = None  # the known issue's reason, when the signature is listed

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    """What a campaign found: counts and findings (known issues apart)."""

    inputs: int = 0  # distinct input ids (each may have run under both backends)
    findings: list[Finding] = field(default_factory=list)
    failed_ids: set[tuple[str, int]] = field(default_factory=set)
    extra: Counter = field(default_factory=Counter)

    @property
    def new(self) -> list[Finding]:
        return [f for f in self.findings if f.known is None]

    @property
    def known(self) -> list[Finding]:
        return [f for f in self.findings if f.known is not None]

    def counts(self, findings: Iterable[Finding] | None = None) -> Counter:
        return Counter(f.category for f in (self.findings if findings is None else findings))

    def summary_line(self, name: str) -> str:
        new = self.counts(self.new)
        bad_inputs = {f.input_id for f in self.new}
        parts = [f"{name}: inputs {self.inputs}", f"passed {self.inputs - len(bad_inputs)}"]
        parts += [f"{SUMMARY_NAMES[c]} {new.get(c, 0)}" for c in CATEGORIES]
        parts.append(f"known issues {len(self.known)}")
        parts += [f"{k} {v}" for k, v in sorted(self.extra.items())]
        return ", ".join(parts)

    def distinct(self, findings: Iterable[Finding]) -> dict[tuple[str, str], list[Finding]]:
        out: dict[tuple[str, str], list[Finding]] = {}
        for f in findings:
            out.setdefault((f.category, f.signature), []).append(f)
        return out

    def print(self, name: str, out: Any = sys.stdout) -> None:
        for title, group in (("NEW FINDINGS", self.new), ("known issues (listed in KNOWN_ISSUES)", self.known)):
            groups = self.distinct(group)
            if not groups:
                continue
            print(f"--- {title}: {len(groups)} distinct", file=out)
            for (cat, sig), fs in sorted(groups.items()):
                first = min(fs, key=lambda f: len(f.detail) + f.input_id)
                print(f"[{cat}] {sig}  x{len(fs)}", file=out)
                if first.known:
                    print(f"    known: {first.known}", file=out)
                print(f"    {first.message}", file=out)
                print(f"    input {first.input_id} ({first.backend})", file=out)
                if first.repro:
                    print(f"    reproducer: {first.repro}", file=out)
        print(self.summary_line(name), file=out)


def exception_signature(exc: BaseException) -> str:
    """``Type@file:function`` of the innermost frame inside kvref (else the innermost frame)."""
    tb = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in tb if "/kvref/" in f.filename] or list(tb)
    where = ""
    if frames:
        f = frames[-1]
        where = f"@{Path(f.filename).name}:{f.name}"
    return f"{type(exc).__name__}{where}"


def format_exc(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]


# ---------------------------------------------------------------------------------------------- child side
def vm_size() -> int:
    """The process's current address-space size in bytes (Linux; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cap_address_space(extra_mb: int) -> None:
    """RLIMIT_AS = what the process maps now (interpreter, NumPy, kvref) + ``extra_mb``."""
    if extra_mb <= 0:
        return
    limit = vm_size() + extra_mb * (1 << 20)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def maxrss() -> int:
    """Peak resident set size in bytes (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child_main(run_one: Callable[[int], tuple[list[Finding], Any]], mem_cap_mb: int) -> int:
    """Serve one batch: ids from stdin (JSON list), progress and findings as JSON lines on stdout.

    ``run_one(i)`` returns the findings and an *outcome* (JSON): what the input did, compared between the
    twins when a campaign runs both backends."""
    ids = json.loads(sys.stdin.read())
    cap_address_space(mem_cap_mb)
    out = sys.stdout
    for i in ids:
        out.write(json.dumps({"start": i}) + "\n")
        out.flush()
        try:
            findings, outcome = run_one(i)
        except Exception as e:
            findings = [
                Finding(
                    "exception", f"harness:{exception_signature(e)}", f"{type(e).__name__}: {e}", i, "?", format_exc(e)
                )
            ]
            outcome = None
        msg = {"done": i, "findings": [f.to_json() for f in findings], "outcome": outcome}
        out.write(json.dumps(msg) + "\n")
        out.flush()
    out.write(json.dumps({"end": True}) + "\n")
    out.flush()
    return 0


# ---------------------------------------------------------------------------------------------- parent side
@dataclass
class ChildResult:
    done: dict[int, list[Finding]]
    outcomes: dict[int, Any]
    status: str  # "ok", "crash", "hang"
    blamed: int | None  # the id started last and not finished (crash / hang)
    info: str  # signal / exit code / stderr tail


def child_env(backend: str) -> dict[str, str]:
    env = dict(os.environ)
    env["KVREF_BACKEND"] = backend
    for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[v] = "1"  # a child per core: keep the BLAS pools from reserving address space
    env["PYTHONFAULTHANDLER"] = "1"
    return env


def run_child(argv: list[str], ids: list[int], backend: str, timeout: float) -> ChildResult:
    """Run ``argv`` (a fuzzer in --child mode) on ``ids``; ``timeout``: seconds without progress = hang."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(backend),
        cwd=ROOT,
        start_new_session=True,
    )
    assert proc.stdin and proc.stdout and proc.stderr
    proc.stdin.write(json.dumps(ids).encode())
    proc.stdin.close()
    done: dict[int, list[Finding]] = {}
    outcomes: dict[int, Any] = {}
    started: int | None = None
    ended = False
    err_chunks: list[bytes] = []
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(proc.stderr, selectors.EVENT_READ, "err")
    buf = b""
    deadline = time.monotonic() + timeout + 30  # the first input also pays for the imports
    hung = False
    open_streams = 2
    while open_streams:
        left = deadline - time.monotonic()
        if left <= 0:
            hung = True
            break
        for key, _ in sel.select(min(left, 1.0)):
            chunk = os.read(key.fileobj.fileno(), 1 << 16)  # type: ignore[union-attr]
            if not chunk:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            if key.data == "err":
                err_chunks.append(chunk)
                continue
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                msg = json.loads(line)
                if "start" in msg:
                    started = msg["start"]
                    deadline = time.monotonic() + timeout
                elif "done" in msg:
                    done[msg["done"]] = [Finding(**f) for f in msg["findings"]]
                    outcomes[msg["done"]] = msg.get("outcome")
                    started = None
                elif msg.get("end"):
                    ended = True
    if hung:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    sel.close()
    proc.stdout.close()
    proc.stderr.close()
    stderr = b"".join(err_chunks).decode("utf-8", "replace")[-3000:]
    if hung:
        return ChildResult(done, outcomes, "hang", started, f"no progress for {timeout:g} s\n{stderr}")
    if ended and proc.returncode == 0:
        return ChildResult(done, outcomes, "ok", None, "")
    rc = proc.returncode
    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
    return ChildResult(done, outcomes, "crash", started, f"{how}\n{stderr}")


def run_batch(
    argv: list[str],
    ids: list[int],
    backend: str,
    timeout: float,
    on_kill: Callable[[int, str, str, str], Finding],
) -> tuple[dict[int, list[Finding]], dict[int, Any]]:
    """Run ``ids`` in as few children as possible; a crash or hang is blamed on its input, confirmed alone.

    Returns the findings and the outcome of every input (None for an input that killed its child)."""
    results: dict[int, list[Finding]] = {}
    outcomes: dict[int, Any] = {}
    pending = list(ids)
    while pending:
        res = run_child(argv, pending, backend, timeout)
        results.update(res.done)
        outcomes.update(res.outcomes)
        if res.status == "ok":
            break
        not_done = [i for i in pending if i not in res.done]
        if res.blamed is None and not not_done:  # died after its last input (at exit: a heap corrupted earlier)
            last = pending[-1]
            where = f"at exit, after inputs {pending[0]}..{last} in the same process"
            results[last] = [*results.get(last, []), on_kill(last, res.status, res.info, where)]
            break
        blamed = res.blamed if res.blamed is not None else not_done[0]
        alone = run_child(argv, [blamed], backend, timeout) if len(pending) > 1 else res
        if alone.status != "ok":
            results[blamed] = [on_kill(blamed, alone.status, alone.info, "reproduces alone in a fresh process")]
        else:
            where = f"only after inputs {pending[0]}..{blamed} in the same process (alone: passes)"
            results[blamed] = [on_kill(blamed, res.status, res.info, where), *alone.done.get(blamed, [])]
        outcomes[blamed] = None
        pending = pending[pending.index(blamed) + 1 :]
    return results, outcomes


def campaign(
    argv_for: Callable[[str], list[str]],
    ids: list[int],
    backends: list[str],
    jobs: int,
    batch: int,
    timeout: float,
    on_kill: Callable[[int, str, str, str, str], Finding],
    progress: bool = False,
) -> tuple[dict[tuple[str, int], list[Finding]], dict[tuple[str, int], Any]]:
    """Every id under every backend in ``backends`` (all of them, or alternating when ``backends`` is
    ``["alternate"]``), ``batch`` ids per child, ``jobs`` children at a time."""
    work: list[tuple[str, list[int]]] = []
    for k in range(0, len(ids), batch):
        chunk = ids[k : k + batch]
        if backends == ["alternate"]:
            work.append((BACKENDS[(k // batch) % 2], chunk))
        else:
            work.extend((b, chunk) for b in backends)
    out: dict[tuple[str, int], list[Finding]] = {}
    outcomes: dict[tuple[str, int], Any] = {}
    t0 = time.monotonic()

    def one(item: tuple[str, list[int]]) -> tuple[str, tuple[dict[int, list[Finding]], dict[int, Any]]]:
        b, chunk = item
        return b, run_batch(argv_for(b), chunk, b, timeout, lambda i, s, info, where: on_kill(i, b, s, info, where))

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for n, (b, (res, outs)) in enumerate(pool.map(one, work), 1):
            for i, fs in res.items():
                out[(b, i)] = fs
            for i, o in outs.items():
                outcomes[(b, i)] = o
            if progress:
                found = sum(len(fs) for fs in out.values())
                print(
                    f"  batch {n}/{len(work)} done, {len(out)} inputs, {found} findings, {time.monotonic() - t0:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return out, outcomes


def twin_findings(
    outcomes: dict[tuple[str, int], Any], signature: Callable[[Any, Any], str] | None = None
) -> list[Finding]:
    """A finding per input whose outcome differs between the backends (both must have run it);
    ``signature(a, b)`` names the difference (default: where the outcomes first differ)."""
    found = []
    ids = sorted({i for _, i in outcomes})
    for i in ids:
        a, b = outcomes.get((BACKENDS[0], i)), outcomes.get((BACKENDS[1], i))
        if a is None or b is None or a == b:
            continue
        diff = first_diff(a, b)
        sig = signature(a, b) if signature is not None else diff.split(":", 1)[0]
        found.append(Finding("twin", sig, f"{BACKENDS[0]} and {BACKENDS[1]} differ at {diff}", i, "both"))
    return found


def first_diff(a: Any, b: Any, path: str = "") -> str:
    """Where two outcomes (nested lists / dicts / scalars) first differ, with both values."""
    if isinstance(a, list) and isinstance(b, list):
        for k, (x, y) in enumerate(zip(a, b, strict=False)):
            if x != y:
                return first_diff(x, y, f"{path}[{k}]")
        return f"{path or 'length'}: {len(a)} vs {len(b)} entries"
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return first_diff(a.get(k), b.get(k), f"{path}.{k}")
    return f"{path or 'outcome'}: {a!r} vs {b!r}"


def apply_known(findings: list[Finding], known: dict[str, str]) -> None:
    """Mark findings whose ``category:signature`` matches a known issue's pattern (fnmatch: ``*``, ``?``, ``[[]``)."""
    for f in findings:
        key = f"{f.category}:{f.signature}"
        for pattern, reason in known.items():
            if fnmatch.fnmatchcase(key, pattern):
                f.known = reason
                break


__all__ = [
    "BACKENDS",
    "CATEGORIES",
    "ROOT",
    "Finding",
    "Report",
    "apply_known",
    "campaign",
    "cap_address_space",
    "child_main",
    "exception_signature",
    "first_diff",
    "format_exc",
    "maxrss",
    "run_batch",
    "run_child",
    "twin_findings",
]
