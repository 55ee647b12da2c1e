"""The K-shift against a real model's: rows cut from Gemma 3 270M in llama.cpp 0.3.36 (conformance/kshift/).

``conformance/gen_real_kshift.py`` read them out of llama.cpp's update graph (the K-shift ROPE nodes, through
``cb_eval``): K rows of four layers (two SWA, two global) before and after the shift, the shift input and the
op parameters. kvref must turn the before-rows into the after-rows bit for bit, from the function and from a
memory replaying the same operations; each rounding variant it does not take (no FMA, float64 trig, another
frequency base) must not. Nothing here needs llama.cpp or the model.
"""

from __future__ import annotations

import dataclasses
import json
import platform
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvref
from kvref.hparams import HParams, RopeType, SWAType
from kvref.memory.kshift import GGML_CPU, NO_FMA, RopeKernel, RopeParams, shift_k_rows

GOLDEN = Path(__file__).resolve().parent.parent / "conformance" / "kshift" / "gemma3-270m"
META: dict[str, Any] = json.loads((GOLDEN / "kshift.json").read_text())
SHAPE = tuple(META["rows"]["shape"])  # (layers, cells, kv heads, head dim)
PRE = np.frombuffer((GOLDEN / "k-pre.bin").read_bytes(), dtype="<f2").reshape(SHAPE)
POST = np.frombuffer((GOLDEN / "k-post.bin").read_bytes(), dtype="<f2").reshape(SHAPE)
LAYERS = META["layers"]

# the rows were rotated with glibc's cosf/sinf/powf; another C library rounds a few angles differently
glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the golden's trig is glibc's (kvref calls libm)")


def params(entry: dict[str, Any], **change: Any) -> RopeParams:
    r = dict(entry["rope"])
    assert r.pop("n_offs") == 0 and r.pop("freq_factors") is False
    return dataclasses.replace(RopeParams(**r), **change)


def shifted(i: int, p: RopeParams, kernel: RopeKernel = GGML_CPU) -> np.ndarray:
    """kvref's shift of golden layer i's before-rows; float16 (cells, kv heads, head dim)."""
    buf = PRE[i].reshape(SHAPE[1], -1).copy().view(np.uint8)
    shift = np.asarray(LAYERS[i]["shift"], dtype=np.int32)
    shift_k_rows(buf, "f16", SHAPE[2], SHAPE[3], shift, p, kernel=kernel)
    return buf.view("<f2").reshape(SHAPE[1:])


def n_wrong(i: int, y: np.ndarray) -> int:
    return int((y.view(np.uint16) != POST[i].view(np.uint16)).sum())


def test_golden_covers_what_it_claims():
    """Two SWA and two global layers (freq base 1e4 vs 1e6, head size 256, NEOX), rows that moved."""
    assert SHAPE[0] == len(LAYERS) == 4 and SHAPE[3] == 256
    assert sorted(e["swa"] for e in LAYERS) == [False, False, True, True]
    assert {e["rope"]["freq_base"] for e in LAYERS if e["swa"]} == {10000.0}
    assert {e["rope"]["freq_base"] for e in LAYERS if not e["swa"]} == {1000000.0}
    assert all(e["rope"]["mode"] == 2 and e["rope"]["n_dims"] == 256 for e in LAYERS)
    for i, e in enumerate(LAYERS):
        moved = np.asarray(e["shift"]) != 0
        assert moved.sum() > SHAPE[1] // 2 and len(set(e["shift"])) > 10
        assert (PRE[i][moved] != POST[i][moved]).any() and np.array_equal(PRE[i][~moved], POST[i][~moved])


@glibc
@pytest.mark.parametrize("i", range(len(LAYERS)), ids=[f"layer{e['layer']}" for e in LAYERS])
def test_kshift_reproduces_llama_rows(i):
    assert n_wrong(i, shifted(i, params(LAYERS[i]))) == 0


@pytest.mark.parametrize(
    "variant",
    ["no-fma", "float64-trig", "base-1e-4", "base-of-other-cache"],
)
def test_each_rounding_variant_is_caught(variant):
    """Negative controls: each step of the rule matters on these rows."""
    wrong = 0
    for i, e in enumerate(LAYERS):
        p, k = params(e), GGML_CPU
        if variant == "no-fma":
            k = NO_FMA
        elif variant == "float64-trig":
            k = RopeKernel(libm=False)
        elif variant == "base-1e-4":
            p = dataclasses.replace(p, freq_base=p.freq_base * 1.0001)
        else:
            p = dataclasses.replace(p, freq_base=1000000.0 if e["swa"] else 10000.0)
        wrong += n_wrong(i, shifted(i, p, k))
    assert wrong > 0


def gemma3_270m() -> HParams:
    """Gemma 3 270M's attention hyper-parameters (its GGUF, and llama.cpp's default SWA base 10000)."""
    swa = [il in META["caches"]["swa"] for il in range(18)]
    return HParams(
        arch="gemma3", n_layer=18, n_embd=640, n_head=4, n_head_kv=1, n_embd_head_k=256, n_embd_head_v=256,
        swa_layers=tuple(swa), n_swa=512, swa_type=SWAType.STANDARD, rope_type=RopeType.NEOX, n_rot=256,
        rope_freq_base=1000000.0, rope_freq_base_swa=10000.0, rope_freq_scale_swa=1.0,
    )  # fmt: skip


@glibc
def test_memory_replay_reproduces_llama_rows():
    """The same prompt and operations on kvref's iSWA memory: the shift input per cell is llama.cpp's, and
    update() turns the golden's before-rows into its after-rows (cells at the same indices as in llama.cpp)."""
    run, ctx = META["run"], META["context"]
    mem = kvref.create_memory(gemma3_270m(), n_ctx=ctx["n_ctx"], type_k="f16", type_v="f16", flash_attn=False)
    n = run["prompt"]["n"]
    mem.decode(kvref.Batch(tokens=list(range(n)), seq_ids=[[0]] * n), n_ubatch=512)
    by_layer = {}
    for part in (mem.base, mem.swa):
        for layer in part.layers:
            by_layer[layer.il] = (part, layer)
    for i, e in enumerate(LAYERS):
        part, layer = by_layer[e["layer"]]
        assert layer.k.shape[1] == e["n_cells"]
        layer.k[0, e["cells"]] = PRE[i].reshape(SHAPE[1], -1).view(np.uint8)
    for name, *args in run["ops"]:
        getattr(mem, name)(*args)
    for e in LAYERS:
        part, _ = by_layer[e["layer"]]
        assert part.k_shift_input()[e["cells"]].tolist() == e["shift"]
    assert mem.update()
    for i, e in enumerate(LAYERS):
        _, layer = by_layer[e["layer"]]
        got = layer.k[0, e["cells"]].view("<f2").reshape(SHAPE[1:])
        assert n_wrong(i, got) == 0, f"layer {e['layer']}"
