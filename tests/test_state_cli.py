"""The command line: `kvref inspect`, `--version`, usage conventions (console script and python -m kvref)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import kvref
from kvref.jobs.cli import main

# subprocesses start where the imported kvref lives, never in a checkout whose kvref/ would shadow it
KVREF_HOME = Path(kvref.__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "state"
GOLDEN = Path(__file__).resolve().parent.parent / "conformance" / "golden"


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


def test_bare_kvref_is_a_usage_error() -> None:
    """argparse's convention: no command is a usage error (usage on stderr, exit 2)."""
    r = subprocess.run([sys.executable, "-m", "kvref"], capture_output=True, text=True, cwd=KVREF_HOME)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("usage: kvref") and "a command is required" in r.stderr


def test_version_names_backend_and_llama_cpp() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvref", "--version"], capture_output=True, text=True, check=True, cwd=KVREF_HOME
    )
    assert r.stdout.startswith(f"kvref {kvref.__version__} ({kvref.backend()} backend), following llama.cpp 0c1e570")
    assert "compat '2026-10'" in r.stdout


def test_every_option_has_help() -> None:
    from kvref.jobs.cli import build_parser

    parser = build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = [parser, *(p for s in subs for p in s.choices.values())]
    missing = [
        f"{p.prog} {a.dest}"
        for p in parsers
        for a in p._actions
        if not isinstance(a, argparse._SubParsersAction) and not a.help
    ]
    assert not missing, missing


def test_inspect_reads_stdin() -> None:
    path = GOLDEN / "llama-shared-prefix" / "03-seq-seq0.ggsq"
    r = subprocess.run(
        [sys.executable, "-m", "kvref", "inspect", "-", "--json"],
        input=path.read_bytes(),
        capture_output=True,
        cwd=KVREF_HOME,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["format"] == "seq"


def test_inspect_model_turns_tokens_into_text(capsys) -> None:
    import gguf

    model = Path(__file__).resolve().parent.parent / "conformance" / "models" / "llama-tiny.gguf"
    path = GOLDEN / "llama-shared-prefix" / "01-session.ggsn"
    assert main(["inspect", "--json", "--model", str(model), str(path)]) == 0
    s = json.loads(capsys.readouterr().out)
    field = gguf.GGUFReader(str(model)).fields["tokenizer.ggml.tokens"]
    pieces = [bytes(field.parts[i]).decode() for i in field.data]
    assert s["text"] == "".join(pieces[t] for t in s["tokens"]).replace("\u2581", " ")


def test_check_of_a_file_that_is_no_state_is_an_error_not_a_no(tmp_path: Path, capsys) -> None:
    model = str(GOLDEN.parent / "models" / "llama-tiny.gguf")
    empty, rand, missing = tmp_path / "empty.bin", tmp_path / "random.bin", tmp_path / "missing.bin"
    empty.write_bytes(b"")
    rand.write_bytes(bytes(range(7, 107)))
    for path, err in ((empty, "truncated: 0 bytes"), (rand, "not a llama.cpp state"),
                      (missing, "missing.bin: No such file or directory"), (tmp_path, "Is a directory")):  # fmt: skip
        assert main(["check", str(path), "--model", model]) == 2, path
        out = capsys.readouterr()
        assert err in out.err and "another model" not in out.out + out.err, (path, out)


def test_check_of_another_models_state_is_a_no(capsys) -> None:
    model = str(GOLDEN.parent / "models" / "llama-tiny.gguf")
    assert main(["check", str(GOLDEN / "qwen3-gqa" / "07-session.ggsn"), "--model", model]) == 1
    assert "wrong model arch" in capsys.readouterr().out


def test_check_offers_llama_cpp_pythons_defaults(capsys) -> None:
    model = str(GOLDEN.parent / "models" / "llama-tiny.gguf")
    path = str(GOLDEN / "llama-f16-single-seq" / "03-seq-seq0.ggsq")
    assert main(["check", path, "--model", model]) == 1  # llama.cpp's default: flash attention auto
    out = capsys.readouterr().out
    assert "fix: --flash-attn off" in out and "--defaults llama-cpp-python" in out
    assert main(["check", path, "--model", model, "--defaults", "llama-cpp-python"]) == 0
    assert capsys.readouterr().out.startswith("yes:")


def _stdin(monkeypatch, data: bytes) -> None:
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))


def test_every_command_that_reads_a_state_reads_stdin(monkeypatch, capsysbinary, tmp_path: Path) -> None:
    path = GOLDEN / "llama-f16-single-seq" / "03-seq-seq0.ggsq"
    model = str(GOLDEN.parent / "models" / "llama-tiny.gguf")
    for argv, code in (
        (["inspect", "-"], 0),
        (["diff", "-", str(path)], 0),
        (["check", "-", "--model", model, "--defaults", "llama-cpp-python"], 0),
        (["export", "-", str(tmp_path / "kv.npz")], 0),
        (["convert", "-", str(tmp_path / "out.ggsq")], 0),
    ):
        _stdin(monkeypatch, path.read_bytes())
        assert main(argv) == code, (argv, capsysbinary.readouterr().err)
    assert (tmp_path / "out.ggsq").read_bytes() == path.read_bytes()
    _stdin(monkeypatch, path.read_bytes())
    assert main(["diff", "-", "-"]) == 2
    assert b"only one argument can be -" in capsysbinary.readouterr().err


def test_convert_and_export_write_stdout(monkeypatch, capsysbinary) -> None:
    import io

    import numpy as np

    path = GOLDEN / "llama-f16-single-seq" / "03-seq-seq0.ggsq"
    assert main(["convert", str(path), "-"]) == 0
    out = capsysbinary.readouterr()
    assert out.out == path.read_bytes() and b"wrote standard output" in out.err
    assert main(["export", str(path), "-"]) == 0
    assert "__kvref__" in np.load(io.BytesIO(capsysbinary.readouterr().out)).files


def test_outputs_of_the_wrong_kind_are_refused_before_any_work(tmp_path: Path, capsys) -> None:
    path = str(GOLDEN / "llama-f16-single-seq" / "03-seq-seq0.ggsq")
    assert main(["export", path, str(tmp_path / "kv.txt")]) == 2
    assert "OUT.npz or OUT.safetensors" in capsys.readouterr().err
    assert main(["plot", path, "-o", str(tmp_path / "cache.txt")]) == 2
    assert "draws .png, .svg, .pdf" in capsys.readouterr().err
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert main(["convert", path, str(fifo)]) == 2
    assert "is a FIFO, not a regular file" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]


def test_export_prints_the_files_byte_count(tmp_path: Path, capsys) -> None:
    out = tmp_path / "kv.npz"
    assert main(["export", str(GOLDEN / "llama-f16-single-seq" / "03-seq-seq0.ggsq"), str(out)]) == 0
    assert f"{out.stat().st_size} bytes" in capsys.readouterr().out


def test_check_compat_takes_every_era_convert_writes(capsys) -> None:
    model = str(GOLDEN.parent / "models" / "llama-tiny.gguf")
    legacy = str(GOLDEN / "legacy-0.3.8-llama-f16-single-seq" / "03-seq-seq0.ggsq")
    current = str(GOLDEN / "llama-f16-single-seq" / "03-seq-seq0.ggsq")
    for compat in ("0.3.8", "2024-09", "0.3.0"):
        assert main(["check", legacy, "--model", model, "--defaults", "llama-cpp-python", "--compat", compat]) == 0
        assert capsys.readouterr().out.startswith("yes: seq in the 2024-09 layout")
    for compat, era in (("0.2.90", "2024-08"), ("2024-05", "2024-05"), ("0.3.11", "2025-07")):
        assert main(["check", current, "--model", model, "--defaults", "llama-cpp-python", "--compat", compat]) == 1
        out = capsys.readouterr().out
        # a sequence file needs no model to be converted (only a session of version 5 .. 7 does)
        assert f"fix: kvref convert FILE OUT --to-era {era}" in out, out


def test_convert_refuses_a_sequence_file_whose_ext_cannot_be_known(tmp_path: Path, capsys) -> None:
    """A 0.3.16 M-RoPE (qwen2vl) sequence file has no cell ext and names no arch: converted to the current layout
    blindly, llama.cpp 0.3.36 would misread it. kvref asks for the model; check names the problem."""
    legacy = str(GOLDEN / "legacy-0.3.16-qwen2vl-mrope" / "03-seq-seq0.ggsq")
    model = str(GOLDEN.parent / "models" / "qwen2vl-tiny.gguf")
    out = tmp_path / "up.ggsq"
    assert main(["convert", legacy, str(out)]) == 2
    assert "--model M.gguf, or --arch" in capsys.readouterr().err and not out.exists()
    assert main(["convert", legacy, str(out), "--model", model]) == 0
    assert main(["check", str(out), "--model", model, "--defaults", "llama-cpp-python"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("yes:")
    # what the blind conversion wrote (ext-less cells in the current layout): check says what is wrong
    blind = tmp_path / "blind.ggsq"
    kvref.convert(legacy, blind, arch="llama")
    assert main(["check", str(blind), "--model", model, "--defaults", "llama-cpp-python"]) == 1
    text = capsys.readouterr().out
    assert "carry no M-RoPE position ext" in text and "fix: kvref convert FILE OUT --arch qwen2vl" in text


def test_check_counts_the_cells_of_every_stream(capsys) -> None:
    model = str(GOLDEN.parent / "models" / "llama-tiny.gguf")
    path = str(GOLDEN / "llama-f16-multistream" / "01-session.ggsn")  # streams of 11, 8 and 4 cells
    argv = ["check", path, "--model", model, "--no-kv-unified", "--n-seq-max", "3", "--defaults", "llama-cpp-python"]
    assert main(argv) == 0
    assert "23 cells restored into the context" in capsys.readouterr().out


def test_inspect_bounds_its_output_and_all_gives_every_token(tmp_path: Path, capsys) -> None:
    import numpy as np

    from kvref import state

    o = state.load(GOLDEN / "llama-shared-prefix" / "01-session.ggsn")
    o.tokens = (np.arange(100_000) % 97).astype(np.int32)
    big = tmp_path / "big.ggsn"
    state.save(o, big)
    assert main(["inspect", "--json", str(big)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert "tokens" not in s and s["tokens_omitted"] == 100_000 and s["n_tokens"] == 100_000
    assert main(["inspect", "--json", "--all", str(big)]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == o.tokens.tolist()
    model = str(GOLDEN.parent / "models" / "llama-tiny.gguf")
    assert main(["inspect", "--json", "--model", model, str(big)]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["text_of_tokens"] == 1024 and s["text"]


def test_inspect_with_the_model_names_the_model_layers(capsys) -> None:
    """Gemma 3 (tiny: layer 5 of 6 is full attention, 0..4 slide): the base section's layer 0 is model layer 5."""
    path = str(GOLDEN / "gemma3-iswa" / "01-session.ggsn")
    assert main(["inspect", "--json", path, "--model", str(GOLDEN.parent / "models" / "gemma3-tiny.gguf")]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [lay["il"] for lay in s["sections"][0]["streams"][0]["layers"]] == [5]
    assert [lay["il"] for lay in s["sections"][1]["streams"][0]["layers"]] == [0, 1, 2, 3, 4]
    assert main(["inspect", path, "--model", str(GOLDEN.parent / "models" / "llama-tiny.gguf")]) == 0
    out = capsys.readouterr().out
    assert "note: the model does not fit this state" in out and "model layer" not in out
