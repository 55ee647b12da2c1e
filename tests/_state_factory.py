"""Hand-built state objects for the kvref.state tests: every layout and variant, small and deterministic."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from kvref.ggml.types import GGMLType, row_size
from kvref.state import (
    Cells,
    KVData,
    KVSection,
    KVStream,
    LayerRows,
    MemorySections,
    Outputs,
    RecurrentLayer,
    RecurrentSection,
    SeqFile,
    SeqStateBlob,
    SessionFile,
    StateBlob,
    TransposedRows,
)
from kvref.state import dsv4 as D
from kvref.state.constants import LAYOUTS

N_EMBD = 64  # elements per K/V row: two q8_0/q4_0 blocks, 128 f16 bytes


def rows(rng: np.random.Generator, n: int, nbytes: int) -> np.ndarray:
    return rng.integers(0, 256, (n, nbytes), dtype=np.uint8)


def cells(rng: np.random.Generator, n: int, ext_size: int, seq_mode: bool, recurrent: bool = False) -> Cells:
    pos = np.sort(rng.choice(1000, n, replace=False)).astype(np.int32)
    if recurrent and seq_mode:
        seqs: list[list[int]] = [[] for _ in range(n)]  # recurrent sequence saves write n_seq_id = 0
    elif seq_mode:
        seqs = [[3]] * n
    else:
        seqs = [sorted(rng.choice(8, int(rng.integers(1, 4)), replace=False).tolist()) for _ in range(n)]
    ext = rng.integers(-5, 50, (n, ext_size // 4)).astype(np.int32) if ext_size else None
    return Cells.from_lists(pos, seqs, ext=ext, ext_size=ext_size)


def kv_section(
    rng: np.random.Generator,
    *,
    n_stream: int = 2,
    n_layer: int = 3,
    ext_size: int = 0,
    v_trans: int = 0,
    has_v: bool = True,
    n_stream_field: bool = True,
    seq_mode: bool = False,
    k_type: GGMLType = GGMLType.F16,
) -> KVSection:
    streams = []
    for s in range(n_stream if n_stream_field else 1):
        n = 0 if s == 1 else int(rng.integers(1, 6))  # stream 1 stays empty: exercises cell_count == 0
        if n == 0:
            streams.append(KVStream(None, None))
            continue
        krs = row_size(k_type, N_EMBD)
        k = [LayerRows(int(k_type), krs, rows(rng, n, krs)) for _ in range(n_layer)]
        v: list[Any] = []
        if has_v:
            if v_trans:
                v = [TransposedRows(int(GGMLType.F16), 2, N_EMBD, rows(rng, N_EMBD, n * 2)) for _ in range(n_layer)]
            else:
                v = [LayerRows(int(GGMLType.F16), N_EMBD * 2, rows(rng, n, N_EMBD * 2)) for _ in range(n_layer)]
        streams.append(KVStream(cells(rng, n, ext_size, seq_mode), KVData(v_trans, k, v)))
    return KVSection(streams, has_n_stream=n_stream_field)


def recurrent_section(
    rng: np.random.Generator,
    *,
    n_layer: int = 4,
    n_state: int = 4,
    s_trans: int = 0,
    ple: bool = False,
    seq_mode: bool = False,
    n: int | None = None,
) -> RecurrentSection:
    n = int(rng.integers(0, 4)) if n is None else n
    r = []
    for _ in range(n_state):
        layer = RecurrentLayer(int(GGMLType.F32), 24, rows(rng, n, 24))
        if ple:
            layer.p_row_size, layer.p_data = 8, rows(rng, n, 8)
        r.append(layer)
    if s_trans:
        s: list[Any] = [TransposedRows(int(GGMLType.F32), 4, 6, rows(rng, 6, n * 4)) for _ in range(n_state)]
    else:
        s = [LayerRows(int(GGMLType.F32), 40, rows(rng, n, 40)) for _ in range(n_state)]
    return RecurrentSection(cells(rng, n, 0, seq_mode, recurrent=True), s_trans, n_layer, r, s)


def dsv4_section(rng: np.random.Generator, seq_mode: bool = False, partial: bool = False) -> D.DSV4Section:
    """A llama_kv_cache_dsv4 section: K-only raw iSWA sections, then (unless partial) 3 compressed K caches, then 3
    compressor states."""
    ns = 1 if seq_mode else 2
    raw = [kv_section(rng, n_stream=ns, has_v=False, seq_mode=seq_mode) for _ in range(1 if partial else 2)]

    def block(t: int, ne0: int, n: int, rsize: int) -> D.TensorStreams:
        return D.TensorStreams(t, ne0, n, rsize, rng.integers(0, 256, (ns, n * rsize), dtype=np.uint8))

    ks = [] if partial else [D.KCacheSection(name, 2, 3, ns, [(1, block(1, 8, 3, 16))]) for name, _ in D.COMP_PARTS]
    ss = [D.CompStateSection(name, 1, r, 2, 4, ns, [(1, block(0, 4, 2, 16), block(0, 4, 2, 16))])
          for name, r in D.COMP_PARTS]  # fmt: skip
    return D.DSV4Section(D.DSV4Header(mode=int(partial)), raw, ks, ss)


def memory(rng: np.random.Generator, layout: str, seq_mode: bool = False, **kw: Any) -> MemorySections:
    kv_kw = {k: kw[k] for k in ("ext_size", "v_trans", "has_v", "n_stream_field", "k_type") if k in kw}
    rec_kw = {k: kw[k] for k in ("s_trans", "ple") if k in kw}
    hybrid = "recurrent" in LAYOUTS[layout] and "kv" in LAYOUTS[layout]
    sections: list[Any] = []
    for i, kind in enumerate(LAYOUTS[layout]):
        if kind == "dsv4":
            sections.append(dsv4_section(rng, seq_mode, bool(kw.get("partial"))))
        elif kind == "kv" and layout == "hybrid_idx" and i == 2:
            # llama_memory_hybrid_idx's indexer cache: no V, a cell ext only with PLE (its hparams have no RoPE)
            idx_kw = dict(kv_kw, has_v=False, ext_size=kv_kw.get("ext_size", 0) if rec_kw.get("ple") else 0)
            sections.append(kv_section(rng, seq_mode=seq_mode, **idx_kw))
        elif kind == "kv":
            sections.append(kv_section(rng, seq_mode=seq_mode, **kv_kw))
        else:
            sections.append(recurrent_section(rng, n_state=2 if hybrid else 4, seq_mode=seq_mode, **rec_kw))
    return MemorySections(layout, sections)


def make(kind: str, layout: str, seed: int = 0, *, version: int | None = None, outputs: bool = False, **kw: Any) -> Any:
    rng = np.random.default_rng(seed)
    seq_mode = kind in ("seq", "seq_state")
    mem = memory(rng, layout, seq_mode, **kw)
    tokens = rng.integers(0, 32000, int(rng.integers(0, 20))).astype(np.int32)
    outs = None
    if outputs:
        n_out = int(rng.integers(0, 4))
        outs = Outputs(
            np.arange(n_out, dtype=np.int32),
            rng.random(n_out * 5).astype(np.float32),
            rng.random(n_out * 3).astype(np.float32),
        )
    if kind == "session":
        return SessionFile(
            version or (9 if outputs or not kw.get("n_stream_field", True) else 10), tokens, "llama", outs, mem
        )
    if kind == "seq":
        return SeqFile(version or 3, tokens, mem)
    if kind == "state":
        return StateBlob("llama", outs, mem)
    header = kw.get("seq_header", True)
    return SeqStateBlob(mem, seq_id=3 if header else None, has_header=header)


def load_options(kind: str, layout: str, *, outputs: bool = False, **kw: Any) -> dict[str, Any]:
    """The explicit load() options that describe an object built by `make`."""
    opts: dict[str, Any] = {
        "kind": kind,
        "layout": layout,
        "ext_size": kw.get("ext_size", 0),
        "n_stream_field": kw.get("n_stream_field", True),
        "has_v": kw.get("has_v", layout != "dsv4"),  # a DSV4 raw cache is K-only
        "ple": kw.get("ple", False),
    }
    if kind in ("session", "state"):
        opts["outputs"] = outputs
    if kind == "seq_state":
        opts["seq_header"] = kw.get("seq_header", True)
    hybrid = "recurrent" in LAYOUTS[layout] and "kv" in LAYOUTS[layout]
    if "recurrent" in LAYOUTS[layout]:
        opts["n_state_layers"] = 2 if hybrid else 4
    return opts


KINDS = ("session", "seq", "state", "seq_state")
ALL_LAYOUTS = tuple(LAYOUTS)

# (kind, layout, variant options) covering every layout and every variant at least once
CASES: list[tuple[str, str, dict[str, Any]]] = [
    (kind, layout, {}) for kind, layout in itertools.product(KINDS, ALL_LAYOUTS)
] + [
    ("session", "kv", {"ext_size": 12}),
    ("session", "kv", {"ext_size": 8, "outputs": True}),
    ("session", "kv", {"v_trans": 1}),
    ("session", "kv", {"v_trans": 1, "ext_size": 12}),
    ("session", "kv", {"has_v": False, "k_type": GGMLType.Q8_0}),
    ("session", "kv", {"k_type": GGMLType.Q4_0}),
    ("session", "kv", {"n_stream_field": False, "outputs": True}),
    ("session", "iswa", {"outputs": True}),
    ("seq_state", "dsv4", {"partial": True}),
    ("seq", "kv", {"n_stream_field": False, "version": 2}),
    ("seq", "iswa", {"ext_size": 8, "version": 2}),
    ("state", "recurrent", {"s_trans": 1}),
    ("state", "recurrent", {"ple": True}),
    ("state", "hybrid", {"ple": True, "v_trans": 1}),
    ("seq_state", "kv", {"seq_header": False}),
    ("seq_state", "hybrid", {"seq_header": False}),
]
