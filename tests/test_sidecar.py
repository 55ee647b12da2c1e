"""The identity sidecar ``<file>.kvref.json`` is untrusted input: read bounded, validated field by field, and
written like a state file (temporary file, rename), never through a planted symlink."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from kvref.errors import FormatError
from kvref.jobs.check import check_file
from kvref.jobs.sidecar import MAX_BYTES, read_sidecar, sidecar_path, verify_sidecar, write_sidecar

ROOT = Path(__file__).resolve().parent.parent / "conformance"
GOLDEN = ROOT / "golden" / "llama-shared-prefix" / "03-seq-seq0.ggsq"
LLAMA = ROOT / "models" / "llama-tiny.gguf"


@pytest.fixture
def state(tmp_path: Path) -> Path:
    out = tmp_path / "slot.ggsq"
    out.write_bytes(GOLDEN.read_bytes())
    return out


def test_a_written_sidecar_reads_back_and_verifies(state: Path) -> None:
    write_sidecar(state, model=LLAMA)
    doc = read_sidecar(state)
    assert doc is not None and doc["payload"]["size"] == state.stat().st_size
    assert verify_sidecar(state, LLAMA) == []


def test_a_fifo_sidecar_is_refused_without_blocking(state: Path) -> None:
    os.mkfifo(sidecar_path(state))
    done: list[BaseException] = []

    def read() -> None:
        try:
            read_sidecar(state)
        except BaseException as e:
            done.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "reading a FIFO sidecar blocked"
    assert isinstance(done[0], FormatError) and "not a regular file" in str(done[0])


def test_a_sidecar_linked_to_an_endless_file_is_refused(state: Path) -> None:
    sidecar_path(state).symlink_to("/dev/zero")
    with pytest.raises(FormatError, match="not a regular file"):
        read_sidecar(state)


def test_a_huge_sidecar_is_refused_unread(state: Path) -> None:
    with open(sidecar_path(state), "wb") as f:
        f.truncate(MAX_BYTES * 64)  # sparse: a reader that reads it whole allocates 64 MiB
    with pytest.raises(FormatError, match=f"larger than {MAX_BYTES} bytes"):
        read_sidecar(state)


def test_deep_nesting_is_a_format_error(state: Path) -> None:
    sidecar_path(state).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FormatError, match="nested too deeply"):
        read_sidecar(state)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("payload", {"size": "8037"}, r"payload.size is \"8037\", not a byte count"),
        ("payload", {"size": True}, r"payload.size is true, not a byte count"),
        ("payload", {"size": -1}, r"payload.size is -1, not a byte count"),
        ("payload", [1, 2], r"payload is \[1, 2\], not dict"),
        ("model", {"sha256": "xyz"}, r"model.sha256 is \"xyz\", not 64 hex digits"),
        ("model", "llama", r"model is \"llama\", not dict"),
        ("kind", None, r"kind is null, not str$"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(state: Path, field: str, value: object, message: str) -> None:
    write_sidecar(state)
    doc = json.loads(sidecar_path(state).read_text())
    doc[field] = value
    sidecar_path(state).write_text(json.dumps(doc))
    with pytest.raises(FormatError, match=message):
        verify_sidecar(state)
    with pytest.raises(FormatError, match=message):  # kvref check reports it, it does not crash
        check_file(state, LLAMA)


def test_writing_a_sidecar_replaces_a_planted_symlink(state: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    sidecar_path(state).symlink_to(victim)
    write_sidecar(state)
    assert victim.read_text() == "keep me"
    assert not sidecar_path(state).is_symlink() and read_sidecar(state) is not None
    assert [p.name for p in tmp_path.iterdir() if ".kvref-partial-" in p.name] == []
