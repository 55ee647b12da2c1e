"""Live: kvref with a real model, Gemma 3 270M (iSWA, head size 256, Q4_K_M) in llama.cpp.

- the K-shift: every layer's whole K cache before and after llama.cpp's update graph (read through ``cb_eval`` by
  ``conformance/gen_real_kshift.py``) against kvref's memory replaying the same prompt and operations;
- a session file cut in kvref (a sequence removed, seq 0 shifted with kvref's K-shift) and loaded back into
  llama.cpp continues with bit-identical logits to llama.cpp doing the same edit itself; without FMA in the shift
  it does not.

Marked ``live``; skipped without llama-cpp-python or the model (``KVREF_GEMMA3_GGUF``, ``~/.cache/kvref-models/``;
``python conformance/gen_real_kshift.py --fetch`` downloads it, ~250 MB).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvref
from kvref.memory.kshift import NO_FMA

pytestmark = pytest.mark.live
try:
    import llama_cpp  # noqa: F401
except Exception as exc:
    pytest.skip(f"llama_cpp cannot be imported ({type(exc).__name__}: {exc})", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "conformance"))
import gen_real_kshift as g  # type: ignore[import-not-found]  # noqa: E402

MODEL = g.find_model()
if MODEL is None:
    pytest.skip(
        f"no {g.MODEL_NAME}: set {g.MODEL_ENV} or run python conformance/gen_real_kshift.py --fetch",
        allow_module_level=True,
    )
if platform.libc_ver()[0] != "glibc":
    pytest.skip("kvref's default K-shift follows glibc's libm (the 0.3.36 Linux wheel)", allow_module_level=True)

PROMPT_A = g.prompt_tokens(300, seed=21)
PROMPT_B = g.prompt_tokens(100, seed=22)
NEXT = [2364, 1009, 7351, 496]


def layers_of(mem: Any) -> dict[int, tuple[Any, Any]]:
    return {layer.il: (part, layer) for part in (mem.base, mem.swa) for layer in part.layers}


@pytest.fixture(scope="module")
def nodes() -> list[g.ShiftNode]:
    assert MODEL is not None
    return g.shift_run(MODEL)


def before_shift(nodes: list[g.ShiftNode], type_k: str) -> tuple[Any, dict[int, tuple[Any, Any]]]:
    """kvref's memory from the GGUF after the golden run's prompt, its K rows replaced by the graph's before-rows
    and the run's operations made (``update()`` runs the shift), and its `layers_of`."""
    assert MODEL is not None
    mem = kvref.create_memory(kvref.HParams.from_gguf(MODEL), n_ctx=1024, type_k=type_k, type_v="f16")
    mem.decode(kvref.Batch(tokens=g.prompt_tokens(), seq_ids=[[0]] * g.N_PROMPT), n_ubatch=512)
    by_layer = layers_of(mem)
    assert sorted(n.layer for n in nodes) == sorted(by_layer) == list(range(18))
    for n in nodes:
        by_layer[n.layer][1].k[0] = n.pre.reshape(n.pre.shape[0], -1).view(np.uint8)
    for name, *args in g.OPS:
        getattr(mem, name)(*args)
    return mem, by_layer


def test_kshift_of_every_layer_and_cell_matches_llama(nodes):
    """kvref's memory from the GGUF, the graph's before-rows of all 18 layers (1024 cells each, empty ones too),
    the golden run's operations: the shift input and every after-row are llama.cpp's."""
    mem, by_layer = before_shift(nodes, "f16")
    for n in nodes:
        part, _ = by_layer[n.layer]
        assert np.array_equal(part.k_shift_input(), n.shift), f"shift input, layer {n.layer}"
    mem.update()
    wrong = {}
    for n in nodes:
        got = by_layer[n.layer][1].k[0].view("<u2")
        wrong[n.layer] = int((got != n.post.reshape(n.post.shape[0], -1).view("<u2")).sum())
    assert wrong == dict.fromkeys(wrong, 0)


def test_kshift_with_f32_k_matches_llama():
    """The same run with an f32 K cache (ggml's f32 rope kernel): every element of every layer."""
    assert MODEL is not None
    nodes = g.shift_run(MODEL, type_k="f32")
    mem, by_layer = before_shift(nodes, "f32")
    mem.update()
    for n in nodes:
        got = by_layer[n.layer][1].k[0].view("<f4")
        assert np.array_equal(got.view("<u4"), n.post.reshape(n.post.shape[0], -1).view("<u4")), f"layer {n.layer}"


# the edit both sides make: cut sequence 1, then move seq 0 (a forward shift and a self-extend division, which
# leave no hole, so llama.cpp's restore puts every cell back where the unedited context has it)
EDIT: list[list[Any]] = [["seq_rm", 1, -1, -1], ["seq_add", 0, 0, -1, 40], ["seq_div", 0, 140, 340, 2]]


def continue_logits(r: g.Run) -> list[np.ndarray]:
    return [r.decode([t]) for t in NEXT]


def two_sequences(r: g.Run) -> None:
    r.decode(PROMPT_A, seq=0)
    r.decode(PROMPT_B, seq=1)


@pytest.fixture(scope="module")
def reference() -> list[np.ndarray]:
    """llama.cpp alone: both prompts, the edit with its own K-shift (at the next decode), then the tokens."""
    assert MODEL is not None
    with g.Run(MODEL, n_ctx=1024, n_seq_max=2) as r:
        two_sequences(r)
        for op in EDIT:
            r.apply(op)
        return continue_logits(r)


@pytest.mark.parametrize("kernel", ["default", "no-fma"])
def test_session_edited_in_kvref_continues_like_llama(tmp_path: Path, reference, kernel):
    """Save both sequences, restore into kvref, edit and apply the K-shift there, save, load into a new llama.cpp
    context and continue: logits bit-identical to the reference — and not, when kvref's shift skips the FMA."""
    assert MODEL is not None
    src, dst = tmp_path / "both.ggsn", tmp_path / "edited.ggsn"
    tokens = PROMPT_A + PROMPT_B
    with g.Run(MODEL, n_ctx=1024, n_seq_max=2) as r:
        two_sequences(r)
        r.save_session(src, tokens)
    mem = kvref.restore(src, model=MODEL).memory
    if kernel == "no-fma":
        mem.base.rope_kernel = mem.swa.rope_kernel = NO_FMA
    for name, *args in EDIT:
        getattr(mem, name)(*args)
    assert mem.update()
    kvref.save_memory(mem, dst, kind="session", tokens=PROMPT_A)
    with g.Run(MODEL, n_ctx=1024, n_seq_max=2) as r:
        assert r.load_session(dst) == PROMPT_A
        got = continue_logits(r)
    same = [np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in zip(got, reference, strict=True)]
    if kernel == "default":
        assert all(same), same
    else:
        assert not all(same)
