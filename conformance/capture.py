"""Read the graph inputs llama.cpp computes with, while it runs: the KQ masks, the K/V row indices, the
token positions and the K-shift input.

llama.cpp hands every graph node to ``llama_context_params.cb_eval`` twice: first asking whether the
caller wants to see it (``ask`` true), then, for the nodes it said yes to, once the node is computed
(``ask`` false). The inputs are leaves, never nodes, so they are read through the nodes that consume them:

=====================  =====================================  ==========
input                  consumer node                          source
=====================  =====================================  ==========
KQ mask (no FA)        SOFT_MAX ``kq_soft_max-<il>``          src[1]
KQ mask (FA, f16)      FLASH_ATTN_EXT (K from cache_k_l<il>)  src[3]
K / V row indices      SET_ROWS into cache_k_l<il> / _v_      src[1]
token positions        ROPE fed by ``inp_pos``                src[1]
K-shift                ROPE over a view of cache_k_l<il>      src[1]
T5 position buckets    GET_ROWS of ``*attn_rel_b.weight``     src[1] (a 1-D view of ``pos_bucket_enc`` /
                                                              ``pos_bucket_dec``: the view's source is read)
deepseek4 inputs       any node reading ``dsv4_<cache>_<field>``  that src (llm_graph_input_dsv4: recorded as
                                                              ``dsv4_<cache>_<field>``, the masks as
                                                              ``kq_mask_dsv4_<cache>``)
=====================  =====================================  ==========

With ``rows=True`` (the attention-rotation cases) the K and V rows a decode stores are read too, before and
after llama.cpp's Hadamard rotation: through each ``MUL_MAT`` with the hint ``GGML_HINT_SRC0_IS_HADAMARD`` whose
src[1] is (a reshape of) ``Kcur-<il>`` / ``Vcur-<il>`` (src[1] before, the node itself after). In a K-shift graph
of a quantized K cache the same is read at both rotations of each layer: the first takes the dequantized K and
gives it unrotated (ubatch -1 in the keys), the second takes it roped and gives what is quantized back (-2). There
the ROPE reads the rotated cast of the cache: the chain to ``cache_k_l<il>`` is followed through src[1] of those
MUL_MAT nodes.

The base and the SWA mask (and the two caches' indices) carry the same names; the layer index of the
consumer tells them apart (the caller maps it with the model's SWA layers). Every graph of a model starts
with the token-embedding lookup (GET_ROWS of ``token_embd.weight``), which is how the ubatches of one
llama_decode are told apart; a K-shift graph has no such node and runs before them.

Older releases (the legacy goldens) differ in what there is to read. Before llama.cpp's ``ggml_set_rows``
(0.2.90, and 0.3.12, where it is opt-in through ``LLAMA_SET_ROWS`` and off) K and V are written with a CPY into
a view of the cache: there are no row indices. Their KQ masks have ``GGML_PAD(n_tokens, GGML_KQ_MASK_PAD)``
rows per stream (32 in 0.2.90, 64 in 0.3.12 .. 0.3.16), the rows past the ubatch's tokens all -inf; the mask
is recorded with the shape llama.cpp gave it. 0.3.12 .. 0.3.16 name neither the soft-max (its layer is then
the K cache's the KQ product read) nor, up to 0.3.35, the positions (the unnamed input a Q/K ROPE reads).

llama-cpp-python does not declare ``struct ggml_tensor``: it is declared here from ggml.h of the vendored
llama.cpp of each release (``_tensor_fields``) and its size is checked against ``ggml_tensor_overhead()``
(the tensor plus ggml's 32-byte object header) when the module is imported. Data is read by pointer: the CPU
backend keeps it in host memory.
"""

from __future__ import annotations

import base64
import ctypes
import re
from pathlib import Path
from typing import Any

import llama_cpp as L
import numpy as np

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
GGML_MAX_NAME = 64
GGML_OBJECT_SIZE = 32  # struct ggml_object: offs, size, next, type, 4 bytes padding


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor of the loaded release's ggml.h (fields from ``_tensor_fields``)."""


def _tensor_fields(version: str) -> list[tuple[str, Any]]:
    """struct ggml_tensor in ggml.h of the llama.cpp vendored by llama-cpp-python ``version``. Until the
    autumn of 2024 (0.2.x) it still had the deprecated ``backend`` enum after ``type`` and the ``grad``
    pointer before ``src``, and no trailing padding (0.2.x and 0.3.0 checked); 0.3.12 .. 0.3.36 share the layout
    without them. In spring 2024 (0.2.67 checked; gone by 0.2.82) it also had perf counters after ``src`` and the
    trailing padding."""
    ptr = ctypes.POINTER(GGMLTensor)
    old = version.startswith("0.2.") or version == "0.3.0"
    perf = tuple(int(x) for x in version.split(".")[:3]) <= (0, 2, 67)
    return [
        ("type", ctypes.c_int),
        *([("backend", ctypes.c_int)] if old else []),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        *([("grad", ptr)] if old else []),
        ("src", ptr * GGML_MAX_SRC),
        *(
            [("perf_runs", ctypes.c_int), ("perf_cycles", ctypes.c_int64), ("perf_time_us", ctypes.c_int64)]
            if perf
            else []
        ),
        ("view_src", ptr),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        *([] if old and not perf else [("padding", ctypes.c_char * 8)]),
    ]


GGMLTensor._fields_ = _tensor_fields(L.__version__)


def _load_ggml() -> Any:
    try:
        from llama_cpp import _ggml  # 0.3.x
    except ImportError:  # 0.2.x bindings load libggml only through libllama: open it from the package
        pkg = Path(L.__file__).parent
        lib = pkg / "lib" / "libggml.so"
        # spring 2024 (0.2.67) links ggml into libllama.so, which exports its functions
        return ctypes.CDLL(str(lib if lib.exists() else pkg / "libllama.so"))
    return _ggml.libggml


_lib = _load_ggml()
_lib.ggml_tensor_overhead.restype = ctypes.c_size_t
_lib.ggml_tensor_overhead.argtypes = []
_lib.ggml_op_name.restype = ctypes.c_char_p
_lib.ggml_op_name.argtypes = [ctypes.c_int]

_overhead = int(_lib.ggml_tensor_overhead())
if ctypes.sizeof(GGMLTensor) + GGML_OBJECT_SIZE != _overhead:
    raise RuntimeError(
        f"struct ggml_tensor declared here is {ctypes.sizeof(GGMLTensor)} bytes, but the loaded ggml says "
        f"ggml_tensor_overhead() = {_overhead} = {GGML_OBJECT_SIZE} + {_overhead - GGML_OBJECT_SIZE}: "
        f"llama-cpp-python {L.__version__} vendors another ggml.h; update _tensor_fields"
    )

_OP_IDS: dict[str, int] = {}
for _i in range(256):
    _n = _lib.ggml_op_name(_i)
    # 0.3.0's ggml_op_name does not bound its index (no "COUNT" entry): past the last op it reads other memory
    if _n is None or not re.fullmatch(rb"[A-Z0-9_]+", _n):
        break
    _OP_IDS.setdefault(_n.decode(), _i)
    if _n == b"COUNT":
        break
OP_SOFT_MAX = _OP_IDS["SOFT_MAX"]
OP_FLASH_ATTN_EXT = _OP_IDS.get("FLASH_ATTN_EXT", -1)  # none before the spring 2024 kernels (0.2.67)
OP_SET_ROWS = _OP_IDS.get("SET_ROWS", -1)  # none before mid-2025: K/V written by CPY
OP_ROPE = _OP_IDS["ROPE"]
OP_GET_ROWS = _OP_IDS["GET_ROWS"]
OP_MUL_MAT = _OP_IDS["MUL_MAT"]
GGML_HINT_SRC0_IS_HADAMARD = 1  # ggml.h
GGML_TENSOR_FLAG_INPUT = 1  # ggml.h enum ggml_tensor_flag
_ROWS_RE = re.compile(r"^([KV])cur-(\d+)")

# ggml.h enum ggml_type: the input tensors are of these types
_DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 26: np.dtype("<i4"), 27: np.dtype("<i8")}
TYPE_NAMES = {0: "f32", 1: "f16", 26: "i32", 27: "i64"}

_CACHE_RE = re.compile(r"cache_([kv])_l(\d+)")
_LAYER_RE = re.compile(r"-(\d+)$")
_BLK_RE = re.compile(r"blk\.(\d+)\.")
_UNNAMED_RE = re.compile(r"^(leaf_\d+)?$")  # ggml_build_forward names an unnamed leaf leaf_<n>


def _name(t: Any) -> str:
    return t.name.decode("utf-8", "replace")


def _is_hadamard(t: Any) -> bool:
    """A MUL_MAT by llama.cpp's rotation matrix (llama_mul_mat_hadamard sets the hint in op_params[1])."""
    return bool(t.op == OP_MUL_MAT and t.op_params[1] == GGML_HINT_SRC0_IS_HADAMARD)


def _cache_of(p: Any, depth: int = 8) -> tuple[str, int] | None:
    """('k' | 'v', layer) when tensor ``p`` is (a view of, a cast of, a rotation of) a layer's K or V cache."""
    while p and depth > 0:
        t = p.contents
        m = _CACHE_RE.search(_name(t))
        if m:
            return m.group(1), int(m.group(2))
        p = t.view_src if t.view_src else (t.src[1] if _is_hadamard(t) else t.src[0])
        depth -= 1
    return None


def read_tensor(t: Any) -> np.ndarray:
    """The tensor's data as a NumPy array in ggml order reversed: shape (ne3, ne2, ne1, ne0), strides nb."""
    dt = _DTYPES.get(t.type)
    if dt is None:
        raise TypeError(f"tensor {_name(t)!r}: ggml type {t.type} is not one this reader knows")
    if not t.data:
        raise ValueError(f"tensor {_name(t)!r} has no data (not allocated on the host)")
    ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)]
    nb = [int(t.nb[i]) for i in range(GGML_MAX_DIMS)]
    if nb[0] != dt.itemsize:
        raise ValueError(f"tensor {_name(t)!r}: nb[0] {nb[0]} for a {dt.itemsize}-byte type")
    extent = sum((n - 1) * s for n, s in zip(ne, nb, strict=True)) + dt.itemsize
    buf = (ctypes.c_uint8 * extent).from_address(t.data)
    arr = np.ndarray(tuple(reversed(ne)), dtype=dt, buffer=buf, strides=tuple(reversed(nb)))
    return np.array(arr)  # a copy: the buffer is reused by the next graph


# ------------------------------------------------------------------ compact encodings


def encode_ints(a: Any) -> Any:
    """An int list, or ``{"runs": [[first, step, count], ...]}`` (arithmetic runs) when that is shorter."""
    v = [int(x) for x in np.asarray(a).reshape(-1)]
    runs: list[list[int]] = []
    i = 0
    while i < len(v):
        if i + 1 == len(v):
            runs.append([v[i], 0, 1])
            break
        step = v[i + 1] - v[i]
        j = i + 1
        while j + 1 < len(v) and v[j + 1] - v[j] == step:
            j += 1
        runs.append([v[i], step, j - i + 1])
        i = j + 1
    return {"runs": runs} if 3 * len(runs) + 4 < len(v) else v


def encode_mask(m: np.ndarray) -> dict:
    """shape, the finite/-inf pattern (np.packbits, base64) and the finite values other than 0."""
    flat = m.astype(np.float32).reshape(-1)
    if np.isnan(flat).any() or np.isposinf(flat).any():
        raise ValueError("mask holds NaN or +inf")
    finite = np.isfinite(flat)
    out: dict = {"shape": list(m.shape), "finite": base64.b64encode(np.packbits(finite).tobytes()).decode()}
    other = np.flatnonzero(finite & (flat != 0))
    if other.size:
        out["values"] = [[int(i), float(flat[i])] for i in other]
    return out


# ------------------------------------------------------------------ the callback


class Capture:
    """Collects the graph inputs of every graph llama.cpp computes; ``take()`` hands them over per decode.

    ``swa_layer(il)`` says whether layer il's attention reads the SWA cache (of an iSWA memory)."""

    def __init__(self, swa_layer: Any, rows: bool = False) -> None:
        self.swa_layer = swa_layer
        self.want_rows = rows
        # rows=True: per decode, ("k" | "v", layer, ubatch, pre-rotation f32, post-rotation f32) in graph order
        self.rows: list[tuple[str, int, int, np.ndarray, np.ndarray]] = []
        self.shifts: list[dict] = []
        self.ubatches: list[dict] = []
        self._seen: set = set()
        self._shift_seen: set = set()
        self._want: dict[int, tuple] = {}  # node address -> what to read when it is computed
        self.fn = L.ggml_backend_sched_eval_callback(self._cb)

    def install(self, cparams: Any) -> None:
        cparams.cb_eval = self.fn
        cparams.cb_eval_user_data = None

    def take(self) -> dict:
        out = {"shift": self.shifts, "ubatches": self.ubatches, "rows": self.rows}
        self.shifts, self.ubatches, self._seen, self._shift_seen = [], [], set(), set()
        self.rows = []
        return out

    def _cb(self, ptr: int, ask: bool, _ud: Any) -> bool:
        try:
            return self._eval(ptr, ask)
        except Exception as e:  # an exception cannot cross the C boundary: keep it for the driver
            self.error = e
            return False

    error: Exception | None = None

    def _classify(self, t: Any) -> tuple | None:
        """What to read from node t (key, source index), or None."""
        op = t.op
        if op == OP_GET_ROWS and t.src[0] and _name(t.src[0].contents) == "token_embd.weight":
            return ("graph",)
        for i in range(GGML_MAX_SRC):  # deepseek4's compression inputs (llm_graph_input_dsv4), named dsv4_*
            p = t.src[i]
            if not p:
                break
            n = _name(p.contents)
            if n.startswith("dsv4_") and p.contents.flags & GGML_TENSOR_FLAG_INPUT:
                return ("kq_mask_" + n[: -len("_kq_mask")] if n.endswith("_kq_mask") else n, -1, i)
        if op == OP_GET_ROWS and t.src[0] and t.src[1] and "attn_rel_b" in _name(t.src[0].contents):
            m = _BLK_RE.search(_name(t.src[0].contents))
            return ("pos_bucket", int(m.group(1)) if m else -1, 1)
        if op == OP_SOFT_MAX and t.src[1]:
            # named kq_soft_max[_ext]-<il> where llama.cpp names it; 0.3.12 .. 0.3.16 leave it unnamed: the
            # layer is that of the K cache the KQ product read
            m = _LAYER_RE.search(_name(t)) if _name(t).startswith("kq_soft_max") else None
            if m is not None:
                return ("kq_mask", int(m.group(1)), 1)
            c = _cache_of(t.src[0], depth=12)
            return None if c is None else ("kq_mask", c[1], 1)
        if op == OP_FLASH_ATTN_EXT:
            c = _cache_of(t.src[1])
            if c is None or not t.src[3]:
                return None
            return ("kq_mask", c[1], 3)
        if op == OP_SET_ROWS:
            c = _cache_of(t.src[2]) or _cache_of(t.view_src)
            if c is None:
                return None
            return (f"{c[0]}_idxs", c[1], 1)
        if self.want_rows and _is_hadamard(t) and t.src[1]:
            m = _ROWS_RE.search(_name(t.src[1].contents))
            if m:
                return ("rows", int(m.group(2)), m.group(1).lower())
            c = _cache_of(t.src[1], depth=16)
            if c is not None and c[0] == "k" and not self.ubatches:
                return ("shift_rows", c[1], "k")
        if op == OP_ROPE and t.src[1]:
            p = t.src[1].contents
            c = None if _name(p) == "inp_pos" else _cache_of(t.src[0])
            if c is not None and c[0] == "k":
                return ("k_shift", c[1], 1)
            # the positions: named inp_pos, except in 0.3.12 .. 0.3.35, where they are the unnamed input (ggml
            # names it leaf_<n> in the graph) a ROPE of Q or K reads
            unnamed = _UNNAMED_RE.match(_name(p)) is not None
            if _name(p) == "inp_pos" or (c is None and unnamed and p.flags & GGML_TENSOR_FLAG_INPUT):
                m = _LAYER_RE.search(_name(t))
                return ("pos", int(m.group(1)) if m else -1, 1)
        return None

    def _swa(self, kind: str, il: int) -> bool:
        # the positions are one input for every layer
        return kind != "pos" and il >= 0 and bool(self.swa_layer(il))

    def _eval(self, ptr: int, ask: bool) -> bool:
        t = ctypes.cast(ptr, ctypes.POINTER(GGMLTensor)).contents
        if ask:
            what = self._classify(t)
            if what is None:
                return False
            if what[0] == "graph":
                self.ubatches.append({"inputs": []})
                self._seen = set()
                return False
            if what[0] == "rows":
                if not self.ubatches:
                    return False
                self._want[ptr] = what
                return True
            if what[0] == "shift_rows":
                self._want[ptr] = what
                return True
            kind, il, _src = what
            key = (kind, self._swa(kind, il))
            if kind == "k_shift":
                # one shift graph per cache (base, SWA), before the ubatches' graphs
                if self.ubatches or key in self._shift_seen:
                    return False
                self._shift_seen.add(key)
            else:
                if not self.ubatches or key in self._seen:
                    return False
                self._seen.add(key)
            self._want[ptr] = what
            return True
        what = self._want.pop(ptr, None)
        if what is None:
            return True
        if what[0] in ("rows", "shift_rows"):
            pre, post = read_tensor(t.src[1].contents), read_tensor(t)
            # a K-shift graph rotates twice per layer (undo, then redo): ubatch -1, then -2
            ub = len(self.ubatches) - 1
            if what[0] == "shift_rows":
                ub = -1 - sum(1 for r in self.rows if r[2] < 0 and r[1] == what[1])
            self.rows.append((what[2], what[1], ub, pre.reshape(-1), post.reshape(-1)))
            return True
        kind, il, src = what
        swa = self._swa(kind, il)
        s = t.src[src].contents
        if kind == "pos_bucket" and s.view_src:
            s = s.view_src.contents  # build_pos_bias reshapes the input to 1-D: read the input itself
        data = read_tensor(s)
        if kind == "k_shift":
            self.shifts.append({"swa": swa, "layer": il, "data": data})
            return True
        ent: dict = {"tensor": kind, "layer": il, "swa": swa, "type": TYPE_NAMES[s.type]}
        if kind.startswith("kq_mask"):
            if data.shape[1] != 1:
                raise ValueError(f"kq mask of layer {il}: ne[2] = {data.shape[1]}, expected 1")
            ent["shape"] = list(data.shape)
            ent["mask"] = data[:, 0]
        else:
            ent["data"] = data.reshape(-1)
        self.ubatches[-1]["inputs"].append(ent)
        return True


def encode(graphs: dict) -> dict:
    """The JSON form of ``Capture.take()`` (see case.schema.json, op_decode.graph)."""
    shifts = []
    for s in graphs["shift"]:
        shifts.append({"swa": s["swa"], "layer": s["layer"], "k_shift": encode_ints(s["data"])})
    ubs = []
    for u in graphs["ubatches"]:
        ins = []
        for e in u["inputs"]:
            d = {k: e[k] for k in ("tensor", "layer", "swa", "type")}
            if e["tensor"].startswith("kq_mask"):
                d.update(encode_mask(e["mask"]))
            else:
                d["data"] = encode_ints(e["data"])
            ins.append(d)
        order = ("kq_mask", "k_idxs", "v_idxs", "pos", "pos_bucket")
        ins.sort(key=lambda d: (d["swa"], order.index(d["tensor"]) if d["tensor"] in order else len(order),
                                d["tensor"]))  # fmt: skip
        ubs.append({"inputs": ins})
    out: dict = {"ubatches": ubs}
    if shifts:
        out["shift"] = shifts
    return out
