"""Live: what ``kvref convert`` and ``save_memory`` write loads in the real llama.cpp, and decoding then continues
with logits identical (bit for bit) to a run that never left llama.cpp.

Marked ``live`` (``pytest -m live``); skipped, with the reason, when llama-cpp-python cannot be imported. Each
test compares against a reference context in which the cells of the continued sequence sit at the same indices
(attention sums depend on where the cells are), so equality is exact.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvref

pytestmark = pytest.mark.live
from _llama_live import Ctx  # noqa: E402  (skips this module, with the reason, without llama-cpp-python)
from golden import tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "conformance"
PROMPT = [12, 57, 12, 77, 77, 8, 39, 111, 47, 115, 59, 69]
OTHER = [5, 9, 33, 61, 70, 101, 7]
NEXT = [44, 17, 90]


def continue_logits(ctx: Ctx, seq: int = 0) -> list[np.ndarray]:
    """Decode NEXT one token at a time for ``seq``; the logits after each."""
    return [ctx.decode([t], seq) for t in NEXT]


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a, b), f"token {i}: max |diff| {np.abs(a - b).max()}"


@pytest.mark.parametrize("release", ["0.3.12", "0.3.16", "0.3.35"])
@pytest.mark.parametrize("file", ["01-session.ggsn", "03-seq-seq0.ggsq"])
def test_upgraded_legacy_file_loads_and_continues(release: str, file: str, tmp_path: Path) -> None:
    """A session / sequence file of 0.3.12 (v9, output block, no n_stream), 0.3.16 (v9, output block) or 0.3.35
    (v9 without it) upgraded to the current layout loads in 0.3.36 and continues like a run that decoded the same
    tokens itself."""
    case_dir = ROOT / "golden" / f"legacy-{release}-llama-f16-single-seq"
    case = json.loads((case_dir / "case.json").read_text())
    save = next(op for op in case["trace"] if op.get("file") == file)
    new = tmp_path / file
    out = kvref.convert(case_dir / file, new, arch=case["model"]["hparams"]["arch"])  # a sequence save names no arch
    assert out.version == (10 if out.kind == "session" else 3) and getattr(out, "outputs", None) is None
    m = tiny_model("llama-tiny")
    with Ctx(m) as ref:  # the run that never left llama.cpp: the trace's decodes, then NEXT
        for op in case["trace"][1:]:
            if op is save:
                break
            if op["op"] == "decode":
                ref.decode(op["tokens"], 0, op["pos"][0])
        want = continue_logits(ref)
    with Ctx(m) as ctx:
        loaded = ctx.load_session(new) if out.kind == "session" else ctx.load_seq(new, 0)
        assert loaded == save["tokens"]
        got = continue_logits(ctx)
    assert_same(got, want)


@pytest.fixture(scope="module")
def two_seq_session(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 0.3.36 session holding PROMPT in seq 0 (cells 0..11) then OTHER in seq 1; and the sequence file of OTHER
    decoded alone."""
    d = tmp_path_factory.mktemp("live")
    m = tiny_model("llama-tiny")
    with Ctx(m, n_seq_max=2) as ctx:
        ctx.decode(PROMPT, 0)
        ctx.decode(OTHER, 1)
        ctx.save_session(d / "two.ggsn", PROMPT)
    with Ctx(m) as ctx:
        ctx.decode(OTHER, 0)
        ctx.save_seq(d / "other.ggsq", 0, OTHER)
    return d / "two.ggsn", d / "other.ggsq"


def _reference(n_seq_max: int = 1, seq: int = 0) -> list[np.ndarray]:
    with Ctx(tiny_model("llama-tiny"), n_seq_max=n_seq_max) as ref:
        ref.decode(PROMPT, seq)
        return continue_logits(ref, seq)


def test_extracted_sequence_loads_and_continues(two_seq_session: tuple[Path, Path], tmp_path: Path) -> None:
    session, _ = two_seq_session
    out = tmp_path / "seq0.ggsq"
    kvref.convert(session, out, seq=0, tokens=PROMPT)  # the session holds two sequences: name the tokens
    with Ctx(tiny_model("llama-tiny")) as ctx:
        assert ctx.load_seq(out, 0) == PROMPT
        got = continue_logits(ctx)
    assert_same(got, _reference())


def test_merged_session_loads_and_continues(two_seq_session: tuple[Path, Path], tmp_path: Path) -> None:
    session, other = two_seq_session
    seq0 = tmp_path / "seq0.ggsq"
    kvref.convert(session, seq0, seq=0)
    merged = tmp_path / "merged.ggsn"
    kvref.convert(seq0, merged, merge=[other], arch="llama")
    with Ctx(tiny_model("llama-tiny"), n_seq_max=2) as ctx:
        ctx.load_session(merged)
        assert ctx.pos_max(1) == len(OTHER) - 1
        got = continue_logits(ctx, 0)
    with Ctx(tiny_model("llama-tiny"), n_seq_max=2) as ref:  # PROMPT in seq 0, OTHER in seq 1, as merged
        ref.decode(PROMPT, 0)
        ref.decode(OTHER, 1)
        want = continue_logits(ref, 0)
    assert_same(got, want)


def test_remapped_session_loads_and_continues(tmp_path: Path) -> None:
    m = tiny_model("llama-tiny")
    with Ctx(m, n_seq_max=2) as ctx:
        ctx.decode(PROMPT, 0)
        ctx.save_session(tmp_path / "s.ggsn", PROMPT)
    from kvref.jobs.cli import main

    assert main(["convert", str(tmp_path / "s.ggsn"), str(tmp_path / "r.ggsn"), "--map", "0:1"]) == 0
    with Ctx(m, n_seq_max=2) as ctx:
        ctx.load_session(tmp_path / "r.ggsn")
        assert ctx.pos_max(0) == -1 and ctx.pos_max(1) == len(PROMPT) - 1
        got = continue_logits(ctx, 1)
    assert_same(got, _reference(2, 0))


def test_edited_session_loads_and_continues(tmp_path: Path) -> None:
    """seq_rm on the kvref memory restored from a session, saved back: llama.cpp continues as after its own seq_rm."""
    m = tiny_model("llama-tiny")
    with Ctx(m) as ctx:
        ctx.decode(PROMPT, 0)
        ctx.save_session(tmp_path / "s.ggsn", PROMPT)
    mem, _ = kvref.restore(tmp_path / "s.ggsn", model=m)
    assert mem.seq_rm(0, 8, -1)
    kvref.save_memory(mem, tmp_path / "e.ggsn", tokens=PROMPT[:8])
    with Ctx(m) as ctx:
        assert ctx.load_session(tmp_path / "e.ggsn") == PROMPT[:8]
        got = continue_logits(ctx)
    with Ctx(m) as ref:
        ref.decode(PROMPT, 0)
        assert ref.seq_rm(0, 8, -1)
        want = continue_logits(ref)
    assert_same(got, want)


@pytest.mark.parametrize(
    ("name", "kind"),
    [("llama-tiny", "kv"), ("gemma3-tiny", "iswa"), ("mamba-tiny", "recurrent"), ("lfm2-tiny", "hybrid")],
)
def test_saved_memory_of_each_kind_loads_and_continues(name: str, kind: str, tmp_path: Path) -> None:
    """llama.cpp's session -> kvref.restore -> memory.save (session and sequence file) -> llama.cpp loads both and
    continues exactly as the context that never saved."""
    m = tiny_model(name)
    with Ctx(m) as ctx:
        ctx.decode(PROMPT, 0)
        ctx.save_session(tmp_path / "orig.ggsn", PROMPT)
        want = continue_logits(ctx)
    mem, _ = kvref.restore(tmp_path / "orig.ggsn", model=m)
    assert mem.kind == kind
    kvref.save_memory(mem, tmp_path / "kvref.ggsn", tokens=PROMPT)
    kvref.save_memory(mem, tmp_path / "kvref.ggsq", kind="seq", seq_id=0, tokens=PROMPT)
    with Ctx(m) as ctx:
        assert ctx.load_session(tmp_path / "kvref.ggsn") == PROMPT
        assert_same(continue_logits(ctx), want)
    with Ctx(m) as ctx:
        assert ctx.load_seq(tmp_path / "kvref.ggsq", 0) == PROMPT
        assert_same(continue_logits(ctx), want)
