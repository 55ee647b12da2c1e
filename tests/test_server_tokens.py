"""llama-server's slot files: the token field is a plain list or llama-server's packed prompt (with media)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

import kvref.state as S
from kvref.errors import FormatError
from kvref.state.server_tokens import read_prompt

GOLDEN = Path(__file__).resolve().parent.parent / "conformance" / "golden" / "llama-shared-prefix" / "03-seq-seq0.ggsq"


def packed(tokens: list[int], media: list[tuple[int, bytes]]) -> np.ndarray:
    """What server_tokens::serialize writes (llama-cpp-python 0.3.36's tools/server/server-common.cpp)."""
    raw = struct.pack("<iII", -1, 1, len(tokens)) + struct.pack(f"<{len(tokens)}i", *tokens)
    raw += struct.pack(f"<I{len(media)}I", len(media), *(s for s, _ in media))
    for _, chunk in media:
        raw += struct.pack("<I", len(chunk)) + chunk
    raw += b"\0" * (-len(raw) % 4)
    return np.frombuffer(raw, "<i4").copy()


def test_a_packed_prompt_with_an_image_is_read() -> None:
    p = read_prompt(packed([5, 6, -1, -1, -1, 7], [(2, b"\x01" * 13)]))
    assert p.form == "llama-server packed v1"
    assert p.tokens.tolist() == [5, 6, -1, -1, -1, 7] and p.media == [(2, 13)]


def test_inspect_says_which_form_a_slot_file_uses() -> None:
    obj = S.load(GOLDEN)
    assert obj.summary()["token_field"] == {"form": "plain"}
    obj.tokens = packed([4, 5, 6], [])
    data = obj.to_bytes()
    tf = S.load(data).summary()["token_field"]
    assert tf["form"] == "llama-server packed v1" and tf["n_prompt_tokens"] == 3 and tf["media"] == []


@pytest.mark.parametrize(
    "field",
    [
        np.array([-1], np.int32),  # the marker alone
        np.array([-1, 2], np.int32),  # an unknown version
        np.array([-1, 1, 0x7FFFFFFF], np.int32),  # a lying token count
        packed([1], [(0, b"abcd")])[:-1],  # a media chunk cut short
    ],
)
def test_a_broken_packed_prompt_is_a_format_error_and_inspect_still_works(field: np.ndarray) -> None:
    with pytest.raises(FormatError):
        read_prompt(field)
    obj = S.load(GOLDEN)
    obj.tokens = field
    assert S.load(obj.to_bytes()).summary()["token_field"]["form"] == "unreadable llama-server packed prompt"
