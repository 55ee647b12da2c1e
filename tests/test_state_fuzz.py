"""Hypothesis: byte mutations of valid states give a FormatError or a state that writes back to the same bytes."""

from __future__ import annotations

import pytest
from _state_factory import load_options, make
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvref.state as S
from kvref.errors import FormatError
from kvref.state.constants import FIELDS

SEEDS = [
    make("session", "kv", 21, outputs=True, ext_size=8).to_bytes(),
    make("session", "hybrid", 22, v_trans=1).to_bytes(),
    make("seq", "iswa", 23, ext_size=12).to_bytes(),
    make("state", "recurrent", 24, s_trans=1).to_bytes(),
    make("seq_state", "hybrid_idx", 25).to_bytes(),
]
EXPLICIT = [
    load_options("session", "kv", outputs=True, ext_size=8),
    load_options("session", "hybrid", v_trans=1),
    load_options("seq", "iswa", ext_size=12),
    load_options("state", "recurrent", s_trans=1),
    load_options("seq_state", "hybrid_idx"),
]


@st.composite
def mutated(draw: st.DrawFn) -> tuple[int, bytes]:
    i = draw(st.integers(0, len(SEEDS) - 1))
    b = bytearray(SEEDS[i])
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["set", "u32", "cut", "insert", "delete"]))
        at = draw(st.integers(0, max(0, len(b) - 1)))
        if op == "set" and b:
            b[at] = draw(st.integers(0, 255))
        elif op == "u32":
            v = draw(st.sampled_from([0, 1, 2, 255, 256, 0x7FFFFFFF, 0xFFFFFFFF, 1 << 31]))
            b[at : at + 4] = v.to_bytes(4, "little")
        elif op == "cut":
            del b[at:]
        elif op == "insert":
            b[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del b[at : at + draw(st.integers(1, 8))]
    return i, bytes(b)


def _check(blob: bytes, **kw: object) -> None:
    try:
        obj = S.load(blob, **kw)
    except FormatError as e:
        assert e.field in FIELDS, e
        return
    assert obj.to_bytes() == blob


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutations_explicit(case: tuple[int, bytes]) -> None:
    i, blob = case
    _check(blob, **EXPLICIT[i])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutations_auto(case: tuple[int, bytes]) -> None:
    _check(case[1])


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes(blob: bytes) -> None:
    _check(blob)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_mutations_long(case: tuple[int, bytes]) -> None:
    i, blob = case
    _check(blob, **EXPLICIT[i])
