"""compat="2025": where llama.cpp of 2025 (llama-cpp-python 0.3.16) and of October 2026 differ (kvref.compat)."""

from __future__ import annotations

import pytest
from golden import load_case
from test_memory_factory import gemma2, llama

from kvref import compat
from kvref.constants import LLAMA_MAX_SEQ
from kvref.errors import BatchError, KVRefError
from kvref.jobs.conformance import hparams_from_case
from kvref.memory.base import decode_seq_bound
from kvref.memory.batch import Batch
from kvref.memory.factory import context_params, create_memory, kv_pad
from kvref.memory.kv_state import has_cell_ext


def test_producer_versions_map_to_a_compat():
    assert compat.for_llama_cpp_python("0.3.16").compat == "2025"
    assert compat.for_llama_cpp_python("0.3.36").compat == "2026-10"
    assert compat.for_llama_cpp_python(None).compat == compat.DEFAULT == "2026-10"
    # every release maps (tests/test_compat_versions.py)
    assert compat.for_llama_cpp_python("0.3.20").compat == "0.3.17"
    assert isinstance(compat.for_llama_cpp_python("0.3.20"), compat.Profile)
    with pytest.raises(KVRefError, match="version"):
        compat.for_llama_cpp_python("latest")
    with pytest.raises(ValueError):
        create_memory(llama(), 256, compat="2024")


def test_2025_context_sizing():
    hp = llama()
    # non-unified: streams of pad(ceil(n_ctx / n_seq_max), 32) cells (legacy-0.3.16-llama-f16-multistream)
    cp = context_params(hp, 256, 3, kv_unified=False, n_batch=512, n_ubatch=512, compat="2025")
    assert (cp.n_ctx, cp.n_ctx_seq, cp.n_batch, cp.n_ubatch) == (288, 96, 256, 256)
    assert context_params(hp, 256, 3, kv_unified=False).n_ctx == 768  # October 2026
    cp = context_params(hp, 100, compat="2025")
    assert (cp.n_ctx, cp.n_ctx_seq) == (128, 128)
    cp = context_params(hp, 100, flash_attn=True, n_batch=16, compat="2025")
    assert (cp.n_ctx, cp.n_batch) == (256, 64)  # flash attention pads to 256; n_batch >= GGML_KQ_MASK_PAD
    assert (kv_pad(False, "2025"), kv_pad(True, "2025"), kv_pad(True)) == (32, 256, 1)
    mem = create_memory(hp, 256, 3, False, compat="2025")
    assert (mem.get_size(), mem.n_pad, mem.compat) == (96, 32, "2025")


def test_decode_seq_bound():
    assert decode_seq_bound("2026-10", True, 2) == decode_seq_bound("2026-10", False, 2) == 2
    assert decode_seq_bound("2025", True, 2) == LLAMA_MAX_SEQ
    assert decode_seq_bound("2025", False, 2) == 2


@pytest.mark.parametrize("make", [lambda **kw: create_memory(llama(), 256, 2, **kw),
                                  lambda **kw: create_memory(gemma2(n_swa=4), 256, 2, **kw)])  # fmt: skip
def test_kv_decode_seq_ids(make):
    batch = Batch(tokens=[1, 2], pos=[0, 1], seq_ids=[[5], [5]])
    with pytest.raises(BatchError, match="seq_id"):
        make().decode(batch)
    mem = make(compat="2025")
    mem.decode(batch)  # 2025: a unified context let ids up to LLAMA_MAX_SEQ through
    assert mem.seq_pos_max(5) == 1


def test_mrope_cache_has_no_ext_and_can_shift_in_2025():
    hp = hparams_from_case(load_case("qwen2vl-mrope"))
    new, old = create_memory(hp, 256), create_memory(hp, 256, compat="2025")
    assert (has_cell_ext(new), new.get_can_shift()) == (True, False)
    assert (has_cell_ext(old), old.get_can_shift()) == (False, True)


def test_2025_sequence_saves_keep_swa_masked_cells():
    tokens = Batch(tokens=list(range(13)), seq_ids=[[0]] * 13)
    n_cells = {}
    for c in compat.COMPATS:
        mem = create_memory(gemma2(n_swa=4), 256, compat=c)
        mem.decode(tokens)
        base, swa = mem.state_sections(0)
        n_cells[c] = (base.streams[0].cells.n, swa.streams[0].cells.n)
    # as the gemma2-swa-overflow goldens
    assert n_cells == {"2026-10": (13, 4), "2026-08": (13, 4), "2025": (13, 13), "2025-07": (13, 13)}


@pytest.mark.parametrize("c,cells_used,head", [("2026-10", [0, 2], 3), ("2025", [4, 5], 4)])
def test_sequence_restore_placement(c, cells_used, head):
    """October 2026 places a restored sequence cell by cell (apply_ubatch leaves the head after the last);
    2025 wanted one contiguous block (find_slot cont=true) and moved the head back to its first cell."""
    mem = create_memory(llama(), 256, 2, compat=c)
    mem.decode(Batch(tokens=[1, 2, 3, 4], pos=[0, 0, 1, 1], seq_ids=[[0], [1], [0], [1]]))  # cells 0 1 0 1
    blob = mem.state_write(0)
    mem.seq_rm(0)  # frees cells 0 and 2
    mem.heads[0] = 0
    mem.state_read(blob, 0)
    cells = mem.cells(0)
    assert ([i for i in range(cells.size()) if cells.seq_has(i, 0)], mem.heads[0]) == (cells_used, head)
