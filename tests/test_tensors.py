"""Issue 13 part B: dequantize/quantize, the attention rotation, tensors, retyping, export, plot, progress."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest

import kvref
from kvref.ggml import quant, rotation
from kvref.ggml.rows import typed
from kvref.jobs import export as kexport
from kvref.jobs import plot as kplot
from kvref.jobs import tensors
from kvref.jobs.cli import main
from kvref.jobs.progress import Progress

ROOT = Path(__file__).resolve().parent.parent / "conformance"
GOLD = ROOT / "golden"
LLAMA = ROOT / "models" / "llama-tiny.gguf"
Q8 = GOLD / "llama-q8_0-fa-multistream" / "01-session.ggsn"
F16 = GOLD / "llama-f16-multistream" / "01-session.ggsn"


def test_quant_round_trips_and_refusals() -> None:
    x = np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32)
    for t in quant.KV_TYPES:
        if not quant.can_quantize(t):
            with pytest.raises(quant.QuantError, match="no iq4_nl quantizer"):
                quant.quantize(x, t)
            continue
        raw = quant.quantize(x, t)
        assert raw.dtype == np.uint8 and raw.shape == (4, kvref.ggml.types.row_size(t, 64))
        back = quant.dequantize(raw, t)
        assert back.shape == x.shape and np.abs(back - x).max() < 0.3
        assert np.array_equal(quant.quantize(back, t), raw)  # a second round trip changes no byte
    with pytest.raises(quant.QuantError, match="not a KV-cache type"):
        quant.dequantize(np.zeros((1, 84), np.uint8), "q2_K")
    iq = np.zeros((1, 18), np.uint8)  # dequantizing iq4_nl works
    assert quant.dequantize(iq, "iq4_nl").shape == (1, 32)


def test_hadamard_and_rule() -> None:
    for n in (64, 128, 256):
        h = rotation.hadamard(n)
        assert np.allclose(h @ h, np.eye(n), atol=1e-5) and np.array_equal(h, h.T)
        assert h[0, 0] == np.float32(1 / np.sqrt(np.float32(n)))
    assert [rotation.k_rot_size(h) for h in (64, 128, 192, 256, 320)] == [64, 128, 64, 256, 64]
    x = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    assert np.allclose(rotation.rotate(rotation.rotate(x, 128), 128), x, atol=1e-5)
    assert rotation.attn_rot("q8_0", 128, 128, disabled=False)
    assert not rotation.attn_rot("f16", 128, 128, disabled=False)
    assert not rotation.attn_rot("bf16", 128, 128, disabled=False)
    assert not rotation.attn_rot("q8_0", 96, 96, disabled=False)
    assert not rotation.attn_rot("q8_0", -1, 128, disabled=False)  # head sizes differ between layers
    assert not rotation.attn_rot("q8_0", 128, 128, disabled=True)
    assert rotation.rotation_disabled({"LLAMA_ATTN_ROT_DISABLE": " 1x"})
    assert not rotation.rotation_disabled({"LLAMA_ATTN_ROT_DISABLE": "abc"})
    assert not rotation.rotation_disabled({})


def test_kv_cache_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    hp = kvref.HParams(arch="llama", n_layer=2, n_embd=128, n_head=2, n_head_kv=2)
    mem = kvref.create_memory(hp, n_ctx=64, flash_attn=True, type_k="q8_0", type_v="q4_0")
    assert mem.attn_rot_k and mem.attn_rot_v
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    assert not mem.attn_rot_k
    with pytest.raises(AttributeError):
        mem.attn_rot_k = True  # type: ignore[misc]


def test_state_tensors_shapes_and_metadata() -> None:
    st = kvref.state.load(F16)
    ts = tensors.state_tensors(st, model=LLAMA)
    sec = st.memory.sections[0]
    t = ts.kv[0]
    c = sec.streams[t.stream].cells
    assert t.k.shape == (c.n, 2, 32) and t.v is not None and t.v.shape == (c.n, 2, 32)
    assert t.il == 0 and np.array_equal(t.pos, c.pos) and t.seq_ids(0) == c.seq_ids(0)
    raw = np.asarray(sec.streams[t.stream].data.k[0].data).view(np.float16).astype(np.float32)
    assert np.array_equal(t.k.reshape(c.n, -1), raw)
    flat = tensors.state_tensors(st).kv[0]  # no model: one "head" of the whole row
    assert flat.k.shape == (c.n, 1, 64) and flat.il is None


def test_transposed_v_is_untransposed() -> None:
    hp = kvref.HParams.from_gguf(LLAMA)
    mem = kvref.create_memory(hp, n_ctx=32, flash_attn=False)
    mem.decode(kvref.Batch(tokens=[5, 6, 7], seq_ids=[[0]] * 3), n_ubatch=512)
    rows = np.arange(3 * 64, dtype=np.float32).reshape(3, 64) / 100
    layer = mem.layers[0]
    typed(layer.v, "f16")[0, :, :3] = rows.T.astype(np.float16)
    t = tensors.memory_tensors(mem).kv[0]
    assert np.allclose(t.v.reshape(3, 64), rows, atol=1e-3) and list(t.cells) == [0, 1, 2]


def test_recurrent_shapes() -> None:
    hp = kvref.HParams.from_gguf(ROOT / "models" / "mamba-tiny.gguf")
    obj = kvref.state.load(GOLD / "mamba-seq-cp-rm" / "01-session.ggsn")
    r = tensors.state_tensors(obj, hparams=hp).recurrent[0]
    assert r.r.shape[1:] == (hp.ssm_d_inner, hp.ssm_d_conv - 1) and r.s.shape[1:] == (hp.ssm_d_inner, hp.ssm_d_state)
    rw = kvref.HParams.from_gguf(ROOT / "models" / "rwkv6-tiny.gguf")
    r_shape, s_shape = tensors.recurrent_shapes(rw)  # type: ignore[misc]
    assert int(np.prod(r_shape)) == rw.n_embd_r() and int(np.prod(s_shape)) == rw.n_embd_s()


def test_rotated_file_needs_model() -> None:
    obj = kvref.state.load(Q8)  # q8_0 rows of 64 values: a rotation may apply
    with pytest.raises(kvref.KVRefError, match="rotation"):
        tensors.state_tensors(obj)
    ts = tensors.state_tensors(obj, model=LLAMA)  # head size 32: llama.cpp does not rotate
    assert not ts.kv[0].unrotated_k
    rot = tensors.state_tensors(obj, head_dim=64)  # pretend head size 64: rotation undone
    assert rot.kv[0].unrotated_k


def test_retype_round_trip(tmp_path: Path) -> None:
    src = kvref.state.load(GOLD / "llama-f16-fa-single-seq" / "01-session.ggsn")  # V row-wise (flash attention)
    q8 = kvref.convert(src, type_k="q8_0", type_v="q8_0", model=LLAMA)
    assert {r.type_name for s in q8.memory.kv_sections[0].streams if s.data for r in s.data.k} == {"q8_0"}
    assert kvref.convert(q8, type_k="q8_0", type_v="q8_0", model=LLAMA).to_bytes() == q8.to_bytes()
    back = kvref.convert(q8, type_k="f16", type_v="f16", model=LLAMA)
    a = tensors.state_tensors(back, model=LLAMA).kv[0]
    b = tensors.state_tensors(src, model=LLAMA).kv[0]
    assert np.abs(a.k - b.k).max() <= np.abs(b.k).max() / 127
    with pytest.raises(kvref.KVRefError, match="iq4_nl"):
        kvref.convert(src, type_k="iq4_nl")
    nofa = kvref.state.load(F16)  # V transposed
    with pytest.raises(kvref.KVRefError, match="flash attention"):
        kvref.convert(nofa, type_v="q8_0")
    with pytest.raises(kvref.KVRefError, match="model="):
        kvref.convert(Q8, type_k="f16")


def test_export_npz_and_safetensors(tmp_path: Path) -> None:
    arrays = kexport.export(F16, tmp_path / "x.npz", model=LLAMA)
    z = np.load(tmp_path / "x.npz")
    assert set(arrays) <= set(z.files) and json.loads(str(z["__kvref__"]))["layout"] == "kv"
    assert "kv.0.s0.l0.k" in arrays and arrays["kv.0.s0.layer"].tolist() == [0, 1]
    mask, sid, start = arrays["kv.0.s0.seq_mask"], arrays["kv.0.s0.seq_id"], arrays["kv.0.s0.seq_start"]
    assert all(mask[i, sid[start[i] : start[i + 1]]].all() for i in range(len(start) - 1))
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    assert main(["export", str(F16), str(tmp_path / "x.safetensors"), "--model", str(LLAMA)]) == 0
    got = load_file(str(tmp_path / "x.safetensors"))
    assert np.array_equal(got["kv.0.s0.l1.v"], arrays["kv.0.s0.l1.v"])


def test_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert main(["plot", str(F16), "-o", str(tmp_path / "a.png")]) == 0
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"
    from kvref.jobs.plot import memory_panels, plot, state_panels

    hp = kvref.HParams.from_gguf(ROOT / "models" / "gemma3-tiny.gguf")
    panels = state_panels(kvref.state.load(GOLD / "gemma3-iswa" / "01-session.ggsn"), hp)
    assert panels[-1].n_swa == hp.n_swa and panels[0].n_swa == 0
    mem = kvref.create_memory(kvref.HParams.from_gguf(LLAMA), n_ctx=32, n_seq_max=2)
    mem.decode(kvref.Batch(tokens=list(range(4, 10)), seq_ids=[[0]] * 6), n_ubatch=512)
    mem.seq_add(0, 2, -1, -1)
    (p,) = memory_panels(mem)
    assert p.shift is not None and p.shift.tolist() == [0, 0, -1, -1, -1, -1]
    plot(mem, tmp_path / "m.png")


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builtins

    real = builtins.__import__

    def fake(name: str, *a: object, **k: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(kvref.KVRefError, match=r"pip install 'kvref\[plot\]'"):
        kplot.plot(F16, tmp_path / "a.png")


def test_progress() -> None:
    quiet = io.StringIO()  # StringIO.isatty() is False
    with Progress(100, "x", stream=quiet) as bar:  # StringIO is not a terminal: nothing drawn
        bar.update(100)
    assert quiet.getvalue() == ""
    loud = io.StringIO()
    with Progress(2048, "export", stream=loud, enabled=True) as bar:
        bar.update(1024)
        bar.update(1024)
    assert "100%" in loud.getvalue() and loud.getvalue().endswith("export\n")


def test_inspect_rotation_note(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(Q8)]) == 0
    assert "probably written with llama.cpp's attention rotation" in capsys.readouterr().out
    assert main(["inspect", str(F16)]) == 0
    assert "rotation" not in capsys.readouterr().out


def test_jamba_recurrent_rows_have_mambas_shape() -> None:
    from kvref.jobs.conformance import hparams_from_case

    hp = hparams_from_case(json.loads((GOLD / "jamba-hybrid" / "case.json").read_text()))
    obj = kvref.state.load(GOLD / "jamba-hybrid" / "01-session.ggsn")
    r = tensors.state_tensors(obj, hparams=hp).recurrent[0]
    assert r.r.shape[1:] == (hp.ssm_d_inner, hp.ssm_d_conv - 1) and r.s.shape[1:] == (hp.ssm_d_inner, hp.ssm_d_state)
    assert r.il is not None and r.il >= 0


def test_a_model_that_did_not_write_the_state_is_refused(tmp_path: Path) -> None:
    gemma = GOLD / "gemma3-iswa" / "01-session.ggsn"
    with pytest.raises(kvref.KVRefError, match="written by a 'gemma3' model, the model given is 'llama'"):
        kexport.export(gemma, tmp_path / "x.npz", model=LLAMA)
    assert not (tmp_path / "x.npz").exists()
    # a sequence file names no arch: the memory layout and the layer count tell
    with pytest.raises(kvref.KVRefError, match="holds a iswa memory, a 'llama' model builds a kv one"):
        tensors.state_tensors(GOLD / "gemma3-iswa" / "03-seq-seq0.ggsq", model=LLAMA)
    three = dataclasses.replace(kvref.HParams.from_gguf(LLAMA), n_layer=3)
    with pytest.raises(kvref.KVRefError, match="section 0 holds 2 layers, the model's kv cache 3"):
        tensors.state_tensors(GOLD / "llama-shared-prefix" / "03-seq-seq0.ggsq", hparams=three)


def test_plot_ticks_whole_cells(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recurrent section of two cells: matplotlib's default ticks fell at 0.5; a cell is whole."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from kvref.jobs.plot import plot

    ticks: list[float] = []
    save = Figure.savefig

    def record(fig: Figure, *args: object, **kw: object) -> None:
        ticks.extend(t for ax in fig.axes[:-1] for t in ax.get_xticks())  # the last axes is the colour bar
        save(fig, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(Figure, "savefig", record)
    plot(GOLD / "mamba-seq-cp-rm" / "01-session.ggsn", tmp_path / "r.png")
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
