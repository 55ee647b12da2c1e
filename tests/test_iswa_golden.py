"""KVCacheISWA / HybridMemory against llama.cpp's recorded traces (conformance/golden: gemma2-*, jamba-hybrid)."""

from __future__ import annotations

import pytest
from golden import ALL_CASES, load_case, memory_for, params, replay

CASES = [c for c in ALL_CASES if load_case(c)["memory"]["type"] in ("iswa", "hybrid")]


@pytest.mark.parametrize("case_id", params(CASES, "replay"))
def test_replay_matches_llama_cpp(case_id):
    report = replay(case_id, memory_for(load_case(case_id)))
    assert report["saves"] > 0
