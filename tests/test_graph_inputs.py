"""The graph inputs llama.cpp computed with (KQ masks, K/V row indices, positions, K-shift), captured while it
ran (conformance/capture.py) and committed in the goldens' decode ops, against kvref's (``kvref conformance``'s
``graph`` check).

The goldens are read as committed: nothing here needs llama-cpp-python, except the test of the capture module
itself, which is skipped without it. The mask twin in use is the run's (``KVREF_BACKEND``); the twin tests run
the check with each mask twin explicitly, so either CI run covers both.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvref._backend import _load_compiled
from kvref.jobs import conformance as C
from kvref.memory import mask_kernels

ROOT = Path(__file__).resolve().parent.parent / "conformance"
CASES = C.list_cases(ROOT) if (ROOT / "golden").is_dir() else []
CAPTURED = [cid for cid in CASES if C.has_graph_inputs(C.load_case(ROOT, cid))]
MASK_C = _load_compiled("memory.mask")


def graph_check(cid: str, root: Path = ROOT) -> C.CheckResult:
    res = C.run_case(root, cid, expected={})
    return next(c for c in res.checks if c.name == "graph")


def test_the_goldens_carry_captures() -> None:
    """Every golden (the legacy ones too) has graph inputs on its decodes."""
    if not CASES:
        pytest.skip("no conformance/golden directory")
    for cid in CASES:
        case = C.load_case(ROOT, cid)
        decodes = [op for op in case["trace"] if op["op"] == "decode"]
        if not decodes:
            assert not C.has_graph_inputs(case), cid
        else:
            assert all("graph" in op for op in decodes if op["ret"] == 0), cid
    kinds = {
        (e["tensor"], e["swa"], e["type"])
        for cid in CAPTURED
        for op in C.load_case(ROOT, cid)["trace"]
        for u in op.get("graph", {}).get("ubatches", [])
        for e in u["inputs"]
    }
    # the goldens cover both mask types, both caches of an iSWA memory, and the K-shift
    assert {
        ("kq_mask", False, "f32"),
        ("kq_mask", False, "f16"),
        ("kq_mask", True, "f32"),
        ("kq_mask", True, "f16"),
    } <= kinds
    assert {("k_idxs", False, "i64"), ("v_idxs", True, "i64"), ("pos", False, "i32")} <= kinds
    shifts = {s["swa"] for cid in CAPTURED for op in C.load_case(ROOT, cid)["trace"]
              for s in op.get("graph", {}).get("shift", [])}  # fmt: skip
    assert shifts == {False, True}


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
@pytest.mark.parametrize("cid", CAPTURED)
def test_graph_inputs_match_llama_cpp(cid: str) -> None:
    res = graph_check(cid)
    assert res.status == "pass", f"{cid}: {res.detail}"
    assert "decodes" in res.detail


def test_cases_without_captures_pass_as_not_applicable(tmp_path: Path) -> None:
    if "llama-f16-single-seq" not in CASES:
        pytest.skip("no goldens")
    root = _copy_case("llama-f16-single-seq", tmp_path, lambda case: [op.pop("graph", None) for op in case["trace"]])
    res = graph_check("llama-f16-single-seq", root)
    assert res.status == "pass" and "not applicable" in res.detail


def _copy_case(cid: str, tmp_path: Path, change: Any) -> Path:
    """A conformance root in tmp_path holding golden ``cid`` with ``change(case)`` applied to its case.json."""
    src = ROOT / "golden" / cid
    root = tmp_path / "conformance"
    shutil.copytree(src, root / "golden" / cid)
    case = json.loads((src / "case.json").read_text())
    change(case)
    (root / "golden" / cid / "case.json").write_text(json.dumps(case))
    return root


# one case per mask feature: SWA window (both caches), chunked window, f16 (flash attention) masks over streams,
# K-shift, M-RoPE positions, a hybrid iSWA memory
TWIN_CASES = [
    "gemma2-swa-wraparound",
    "llama4-chunked",
    "llama-q8_0-fa-multistream",
    "fuzz-gemma2-seed3",
    "llama-context-shift",
    "qwen2vl-mrope",
    "lfm2-swa-hybrid-iswa",
]


def _twin(name: str) -> Any:
    from kvref.memory import _mask_py

    if name == "py":
        return _mask_py
    if MASK_C is None:
        pytest.skip("the compiled mask twin is not built (KVREF_BACKEND=python run)")
    return MASK_C


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
@pytest.mark.parametrize("twin", ["py", "c"])
@pytest.mark.parametrize("cid", TWIN_CASES)
def test_each_mask_twin_matches_llama_cpp(cid: str, twin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mask_kernels, "impl", _twin(twin))
    res = graph_check(cid)
    assert res.status == "pass", f"{cid} ({twin} twin): {res.detail}"


# ------------------------------------------------------------------ negative controls: the check must see these


def _wrap_mask(monkeypatch: pytest.MonkeyPatch, **change: Any) -> None:
    """Make kvref.memory.mask fill masks with some arguments changed (the slot search is left alone)."""
    impl = mask_kernels.impl
    real = impl.fill_kq_mask_raw

    class Wrapped:
        def __getattr__(self, name: str) -> Any:
            return getattr(impl, name)

        @staticmethod
        def fill_kq_mask_raw(*args: Any, **kw: Any) -> Any:
            for k, f in change.items():
                kw[k] = f(kw)
            return real(*args, **kw)

    monkeypatch.setattr(mask_kernels, "impl", Wrapped())


def _fails(cid: str, *needles: str) -> str:
    res = graph_check(cid)
    assert res.status == "fail", f"{cid}: the perturbed kvref passed the graph check"
    for n in (cid, "op ", "ubatch ", *needles):
        assert n in res.detail, (n, res.detail)
    # replay (cells, state bytes) does not read the mask: only the graph check sees the difference
    replay = next(c for c in C.run_case(ROOT, cid, expected={}).checks if c.name == "replay")
    return replay.status


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
def test_a_wider_window_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    _wrap_mask(monkeypatch, n_swa=lambda kw: kw["n_swa"] + 1 if kw.get("n_swa") else 0)
    assert _fails("gemma2-swa-wraparound", "kq_mask (swa)", "first difference at") == "pass"


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
def test_lost_causality_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    _wrap_mask(monkeypatch, causal=lambda kw: False)
    assert _fails("llama-f16-single-seq", "kq_mask (layer 0)", "kvref 0.0, llama.cpp -inf") == "pass"


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
def test_shifted_k_idxs_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvref.memory.kv_cache import KVCache

    real = KVCache.k_idxs
    monkeypatch.setattr(KVCache, "k_idxs", lambda self, ub, s: real(self, ub, s) + 1)
    _fails("llama-f16-multistream", "k_idxs", "first difference at 0")


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
def test_v_idxs_of_the_wrong_layout_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transposed V's indices (one per token and component) where llama.cpp used rows, and the reverse."""
    from kvref.memory.kv_cache import KVCache

    monkeypatch.setattr(KVCache, "v_idxs", lambda self, ub, s: KVCache.k_idxs(self, ub, s))
    _fails("llama-f16-single-seq", "v_idxs", "shape")


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
def test_a_wrong_k_shift_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvref.memory.kv_cache import KVCache

    real = KVCache.k_shift_input
    monkeypatch.setattr(KVCache, "k_shift_input", lambda self: np.where(real(self) != 0, real(self) - 1, 0))
    res = graph_check("llama-context-shift")
    assert res.status == "fail" and "K-shift input (base cache, layer 0)" in res.detail, res.detail
    assert "llama-context-shift: op 9 (decode)" in res.detail


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
def test_a_missing_k_shift_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvref.memory.kv_cache import KVCache

    monkeypatch.setattr(KVCache, "get_has_shift", lambda self: False)
    res = graph_check("fuzz-gemma2-seed3")
    assert res.status == "fail" and "K-shift of caches [none], llama.cpp [base, swa]" in res.detail, res.detail


@pytest.mark.skipif(not CAPTURED, reason="no goldens with captured graph inputs")
def test_a_perturbed_golden_is_caught(tmp_path: Path) -> None:
    """Flip one bit of a committed mask (and one position): the check names the op, ubatch, tensor and element."""
    src = ROOT / "golden" / "gemma3-iswa"
    for kind, needle in (("kq_mask", "first difference at (0, 0, 0): kvref 0.0, llama.cpp -inf"), ("pos", "pos")):
        root = tmp_path / kind / "conformance"
        shutil.copytree(src, root / "golden" / src.name)
        case = json.loads((src / "case.json").read_text())
        k = next(i for i, op in enumerate(case["trace"]) if "graph" in op)
        e = next(e for e in case["trace"][k]["graph"]["ubatches"][0]["inputs"] if e["tensor"] == kind and not e["swa"])
        if kind == "kq_mask":
            bits = bytearray(base64.b64decode(e["finite"]))
            bits[0] ^= 0x80
            e["finite"] = base64.b64encode(bytes(bits)).decode()
        else:
            e["data"] = (C.decode_ints(e["data"]) + 7).tolist()
        (root / "golden" / src.name / "case.json").write_text(json.dumps(case))
        res = graph_check(src.name, root)
        assert res.status == "fail", kind
        assert f"gemma3-iswa: op {k} (decode): ubatch 0: {kind} (layer " in res.detail and needle in res.detail


# ------------------------------------------------------------------ legacy producers: padded masks, no row indices

LEGACY_CAPTURED = [cid for cid in CAPTURED if cid.startswith("legacy-")]


@pytest.mark.skipif(not LEGACY_CAPTURED, reason="no legacy goldens with captured graph inputs")
def test_legacy_masks_are_padded_as_their_llama_cpp_padded_them() -> None:
    """Before 0.3.35 the captured mask has n_tps rounded up to GGML_KQ_MASK_PAD rows (32 in 2024, 64 from 0.3.8);
    K/V row indices exist from 0.3.16 on (0.2.90, 0.3.0, 0.3.8 and 0.3.12 write K/V with a CPY into a view)."""
    for cid in LEGACY_CAPTURED:
        case = C.load_case(ROOT, cid)
        pad = C.kq_mask_pad(case)
        release = case["producer"]["llama_cpp_python"]
        assert pad == {"0.2.90": 32, "0.3.0": 32, "0.3.8": 64, "0.3.12": 64, "0.3.16": 64, "0.3.35": 1}[release], cid
        for op in case["trace"]:
            for u in op.get("graph", {}).get("ubatches", []):
                kinds = {e["tensor"] for e in u["inputs"]}
                if release in ("0.2.90", "0.3.0", "0.3.8", "0.3.12"):
                    assert not kinds & {"k_idxs", "v_idxs"}, cid
                for e in u["inputs"]:
                    if e["tensor"] == "kq_mask":
                        assert e["shape"][1] % pad == 0, (cid, e["shape"])


def _legacy_mask_case() -> tuple[str, int]:
    """A legacy golden whose first captured mask has padding rows, and the index of that decode."""
    for cid in LEGACY_CAPTURED:
        case = C.load_case(ROOT, cid)
        if C.kq_mask_pad(case) > 1:
            for k, op in enumerate(case["trace"]):
                if any(e["tensor"] == "kq_mask" for u in op.get("graph", {}).get("ubatches", []) for e in u["inputs"]):
                    return cid, k
    pytest.skip("no legacy golden with a padded mask")


def _first_mask(case: dict, k: int) -> dict:
    return next(e for e in case["trace"][k]["graph"]["ubatches"][0]["inputs"] if e["tensor"] == "kq_mask")


@pytest.mark.skipif(not LEGACY_CAPTURED, reason="no legacy goldens with captured graph inputs")
def test_a_perturbed_legacy_mask_is_caught(tmp_path: Path) -> None:
    """A token row, a padding row and the padded shape of a legacy golden's mask, each changed, fail the check."""
    cid, k = _legacy_mask_case()

    def flip(bit: Any) -> Any:
        def change(case: dict) -> None:
            e = _first_mask(case, k)
            bits = np.unpackbits(np.frombuffer(base64.b64decode(e["finite"]), np.uint8))
            bits[bit(e["shape"])] ^= 1
            e["finite"] = base64.b64encode(np.packbits(bits).tobytes()).decode()

        return change

    def unpad(case: dict) -> None:
        e = _first_mask(case, k)
        m = C.decode_mask(e)[:, : e["shape"][1] - 1]
        e["shape"] = list(m.shape)
        e["finite"] = base64.b64encode(np.packbits(np.isfinite(m).reshape(-1)).tobytes()).decode()

    for name, change, needle in (
        ("token row", flip(lambda shape: 0), "first difference at (0, 0, 0)"),
        ("padding row", flip(lambda shape: shape[1] * shape[2] - 1), "is 0.0, not -inf"),
        ("shape", unpad, "n_tps padded to"),
    ):
        root = _copy_case(cid, tmp_path / name.replace(" ", "-"), change)
        res = graph_check(cid, root)
        assert res.status == "fail", f"{cid}: {name}: the perturbed golden passed"
        assert f"{cid}: op {k} (decode): ubatch 0: kq_mask (layer " in res.detail and needle in res.detail, res.detail


# ------------------------------------------------------------------ the capture side (needs llama-cpp-python)


def test_capture_module_declares_ggml_tensor_and_round_trips() -> None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.skip("llama-cpp-python is not installed: conformance/capture.py reads tensors through it")
    import sys

    sys.path.insert(0, str(ROOT))
    try:
        import capture
    finally:
        sys.path.remove(str(ROOT))
    # the struct size was checked against ggml_tensor_overhead() at import
    assert capture.ctypes.sizeof(capture.GGMLTensor) + capture.GGML_OBJECT_SIZE == capture._overhead
    rng = np.random.default_rng(0)
    for v in ([], [5], [3, 4], list(range(10)), [0] * 40 + [-8] * 12, rng.integers(-5, 5, 50).tolist()):
        assert C.decode_ints(capture.encode_ints(v)).tolist() == v
    m = np.where(rng.random((2, 3, 7)) < 0.5, np.float32(0), np.float32(-np.inf)).astype(np.float32)
    m[1, 2, 3] = -2.0  # an ALiBi-like value
    enc = capture.encode_mask(m)
    assert enc["values"] == [[1 * 21 + 2 * 7 + 3, -2.0]]
    assert np.array_equal(C.decode_mask(enc), m)
