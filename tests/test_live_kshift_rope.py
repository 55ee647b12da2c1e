"""Live: kvref's K-shift against llama.cpp's K-shift graph for the rope kernels Gemma 3 does not reach.

Tiny NORM-rope llamas (head sizes 64, 10, 6 and 2: ggml's vectorised f32 NORM loop, its unfused last pair, and no
vector at all) with f32 and f16 K caches, without and with YaRN (ext_factor 1, freq_scale 0.25: the fused YaRN
angle and mscale). Each K-shift ROPE node is read through ``cb_eval`` (``conformance/gen_real_kshift.py``): its
view before and after, its shift input and its parameters; kvref must give every element, and without FMA must
not (where the case has a product to fuse). Marked ``live``; skipped without llama-cpp-python.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvref.memory.kshift import GGML_CPU, NO_FMA, RopeKernel, RopeParams, rope_f32

pytestmark = pytest.mark.live
try:
    import llama_cpp  # noqa: F401
except Exception as exc:
    pytest.skip(f"llama_cpp cannot be imported ({type(exc).__name__}: {exc})", allow_module_level=True)
if platform.libc_ver()[0] != "glibc":
    pytest.skip("kvref's default K-shift follows glibc's libm (the 0.3.36 Linux wheel)", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent / "conformance"
sys.path.insert(0, str(ROOT))
import gen_real_kshift as g  # type: ignore[import-not-found]  # noqa: E402

OPS: list[list[Any]] = [["seq_rm", 0, 10, 30], ["seq_add", 0, 30, -1, -20], ["seq_div", 0, 60, 130, 3]]
PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 100, 150)]
YARN = {"rope_scaling_type": 2, "rope_freq_scale": 0.25, "yarn_ext_factor": 1.0, "yarn_orig_ctx": 64}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """2-layer NORM llamas, 2 heads of size hd (written to a temp dir, not committed)."""
    import tinymodels as tm  # type: ignore[import-not-found]

    out = tmp_path_factory.mktemp("models")
    paths = {}
    for hd in (64, 10, 6, 2):
        d = tm._Dims(n_layer=2, n_embd=2 * hd, n_head=2, n_head_kv=2, hd=hd, n_ff=64)
        b = tm._Builder("llama", seed=7)
        tm._transformer(b, d)

        def meta(w: Any, d: Any = d, hd: int = hd) -> None:
            tm._common_meta(w, d)
            w.add_rope_dimension_count(hd)
            w.add_rope_freq_base(10000.0)
            w.add_layer_norm_rms_eps(1e-5)

        paths[hd] = b.finish(out, f"llama-hd{hd}", meta, {}).path
    return paths


def n_wrong(nodes: list[g.ShiftNode], kernel: RopeKernel, f32: bool) -> int:
    wrong = 0
    for n in nodes:
        r = dict(n.params)
        assert r.pop("n_offs") == 0 and r.pop("freq_factors") is False
        p = RopeParams(**r)
        y = rope_f32(n.pre.astype(np.float32), n.shift, p, kernel=kernel, f32_op=f32).astype(n.pre.dtype)
        wrong += int((y.view(f"u{y.itemsize}") != n.post.view(f"u{y.itemsize}")).sum())
    return wrong


@pytest.mark.parametrize("yarn", [False, True], ids=["plain", "yarn"])
@pytest.mark.parametrize("type_k", ["f32", "f16"])
@pytest.mark.parametrize("hd", [64, 10, 6, 2])
def test_kshift_matches_llama_graph(models, hd, type_k, yarn):
    cp = dict(YARN) if yarn else {}
    nodes = g.shift_run(models[hd], type_k=type_k, ops=OPS, prompt=PROMPT, n_ctx=256, next_token=5, **cp)
    assert len(nodes) == 2 and all(n.pre.shape == (256, 2, hd) for n in nodes)
    p = nodes[0].params
    assert p["mode"] == 0 and p["n_dims"] == hd
    assert (p["ext_factor"], p["freq_scale"]) == ((1.0, 0.25) if yarn else (0.0, 1.0))
    assert n_wrong(nodes, GGML_CPU, type_k == "f32") == 0
    # without FMA it differs, where the case has fused products and rows enough to show it (f16 hides most)
    if (type_k == "f32" and hd != 2) or hd == 64:
        assert n_wrong(nodes, NO_FMA, type_k == "f32") > 0
    if type_k == "f32" and hd in (10, 6):
        # ggml's vectorised f32 NORM loop leaves the odd last pair unfused: fusing it too is wrong
        assert n_wrong(nodes, GGML_CPU, False) > 0
