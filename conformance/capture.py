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
DSA MLA mask           FILL of ``attn_inp_kq_mask``           src[0] (its soft-max reads the top-k mask)
DSA indexer mask       LIGHTNING_INDEXER                      src[3] (``kq_mask_lid``, f16)
DSA indexer indices    SET_ROWS of ``indexer_k-<il>`` rows    src[1] (``k_idxs_lid``)
MSA indexer row idxs   SET_ROWS into an indexer cache_k_l<il> src[1] (``k_idxs_idx``: the cache's rows are
                       (rows ``idx_width`` wide)                      ``idx_width`` wide, the base cache's are not)
MSA pos_mask           ``msa_bs-<il>`` (POOL_2D) -> its ADD       src[1] (``kq_mask_msa_pos``)
MSA pos_slot_i         the GET_ROWS that ADD's MUL_MAT reads   src[1] (``msa_pos_slot``)
MSA local bias         ADD of ``msa_bs-<il>``                  src[1] (``kq_mask_msa_bias``)
MSA cell_blk (batch)   GET_ROWS of ``msa_block_mask-<il>``     src[1] (``msa_cell_blk``)
MSA pos_slot_f         GET_ROWS of another input (decode)      src[0] (``msa_pos_slot_f``)
deepseek4 inputs       any node reading ``dsv4_<cache>_<field>``  that src (llm_graph_input_dsv4: recorded as
                                                              ``dsv4_<cache>_<field>``, the masks as
                                                              ``kq_mask_dsv4_<cache>``)
=====================  =====================================  ==========

(MSA: MiniMax-M3's llm_graph_input_msa, read through views and reshapes to the input itself.)

With ``rows=True`` (the attention-rotation cases) the K and V rows a decode stores are read too, before and
after llama.cpp's Hadamard rotation: through each ``MUL_MAT`` with the hint ``GGML_HINT_SRC0_IS_HADAMARD`` whose
src[1] is (a reshape of) ``Kcur-<il>`` / ``Vcur-<il>`` (src[1] before, the node itself after). In a K-shift graph
of a quantized K cache the same is read at both rotations of each layer: the first takes the dequantized K and
gives it unrotated (ubatch -1 in the keys), the second takes it roped and gives what is quantized back (-2). There
the ROPE reads the rotated cast of the cache: the chain to ``cache_k_l<il>`` is followed through src[1] of those
MUL_MAT nodes.

The base and the SWA mask (and the two caches' indices) carry the same names; the layer index of the
consumer tells them apart (the caller maps it with the model's SWA layers). Every graph of a model starts
with the token-embedding lookup (GET_ROWS of ``token_embd.weight``; DFlash's KV-injection graph with the MUL_MAT of
``fc.weight``), which is how the ubatches of one llama_decode are told apart; a K-shift graph has no such node and
runs before them.

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
OP_FILL = _OP_IDS.get("FILL", -1)  # the DSA attention fills a copy of the MLA KQ mask with -inf (0.3.36)
OP_LIGHTNING_INDEXER = _OP_IDS.get("LIGHTNING_INDEXER", -1)  # the fused DSA lightning indexer (0.3.36)
# the inputs of llm_graph_input_attn_k_dsa's indexer cache, recorded under their own names
LID_INPUTS = ("kq_mask_lid", "k_idxs_lid")
OP_ADD = _OP_IDS["ADD"]
OP_CONCAT = _OP_IDS.get("CONCAT", -1)
OP_EXP = _OP_IDS.get("EXP", -1)
OP_LIGHTNING_INDEXER = _OP_IDS.get("LIGHTNING_INDEXER", -1)  # glm5-next's fused k-pool indexer (2026)
OP_ADD = _OP_IDS["ADD"]
GGML_HINT_SRC0_IS_HADAMARD = 1  # ggml.h
GGML_TENSOR_FLAG_INPUT = 1  # ggml.h enum ggml_tensor_flag
_ROWS_RE = re.compile(r"^([KV])cur-(\d+)")

# ggml.h enum ggml_type: the input tensors are of these types
_DTYPES = {0: np.dtype("<f4"), 1: np.dtype("<f2"), 26: np.dtype("<i4"), 27: np.dtype("<i8")}
TYPE_NAMES = {0: "f32", 1: "f16", 26: "i32", 27: "i64"}

_CACHE_RE = re.compile(r"cache_([kv])_l(\d+)")
_IDX_CACHE_RE = re.compile(r"cache_idx_k_l(\d+)")  # llama_memory_hybrid_idx's indexer cache ("idx_" name tag)
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


def _idx_cache_of(p: Any, depth: int = 4) -> int | None:
    """The layer when tensor ``p`` is (a view of) a layer's indexer cache (llama_memory_hybrid_idx)."""
    while p and depth > 0:
        t = p.contents
        m = _IDX_CACHE_RE.search(_name(t))
        if m:
            return int(m.group(1))
        p = t.view_src if t.view_src else t.src[0]
        depth -= 1
    return None


def _idx_width(p: Any) -> tuple[int, int] | None:
    """(the view's row width, the indexer cache's row width) when ``p`` is a view of an indexer cache."""
    if not p:
        return None
    t = p.contents
    root = t
    depth = 4
    while root.view_src and depth > 0:
        root = root.view_src.contents
        depth -= 1
    if not _IDX_CACHE_RE.search(_name(root)):
        return None
    return int(t.ne[0]), int(root.ne[0])


def _named_from(p: Any, prefix: str, depth: int = 10) -> int | None:
    """The layer of the first tensor named ``<prefix>-<il>`` up the chain of views / first sources from ``p``."""
    while p and depth > 0:
        t = p.contents
        n = _name(t)
        if n.startswith(prefix + "-"):
            m = _LAYER_RE.search(n)
            return int(m.group(1)) if m else -1
        p = t.view_src if t.view_src else t.src[0]
        depth -= 1
    return None


def _is_input(p: Any) -> bool:
    return bool(p) and bool(p.contents.flags & GGML_TENSOR_FLAG_INPUT)


def _root(p: Any) -> Any:
    """The tensor a (chain of) view(s) / reshape(s) ``p`` looks at."""
    while p and p.contents.view_src:
        p = p.contents.view_src
    return p


def _through_views(p: Any, op: int, depth: int = 4) -> Any:
    """Follow views and reshapes from ``p`` (through their source) to the first tensor of ``op``, or None."""
    while p and depth > 0:
        if p.contents.op == op:
            return p
        p = p.contents.view_src if p.contents.view_src else None
        depth -= 1
    return None


def _is_input(p: Any) -> bool:
    return bool(p) and bool(p.contents.flags & GGML_TENSOR_FLAG_INPUT)


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

    def __init__(self, swa_layer: Any, rows: bool = False, idx_width: int = 0, kpool: bool = False) -> None:
        self.swa_layer = swa_layer
        # llama_memory_hybrid_idx: its lightning indexer reads the k-pool mask (a DSA indexer reads kq_mask_lid)
        self.kpool = kpool
        # MSA (minimax-m3): the indexer key cache's row width; its SET_ROWS indices are k_idxs_idx
        self.idx_width = idx_width
        self._msa_pos_mask: int | None = None  # the address of this ubatch's pos_mask input (once seen)
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
        if op == OP_MUL_MAT and t.src[0] and _name(t.src[0].contents) == "fc.weight":
            return ("graph",)  # DFlash's KV-injection graph starts with its feature fusion (no token embedding)
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
        if op == OP_SOFT_MAX and _name(t).startswith("kq_soft_max_gathered") and _is_input(t.src[1]):
            m = _LAYER_RE.search(_name(t))
            return ("kq_mask_kpool_gather", int(m.group(1)) if m else -1, 1)  # glm5-next's gathered selection
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
        # qwen4exp's QSA inputs (llama_memory_hybrid_idx::set_input_qsa), glm5-next's k-pool inputs (set_input_kpool)
        # and the indexer cache's row indices
        if op == OP_SET_ROWS:
            il = _idx_cache_of(t.src[2]) if t.src[2] else None
            il = il if il is not None else (_idx_cache_of(t.view_src) if t.view_src else None)
            if il is not None:
                # the whole row (key | gate | pooled): cpy_k; the pooled third alone: the new pooled keys' rows
                w = _idx_width(t.src[2]) if t.src[2] else None
                return ("k_idxs_idx" if w is None or w[0] == w[1] else "kpool_new_pool_rep", il, 1)
        if op == OP_GET_ROWS and t.src[0] and t.src[1]:
            il = _idx_cache_of(t.src[0])
            if il is not None:
                w = _idx_width(t.src[0])
                if w is not None and 3 * w[0] == w[1]:
                    return ("kpool_pool_cells", il, 1)  # the pooled thirds of the pools' rows
                if w is not None and 3 * w[0] == 2 * w[1]:
                    return ("kpool_new_pool_idxs", il, 1)  # key | gate of the new pools' members
                return ("qsa_blk_cells", il, 1)
            if _is_input(t.src[0]) and t.src[0].contents.type == 26:
                m = _LAYER_RE.search(_name(t.src[1].contents))
                return ("kpool_pool_idxs", int(m.group(1)) if m else -1, 0)  # the selected pools' member cells
        if op == OP_LIGHTNING_INDEXER and self.kpool and t.src[3] and _is_input(t.src[3]):
            m = _LAYER_RE.search(_name(t))
            return ("kq_mask_kpool_pool", int(m.group(1)) if m else -1, 3)
        if op == OP_ADD and self.kpool and _name(t).startswith("indexer_score-") and _is_input(t.src[1]):
            m = _LAYER_RE.search(_name(t))
            return ("kq_mask_kpool_pool", int(m.group(1)) if m else -1, 1)  # the unfused k-pool score
        if op == OP_CONCAT and _is_input(t.src[1]) and t.src[1].contents.type == 26:
            m = _LAYER_RE.search(_name(t))
            return ("kpool_tail_idxs", int(m.group(1)) if m else -1, 1)
        if op == OP_EXP and t.src[0] and _is_input(t.src[0].contents.view_src):
            return ("kq_mask_kpool_gather", -1, 0)  # the scatter path reads the gather mask's live slots
        if op == OP_ADD and _name(t).startswith("indexer_sel-") and t.src[1]:
            m = _LAYER_RE.search(_name(t))
            return ("kq_mask", int(m.group(1)) if m else -1, 1)  # the k-pool selection plus the KQ mask
            il = _named_from(t.src[0], "indexer_score")
            if il is not None:
                return ("qsa_cell_blk", il, 1)
        if op == OP_ROPE and t.src[1]:
            il = _named_from(t.src[0], "indexer_k_pooled")
            if il is not None:
                return ("qsa_blk_pos", il, 1)
        if op == OP_ADD and _is_input(t.src[1]) and t.src[1].contents.type == 0:
            il = _named_from(t.src[0], "indexer_score")
            if il is not None:
                return ("kq_mask_qsa_bias", il, 1)
        if op == OP_ADD and t.src[1] and _is_input(t.src[1].contents.view_src):
            # the QSA scores plus a view of the KQ mask: read the mask here, before the attention's top-k unmasking
            # (an ADD that ggml-alloc may compute in place over the mask) reaches it
            il = _named_from(t.src[0], "indexer_score")
            if il is not None:
                return ("kq_mask", il, 1)
        if op == OP_SET_ROWS:
            c = _cache_of(t.src[2]) or _cache_of(t.view_src)
            if c is None:
                return None
            # the DSA indexer cache's tensors carry the MLA cache's names: its rows are the indexer keys
            if t.src[0] and _name(t.src[0].contents).startswith("indexer_k"):
                return ("k_idxs_lid", c[1], 1)
            if self.idx_width and c[0] == "k" and int(_root(t.view_src).contents.ne[0]) == self.idx_width:
                return ("k_idxs_idx", c[1], 1)
            return (f"{c[0]}_idxs", c[1], 1)
        if op == OP_LIGHTNING_INDEXER and t.src[3]:
            # ggml_lightning_indexer(q, k = the indexer cache's K, weights, mask): the indexer KQ mask (f16)
            c = _cache_of(t.src[1])
            return ("kq_mask_lid", -1 if c is None else c[1], 3)
        if op == OP_FILL and t.src[0] and _name(t.src[0].contents) == "attn_inp_kq_mask":
            # the DSA attention (build_attn of llm_graph_input_attn_k_dsa) reads the MLA mask here first (its
            # soft-max / flash attention gets the mask with the top-k keys unmasked); the layer is not named
            return ("kq_mask", -1, 0)
        if self.idx_width:
            msa = self._classify_msa(t)
            if msa is not None:
                return msa
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

    def _classify_msa(self, t: Any) -> tuple | None:
        """MiniMax-M3's llm_graph_input_msa inputs (see the module docstring): ("msa", layer, [(name, input), ...])."""
        name = _name(t)
        m = _LAYER_RE.search(name)
        if name.startswith("msa_bs-") and t.src[0]:
            sc = t.src[0].contents  # the block pooling reads the scores plus pos_mask
            out = []
            if sc.op == OP_ADD and _is_input(_root(sc.src[1])):
                out.append(("kq_mask_msa_pos", _root(sc.src[1])))
            mm = _through_views(sc.src[0], OP_MUL_MAT)
            gr = _through_views(mm.contents.src[0], OP_GET_ROWS) if mm else None
            if gr and _is_input(_root(gr.contents.src[1])):
                out.append(("msa_pos_slot", _root(gr.contents.src[1])))
            return ("msa", int(m.group(1)) if m else -1, out) if out else None
        bias = t.op == OP_ADD and t.src[0] and _name(t.src[0].contents).startswith("msa_bs-")
        if bias and _is_input(_root(t.src[1])):
            il = _LAYER_RE.search(_name(t.src[0].contents))
            return ("msa", int(il.group(1)) if il else -1, [("kq_mask_msa_bias", _root(t.src[1]))])
        if t.op == OP_GET_ROWS and t.src[0] and t.src[1]:
            if "msa_block_mask" in _name(t.src[0].contents) and _is_input(_root(t.src[1])):
                return ("msa", -1, [("msa_cell_blk", _root(t.src[1]))])
            src = _root(t.src[0])
            if (
                _is_input(src)
                and src.contents.type == 0
                and self._msa_pos_mask is not None
                and ctypes.addressof(src.contents) != self._msa_pos_mask
            ):
                return ("msa", -1, [("msa_pos_slot_f", src)])
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
                self._msa_pos_mask = None
                return False
            if what[0] == "msa":
                if not self.ubatches:
                    return False
                todo = [(name, leaf) for name, leaf in what[2] if (name, False) not in self._seen]
                if not todo:
                    return False
                for name, leaf in todo:
                    self._seen.add((name, False))
                    if name == "kq_mask_msa_pos":
                        self._msa_pos_mask = ctypes.addressof(leaf.contents)
                self._want[ptr] = ("msa", what[1], todo)
                return True
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
        if what[0] == "msa":
            for name, leaf in what[2]:
                lt = leaf.contents
                data = read_tensor(lt)
                ent: dict = {"tensor": name, "layer": what[1], "swa": False, "type": TYPE_NAMES[lt.type]}
                if name.startswith("kq_mask"):
                    ent["shape"] = [int(data.shape[0]), int(data.shape[2]), int(data.shape[3])]
                    ent["mask"] = data[:, 0]
                else:
                    ent["data"] = data.reshape(-1)
                self.ubatches[-1]["inputs"].append(ent)
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
        if not s.flags & GGML_TENSOR_FLAG_INPUT and _is_input(s.view_src):
            s = s.view_src.contents  # a reshape of the input (qwen4exp's QSA KQ mask, glm5-next's k-pool inputs)
        data = read_tensor(s)
        if kind == "k_shift":
            self.shifts.append({"swa": swa, "layer": il, "data": data})
            return True
        ent: dict = {"tensor": kind, "layer": il, "swa": swa, "type": TYPE_NAMES[s.type]}
        if kind == "kq_mask_qsa_bias":
            # F32 [n_blocks or n_kv, n_tps, n_stream]: (n_stream, n_tps, n) like a KQ mask
            ent["shape"] = list(data.shape[1:])
            ent["mask"] = data[0]
        elif kind in ("kq_mask_kpool_pool", "kq_mask_kpool_gather"):
            # [n_pool, n_tokens] / [n_sel, 1, 1, n_tokens]: (1, n_tokens, n)
            mask = data.reshape(1, -1, data.shape[-1]) if kind.endswith("pool") else data.reshape(1, data.shape[0], -1)
            ent["shape"] = list(mask.shape)
            ent["mask"] = mask
        elif kind.startswith("kq_mask"):
            if data.shape[1] != 1:
                raise ValueError(f"kq mask of layer {il}: ne[2] = {data.shape[1]}, expected 1")
            ent["shape"] = list(data.shape)
            ent["mask"] = data[:, 0]
        else:
            ent["data"] = data.reshape(-1)
        self.ubatches[-1]["inputs"].append(ent)
        return True


_INPUT_ORDER = ("kq_mask", "k_idxs", "v_idxs", "pos", "pos_bucket", *LID_INPUTS)


def _input_rank(d: dict) -> tuple:
    """The order of a ubatch's inputs in case.json: base before SWA, the common inputs, then others by name."""
    t = d["tensor"]
    return (d["swa"], _INPUT_ORDER.index(t) if t in _INPUT_ORDER else len(_INPUT_ORDER), t)


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
        ins.sort(key=_input_rank)
        ubs.append({"inputs": ins})
    out: dict = {"ubatches": ubs}
    if shifts:
        out["shift"] = shifts
    return out
