#!/usr/bin/env python3
"""Side-file fuzzer (issue 22): odd save targets and hostile identity sidecars, each input in a fresh directory.

Save targets: a regular file, a FIFO, a directory, a socket, a private character device (as root), symlinks to
each of them, dangling and looping symlinks, names at and past the file-system limit (ASCII and multi-byte),
leftover partial files of live and dead processes, and targets with odd modes; the save is `kvref.state.save`,
`kvref.save_memory`, `kvref.convert` or `write_sidecar`. Checks: only kvref errors (and the OSError of a name
past the limit); a target that is not a regular file keeps its inode and kind; a save that succeeds leaves a
regular file holding exactly the bytes asked for; no partial file of this process remains; partial files of
this target whose process is gone are removed.

Sidecars: JSON with fields of the wrong type (strings for numbers, booleans, lists, nested objects, short or
non-hex hashes, negative sizes), deep nesting, invalid UTF-8, NUL bytes, empty files, huge sparse files, FIFOs and
links to /dev/zero; read by `read_sidecar`, `verify_sidecar` and `kvref.check_file`. Checks: a result or a kvref
error, never another exception or a hang (the child is watched) or an unbounded read (the child's address space
is capped).

    python fuzzing/side_files.py --inputs 2000 --seed 1 --jobs 2
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import random
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuzz_common import ROOT, Finding, Report, apply_known, campaign, child_main, exception_signature, format_exc

GOLDEN = ROOT / "conformance" / "golden" / "llama-shared-prefix" / "03-seq-seq0.ggsq"
MODEL = ROOT / "conformance" / "models" / "llama-tiny.gguf"
DEFAULT_OUT = Path(tempfile.gettempdir()) / "kvref-fuzz" / "side-files"
KNOWN_ISSUES: dict[str, str] = {}

TARGETS = ["new", "regular", "fifo", "dir", "socket", "chardev", "link-regular", "link-fifo", "link-dir",
           "link-dangling", "link-loop", "long", "long-utf8", "too-long", "mode-000", "partials"]  # fmt: skip
SAVES = ["state.save", "save_memory", "convert", "write_sidecar"]
SIDECARS = ["types", "nesting", "utf8", "nul", "empty", "huge", "fifo", "zero", "truncated", "valid"]


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def make_target(rng: random.Random, d: Path, kind: str) -> tuple[Path, list[Path]]:
    """The target of a save in ``d`` and the partial files a correct save must remove."""
    name_max = os.pathconf(d, "PC_NAME_MAX")
    t = d / "slot.bin"
    dead: list[Path] = []
    if kind == "regular":
        t.write_bytes(rng.randbytes(rng.randrange(0, 64)))
    elif kind == "fifo":
        os.mkfifo(t)
    elif kind == "dir":
        t.mkdir()
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(t))
        s.close()
    elif kind == "chardev":
        if os.getuid() == 0:
            os.mknod(t, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a private /dev/null
        else:
            os.mkfifo(t)
    elif kind.startswith("link-"):
        inner = d / "inner"
        what = kind[5:]
        if what == "regular":
            inner.write_bytes(b"old")
        elif what == "fifo":
            os.mkfifo(inner)
        elif what == "dir":
            inner.mkdir()
        elif what == "loop":
            inner = d / "slot.bin"
        t.symlink_to(inner)
    elif kind in ("long", "long-utf8", "too-long"):
        n = name_max - rng.randrange(0, 8) if kind != "too-long" else name_max + rng.randrange(1, 8)
        t = d / ("é" * (n // 2) if kind == "long-utf8" else "s" * n)
    elif kind == "mode-000":
        t.write_bytes(b"old")
        t.chmod(0)
    elif kind == "partials":
        for _ in range(rng.randrange(1, 4)):
            p = d / f".slot.bin.kvref-partial-{_dead_pid()}-{rng.randbytes(4).hex()}"
            p.write_bytes(b"half")
            dead.append(p)
        (d / f".slot.bin.kvref-partial-1-{rng.randbytes(4).hex()}").write_bytes(b"pid 1 is alive")
    return t, dead


def _identity(p: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(p)
    except OSError:
        return None
    return st.st_ino, stat.S_IFMT(st.st_mode)


def _real_kind(p: Path) -> int | None:
    try:
        return stat.S_IFMT(os.stat(p).st_mode)
    except OSError:
        return None


def run_save(rng: random.Random, d: Path, i: int) -> list[Finding]:
    import kvref
    from kvref import state
    from kvref.errors import KVRefError
    from kvref.jobs.sidecar import sidecar_path, write_sidecar

    kind, how = rng.choice(TARGETS), rng.choice(SAVES)
    target, dead = make_target(rng, d, kind)
    sig = f"{how}:{kind}"
    before_real = _real_kind(target)
    before_id = _identity(target.resolve()) if before_real is not None else None
    expected: bytes | None = None
    try:
        if how == "state.save":
            obj = state.load(GOLDEN)
            expected = GOLDEN.read_bytes()
            obj.save(target)
        elif how == "save_memory":
            mem = kvref.create_memory(kvref.HParams.from_gguf(MODEL), n_ctx=32, n_seq_max=1)
            kvref.save_memory(mem, target, kind="seq", seq_id=0)
            expected = kvref.save_memory(mem, None, kind="seq", seq_id=0).to_bytes()
        elif how == "convert":
            expected = kvref.convert(GOLDEN, target, arch="llama").to_bytes()
        else:
            write_sidecar(target, state=state.load(GOLDEN))
            target = sidecar_path(target)
        outcome = "ok"
    except KVRefError:
        outcome = "refused"
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ELOOP) or (e.errno == errno.EACCES and os.getuid() != 0):
            outcome = "refused"  # the file system's own answer (the sidecar's name is 11 bytes longer)
        elif how == "write_sidecar" and e.errno in (errno.ENOENT, errno.EISDIR):
            outcome = "refused"  # no state file there for a sidecar to describe
        else:
            return [Finding("exception", f"{sig}:{exception_signature(e)}", f"{type(e).__name__}: {e}", i, "-",
                            format_exc(e))]  # fmt: skip
    except Exception as e:
        return [Finding("exception", f"{sig}:{exception_signature(e)}", f"{type(e).__name__}: {e}", i, "-",
                        format_exc(e))]  # fmt: skip
    found = []
    replaced = before_real not in (None, stat.S_IFREG) and _identity(target.resolve()) != before_id
    if replaced and how != "write_sidecar":
        found.append(Finding("partial", f"replaced:{sig}", f"a {kind} target was replaced ({outcome})", i, "-"))
    wrong = expected is not None and (_real_kind(target) != stat.S_IFREG or target.read_bytes() != expected)
    if outcome == "ok" and wrong:
        found.append(Finding("partial", f"content:{sig}", "the saved file does not hold the state", i, "-"))
    left = [p.name for p in d.iterdir() if f".kvref-partial-{os.getpid()}-" in p.name]
    if left:
        found.append(Finding("partial", f"leftover:{sig}", f"partial files left: {left}", i, "-"))
    if outcome == "ok" and how != "write_sidecar" and any(p.exists() for p in dead):
        found.append(Finding("partial", f"dead-partials:{sig}", "a killed save's partial file was not removed", i, "-"))
    return found


def _type_confused(rng: random.Random) -> Any:
    return rng.choice(["8037", True, False, -1, 2**70, 1.5, [1, 2], {"a": 1}, None, "", "0" * 64, "Z" * 64, []])


def write_sidecar_file(rng: random.Random, state_path: Path, kind: str) -> None:
    from kvref.jobs.sidecar import sidecar_path

    p = sidecar_path(state_path)
    doc: dict[str, Any] = {
        "kvref_sidecar": 1, "file": state_path.name, "kind": "seq",
        "payload": {"size": state_path.stat().st_size, "sha256": "0" * 64}, "era": "2026-10",
        "llama_cpp": {"profile": "2026-10", "llama_cpp_python": "0.3.36"},
        "model": {"file": "m.gguf", "sha256": None, "arch": "llama"}, "context": None, "written_by": "kvref",
    }  # fmt: skip
    if kind == "types":
        for _ in range(rng.randrange(1, 4)):
            key = rng.choice(["kvref_sidecar", "file", "kind", "payload", "era", "llama_cpp", "model", "context"])
            sub = doc.get(key)
            if isinstance(sub, dict) and sub and rng.random() < 0.7:
                sub[rng.choice(list(sub))] = _type_confused(rng)
            else:
                doc[key] = _type_confused(rng)
        p.write_text(json.dumps(doc))
    elif kind == "nesting":
        n = rng.choice([100, 1000, 10**5, 10**6])
        p.write_text(("[" * n + "]" * n) if rng.random() < 0.5 else ('{"a":' * n + "1" + "}" * n))
    elif kind == "utf8":
        p.write_bytes(json.dumps(doc).encode()[:-10] + b'"\xff\xfe\xc3(' + b'"}')
    elif kind == "nul":
        p.write_bytes(json.dumps(doc).encode().replace(b"seq", b"s\x00q"))
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "huge":
        with open(p, "wb") as f:
            f.truncate(rng.choice([2**21, 2**30, 2**40]))
    elif kind == "fifo":
        os.mkfifo(p)
    elif kind == "zero":
        p.symlink_to(rng.choice(["/dev/zero", "/dev/urandom"]))
    elif kind == "truncated":
        text = json.dumps(doc)
        p.write_text(text[: rng.randrange(len(text))])
    else:
        p.write_text(json.dumps(doc))


def run_sidecar(rng: random.Random, d: Path, i: int) -> list[Finding]:
    import kvref
    from kvref.errors import KVRefError
    from kvref.jobs.sidecar import read_sidecar, verify_sidecar

    state_path = d / "slot.ggsq"
    state_path.write_bytes(GOLDEN.read_bytes())
    kind = rng.choice(SIDECARS)
    write_sidecar_file(rng, state_path, kind)
    how = rng.choice(["read", "verify", "check"])
    try:
        if how == "read":
            read_sidecar(state_path)
        elif how == "verify":
            verify_sidecar(state_path, MODEL if rng.random() < 0.5 else None)
        else:
            kvref.check_file(state_path, MODEL, flash_attn=False)
    except KVRefError:
        pass
    except Exception as e:
        sig = f"sidecar-{how}:{kind}:{exception_signature(e)}"
        return [Finding("exception", sig, f"{type(e).__name__}: {e}", i, "-", format_exc(e))]
    return []


def run_one(seed: int, i: int) -> tuple[list[Finding], Any]:
    rng = random.Random(f"{seed}:{i}")
    with tempfile.TemporaryDirectory(prefix="kvref-side-") as tmp:
        d = Path(tmp)
        try:
            return (run_save if rng.random() < 0.5 else run_sidecar)(rng, d, i), None
        finally:
            for p in d.rglob("*"):  # a mode-000 file or a read-only directory must not stop the cleanup
                if not p.is_symlink():
                    os.chmod(p, 0o700)


def run_campaign(
    inputs: int, seed: int = 0, *, jobs: int = 1, batch: int = 200, timeout: float = 20.0, mem_cap_mb: int = 512,
    start: int = 0, known: dict[str, str] | None = None, progress: bool = False,
) -> Report:  # fmt: skip
    """Run inputs ``start .. start + inputs`` of ``seed`` (the backend does not matter here: the Python twins)."""

    def on_kill(i: int, backend: str, status: str, info: str, where: str) -> Finding:
        first = info.strip().splitlines()[0] if info.strip() else status
        return Finding(status, f"{status}:{first}", f"{status} ({first}), {where}", i, backend, info)

    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--seed", str(seed), "--mem-cap-mb",
            str(mem_cap_mb)]  # fmt: skip
    ids = list(range(start, start + inputs))
    results, _ = campaign(lambda b: argv, ids, ["python"], jobs, batch, timeout, on_kill, progress)
    report = Report(inputs=len({i for _, i in results}))
    for fs in results.values():
        report.findings.extend(fs)
    apply_known(report.findings, KNOWN_ISSUES if known is None else known)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--batch", type=int, default=200, help="inputs per child process")
    p.add_argument("--timeout", type=float, default=20.0, help="seconds one input may take")
    p.add_argument("--mem-cap-mb", type=int, default=512, help="address space a child may add (RLIMIT_AS)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        return child_main(lambda i: run_one(a.seed, i), a.mem_cap_mb)
    t0 = time.monotonic()
    report = run_campaign(a.inputs, a.seed, jobs=a.jobs, batch=a.batch, timeout=a.timeout, mem_cap_mb=a.mem_cap_mb,
                          start=a.start, progress=True)  # fmt: skip
    report.extra["seconds"] = round(time.monotonic() - t0)
    report.print("side files")
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
