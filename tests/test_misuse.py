"""Misuse is refused before anything changes, the same way in every memory (issue: hardening, items 2-7).

Each case runs against the memory kinds it concerns; CI runs the file under both backends."""

from __future__ import annotations

import numpy as np
import pytest
from recurrent_helpers import mamba_hparams
from test_memory_factory import jamba, llama

from kvref.errors import (
    ArgumentError,
    ArgumentTypeError,
    BatchError,
    CorruptionError,
    KVRefError,
    SequenceError,
)
from kvref.memory.batch import Batch
from kvref.memory.factory import create_memory

KINDS = {
    "kv": lambda **kw: create_memory(llama(), 256, 3, True, **kw),
    "recurrent": lambda **kw: create_memory(mamba_hparams(), 256, 3, True, **kw),
    "hybrid": lambda **kw: create_memory(jamba(), 256, 3, True, **kw),
}


def filled(kind: str, **kw):
    mem = KINDS[kind](**kw)
    mem.decode(Batch(tokens=[4, 5], seq_ids=[[0], [0]]))
    mem.decode(Batch(tokens=[6, 7], seq_ids=[[1], [1]]))
    return mem


def fingerprint(mem) -> tuple:
    return (mem.state_write(), *(mem.state_write(s) for s in range(3)), *(mem.seq_pos_max(s) for s in range(3)))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("seq_id", [-(2**32), 2**32, 2**31, -(2**31) - 1])
def test_ids_outside_int32_are_refused_not_wrapped(kind: str, seq_id: int) -> None:
    mem = filled(kind)
    before = fingerprint(mem)
    with pytest.raises(SequenceError, match="outside int32"):
        mem.seq_rm(seq_id, -1, -1)  # -2**32 once wrapped to 0 in the recurrent memory: "every sequence"
    with pytest.raises(SequenceError, match="outside int32"):
        mem.state_read(mem.state_write(0), seq_id)
    assert fingerprint(mem) == before


@pytest.mark.parametrize(("compat", "seq_id"), [("2026-08", -2), ("2025", -2), ("0.3.15", -2), ("0.3.15", -1)])
def test_a_hybrid_refuses_as_a_whole(compat: str, seq_id: int) -> None:
    mem = filled("hybrid", compat=compat)
    before = fingerprint(mem)
    with pytest.raises(SequenceError):
        mem.seq_rm(seq_id, -1, -1)  # the recurrent part accepts it, the attention part refuses: neither changes
    assert fingerprint(mem) == before


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.seq_add(1.5, 0, -1, 1),
        lambda m: m.seq_cp(0.0, 1, -1, -1),
        lambda m: m.seq_add("0", 0, -1, 1),
        lambda m: m.seq_add(0, 0, -1, 3.5),
        lambda m: m.seq_rm(None, -1, -1),
        lambda m: m.seq_keep(True),
        lambda m: m.seq_div(0, 0.5, -1, 2),
    ],
)
def test_non_integers_are_type_errors_and_change_nothing(kind: str, call) -> None:
    mem = filled(kind)
    before = fingerprint(mem)
    with pytest.raises(ArgumentTypeError) as e:
        call(mem)
    assert isinstance(e.value, TypeError) and isinstance(e.value, KVRefError)
    assert fingerprint(mem) == before


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_batch_with_a_position_below_minus_one_is_a_batch_error(kind: str) -> None:
    """Positions below -1 decrease from a sequence's start (-1): llama_decode returns -1. A token at -1 itself is
    decoded by llama.cpp; an attention cache would keep its cell used while it reads as empty (CorruptionError)."""
    mem = KINDS[kind]()
    before = fingerprint(mem)
    with pytest.raises(BatchError, match=r"pos\[0\] = -2"):
        mem.decode(Batch(tokens=[7], pos=[-2]))
    if kind != "recurrent":
        with pytest.raises(CorruptionError):
            mem.decode(Batch(tokens=[7], pos=[-1]))
    assert fingerprint(mem) == before


def test_recurrent_seq_add_stays_in_int32() -> None:
    """A shift past int32 is refused; a position moved past INT32_MAX wraps as llama.cpp's int32 does."""
    mem = filled("recurrent")
    before = fingerprint(mem)
    with pytest.raises(ArgumentError, match="shift = 2147483648 is outside int32"):
        mem.seq_add(0, 0, -1, 2**31)
    assert fingerprint(mem) == before
    p = mem.seq_pos_max(0)
    mem.seq_add(0, 0, -1, 2**31 - 1)
    assert mem.seq_pos_min(0) == p + 2**31 - 1 - 2**32
    mem.state_write()  # and what was stored is a state


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8])
def test_numpy_integer_ids_work_like_ints(kind: str, dtype) -> None:
    a, b = filled(kind), filled(kind)
    assert a.seq_rm(dtype(1), -1, -1) == b.seq_rm(1, -1, -1)
    blob = a.state_write(0)
    a.state_read(blob, dtype(2))
    b.state_read(blob, 2)
    assert fingerprint(a) == fingerprint(b)


@pytest.mark.parametrize(
    ("batch", "text"),
    [
        (lambda: Batch(tokens=[2**31]), r"tokens\[0\] = 2147483648 is outside int32"),
        (lambda: Batch(tokens=[4, 2**40]), r"tokens\[1\] = 1099511627776"),
        (lambda: Batch(tokens=[4.5]), "tokens: expected integers"),
        (lambda: Batch(tokens=[4, 5], pos=[0, -3]), r"pos\[1\] = -3"),
        (lambda: Batch(tokens=[4], seq_ids=[[1.0]]), r"seq_ids\[0\]\[0\] = 1.0"),
    ],
)
def test_batch_values_are_checked_where_given(batch, text: str) -> None:
    with pytest.raises(BatchError, match=text):
        batch()


@pytest.mark.parametrize("n_ctx", [-5, 2**32])
def test_create_memory_refuses_sizes_before_allocating(n_ctx: int) -> None:
    with pytest.raises(ArgumentError, match="n_ctx"):
        create_memory(llama(), n_ctx, 1, True)


def test_a_cache_larger_than_memory_is_refused_with_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvref import args

    monkeypatch.setattr(args, "physical_memory", lambda: 1 << 20)  # a 1 MiB machine
    with pytest.raises(ArgumentError, match=r"would take \d+ bytes .* more than this machine's") as e:
        create_memory(llama(), 4096, 1, True)
    assert "lower n_ctx" in str(e.value)
    with pytest.raises(ArgumentError, match="recurrent memory"):
        create_memory(mamba_hparams(n_layer=64), 256, 256, True)
