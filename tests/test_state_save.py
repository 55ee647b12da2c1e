"""``kvref.state.save`` replaces a file crash-safely: fsynced, mode kept, symlinks followed, no leftovers."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import kvref.state as S
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
