"""compat="2026-08" (llama.cpp 4df29be, llama-cpp-python 0.3.35) and the pre-October-2026 whole restore.

Each expectation is read off the 0.3.35 sources (llama-kv-cache.cpp, llama-memory-recurrent.cpp,
llama-context.cpp, llama-arch.cpp) and pinned by the legacy-0.3.35-* goldens where they reach it.
"""

from __future__ import annotations

import pytest
from golden import load_case
from recurrent_helpers import mamba_hparams, ubatch
from test_memory_factory import llama

from kvref import compat
from kvref.constants import LLAMA_MAX_SEQ
from kvref.jobs.conformance import hparams_from_case
from kvref.memory.base import decode_seq_bound
from kvref.memory.batch import Batch
from kvref.memory.factory import context_params, create_memory
from kvref.memory.kv_state import ext_size, has_cell_ext
from kvref.memory.recurrent import RecurrentMemory


def test_producer_and_sizes():
    assert compat.for_llama_cpp_python("0.3.35").compat == "2026-08"
    hp = llama()
    # the context pads n_ctx to 256 as in October 2026
    cp = context_params(hp, 256, 3, kv_unified=False, compat="2026-08")
    assert (cp.n_ctx, cp.n_ctx_seq) == (768, 256)
    # llama_batch_allocr::init got kv_unified ? LLAMA_MAX_SEQ : n_seq_max
    assert decode_seq_bound("2026-08", True, 2) == LLAMA_MAX_SEQ
    assert decode_seq_bound("2026-08", False, 2) == 2


def test_mrope_cell_ext_is_x_y():
    hp = hparams_from_case(load_case("qwen2vl-mrope"))
    mem = create_memory(hp, 256, compat="2026-08")
    assert (has_cell_ext(mem), ext_size(mem), mem.get_can_shift()) == (True, 8, False)
    mem.decode(Batch(tokens=[1, 2, 3], seq_ids=[[0]] * 3))
    (sec,) = mem.state_sections(0)
    assert sec.streams[0].cells.ext_size == 8
    blob = mem.state_write(0)
    other = create_memory(hp, 256, compat="2026-08")
    other.state_read(blob, 1)
    assert other.state_write(1) != blob and other.seq_pos_max(1) == 2


def test_rollback_archs():
    hp = mamba_hparams()
    hp.arch = "lfm2"  # rollback only from October 2026 on
    assert context_params(hp, 256, n_rs_seq=2).n_rs_seq == 2
    assert context_params(hp, 256, n_rs_seq=2, compat="2026-08").n_rs_seq == 0


def _rmem(**kw) -> RecurrentMemory:
    return RecurrentMemory(mamba_hparams(), rs_size=2, n_seq_max=2, compat="2026-08", **kw)


def test_recurrent_seq_rm_negative_id_whole_range():
    m = _rmem()
    p = m.profile  # the seq_rm rules of 0.3.17 .. 0.3.35
    assert (p.recurrent_seq_rm_rule, p.recurrent_seq_rm_checks_n_seq_max, p.recurrent_rollback_single_use) == (
        "cuts_tail", False, False)  # fmt: skip
    m.apply_ubatch(ubatch((0, range(3))))
    assert m.seq_rm(-1, 1, -1) is False  # a negative id: all or nothing
    assert m.seq_rm(-1, -1, -1) is True and m.used == 0
    assert m.seq_rm(2, -1, -1) is False  # >= mem_size


def test_recurrent_rollback_is_not_single_use():
    m = _rmem(n_rs_seq=3)
    m.apply_ubatch(ubatch((0, range(6))))  # pos 5
    assert m.seq_rm(0, 5, -1) is True and m.rs_idx[0] == 1
    # October 2026 refuses (a rollback is pending); 0.3.35 replaces the index with pos - (p0 - 1) = 4 - 2
    assert m.seq_rm(0, 3, -1) is True
    assert (m.pos[0], m.rs_idx[0]) == (2, 2)
    assert m.seq_rm(-1, -1, -1) is True and m.rs_idx == [0, 0]


@pytest.mark.parametrize("c", ["2025-07", "2025", "2026-08", "2026-10"])
def test_whole_restore_of_several_streams(c):
    """From PR #14363 to October 2026 every non-empty stream's read began with clear(true)
    (llama_kv_cache::state_read): only the last non-empty stream survives, and an all-empty state leaves the
    cache as it was. Before PR #14363 ("2025-07", one cache) the read always began with clear(true)."""
    mem = create_memory(llama(), 256, 3, False, compat=c)
    mem.decode(Batch(tokens=[1, 2, 3, 4, 5], pos=[0, 1, 0, 1, 0], seq_ids=[[0], [0], [1], [1], [2]]))
    blob = mem.state_write()
    empty = create_memory(llama(), 256, 3, False, compat=c).state_write()
    other = create_memory(llama(), 256, 3, False, compat=c)
    other.state_read(blob)
    got = [other.seq_pos_max(s) for s in range(3)]
    keeps_all = c in ("2026-10", "2025-07")
    assert got == ([1, 1, 0] if keeps_all else [-1, -1, 0])
    other.state_read(empty)
    assert [other.seq_pos_max(s) for s in range(3)] == ([-1, -1, -1] if keeps_all else got)


def test_2025_07_has_no_streams():
    """llama-cpp-python 0.3.12 (before PR #14363): one cache for every sequence, no u32 n_stream in the state."""
    assert compat.for_llama_cpp_python("0.3.12").compat == "2025-07"
    mem = create_memory(llama(), 256, 3, False, compat="2025-07")
    assert (mem.n_stream, mem.get_size(), mem.n_pad) == (1, 256, 32)
    mem.decode(Batch(tokens=[1, 2], pos=[0, 0], seq_ids=[[0], [7]]))  # ids up to LLAMA_MAX_SEQ
    blob = mem.state_write()
    assert int.from_bytes(blob[:4], "little") == 2  # cell_count first: no n_stream
    (sec,) = mem.state_sections()
    assert sec.has_n_stream is False
    # state_write_meta lists only ids below n_seq_max: seq 7's cell is written with no id
    assert list(mem.state_sections(7)[0].streams[0].cells.n_seq_id) == [0]
    other = create_memory(llama(), 256, 3, False, compat="2025-07")
    other.state_read(blob)
    assert other.state_write() == blob
