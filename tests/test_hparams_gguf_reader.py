"""HParams.from_gguf reads GGUF metadata itself (issue 14): only the pairs' headers, arrays skipped unread.

The values it returns match gguf's GGUFReader for every key of every committed model; a large vocabulary is
counted, never decoded; lying counts fail as "cannot read GGUF metadata" without allocating or looping.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

import kvref.hparams as H
from kvref import HParams
from kvref.errors import HParamsError

ROOT = Path(__file__).resolve().parent.parent
MODELS = sorted(glob.glob(str(ROOT / "conformance/models/*.gguf")))


def _write(path: Path, n_vocab: int = 16, endianess: Any = gguf.GGUFEndian.LITTLE, **extra: Any) -> Path:
    w = gguf.GGUFWriter(str(path), "llama", endianess=endianess)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_block_count(2)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv([2, 4])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_bool("llama.some_flag", True)
    w.add_int8("llama.some_i8", -3)
    w.add_uint64("llama.some_u64", 1 << 40)
    w.add_float64("llama.some_f64", 0.1)
    w.add_array("llama.empty", [])
    w.add_array("llama.strings", ["a", "bé", ""])
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(n_vocab)])
    w.add_token_scores(np.arange(n_vocab, dtype=np.float32).tolist())
    w.add_token_types([1] * n_vocab)
    for k, v in extra.items():
        w.add_key_value(k, v, gguf.GGUFValueType.get_type(v))
    w.add_tensor("token_embd.weight", np.zeros((2, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _same_as_gguf_reader(path: str) -> int:
    ours = H._read_gguf_metadata(path)
    theirs = gguf.GGUFReader(path, "r").fields
    assert list(ours) == list(theirs)
    for key, f in theirs.items():
        mine = ours[key]
        assert mine.types[0] == f.types[0], key
        assert mine.contents() == f.contents(), key
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            assert mine.n_elements == len(f.data), key
    return len(ours)


@pytest.mark.parametrize("path", MODELS, ids=os.path.basename)
def test_every_committed_model_reads_like_gguf_reader(path: str) -> None:
    assert _same_as_gguf_reader(path) > 5


@pytest.mark.parametrize("endianess", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_every_value_type_reads_like_gguf_reader(tmp_path: Path, endianess: Any) -> None:
    path = _write(tmp_path / "m.gguf", endianess=endianess)
    _same_as_gguf_reader(str(path))
    hp = HParams.from_gguf(path)
    assert hp.n_vocab == 16 and hp.n_head_kv_l(0) == 2 and hp.n_head_kv_l(1) == 4


def test_a_large_vocabulary_is_counted_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """262,144 tokens: from_gguf decodes a handful of scalars and one short array, never the vocabulary."""
    path = _write(tmp_path / "big.gguf", n_vocab=262144)
    decoded: list[list[int]] = []
    real = H._GGUFParser.decode

    def counting(self: Any, types: list[int], at: int) -> Any:
        decoded.append(types)
        return real(self, types, at)

    monkeypatch.setattr(H._GGUFParser, "decode", counting)
    hp = HParams.from_gguf(path)
    assert hp.n_vocab == 262144
    arrays = [t for t in decoded if t[0] == gguf.GGUFValueType.ARRAY]
    assert arrays == [[gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]]  # head_count_kv only
    assert len(decoded) < 40


def _lie(data: bytes, at: int, value: int, size: int = 8) -> bytes:
    return data[:at] + value.to_bytes(size, "little") + data[at + size :]


def test_lying_counts_fail_fast(tmp_path: Path) -> None:
    good = _write(tmp_path / "m.gguf").read_bytes()
    key = b"tokenizer.ggml.tokens"
    at = good.index(key) + len(key)  # then: u32 type (array), u32 element type, u64 count
    cases = {
        "kv_count": _lie(good, 16, 1 << 62),
        "array count": _lie(good, at + 8, 1 << 60),
        "string length": _lie(good, at + 16, 1 << 40),  # the first token's length
        "key length": _lie(good, 24, 1 << 50),
        "value type": _lie(good, at, 77, 4),
        "version": _lie(good, 4, 7, 4),
        "magic": b"GGUX" + good[4:],
    }
    for what, data in cases.items():
        p = tmp_path / f"{what}.gguf"
        p.write_bytes(data)
        with pytest.raises(HParamsError, match="cannot read GGUF metadata"):
            HParams.from_gguf(p)


def test_every_truncation_is_refused(tmp_path: Path) -> None:
    good = _write(tmp_path / "m.gguf").read_bytes()
    end_of_kv = good.index(b"token_embd.weight") - 8  # the tensor infos (name length, name, ...) follow
    for cut in range(0, end_of_kv, 7):
        p = tmp_path / "cut.gguf"
        p.write_bytes(good[:cut])
        with pytest.raises(HParamsError, match="cannot read GGUF metadata"):
            HParams.from_gguf(p)


def test_duplicate_keys_are_refused(tmp_path: Path) -> None:
    good = _write(tmp_path / "m.gguf").read_bytes()
    dup = _put(tmp_path / "dup.gguf", _rename(good, "llama.some_flag", "llama.context_length"))
    with pytest.raises(HParamsError, match=r"cannot read GGUF metadata.*Duplicate llama\.context_length"):
        HParams.from_gguf(dup)


def _put(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _rename(data: bytes, old: str, new: str) -> bytes:
    """Rename key ``old`` (same encoded length required) in the pairs of ``data``."""
    a, b = old.encode(), new.encode()
    prefix = len(a).to_bytes(8, "little") + a
    assert prefix in data
    if len(a) == len(b):
        return data.replace(prefix, len(b).to_bytes(8, "little") + b, 1)
    at = data.index(prefix)
    return data[:at] + len(b).to_bytes(8, "little") + b + data[at + len(prefix) :]
