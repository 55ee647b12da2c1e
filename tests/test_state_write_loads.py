"""Whatever a memory writes, ``kvref.state.load`` reads, and writes back byte for byte (llama.cpp writes the same
bytes, so a file it produces is never refused). Includes the sequence saves llama.cpp writes for an id at or past
the context's n_seq_max (cells with ``n_seq_id`` 0)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from recurrent_helpers import mamba_hparams
from test_memory_factory import gemma2, jamba, llama

import kvref.state as S
from kvref.errors import KVRefError
from kvref.memory.batch import Batch
from kvref.memory.factory import create_memory

MEMORIES = {
    "kv": lambda n_seq, unified: create_memory(llama(), 256, n_seq, unified),
    "kv-fa": lambda n_seq, unified: create_memory(llama(), 256, n_seq, unified, True),
    "iswa": lambda n_seq, unified: create_memory(gemma2(n_swa=4, n_layer=2), 256, n_seq, unified),
    "recurrent": lambda n_seq, unified: create_memory(mamba_hparams(), 256, n_seq, unified),
    "hybrid": lambda n_seq, unified: create_memory(jamba(), 256, n_seq, unified),
}

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("decode"), st.integers(0, 3), st.integers(1, 6)),
        st.tuples(st.just("seq_rm"), st.integers(0, 3), st.integers(-1, 8)),
        st.tuples(st.just("seq_cp"), st.integers(0, 3), st.integers(0, 3)),
        st.tuples(st.just("seq_keep"), st.integers(0, 3), st.just(0)),
    ),
    max_size=8,
)


def _apply(mem, op) -> None:
    name, a, b = op
    try:
        if name == "decode":
            mem.decode(Batch(tokens=list(range(4, 4 + b)), seq_ids=[[a]] * b))
        elif name == "seq_rm":
            mem.seq_rm(a, b, -1)
        elif name == "seq_cp":
            mem.seq_cp(a, b, -1, -1)
        else:
            mem.seq_keep(a)
    except KVRefError:
        pass  # refused (a full cache, an id the memory does not take): the memory is unchanged


def _check_loads(mem, seq_id: int) -> None:
    blob = mem.state_write(seq_id)
    if seq_id == -1:
        arch = mem.hparams.arch.encode()
        data = struct.pack("<I", len(arch)) + arch + blob  # llama_state_get_data: arch, then the memory
        obj = S.load(data, kind="state")
    else:
        data = blob  # llama_state_seq_get_data before 2026: the memory section only
        obj = S.load(data, kind="seq_state", seq_header=False)
    assert obj.to_bytes() == data


@pytest.mark.parametrize("kind", list(MEMORIES))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, n_seq=st.integers(1, 4), unified=st.booleans())
def test_every_write_loads_and_round_trips(kind: str, ops, n_seq: int, unified: bool) -> None:
    mem = MEMORIES[kind](n_seq, unified)
    for op in ops:
        _apply(mem, op)
    for seq_id in (-1, *range(n_seq)):
        _check_loads(mem, seq_id)


def test_a_sequence_saved_past_n_seq_max_loads() -> None:
    """n_seq_max 1, unified: llama.cpp restores a sequence file into sequence 1 and then writes its cells with
    n_seq_id 0 (state_write_meta lists only ids below n_seq_max); kvref writes the same and must read it."""
    mem = create_memory(llama(), 256, 1, True)
    mem.decode(Batch(tokens=[4, 5, 6], seq_ids=[[0]] * 3))
    mem.state_read(mem.state_write(0), 1)
    blob = mem.state_write(1)
    n_seq_id = struct.unpack_from("<I", blob, 12)[0]  # n_stream, cell_count, cell 0: pos, n_seq_id
    assert n_seq_id == 0
    obj = S.load(blob, kind="seq_state", seq_header=False)
    assert obj.to_bytes() == blob and obj.memory.sections[0].streams[0].cells.n == 3
    assert S.load(blob).to_bytes() == blob  # auto-detection too
