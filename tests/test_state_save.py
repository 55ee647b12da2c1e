"""``kvref.state.save`` replaces a file crash-safely: fsynced, mode and owner kept, symlinks followed, no leftovers,
and never a target that is not a regular file."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import kvref.state as S
from kvref.errors import SaveTargetError
from kvref.state import atomic

GOLDEN = Path(__file__).resolve().parent.parent / "conformance" / "golden" / "llama-shared-prefix" / "03-seq-seq0.ggsq"


def test_save_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    out = tmp_path / "slot.bin"
    out.write_bytes(b"old")
    out.chmod(0o640)
    S.load(GOLDEN).save(out)
    assert out.read_bytes() == GOLDEN.read_bytes()
    assert stat.S_IMODE(out.stat().st_mode) == 0o640


def test_a_new_file_gets_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        S.load(GOLDEN).save(tmp_path / "new.bin")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.bin").stat().st_mode) == 0o644  # not mkstemp's 0600


def test_save_writes_through_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "data" / "slot.bin"
    real.parent.mkdir()
    real.write_bytes(b"old")
    link = tmp_path / "slot-link.bin"
    link.symlink_to(real)
    S.load(GOLDEN).save(link)
    assert link.is_symlink() and real.read_bytes() == GOLDEN.read_bytes()


def test_a_failed_save_leaves_the_file_and_no_partial(tmp_path: Path) -> None:
    out = tmp_path / "slot.bin"
    out.write_bytes(b"old")

    def boom(f: object) -> int:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic.atomic_write(out, boom)
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot.bin"]


def test_the_file_and_its_directory_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    S.load(GOLDEN).save(tmp_path / "slot.bin")
    assert synced == ["file", "dir"]
    synced.clear()
    S.load(GOLDEN).save(tmp_path / "slot.bin", durable=False)  # as llama.cpp's save: no fsync, still a rename
    assert synced == [] and (tmp_path / "slot.bin").read_bytes() == GOLDEN.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slot.bin"]


def test_saving_over_the_mapped_source_is_safe(tmp_path: Path) -> None:
    out = tmp_path / "slot.bin"
    out.write_bytes(GOLDEN.read_bytes())
    obj = S.load(out)  # memory-mapped from out
    obj.save(out)
    assert out.read_bytes() == GOLDEN.read_bytes()


@pytest.mark.parametrize("kind", ["fifo", "directory", "char-device"])
def test_a_target_that_is_not_a_regular_file_is_refused_untouched(tmp_path: Path, kind: str) -> None:
    if kind == "fifo":
        target = tmp_path / "pipe"
        os.mkfifo(target)
    elif kind == "directory":
        target = tmp_path / "dir"
        target.mkdir()
    else:  # a private copy of /dev/null: a test of this must never risk the real one
        if os.getuid() != 0:
            pytest.skip("only root can make a device node")
        target = tmp_path / "null"
        os.mknod(target, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    before = os.stat(target)
    with pytest.raises(SaveTargetError, match=r"is a (FIFO|directory|character device), not a regular file"):
        S.load(GOLDEN).save(target)
    after = os.stat(target)
    assert (after.st_ino, after.st_mode) == (before.st_ino, before.st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == [target.name]


def test_a_symlink_to_a_device_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "link").symlink_to(fifo)
    with pytest.raises(SaveTargetError, match="FIFO"):
        S.load(GOLDEN).save(tmp_path / "link")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_name_at_the_file_system_limit_saves(tmp_path: Path) -> None:
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    for name in ("s" * limit, "é" * (limit // 2)):  # a multi-byte name is cut at a character boundary
        out = tmp_path / name
        S.load(GOLDEN).save(out)
        assert out.read_bytes() == GOLDEN.read_bytes()
        out.unlink()
    assert list(tmp_path.iterdir()) == []


def test_the_leftover_of_a_killed_save_is_removed_by_the_next(tmp_path: Path) -> None:
    out = tmp_path / "slot.bin"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    leftover = tmp_path / f".slot.bin{atomic.PARTIAL_MARK}{pid}-0123abcd"
    leftover.write_bytes(b"half a save")
    alive = tmp_path / f".slot.bin{atomic.PARTIAL_MARK}{os.getppid()}-0123abcd"  # a running process's save
    alive.write_bytes(b"in progress")
    other = tmp_path / f".other.bin{atomic.PARTIAL_MARK}{pid}-0123abcd"  # another target's: not this save's business
    other.write_bytes(b"x")
    S.load(GOLDEN).save(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([out.name, alive.name, other.name])


def test_save_keeps_the_owner_of_the_file_it_replaces(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("only root can give a file to another owner")
    out = tmp_path / "slot.bin"
    out.write_bytes(b"old")
    os.chown(out, 12345, 23456)
    S.load(GOLDEN).save(out)
    st = os.stat(out)
    assert (st.st_uid, st.st_gid) == (12345, 23456) and out.read_bytes() == GOLDEN.read_bytes()


def test_follow_symlinks_false_replaces_the_link_itself(tmp_path: Path) -> None:
    real = tmp_path / "real.bin"
    real.write_bytes(b"keep me")
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    atomic.atomic_write(link, lambda f: f.write(b"new"), follow_symlinks=False)
    assert not link.is_symlink() and link.read_bytes() == b"new" and real.read_bytes() == b"keep me"


def test_save_memory_refuses_a_fifo_untouched(tmp_path: Path) -> None:
    import kvref

    hp = kvref.HParams.from_gguf(Path(__file__).resolve().parent.parent / "conformance" / "models" / "llama-tiny.gguf")
    mem = kvref.create_memory(hp, n_ctx=64, n_seq_max=1)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(SaveTargetError, match="is a FIFO"):
        kvref.save_memory(mem, fifo, kind="seq", seq_id=0)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_a_saved_state_has_a_one_line_repr(tmp_path: Path) -> None:
    import kvref

    hp = kvref.HParams.from_gguf(Path(__file__).resolve().parent.parent / "conformance" / "models" / "llama-tiny.gguf")
    mem = kvref.create_memory(hp, n_ctx=64, n_seq_max=1)
    mem.decode(kvref.Batch(tokens=list(range(1, 9)), seq_ids=[[0]] * 8))
    out = kvref.save_memory(mem, tmp_path / "s.ggsn", tokens=list(range(1, 9)))
    assert repr(out) == "<SessionFile version 10: arch 'llama', kv memory, 1 stream, 8 cells, 8 tokens>"
    old = kvref.save_memory(mem, tmp_path / "old.ggsq", kind="seq", seq_id=0, era="2025")
    assert repr(old) == "<SeqFile version 2: kv memory, 1 stream, 8 cells, 0 tokens>"
