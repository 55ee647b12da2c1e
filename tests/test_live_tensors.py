"""Live (issue 13 part B): kvref's dequantized, un-rotated K/V against llama.cpp's own caches, and a retyped cache
that llama.cpp loads and decodes from.

A tiny llama with head size 64 (so llama.cpp 0.3.36 rotates quantized K/V) is written to a temp dir with
conformance/tinymodels.py's builders. Marked ``live``; skipped without llama-cpp-python.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import kvref
from kvref.ggml import quant
from kvref.jobs import tensors

pytestmark = pytest.mark.live
try:
    import llama_cpp as L
except Exception as exc:
    pytest.skip(f"llama_cpp cannot be imported ({type(exc).__name__}: {exc})", allow_module_level=True)

from _llama_live import Ctx, _model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent / "conformance"
PROMPT = [12, 57, 12, 77, 77, 8, 39, 111, 47, 115, 59, 69, 3, 30, 90, 17, 41, 66, 5, 100]
NEXT = [44, 17, 90, 23]
TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "q4_0": 2}


@pytest.fixture(scope="module")
def hd64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama, n_embd 128, 2 heads of size 64 (no GQA), written to a temp dir (not committed)."""
    sys.path.insert(0, str(ROOT))
    import tinymodels as tm  # type: ignore[import-not-found]

    out = tmp_path_factory.mktemp("models")
    d = tm._Dims(n_layer=2, n_embd=128, n_head=2, n_head_kv=2, hd=64, n_ff=128)
    b = tm._Builder("llama", seed=1313)
    tm._transformer(b, d)

    def meta(w: object) -> None:
        tm._common_meta(w, d)
        w.add_rope_dimension_count(d.hd)  # type: ignore[attr-defined]
        w.add_rope_freq_base(10000.0)  # type: ignore[attr-defined]
        w.add_layer_norm_rms_eps(1e-5)  # type: ignore[attr-defined]

    return b.finish(out, "llama-hd64", meta, {}).path  # type: ignore[no-any-return]


def typed_ctx(model: Path, type_k: str, type_v: str, n_ctx: int = 256) -> Ctx:
    """Like _llama_live.Ctx (one thread, flash attention on) with the given cache types."""
    c = Ctx.__new__(Ctx)
    c.model = _model(model)
    p = L.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, 1
    p.n_threads = p.n_threads_batch = 1
    p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
    p.type_k, p.type_v = TYPES[type_k], TYPES[type_v]
    p.kv_unified = True
    p.offload_kqv = p.op_offload = False
    p.no_perf, p.embeddings = True, False
    c.ctx = L.llama_init_from_model(c.model, p)
    assert c.ctx, "llama_init_from_model failed"
    c.mem = L.llama_get_memory(c.ctx)
    c.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(c.model))
    return c


def run(model: Path, type_k: str, type_v: str, path: Path) -> list[np.ndarray]:
    with typed_ctx(model, type_k, type_v) as c:
        c.decode(PROMPT)
        c.save_session(path, PROMPT)
        return [c.decode([t]) for t in NEXT]


def kv(path: Path, model: Path, **kw: object) -> list[tensors.KVTensors]:
    return tensors.state_tensors(kvref.state.load(path), model=model, **kw).kv  # type: ignore[arg-type]


def test_flags_match_llama_cpp_rule(hd64: Path) -> None:
    hp = kvref.HParams.from_gguf(hd64)
    mem = kvref.create_memory(hp, n_ctx=256, flash_attn=True, type_k="q8_0", type_v="q8_0")
    assert mem.attn_rot_k and mem.attn_rot_v
    assert not kvref.create_memory(hp, n_ctx=256, flash_attn=True).attn_rot_k  # f16: never
    small = kvref.HParams.from_gguf(ROOT / "models" / "llama-tiny.gguf")  # head size 32
    assert not kvref.create_memory(small, n_ctx=256, flash_attn=True, type_k="q8_0", type_v="q8_0").attn_rot_k


def test_q8_0_cache_agrees_with_f16_after_unrotation(hd64: Path, tmp_path: Path) -> None:
    run(hd64, "f16", "f16", tmp_path / "f16.ggsn")
    run(hd64, "q8_0", "q8_0", tmp_path / "q8.ggsn")
    ref = kv(tmp_path / "f16.ggsn", hd64)
    got = kv(tmp_path / "q8.ggsn", hd64)
    raw = kv(tmp_path / "q8.ggsn", hd64, unrotate=False)
    for a, b, r in zip(ref, got, raw, strict=True):
        assert b.unrotated_k and b.unrotated_v and b.k.shape == a.k.shape == (len(PROMPT), 2, 64)
        for x, y, z in ((a.k, b.k, r.k), (a.v, b.v, r.v)):
            assert x is not None and y is not None and z is not None
            # q8_0: |error| <= d/2 per element with d = max|block| / 127; the rotation is orthonormal, so the
            # un-rotated error is bounded by the block's norm of errors: sqrt(64) * d/2 at worst
            bound = np.abs(x).max() / 127 / 2 * 8 + 1e-3
            assert np.abs(y - x).max() <= bound, (np.abs(y - x).max(), bound)
            assert np.abs(z - x).max() > 10 * np.abs(y - x).max()  # still rotated: far off


def test_rotation_disabled_by_env(hd64: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    run(hd64, "f16", "f16", tmp_path / "f16.ggsn")
    run(hd64, "q8_0", "q8_0", tmp_path / "q8.ggsn")
    hp = kvref.HParams.from_gguf(hd64)
    assert not kvref.create_memory(hp, n_ctx=256, flash_attn=True, type_k="q8_0", type_v="q8_0").attn_rot_k
    ref = kv(tmp_path / "f16.ggsn", hd64)
    plain = kv(tmp_path / "q8.ggsn", hd64, rotated=False)
    for a, b in zip(ref, plain, strict=True):
        assert np.abs(b.k - a.k).max() <= np.abs(a.k).max() / 127 + 1e-3


def test_q8_0_round_trip_is_byte_identical(hd64: Path, tmp_path: Path) -> None:
    run(hd64, "q8_0", "q8_0", tmp_path / "q8.ggsn")
    st = kvref.state.load(tmp_path / "q8.ggsn")
    for sec in st.memory.kv_sections:
        for s in sec.streams:
            assert s.data is not None
            for rows in (*s.data.k, *s.data.v):
                raw = np.asarray(rows.data)
                assert np.array_equal(quant.quantize(quant.dequantize(raw, "q8_0"), "q8_0"), raw)
    # un-rotate, rotate again, requantize: the same bytes too (convert to the same type keeps every byte)
    same = kvref.convert(st, type_k="q8_0", type_v="q8_0", model=hd64)
    assert same.to_bytes() == st.to_bytes()


@pytest.mark.parametrize(("src", "dst"), [("f16", "q8_0"), ("q8_0", "f16")])
def test_retyped_cache_loads_and_decodes(hd64: Path, tmp_path: Path, src: str, dst: str) -> None:
    want = run(hd64, src, src, tmp_path / "src.ggsn")
    kvref.convert(tmp_path / "src.ggsn", tmp_path / "dst.ggsn", type_k=dst, type_v=dst, model=hd64)
    direct = run(hd64, dst, dst, tmp_path / "direct.ggsn")
    with typed_ctx(hd64, dst, dst) as c:
        assert c.load_session(tmp_path / "dst.ggsn") == PROMPT
        got = [c.decode([t]) for t in NEXT]
    scale = max(np.abs(w).max() for w in want)
    for g, w, d in zip(got, want, direct, strict=True):
        err = np.abs(g - w).max()
        assert err <= 0.05 * scale, (err, scale)
        # as close to the source run as a cache filled by llama.cpp in the new type is (within 4x)
        assert err <= 4 * np.abs(d - w).max() + 1e-4, (err, np.abs(d - w).max())


def test_retype_without_undoing_rotation_goes_wrong(hd64: Path, tmp_path: Path) -> None:
    """The control: rows retyped q8_0 -> f16 while pretending the input was not rotated decode worse."""
    want = run(hd64, "f16", "f16", tmp_path / "f16.ggsn")
    run(hd64, "q8_0", "q8_0", tmp_path / "q8.ggsn")
    from kvref.jobs.retype import retype

    obj = kvref.state.load(tmp_path / "q8.ggsn")
    bad = retype(obj, type_k="f16", type_v="f16", src_rotates=False, dst_rotates=False,
                 hparams=kvref.HParams.from_gguf(hd64))  # fmt: skip
    good = kvref.convert(obj, type_k="f16", type_v="f16", model=hd64)
    errs = []
    for o in (good, bad):
        kvref.state.save(o, tmp_path / "x.ggsn")
        with typed_ctx(hd64, "f16", "f16") as c:
            c.load_session(tmp_path / "x.ggsn")
            errs.append(max(np.abs(c.decode([t]) - w).max() for t, w in zip(NEXT, want, strict=True)))
    assert errs[0] * 5 < errs[1], errs
