"""The GGUF twins agree: ``skip_strings`` of ``_gguf_py`` and ``_gguf_c`` step over the same length-prefixed
strings (a tokenizer's vocabulary) to the same offset, and stop at the same string with the same reason when the
bytes are cut short or a length lies; a well-formed array ends where its strings, written out, end."""

from __future__ import annotations

import struct

import pytest
from conftest import NOT_BUILT
from hypothesis import given, settings
from hypothesis import strategies as st

from kvref import _gguf_py
from kvref._backend import _load_compiled

GGUF_C = _load_compiled("gguf")


def encode(strings: list[bytes], big_endian: bool) -> bytes:
    order = ">" if big_endian else "<"
    return b"".join(struct.pack(order + "Q", len(s)) + s for s in strings)


@pytest.fixture
def twins() -> tuple:
    if GGUF_C is None:
        pytest.skip(NOT_BUILT)
    return _gguf_py, GGUF_C


@settings(max_examples=300, deadline=None)
@given(
    strings=st.lists(st.binary(max_size=40), max_size=30),
    prefix=st.binary(max_size=9),
    big_endian=st.booleans(),
    data=st.data(),
)
def test_twins_agree_on_every_cut_and_lie(strings: list[bytes], prefix: bytes, big_endian: bool, data) -> None:
    if GGUF_C is None:
        pytest.skip(NOT_BUILT)
    body = encode(strings, big_endian)
    buf = bytearray(prefix + body)
    at = len(prefix)
    # the array as written: both twins end where the strings end
    want = (at + len(body), 0)
    for mod in (_gguf_py, GGUF_C):
        assert mod.skip_strings(bytes(buf), at, len(strings), len(buf), big_endian) == want
    # a cut, a lying length, a count larger than the array, a bad start or an end past the bytes
    if strings and data.draw(st.booleans()):
        k = data.draw(st.integers(0, len(strings) - 1))
        off = at + sum(8 + len(s) for s in strings[:k])
        lie = data.draw(st.sampled_from([2**64 - 1, 2**63, len(buf), 2**32 + 5]))
        buf[off : off + 8] = struct.pack(">Q" if big_endian else "<Q", lie)
    end = data.draw(st.integers(0, len(buf) + 3))
    count = data.draw(st.integers(0, len(strings) + 2))
    start = data.draw(st.sampled_from([at, at, -1, 0]))
    got = [mod.skip_strings(memoryview(bytes(buf)), start, count, end, big_endian) for mod in (_gguf_py, GGUF_C)]
    assert got[0] == got[1]
    offset, short = got[0]
    assert short in (0, _gguf_py.TRUNCATED_LENGTH, _gguf_py.TRUNCATED_STRING)
    assert short or count == 0 or offset <= min(end, len(buf))  # a walk that stepped ends within the bytes


def test_a_vocabulary_is_stepped_over_without_reading_it(twins: tuple) -> None:
    """262,144 tokens: the offset after them, from either twin, and the first truncated string named."""
    strings = [b"tok%d" % i for i in range(1 << 18)]
    body = encode(strings, False)
    for mod in twins:
        assert mod.skip_strings(body, 0, len(strings), len(body), False) == (len(body), 0)
        assert mod.skip_strings(body, 0, len(strings), len(body) - 1, False) == (len(body), mod.TRUNCATED_STRING)
        # the last string (b"tok262143": an 8-byte length and 9 bytes) starts 17 bytes before the end
        assert mod.skip_strings(body, 0, len(strings), len(body) - 12, False) == (len(body) - 17, mod.TRUNCATED_LENGTH)
