"""llama.cpp's attention rotation and the K-shift of a quantized K cache, against llama.cpp 0.3.36's own rows.

Every expected value comes from llama.cpp: the goldens ``llama-h64-q8_0-rot-kshift`` (head size 64, q8_0 K and V,
two streams) and ``qwen3-h128-q4_0-k-rot-kshift`` (head size 128, rope neox, q4_0 K, f16 V) hold the state before a
shift, with it pending and after the decode that applied it; their ``rows.npz`` holds each decode's K/V rows as
llama.cpp computed them just before and just after its Hadamard rotation (read from the graph through cb_eval).
``conformance/crashes/*.json`` record the configurations where llama.cpp 0.3.36 dies in the K-shift.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvref
from kvref.errors import CheckFailed, KShiftError, KVRefError
from kvref.ggml import quant, rotation
from kvref.ggml.types import traits
from kvref.jobs import conformance as C
from kvref.memory import kshift, kshift_quant
from kvref.memory.kv_cache import KVCache

ROOT = Path(__file__).resolve().parent.parent / "conformance"
CASES = ["llama-h64-q8_0-rot-kshift", "qwen3-h128-q4_0-k-rot-kshift"]
CRASHES = sorted(p.stem for p in (ROOT / "crashes").glob("*.json"))


def _case(cid: str) -> dict[str, Any]:
    return C.load_case(ROOT, cid)


def _rows(cid: str) -> dict[str, np.ndarray]:
    with np.load(ROOT / "golden" / cid / "rows.npz") as z:
        return {k: z[k] for k in z.files}


def _memory(case: dict[str, Any]) -> Any:
    return C.create_memory_for(case, C.hparams_from_case(case))


def _replay(case: dict[str, Any]) -> dict[str, int]:
    mem = _memory(case)
    return C.replay_trace(case, mem, C.Artefacts(ROOT, case))


# ------------------------------------------------------------------ the flags


@pytest.mark.parametrize("cid", CASES)
def test_memory_reports_llama_cpps_rotation_flags(cid: str) -> None:
    case = _case(cid)
    logged = case["observed_context"]["memory_log"]["caches"][0]
    mem = _memory(case)
    assert (mem.attn_rot_k, mem.attn_rot_v) == (logged["attn_rot_k"], logged["attn_rot_v"])
    assert logged["attn_rot_k"] is True  # the cases exist to have it on


@pytest.mark.parametrize("crash", CRASHES)
def test_rotation_flags_of_the_crashing_configurations(crash: str, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads((ROOT / "crashes" / f"{crash}.json").read_text())
    for k, v in doc["env"].items():
        monkeypatch.setenv(k, v)
    logged = doc["observed_context"]["memory_log"]["caches"][0]
    mem = _memory(doc)
    assert (mem.attn_rot_k, mem.attn_rot_v) == (logged["attn_rot_k"], logged["attn_rot_v"])
    # the segmentation faults are the quantized configurations without the K rotation
    if traits(doc["context"]["type_k"]).is_quantized:
        assert logged["attn_rot_k"] == (doc["signal"] != "SIGSEGV")
    else:
        assert not logged["attn_rot_k"]


# ------------------------------------------------------------------ the rotation of stored rows


@pytest.mark.parametrize("cid", CASES)
def test_fwht_is_ggml_cpus_rotation_bit_for_bit(cid: str) -> None:
    hp = C.hparams_from_case(_case(cid))
    rows = _rows(cid)
    pres = [k for k in rows if k.endswith("-pre")]
    assert pres
    matmul_differs = 0
    for k in pres:
        n = rotation.k_rot_size(hp.n_embd_head_k) if "-k" in k else rotation.V_ROT_SIZE
        pre, post = rows[k], rows[k[: -len("pre")] + "post"]
        assert np.array_equal(rotation.fwht(pre, n).view(np.uint32), post.view(np.uint32)), k
        matmul_differs += not np.array_equal(rotation.rotate(pre, n).view(np.uint32), post.view(np.uint32))
    # negative control: the matrix product (the same rotation, other rounding) is not what llama.cpp computes
    assert matmul_differs > 0


def _decoded_cells(case: dict[str, Any]) -> list[tuple[int, int, int, int]]:
    """(op index, token index, stream, position) of every token decoded before the first save."""
    out = []
    n_stream = case["memory"]["n_stream"]
    for k, op in enumerate(case["trace"]):
        if op["op"] == "save":
            break
        if op["op"] == "decode":
            for i, (p, ss) in enumerate(zip(op["pos"], op["seq_ids"], strict=True)):
                out.append((k, i, ss[0] if n_stream > 1 else 0, p))
    return out


@pytest.mark.parametrize("cid", CASES)
def test_stored_rows_are_the_rotated_rows_quantized_by_ggml_cpu(cid: str) -> None:
    """The first save holds each decoded token's K (and quantized V) row: ggml-cpu's quantizer applied to the
    rotated f32 row, byte for byte; the unrotated row quantized is not it (negative control)."""
    case = _case(cid)
    rows = _rows(cid)
    first = next(op for op in case["trace"] if op["op"] == "save")
    st = kvref.state.load(ROOT / "golden" / cid / first["file"])
    sec = st.memory.sections[0]
    t_k, t_v = case["context"]["type_k"], case["context"]["type_v"]
    which = [("k", t_k)] + ([("v", t_v)] if traits(t_v).is_quantized else [])
    checked = unrotated_equal = 0
    for k, i, strm, pos in _decoded_cells(case):
        stream = sec.streams[strm]
        cell = int(np.flatnonzero(np.asarray(stream.cells.pos) == pos)[0])
        for name, t in which:
            blocks = stream.data.k if name == "k" else stream.data.v
            for il, layer_rows in enumerate(blocks):
                post = rows[f"op{k}-ub0-{name}{il}-post"]
                pre = rows[f"op{k}-ub0-{name}{il}-pre"]
                n = post.size // len(case["trace"][k]["tokens"])
                stored = np.asarray(layer_rows.data)[cell]
                assert np.array_equal(quant.quantize_cpu(post[i * n : (i + 1) * n], t), stored), (k, i, name, il)
                unrotated_equal += np.array_equal(quant.quantize_cpu(pre[i * n : (i + 1) * n], t), stored)
                checked += 1
    assert checked > 0 and unrotated_equal == 0


# ------------------------------------------------------------------ the K-shift


@pytest.mark.parametrize("cid", CASES)
def test_kshift_of_quantized_k_is_bit_exact(cid: str) -> None:
    """Replaying the trace: llama.cpp's rows are copied in at each save; after the decodes that apply a shift, every
    such cell's K row (kvref's shift of llama.cpp's rows) must equal the row llama.cpp saved next."""
    r = _replay(_case(cid))
    assert r["carried_rows"] > 0


def _shift_decodes(case: dict[str, Any]) -> list[int]:
    return [k for k, op in enumerate(case["trace"]) if op["op"] == "decode" and op.get("graph", {}).get("shift")]


@pytest.mark.parametrize("cid", CASES)
def test_kshift_steps_are_llama_cpps_f32_values_bit_for_bit(cid: str) -> None:
    """Each step of the shift graph on every cell of the K tensor (empty and unshifted cells too), against the f32
    tensors llama.cpp computed in it (rows.npz ``op<k>-shift1/2-k<il>-pre/post``): the dequantized rows, unrotated,
    roped, rotated again; then the bytes ``update()`` leaves in the cache are those rows quantized by ggml-cpu."""
    case = _case(cid)
    rows = _rows(cid)
    hp = C.hparams_from_case(case)
    n_rot = rotation.k_rot_size(hp.n_embd_head_k)
    ks = _shift_decodes(case)
    assert len(ks) == 2
    fma_off_differs = 0
    for k in ks:
        # the memory as llama.cpp's last save before this decode left it: the shift pending, llama.cpp's rows copied in
        mem = _memory(case)
        C.replay_trace({**case, "trace": case["trace"][:k]}, mem, C.Artefacts(ROOT, case))
        shift = C.decode_ints(case["trace"][k]["graph"]["shift"][0]["k_shift"])
        assert np.array_equal(mem.k_shift_input(), shift)
        want_bytes = []
        for il, layer in enumerate(mem.layers):
            deq, unrot = rows[f"op{k}-shift1-k{il}-pre"], rows[f"op{k}-shift1-k{il}-post"]
            roped, rot = rows[f"op{k}-shift2-k{il}-pre"], rows[f"op{k}-shift2-k{il}-post"]
            flat = layer.k.reshape(-1, layer.k.shape[-1])
            assert np.array_equal(quant.dequantize(flat, mem.type_k).reshape(-1), deq)
            assert np.array_equal(rotation.fwht(deq, n_rot).view(np.uint32), unrot.view(np.uint32))
            x = unrot.reshape(flat.shape[0], hp.n_head_kv_l(il), hp.n_embd_head_k)
            p = mem._rope_params(il)
            y = kshift.rope_f32(x, shift, p, 0, mem.rope_kernel, True)
            assert np.array_equal(y.reshape(-1).view(np.uint32), roped.view(np.uint32))
            y_nofma = kshift.rope_f32(x, shift, p, 0, kshift.RopeKernel(fma=False), True)
            fma_off_differs += not np.array_equal(y_nofma.reshape(-1).view(np.uint32), roped.view(np.uint32))
            assert np.array_equal(rotation.fwht(roped, n_rot).view(np.uint32), rot.view(np.uint32))
            want_bytes.append(quant.quantize_cpu(rot.reshape(flat.shape[0], -1), mem.type_k))
        assert mem.update()
        for layer, want in zip(mem.layers, want_bytes, strict=True):
            assert np.array_equal(layer.k.reshape(want.shape), want)
    # negative control: a rope without fused multiply-adds is not what the 0.3.36 wheel computed
    assert fma_off_differs > 0


@pytest.mark.parametrize("cid", CASES)
@pytest.mark.parametrize("broken", ["no-unrotate", "no-rotation", "shift+1"])
def test_a_wrong_kshift_is_caught(cid: str, broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative controls: the comparison fails when one step of llama.cpp's recipe is changed."""
    calls = {"n": 0}
    real_fwht, real_rope = kshift_quant.fwht, kshift_quant.rope_f32

    def fwht(x: np.ndarray, n: int) -> np.ndarray:
        calls["n"] += 1
        if broken == "no-rotation" or (broken == "no-unrotate" and calls["n"] % 2 == 1):
            return np.asarray(x, np.float32)
        return real_fwht(x, n)

    def rope(x: np.ndarray, pos: np.ndarray, p: Any, *args: Any, **kwargs: Any) -> np.ndarray:
        return real_rope(x, np.asarray(pos) + (1 if broken == "shift+1" else 0), p, *args, **kwargs)

    monkeypatch.setattr(kshift_quant, "fwht", fwht)
    monkeypatch.setattr(kshift_quant, "rope_f32", rope)
    with pytest.raises(CheckFailed, match="row after kvref's K-shift differs"):
        _replay(_case(cid))


# ------------------------------------------------------------------ where llama.cpp crashes

# what llama.cpp printed when it aborted -> the frame it aborted in, and how kvref's refusal names it
ABORTS = {
    "ggml/src/ggml-cpu/ops.cpp:321: not implemented": (
        "ggml_compute_forward_dup",
        "GGML_ABORT 'not implemented' in ggml_compute_forward_dup_to_q",
    ),
    "ggml/src/ggml-cpu/ops.cpp:6486: fatal error": (
        "ggml_compute_forward_rope",
        "GGML_ABORT 'fatal error' in ggml_compute_forward_rope",
    ),
}


@pytest.mark.parametrize("crash", CRASHES)
def test_crashing_kshift_is_refused_before_anything_changes(crash: str, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads((ROOT / "crashes" / f"{crash}.json").read_text())
    assert doc["crashed_op_index"] == len(doc["trace"])
    if doc["signal"] == "SIGSEGV":  # no message: the innermost frame, when gdb was there to name it
        reason = "segmentation fault in llama_kv_cache::build_rope_shift"
        assert not doc["gdb_frames"] or doc["gdb_frames"][0].startswith("llama_kv_cache::build_rope_shift")
    else:  # what llama.cpp printed, the frame it aborted in, and how kvref's refusal names it
        assert doc["signal"] == "SIGABRT"
        frame, reason = ABORTS[doc["message"]]
        assert not doc["gdb_frames"] or frame in doc["gdb_frames"]
    for k, v in doc["env"].items():
        monkeypatch.setenv(k, v)
    mem = _memory(doc)
    C.replay_trace(doc, mem, C.Artefacts(ROOT, {"id": "-", "trace": []}))  # the ops llama.cpp got through
    op = doc["crashed_op"]
    assert op["op"] == "decode" and mem.get_has_shift()
    before = (np.array(mem.cells(0).pos), np.array(mem.cells(0).shift), mem.layers[0].k.copy())
    with pytest.raises(KShiftError) as e:
        mem.decode(kvref.Batch(tokens=op["tokens"], pos=op["pos"], seq_ids=op["seq_ids"]))
    assert reason in str(e.value) and f"type_k {doc['context']['type_k']}" in str(e.value)
    assert np.array_equal(mem.cells(0).pos, before[0]) and np.array_equal(mem.cells(0).shift, before[1])
    assert np.array_equal(mem.layers[0].k, before[2]) and mem.get_has_shift()


def _hp(**kw: Any) -> kvref.HParams:
    base = dict(arch="llama", n_layer=1, n_embd=64, n_head=1, n_head_kv=1, n_embd_head_k=64, n_embd_head_v=64)
    return kvref.HParams(**{**base, **kw})


def _shifted(hp: kvref.HParams, type_k: str = "q8_0", **kw: Any) -> KVCache:
    c = KVCache(hp, type_k=type_k, type_v="f16", v_trans=False, kv_size=8, **kw)
    c.decode(kvref.Batch(tokens=[5, 6, 7], seq_ids=[[0]] * 3))
    c.seq_add(0, 1, -1, 2)
    return c


def test_partial_rotary_refused_as_llama_cpp_aborts() -> None:
    c = _shifted(_hp(n_rot=32))
    assert c.attn_rot_k
    with pytest.raises(KShiftError, match=r"ropes 32 of 64 .* aborts"):
        c.update()
    assert c.get_has_shift()


def test_older_llama_cpp_refused() -> None:
    c = _shifted(_hp(), compat="2026-08")
    with pytest.raises(KShiftError, match=r"0\.3\.36 and later"):
        c.update()


def test_iq4_nl_refused_kvref_cannot_quantize() -> None:
    c = _shifted(_hp(), type_k="iq4_nl")
    with pytest.raises(KShiftError, match="cannot quantize iq4_nl"):
        c.update()


def test_rotated_q8_0_shift_runs_and_zero_rows_stay_zero() -> None:
    c = _shifted(_hp())
    rng = np.random.default_rng(1)
    c.layers[0].k[0, :3] = quant.quantize_cpu(rng.standard_normal((3, 64)).astype(np.float32), "q8_0")
    k0 = c.layers[0].k.copy()
    assert c.update() and not c.get_has_shift()
    assert not np.array_equal(c.layers[0].k[0, 1:3], k0[0, 1:3])  # shifted cells changed
    assert not c.layers[0].k[0, 3:].any()  # empty cells: zero in, zero out


def test_quantize_cpu_differs_from_the_reference_only_in_rounding() -> None:
    # a tie: block maximum 127 makes id = 1 for both; 0.5 rounds to even (0) on the CPU path, away (1) in the ref
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 0.5, 2.5
    cpu, ref = quant.quantize_cpu(x, "q8_0"), quant.quantize(x, "q8_0")
    assert cpu.view(np.int8)[0, 2:5].tolist() == [127, 0, 2]
    assert ref.view(np.int8)[0, 2:5].tolist() == [127, 1, 3]


def test_live_quantize_cpu_is_ggml_cpus_from_float() -> None:
    """kvref's ggml-cpu quantizer against the loaded libggml-cpu's own ``from_float`` (skipped without it)."""
    import ctypes
    import os

    try:
        import llama_cpp
    except Exception as exc:
        pytest.skip(f"llama_cpp cannot be imported ({type(exc).__name__})")
    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_get_type_traits_cpu.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    from_float_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    if not lib.ggml_cpu_has_avx2():
        pytest.skip("kvref models the AVX2 build of ggml-cpu's q8_0 quantizer")
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4000, 32)) * rng.uniform(0.01, 10, (4000, 1))).astype(np.float32)
    ties = np.tile(np.arange(-63, 64, 4, dtype=np.float32)[:32] + 0.5, (50, 1))
    ties[:, 0] = 127
    x = np.concatenate([x, ties, np.zeros((2, 32), np.float32)])
    for t, gid, bsz in (("q8_0", 8, 34), ("q4_0", 2, 18)):
        fn = from_float_t(lib.ggml_get_type_traits_cpu(gid)[0])
        out = np.zeros((x.shape[0], bsz), np.uint8)
        fn(x.ctypes.data, out.ctypes.data, x.size)
        assert np.array_equal(quant.quantize_cpu(x, t), out), t
    # negative control: the reference q8_0 quantizer is not what the CPU backend runs
    fn = from_float_t(lib.ggml_get_type_traits_cpu(8)[0])
    out = np.zeros((x.shape[0], 34), np.uint8)
    fn(x.ctypes.data, out.ctypes.data, x.size)
    assert not np.array_equal(quant.quantize(x, "q8_0"), out)


def test_errors_are_kvref_errors() -> None:
    assert issubclass(KShiftError, KVRefError)
