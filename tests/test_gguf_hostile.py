"""Hostile GGUF metadata is a kvref error naming the key, never a traceback (issue 22, section 2).

Each model is the committed tiny llama with one field changed in place: a string that is not UTF-8, a key that is
not UTF-8, a value of a type no key read as a number can have, head counts of 0, arrays nested without end, or a
file that is not a GGUF model at all. ``HParams.from_gguf``, the vocabulary reader and every job and CLI command
that takes ``--model`` must answer with an HParamsError / FormatError (exit code 2 from the CLI), not with a
UnicodeDecodeError, a ValueError, an IndexError or an AssertionError.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

import kvref
from kvref.errors import FormatError, HParamsError, KVRefError
from kvref.hparams import HParams, _read_gguf_metadata
from kvref.jobs.check import check_file
from kvref.jobs.cli import main
from kvref.jobs.export import export_arrays
from kvref.vocab import vocabulary

ROOT = Path(__file__).resolve().parent.parent
LLAMA = ROOT / "conformance" / "models" / "llama-tiny.gguf"
SESSION = ROOT / "conformance" / "golden" / "llama-f16-fa-single-seq" / "01-session.ggsn"
LEGACY = ROOT / "conformance" / "golden-v7" / "legacy-0.2.83-llama-f16-single-seq" / "01-session.ggsn"


def _value_at(key: str) -> int:
    return _read_gguf_metadata(str(LLAMA))[key]._offset


def patched(tmp_path: Path, name: str, edits: list[tuple[int, bytes]]) -> Path:
    data = bytearray(LLAMA.read_bytes())
    for at, new in edits:
        data[at : at + len(new)] = new
    p = tmp_path / f"{name}.gguf"
    p.write_bytes(bytes(data))
    return p


def string_value(key: str, first: bytes) -> tuple[int, bytes]:
    """The first bytes of a string value replaced (its length stays)."""
    return (_value_at(key) + 8, first)


def value_type(key: str, vtype: int) -> tuple[int, bytes]:
    return (_value_at(key) - 4, struct.pack("<I", vtype))


def u32_value(key: str, v: int) -> tuple[int, bytes]:
    return (_value_at(key), struct.pack("<I", v))


def hostile(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (model, what the error must say)"""
    key_at = LLAMA.read_bytes().index(b"general.name")
    nested = bytearray(LLAMA.read_bytes())
    # tokenizer.ggml.scores becomes an array of arrays of arrays ... (each an array of one array) to its end
    at = _value_at("tokenizer.ggml.scores")
    deep = b"".join(struct.pack("<IQ", 9, 1) for _ in range(64))
    nested[at : at + len(deep)] = deep
    (tmp_path / "nested.gguf").write_bytes(bytes(nested))
    (tmp_path / "text.gguf").write_bytes(b"this is not a model, just some text\n" * 8)
    (tmp_path / "empty.gguf").write_bytes(b"")
    return {
        "arch not utf-8": (patched(tmp_path, "arch", [string_value("general.architecture", b"\xff")]),
                           "general.architecture"),
        "key not utf-8": (patched(tmp_path, "key", [(key_at + 8, b"\xff")]), f"key at offset {key_at - 8}"),
        "context as f32": (patched(tmp_path, "ctxf", [value_type("llama.context_length", 6)]), "llama.context_length"),
        "block count as string": (
            patched(tmp_path, "blk", [value_type("llama.block_count", 8), u32_value("llama.block_count", 1)]),
            "llama.block_count",
        ),
        "head count as f32 nan": (
            patched(tmp_path, "headnan", [value_type("llama.attention.head_count", 6),
                                          (_value_at("llama.attention.head_count"), struct.pack("<f", float("nan")))]),
            "llama.attention.head_count",
        ),
        "arrays nested without end": (tmp_path / "nested.gguf", "nests arrays"),
        "not a gguf file": (tmp_path / "text.gguf", "GGUF magic invalid"),
        "empty file": (tmp_path / "empty.gguf", "empty file"),
    }  # fmt: skip


def test_hostile_metadata_is_an_hparams_error_naming_the_key(tmp_path: Path) -> None:
    for what, (model, says) in hostile(tmp_path).items():
        with pytest.raises(HParamsError, match=None) as e:
            HParams.from_gguf(model)
        assert says in str(e.value), (what, str(e.value))
        for job in (
            lambda m=model: kvref.restore(SESSION, model=m),
            lambda m=model: export_arrays(SESSION, model=m),
            lambda m=model: check_file(SESSION, m),
            lambda m=model: kvref.state.load(LEGACY, model=m),
        ):
            with pytest.raises(HParamsError) as e:
                job()
            assert says in str(e.value), (what, str(e.value))


@pytest.mark.parametrize("cmd", ["inspect", "check", "export", "plot", "diff"])
def test_every_model_option_of_the_cli_exits_2_with_the_key(tmp_path: Path, cmd: str, capsys) -> None:
    out = tmp_path / "out"
    argv = {
        "inspect": ["inspect", str(LEGACY)],  # reads the model twice: the v7 layout and the vocabulary
        "check": ["check", str(SESSION)],
        "export": ["export", str(SESSION), str(out.with_suffix(".safetensors"))],
        "plot": ["plot", str(SESSION), "-o", str(out.with_suffix(".png"))],
        "diff": ["diff", str(LEGACY), str(LEGACY)],  # a v7 session needs its model to be read at all
    }[cmd]
    if cmd == "plot":
        pytest.importorskip("matplotlib")
    for what, (model, says) in hostile(tmp_path).items():
        assert main([*argv, "--model", str(model)]) == 2, what
        err = capsys.readouterr().err
        assert "HParamsError" in err and says in err, (what, err)


def test_the_vocabulary_reader_refuses_with_kvref_errors(tmp_path: Path) -> None:
    for what, (model, says) in hostile(tmp_path).items():
        if what in ("arch not utf-8", "context as f32", "head count as f32 nan"):
            assert len(vocabulary(model)) == 128  # the vocabulary does not read those keys
            continue
        with pytest.raises(HParamsError) as e:
            vocabulary(model)
        assert says in str(e.value), (what, str(e.value))
    tokens_as_u32 = patched(tmp_path, "tok", [(_value_at("tokenizer.ggml.tokens"), struct.pack("<I", 4))])
    with pytest.raises(HParamsError, match=r"(tokenizer\.ggml\.tokens is not an array of strings)|cannot read GGUF"):
        vocabulary(tokens_as_u32)


def test_a_token_that_is_not_utf8_reads_with_replacement_characters(tmp_path: Path) -> None:
    tok = patched(tmp_path, "tok", [(_value_at("tokenizer.ggml.tokens") + 12 + 8, b"\xff")])
    assert vocabulary(tok)[0].startswith("\ufffd")


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        (["llama.attention.head_count"], "K rows of 0 elements"),
        (["llama.attention.head_count_kv"], "K rows of 0 elements"),
        (["llama.embedding_length", "llama.attention.value_length"], "V rows of 0 elements"),
    ],
)
def test_attention_without_heads_is_refused_naming_the_keys(tmp_path: Path, keys: list[str], says: str) -> None:
    """A memory built on such hyper-parameters once failed in a reshape (the K-shift, the state writer)."""
    model = patched(tmp_path, "heads0", [u32_value(key, 0) for key in keys])
    for job in (
        lambda: HParams.from_gguf(model),
        lambda: kvref.restore(SESSION, model=model),
        lambda: kvref.state.load(LEGACY, model=model),
        lambda: export_arrays(SESSION, model=model),
    ):
        with pytest.raises(HParamsError, match=says) as e:
            job()
        assert "llama.attention.head_count_kv" in str(e.value)


def test_a_model_with_fewer_layers_than_the_state_is_a_format_error_when_exporting(tmp_path: Path) -> None:
    """The tensors job once asserted that every layer of the state had a head size from the model."""
    h64 = ROOT / "conformance" / "models" / "llama-h64-tiny.gguf"
    state = next((ROOT / "conformance" / "golden" / "llama-h64-q8_0-rot-kshift").glob("*.ggsn"))
    data = bytearray(h64.read_bytes())
    at = _read_gguf_metadata(str(h64))["llama.block_count"]._offset
    data[at : at + 4] = struct.pack("<I", 1)
    model = tmp_path / "one-layer.gguf"
    model.write_bytes(bytes(data))
    with pytest.raises(KVRefError, match="the model does not fit this state: section 0 holds 2 layers"):
        export_arrays(state, model=model)


def test_a_model_of_another_head_size_is_a_format_error_when_exporting_rotated_rows(tmp_path: Path) -> None:
    """Found by the GGUF fuzzer: undoing the attention rotation with the wrong head size was a plain ValueError."""
    qwen = ROOT / "conformance" / "models" / "qwen3-h128-tiny.gguf"
    state = ROOT / "conformance" / "golden" / "qwen3-h128-q4_0-k-rot-kshift" / "01-state.bin"
    data = bytearray(qwen.read_bytes())
    at = _read_gguf_metadata(str(qwen))["qwen3.attention.key_length"]._offset
    data[at : at + 4] = struct.pack("<I", 256)
    model = tmp_path / "h256.gguf"
    model.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="not the state's"):
        export_arrays(state, model=model)
