"""RecurrentMemory against llama.cpp's recorded traces and state files (conformance/golden/mamba-*)."""

from __future__ import annotations

import pytest
from golden import ALL_CASES, compat_for, load_case, params, replay

import kvref
from kvref.jobs import conformance as C
from kvref.memory.recurrent import RecurrentMemory

CASES = [c for c in ALL_CASES if load_case(c)["memory"]["type"] == "recurrent"]


def hparams_of(case: dict) -> kvref.HParams:
    """The runner's reading of case.json's hparams (Mamba ssm sizes, RWKV wkv head size / token shift)."""
    return C.hparams_from_case(case)


@pytest.mark.skipif(not CASES, reason="no recurrent goldens generated")
@pytest.mark.parametrize("case_id", params(CASES, "replay"))
def test_replay_matches_llama_cpp(case_id):
    case = load_case(case_id)
    hp = hparams_of(case)
    assert (hp.n_embd_r(), hp.n_embd_s()) == (
        case["model"]["hparams"]["n_embd_r"],
        case["model"]["hparams"]["n_embd_s"],
    )
    n_seq_max = case["observed_context"]["n_seq_max"]
    # llama_model::create_memory: f32 R and S, max(1, n_seq_max) cells
    mem = RecurrentMemory(
        hp,
        type_r="f32",
        type_s="f32",
        rs_size=max(1, n_seq_max),
        n_seq_max=n_seq_max,
        n_rs_seq=case["context"].get("n_rs_seq", 0),
        compat=compat_for(case),
        cparams=C.create_memory_for(case, hp).cparams,  # its n_batch: llama_decode asserts a batch past it
    )
    mem.kv_unified = case["context"]["kv_unified"]
    logged = case["observed_context"]["memory_log"]["caches"][0]
    assert (mem.size, len(mem.layers)) == (logged["cells"], logged["layers"])
    report = replay(case_id, mem)
    assert report["saves"] > 0
