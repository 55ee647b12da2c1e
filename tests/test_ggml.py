"""The ggml type table against the gguf package (llama.cpp's own Python description of the types)."""

import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from kvref.ggml.types import TYPE_TRAITS, GGMLType, GGMLTypeError, ggml_type, row_size, type_name

# gguf releases before the fix list q8_1 as 40 bytes; ggml's block_q8_1 is half d + half s + 32 int8 = 36.
_KNOWN_GGUF_ERRATA = {GGMLType.Q8_1: {(32, 40)}}


def test_every_gguf_type_is_in_the_table_with_the_same_id_and_sizes():
    for qt, sizes in GGML_QUANT_SIZES.items():
        t = GGMLType(int(qt))
        assert t.name == qt.name
        tr = TYPE_TRAITS[t]
        if sizes in _KNOWN_GGUF_ERRATA.get(t, set()):
            continue
        assert (tr.block_size, tr.type_size) == sizes, t


def test_every_gguf_enum_member_is_known():
    for qt in GGMLQuantizationType:
        assert GGMLType(int(qt)).name == qt.name


def test_every_table_entry_is_an_enum_member_and_vice_versa():
    assert set(TYPE_TRAITS) == set(GGMLType)


def test_retired_ids_are_not_reused():
    for retired in (4, 5, 31, 32, 33, 36, 37, 38):
        with pytest.raises(GGMLTypeError):
            ggml_type(retired)


@pytest.mark.parametrize(
    ("t", "n", "expected"),
    [("f32", 64, 256), ("f16", 64, 128), ("bf16", 64, 128), ("q8_0", 64, 68), ("q4_0", 64, 36), ("q4_K", 512, 288)],
)
def test_row_size(t, n, expected):
    assert row_size(t, n) == expected


def test_row_size_rejects_partial_blocks():
    with pytest.raises(GGMLTypeError, match="whole number"):
        row_size("q8_0", 48)


def test_names_as_llama_cpp_prints_them():
    assert type_name(GGMLType.Q4_K) == "q4_K"
    assert type_name(1) == "f16"
    assert ggml_type("Q8_0") is GGMLType.Q8_0
    with pytest.raises(GGMLTypeError):
        ggml_type("f8")
