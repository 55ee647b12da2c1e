"""fill_kq_mask over every memory kind: iSWA gives llama.cpp's two masks, hybrid its attention part's."""

import numpy as np
import pytest
from recurrent_helpers import jamba_hparams

import kvref
from kvref.errors import KVRefError
from kvref.hparams import SWAType
from kvref.memory.mask import fill_kq_mask

NEG = -np.inf


def _gemma2_like() -> kvref.HParams:
    # layer 0 slides over a 4-position window, layer 1 attends everything (gemma2's alternation)
    return kvref.HParams(
        arch="gemma2",
        n_layer=2,
        n_embd=64,
        n_head=2,
        n_head_kv=1,
        n_embd_head_k=32,
        n_embd_head_v=32,
        swa_layers=[True, False],
        n_swa=4,
        swa_type=SWAType.STANDARD,
    )


def test_iswa_memory_has_a_base_mask_and_a_swa_mask():
    mem = kvref.create_memory(_gemma2_like(), n_ctx=256, n_seq_max=1)
    assert isinstance(mem, kvref.KVCacheISWA)
    ((ub, slot),) = mem.decode(kvref.Batch(tokens=list(range(4, 14)), seq_ids=[[0]] * 10))
    base = fill_kq_mask(mem, ub, sinfo=slot)
    swa = fill_kq_mask(mem, ub, sinfo=slot, swa=True)
    np.testing.assert_array_equal(base, fill_kq_mask(mem.base, ub, sinfo=slot.base))
    np.testing.assert_array_equal(swa, fill_kq_mask(mem.swa, ub, sinfo=slot.swa))
    # token 9 (position 9): causal over cells 0..9 in the base mask; in the SWA mask only positions
    # p with 9 - p < 4, i.e. 6..9 (llama_hparams::is_masked_swa, standard window)
    row_base, row_swa = base[0, 9, :10], swa[0, 9, :10]
    assert (row_base == 0).all()
    np.testing.assert_array_equal(row_swa, [NEG] * 6 + [0.0] * 4)


def test_hybrid_memory_masks_through_its_attention_part():
    hp = jamba_hparams([True, False, True], n_head_kv=1)
    mem = kvref.create_memory(hp, n_ctx=256, n_seq_max=1)
    assert isinstance(mem, kvref.HybridMemory)
    ((ub, slot),) = mem.decode(kvref.Batch(tokens=[4, 5, 6], seq_ids=[[0]] * 3))
    mask = fill_kq_mask(mem, ub, sinfo=slot)
    np.testing.assert_array_equal(mask[0, :, :3], [[0, NEG, NEG], [0, 0, NEG], [0, 0, 0]])
    with pytest.raises(KVRefError, match="iSWA"):
        fill_kq_mask(mem, ub, sinfo=slot, swa=True)


def test_recurrent_memory_has_no_mask():
    hp = kvref.HParams(
        arch="mamba", n_layer=2, n_embd=64, recurrent_layers=True, ssm_d_conv=4, ssm_d_inner=128, ssm_d_state=8
    )
    mem = kvref.create_memory(hp, n_ctx=256, n_seq_max=1)
    ((ub, slot),) = mem.decode(kvref.Batch(tokens=[4, 5], seq_ids=[[0]] * 2))
    with pytest.raises(KVRefError, match="no attention cache"):
        fill_kq_mask(mem, ub, sinfo=slot)
