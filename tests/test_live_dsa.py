"""Live: a DSA restore that fails in its indexer section leaves what llama.cpp leaves.

llama_kv_cache_dsa::state_read reads the MLA section, then the indexer section; when the indexer section fails it
clears what the MLA read restored (state_clear). The real llama.cpp restores a sequence blob of glm-dsa-tiny whose
indexer section names another K type (the MLA section is intact) and returns 0; kvref's non-atomic restore of the
same bytes must leave the same cells in both caches, and its default (atomic) restore nothing changed.

Marked ``live`` (``pytest -m live``); skipped, with the reason, when llama-cpp-python cannot be imported.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

import kvref

pytestmark = pytest.mark.live
from _llama_live import Ctx, L  # noqa: E402  (skips this module, with the reason, without llama-cpp-python)

MODEL = Path(__file__).resolve().parent.parent / "conformance" / "models" / "glm-dsa-tiny.gguf"
SEQ0, SEQ1 = [12, 57, 12, 77, 77, 8], [5, 9, 33, 61]


def _seq_data(ctx: Ctx, seq: int) -> bytes:
    n = int(L.llama_state_seq_get_size(ctx.ctx, seq))
    buf = (ctypes.c_uint8 * n)()
    assert int(L.llama_state_seq_get_data(ctx.ctx, buf, n, seq)) == n
    return bytes(buf)


def _state(ctx: Ctx) -> bytes:
    n = int(L.llama_state_get_size(ctx.ctx))
    buf = (ctypes.c_uint8 * n)()
    assert int(L.llama_state_get_data(ctx.ctx, buf, n)) == n
    return bytes(buf)


def _cells(sections: list) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Per KV section: (pos, seq ids) of every cell written, in order."""
    out = []
    for sec in sections:
        c = sec.streams[0].cells
        out.append([] if c is None else [(int(c.pos[i]), c.seq_ids(i)) for i in range(c.n)])
    return out


def test_a_failed_indexer_section_clears_the_mla_part_as_llama_cpp_does() -> None:
    with Ctx(MODEL, n_seq_max=2) as ctx:
        ctx.decode(SEQ0, 0)
        ctx.decode(SEQ1, 1)
        obj = kvref.state.load(_seq_data(ctx, 1), kind="seq_state", layout="dsa")
        lid = obj.memory.sections[1].streams[0].data.k[0]
        lid.type = 0  # f32 instead of the cache's f16, the row size kept: llama.cpp's "mismatched key type"
        bad = obj.to_bytes()
        buf = (ctypes.c_uint8 * len(bad)).from_buffer_copy(bad)
        assert int(L.llama_state_seq_set_data(ctx.ctx, buf, len(bad), 1)) == 0  # refused
        theirs = kvref.state.load(_state(ctx), kind="state", layout="dsa")
        pos_max = [ctx.pos_max(0), ctx.pos_max(1)]
    # llama.cpp: seq 1 gone from both caches (the MLA part restored, then cleared), seq 0 untouched
    assert pos_max == [len(SEQ0) - 1, -1]
    assert _cells(theirs.memory.sections) == [[(p, (0,)) for p in range(len(SEQ0))]] * 2

    hp = kvref.HParams.from_gguf(MODEL)

    def decoded() -> kvref.memory.kv_cache_dsa.KVCacheDSA:
        mem = kvref.create_memory(hp, 256, n_seq_max=2, kv_unified=True)
        for seq, toks in ((0, SEQ0), (1, SEQ1)):
            mem.decode(kvref.Batch(tokens=toks, pos=list(range(len(toks))), seq_ids=[[seq]] * len(toks)))
        return mem

    data = kvref.state.section_bytes(*kvref.state.load(bad, kind="seq_state", layout="dsa").memory.sections)
    mem = decoded()
    before = mem.state_write()
    with pytest.raises(kvref.errors.FormatError, match="type"):
        mem.state_read(data, 1)
    assert mem.state_write() == before  # kvref's default: atomic
    with pytest.raises(kvref.errors.FormatError):
        mem.state_read(data, 1, atomic=False)
    assert [mem.seq_pos_max(0), mem.seq_pos_max(1)] == pos_max
    assert _cells(mem.state_sections()) == _cells(theirs.memory.sections)
    assert np.array_equal(mem.mla.cells(0).pos, mem.lid.cells(0).pos)


def test_a_failed_swa_section_keeps_the_dsa_part_as_llama_cpp_does() -> None:
    """llama_kv_cache_dsa_iswa::state_read undoes nothing: a blob whose SWA section fails leaves the MLA and indexer
    caches restored, the SWA cache without the sequence."""
    model = MODEL.with_name("dots3note-tiny.gguf")
    with Ctx(model, n_seq_max=2) as ctx:
        ctx.decode(SEQ0, 0)
        ctx.decode(SEQ1, 1)
        obj = kvref.state.load(_seq_data(ctx, 1), kind="seq_state", layout="dsa_iswa")
        obj.memory.sections[2].streams[0].data.k[0].type = 0  # the SWA section's K type
        bad = obj.to_bytes()
        buf = (ctypes.c_uint8 * len(bad)).from_buffer_copy(bad)
        assert int(L.llama_state_seq_set_data(ctx.ctx, buf, len(bad), 0)) == 0  # into seq 0: refused
        theirs = kvref.state.load(_state(ctx), kind="state", layout="dsa_iswa")
        pos_max = [ctx.pos_max(0), ctx.pos_max(1)]
    seq1 = [(p, (1,)) for p in range(len(SEQ1))]
    # llama.cpp: the MLA and indexer caches hold seq 0 as restored (seq 1's cells), the SWA cache lost seq 0
    restored = sorted([(p, (0,)) for p in range(len(SEQ1))] + seq1)
    got = _cells(theirs.memory.sections)
    assert [sorted(c) for c in got] == [restored, restored, seq1]
    assert pos_max == [-1, len(SEQ1) - 1]  # the memory's positions are the SWA cache's: seq 0 reads as empty
    hp = kvref.HParams.from_gguf(model)
    mem = kvref.create_memory(hp, 256, n_seq_max=2)
    for seq, toks in ((0, SEQ0), (1, SEQ1)):
        mem.decode(kvref.Batch(tokens=toks, pos=list(range(len(toks))), seq_ids=[[seq]] * len(toks)))
    data = kvref.state.section_bytes(*kvref.state.load(bad, kind="seq_state", layout="dsa_iswa").memory.sections)
    with pytest.raises(kvref.errors.FormatError):
        mem.state_read(data, 0, atomic=False)
    assert [mem.seq_pos_max(0), mem.seq_pos_max(1)] == pos_max
    assert _cells(mem.state_sections()) == _cells(theirs.memory.sections)
    assert mem.dsa.seq_pos_max(0) == len(SEQ1) - 1 and mem.swa.seq_pos_max(0) == -1
