"""The conformance runner: kvref against the goldens a real llama.cpp wrote (``kvref conformance``).

For every ``<root>/golden/<case-id>/`` the runner makes these checks:

``parse``    every artefact reads with ``kvref.state.load`` (told its kind, layout and cell ext by the case's
             trace) and writes back byte for byte;
``replay``   the trace runs on a kvref memory built from the case's hyper-parameters and context (when the
             model GGUF is committed, ``HParams.from_gguf`` must agree with the recorded hyper-parameters):
             every return value (init, decode 0 / 1 / -1, seq_rm) and every ``seq_pos_min`` / ``seq_pos_max``
             observation must match; at every save point the cell tables kvref would write (per section, per
             stream: cell order, positions, sequence ids, ext) must match the golden's, then the golden's K/V
             (or R/S) rows are copied into the replayed memory at the cells it writes and its
             ``state_write`` must equal the golden memory bytes exactly; restores feed the golden's memory
             bytes to ``state_read``; an op llama.cpp died in (``"ret": "aborts"``) must raise a kvref error that
             stands for no return value and change nothing, and where kvref refuses an op that leaves llama.cpp's
             cells contradicting themselves (``CorruptionError``) nothing is compared until llama.cpp's memory is
             reset;
``graph``    the trace runs again; at every decode that carries the graph inputs llama.cpp computed with
             (``op["graph"]``, captured by conformance/capture.py), kvref's K-shift input (before the decode),
             KQ masks (base and SWA), K/V row indices and positions (after each ubatch is placed) must equal
             them element for element (a legacy producer's padded mask rows: all -inf, `KQ_MASK_PAD`); cases
             without captures pass as not applicable;
``restore``  every golden loads into a fresh memory (whole, or per sequence into its own and into another
             sequence) and writes back identically (relabelled for another sequence);
``invalid``  (one extra pseudo-case ``invalid``) every file of ``invalid/manifest.json`` raises its error class
             naming its field; faults only a model-aware reader can see (``needs_hparams``) are fed to a
             memory built like the source case's.

Expected failures live in ``<root>/expected_failures.json`` (``{"cases": [{"id", "checks", "reason"}]}``): a
listed check must fail (an unexpected pass is a failure), an unlisted one must pass. A check kvref cannot
run (a memory kind it does not model) is reported as ``unsupported`` and counts as not passing.

Where the goldens are found (``find_root``): ``--root``, else ``./conformance`` when it holds ``golden/``,
else the ``conformance/`` directory of the source checkout kvref was imported from. An installed wheel does
not ship the goldens: run from a checkout, or pass ``--root``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict, cast

import numpy as np
import numpy.typing as npt

from ..about import about, about_line
from ..errors import BatchError, CheckFailed, CompatWarning, CorruptionError, KVRefError, NoSlotError, Unsupported
from ..profile import Profile

if TYPE_CHECKING:
    from ..hparams import HParams, HParamsArgs
    from ..memory.base import MemoryPart
    from ..memory.batch import UBatch
    from ..memory.hybrid import HybridSlot
    from ..memory.kv_cache import KVCache
    from ..memory.kv_cache_iswa import ISWASlot
    from ..memory.slots import SlotInfo
    from ..state import (
        Cells,
        KVSection,
        LayerRows,
        RecurrentSection,
        SeqFile,
        SessionFile,
        StateObject,
        TransposedRows,
    )
    from ._types import AnyMemory, AnySlot, LeafMemory
    from .case_schema import (
        Case,
        CaseResultJSON,
        ConformanceJSON,
        ExpectedFailures,
        Graph,
        GraphInput,
        Ints,
        InvalidEntry,
        InvalidManifest,
        Observed,
        ObservedContext,
        Producer,
        SSMParams,
        TraceOp,
    )

    AnySection = KVSection | RecurrentSection
    # kvref's value of each graph input llama.cpp captured, by (tensor, swa), or why kvref cannot compute it
    GraphValues = dict[tuple[str, bool], npt.NDArray[np.generic[object]] | KVRefError]
    # the ubatches of one decode as they were placed: (ubatch, slot; None for llama_encode, its graph inputs)
    Placed = list[tuple[UBatch, AnySlot | None, GraphValues]]

CHECKS = ("parse", "replay", "graph", "restore")
# The operations of a trace (case.json's ``trace``, case.schema.json): the one vocabulary conformance/driver.py
# records (Run.apply performs any of them in llama.cpp), conformance/fuzz.py plans in, and replay_trace
# interprets on kvref. ``init`` is op 0 only: the context (kvref: create_memory).
TRACE_OPS = ("init", "decode", "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear", "save", "state_load",
             "seq_restore", "set_causal", "encode", "seq_pos_min", "seq_pos_max")  # fmt: skip
# the ``ret`` of an op that kills llama.cpp (GGML_ASSERT, SIGFPE, an uncaught exception): recorded with ``abort``
# (what the dead process showed) and the memory as it was before the call; kvref must raise a KVRefError there and
# change nothing
ABORTS = "aborts"
# what kvref's side of an op gives where llama.cpp goes on with its cells contradicting themselves (a cell at position
# -1: kvref.errors.CorruptionError): the replay cannot compare with llama.cpp again until its memory is reset
CORRUPTS = "corrupts"
INVALID_CASE = "invalid"
PARTIAL_ONLY = 1
_KIND = {"session": "session", "seq": "seq", "state_data": "state", "seq_data": "seq_state"}


@dataclass
class CheckResult:
    name: str
    status: str  # "pass", "fail", "unsupported"
    detail: str = ""
    expected_failure: str | None = None  # the manifest's reason when this check is listed

    @property
    def ok(self) -> bool:
        """The outcome is what the manifest expects."""
        passed = self.status == "pass"
        return passed if self.expected_failure is None else not passed


@dataclass
class CaseResult:
    case: str
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def status(self) -> str:
        if not self.ok:
            bad = [c for c in self.checks if not c.ok]
            return "XPASS" if all(c.expected_failure is not None for c in bad) else "FAIL"
        return "xfail" if any(c.expected_failure is not None for c in self.checks) else "pass"

    def first_problem(self) -> str:
        for c in self.checks:
            if not c.ok:
                if c.expected_failure is not None:
                    return f"{c.name}: unexpectedly passed (listed as expected failure: {c.expected_failure})"
                return f"{c.name}: {c.detail}"
        for c in self.checks:
            if c.expected_failure is not None:
                return f"{c.name} (expected): {c.detail}"
        return ""


# ---------------------------------------------------------------------------------------------- locating
def find_root(root: str | Path | None = None) -> Path:
    """The conformance directory: ``root``, else ./conformance, else the source checkout's conformance/, else the
    goldens installed with the package (``kvref/conformance_data``)."""
    if root is not None:
        p = Path(root)
        if not (p / "golden").is_dir():
            raise KVRefError(f"{p} has no golden/ directory")
        return p
    package = Path(__file__).resolve().parent.parent  # kvref/: a checkout's conformance/ stands beside it
    for p in (Path.cwd() / "conformance", package.parent / "conformance", package / "conformance_data"):
        if (p / "golden").is_dir():
            return p
    raise KVRefError(
        "no conformance/golden directory found: this kvref was installed without its goldens; "
        "run from a kvref checkout or pass --root"
    )


def list_cases(root: Path) -> list[str]:
    return sorted(p.parent.name for p in (root / "golden").glob("*/case.json"))


def load_case(root: Path, case_id: str) -> Case:
    case: Case = json.loads((root / "golden" / case_id / "case.json").read_text())
    return case


def load_expected_failures(root: Path) -> dict[str, dict[str, str]]:
    """``{case id: {check: reason}}`` from expected_failures.json (empty when there is none)."""
    p = root / "expected_failures.json"
    if not p.exists():
        return {}
    out: dict[str, dict[str, str]] = {}
    doc: ExpectedFailures = json.loads(p.read_text())
    for e in doc.get("cases", []):
        for c in e["checks"]:
            out.setdefault(e["id"], {})[c] = e["reason"]
    return out


# ---------------------------------------------------------------------------------------------- model + memory
def hparams_from_case(case: Case) -> HParams:
    """kvref.HParams from a case's recorded ``model.hparams``."""
    from ..hparams import HParams, RopeType, SWAType

    h = case["model"]["hparams"]
    ssm: SSMParams = h.get("ssm") or {}
    kw: HParamsArgs = dict(
        arch=h["arch"], n_layer=h["n_layer"], n_embd=h["n_embd"], n_head=h["n_head"], n_head_kv=h["n_head_kv"],
        n_embd_head_k=h["n_embd_head_k"], n_embd_head_v=h["n_embd_head_v"], swa_layers=h["swa_layers"],
        recurrent_layers=h["recurrent_layers"], n_swa=h["n_swa"], swa_type=SWAType[h["swa_type"].upper()],
        rope_type=RopeType[h["rope_type"].upper()], n_ctx_train=h["n_ctx_train"], n_ff=h.get("n_ff", 0),
        causal_attn=h.get("causal_attn", True), n_vocab=h.get("n_vocab", 0),
        rope_freq_base=h.get("rope_freq_base", 10000.0), rope_freq_scale=h.get("rope_freq_scale", 1.0),
        ssm_d_conv=ssm.get("d_conv", 0), ssm_d_inner=ssm.get("d_inner", 0), ssm_d_state=ssm.get("d_state", 0),
        ssm_n_group=ssm.get("n_group", 0), ssm_dt_rank=ssm.get("dt_rank", 0),
    )  # fmt: skip
    if h.get("n_rot"):
        kw["n_rot"] = h["n_rot"]
    # what decides the recurrent row widths of RWKV and LFM2, and the SWA layers' rope base
    # (and what set_causal false, ALiBi and T5's position buckets do to the graph inputs)
    for name in ("wkv_head_size", "token_shift_count", "n_shortconv_l_cache", "rope_freq_base_swa",
                 "non_causal_type", "f_max_alibi_bias", "n_rel_attn_bkts", "n_layer_kv_from_start",
                 # MLA and the indexer caches (DSA, llama_memory_hybrid_idx: glm5-next's k-pool, qwen4exp's QSA;
                 # minimax-m3's MSA; deepseek4's compressed caches)
                 "n_layer_nextn", "n_embd_head_k_swa", "n_embd_head_v_swa", "n_embd_head_k_mla", "n_embd_head_v_mla",
                 "n_lora_kv", "indexer_head_size", "indexer_top_k", "indexer_kpool", "indexer_kpool_select_tail",
                 "n_embd_head_kda", "n_layer_dense_lead", "indexer_block_size", "indexer_local_blocks",
                 "dsv4_hc_mult"):  # fmt: skip
        if h.get(name) is not None:
            kw[name] = h[name]
    if h.get("indexer_full_layers") is not None:
        kw["indexer_full_layers"] = tuple(h["indexer_full_layers"])
    if h.get("dsv4_compress_ratios") is not None:
        kw["dsv4_compress_ratios"] = tuple(h["dsv4_compress_ratios"])
    sections = h.get("rope_sections")
    if sections:
        kw["rope_sections"] = tuple(sections)
    return HParams(**kw)


def _hp_facts(hp: HParams) -> dict[str, object]:
    """What decides the memory layout, per layer."""
    n = hp.n_layer
    facts: dict[str, object] = {
        "n_layer": n,
        "n_pos_per_embd": hp.n_pos_per_embd(),
        "n_swa": hp.n_swa if hp.is_swa_any() else 0,
        "swa_type": int(hp.swa_type) if hp.is_swa_any() else 0,
        "n_embd_k_gqa": [hp.n_embd_k_gqa(il) for il in range(n)],
        "n_embd_v_gqa": [hp.n_embd_v_gqa(il) for il in range(n)],
        "is_swa": [hp.is_swa(il) for il in range(n)],
        "has_kv": [hp.has_kv(il) for il in range(n)],
        "rope_type": int(hp.rope_type),
        "rope_freq_base": hp.rope_freq_base,
        # what the KQ mask holds (ALiBi distances) and what set_causal false means for a windowed model
        "use_alibi": hp.use_alibi,
        "non_causal_type": int(hp.non_causal_type),
        "n_rel_attn_bkts": hp.n_rel_attn_bkts,
        "n_rot": [hp.n_rot_l(il) for il in range(n)] if hp.rope_type >= 0 else None,
    }
    if hp.is_swa_any():
        # K-shift rotates SWA layers with their own base (the full-attention base when the file has none)
        facts["rope_freq_base_swa"] = hp.rope_freq_base if hp.rope_freq_base_swa is None else hp.rope_freq_base_swa
    facts["n_embd_r"] = hp.n_embd_r()
    facts["n_embd_s"] = hp.n_embd_s()
    return facts


def check_hparams(root: Path, case: Case, hp: HParams) -> None:
    """When the case's GGUF is committed, HParams.from_gguf must agree with the recorded hyper-parameters."""
    from ..hparams import HParams

    m = case["model"]
    rel = m.get("path")
    path = root / rel if rel else None
    if not m.get("committed") or path is None or not path.exists():
        return
    a, b = _hp_facts(HParams.from_gguf(path)), _hp_facts(hp)
    for k in a:
        if a[k] != b.get(k):
            raise CheckFailed(f"HParams.from_gguf({m['file']}).{k} = {a[k]}, case.json says {b.get(k)}")


def compat_for(case: Case) -> Profile:
    """The kvref.profile.Profile of the llama.cpp that produced the case (from its producer's
    llama-cpp-python version; the default when the case does not say)."""
    from ..compat import for_llama_cpp_python

    with warnings.catch_warnings():  # the goldens are what checks a producer older than the releases read
        warnings.simplefilter("ignore", CompatWarning)
        producer = case.get("producer")
        return for_llama_cpp_python(producer.get("llama_cpp_python") if producer else None)


def other_case(case: Case) -> Case:
    """The case as seen from its ctx_other context (case.json's ``other``: a draft context's target): its model,
    context, observations and memory in the places a case has them (the trace stays the case's)."""
    other = case["other"]
    out: dict[str, object] = {k: v for k, v in case.items() if k != "other"}
    out.update(model=other["model"], context=other["context"], observed_context=other["observed_context"],
               observed_model=other["observed_model"], memory=other["memory"])  # fmt: skip
    return cast("Case", out)


def create_memory_for(case: Case, hp: HParams) -> AnyMemory | None:
    """The memory create_memory builds for the case's context, reproducing its producer's llama.cpp (with the memory of
    its ctx_other context first, when the case has one: case.json's ``other``)."""
    from ..memory.factory import create_memory

    mem_other = None
    if "other" in case:
        oc = other_case(case)
        mem_other = create_memory_for(oc, hparams_from_case(oc))
    c = case["context"]
    mem = create_memory(
        hp, n_ctx=c["n_ctx"], n_seq_max=c["n_seq_max"], kv_unified=c["kv_unified"], flash_attn=c["flash_attn"],
        type_k=c["type_k"], type_v=c["type_v"], swa_full=c.get("swa_full", False), n_ubatch=c["n_ubatch"],
        n_batch=c["n_batch"], n_rs_seq=c.get("n_rs_seq", 0), compat=compat_for(case),
        ctx_type=c.get("ctx_type", "default"), mem_other=mem_other,
    )  # fmt: skip
    return cast("AnyMemory | None", mem)  # create_memory builds one of them


def check_memory_shape(case: Case, mem: AnyMemory) -> None:
    """The memory kvref built has the kind and sizes llama.cpp logged."""
    want = case["memory"]
    kind = {"KVCache": "kv", "KVCacheISWA": "iswa", "RecurrentMemory": "recurrent", "HybridMemory": "hybrid",
            "KVCacheDSA": "dsa", "KVCacheDSAISWA": "dsa_iswa", "HybridIdxMemory": "hybrid_idx", "KVCacheMSA": "msa",
            "KVCacheISWAShared": "iswa", "KVCacheDSV4": "dsv4"}  # fmt: skip
    got = kind.get(type(mem).__name__, type(mem).__name__)
    if got == "hybrid":
        got = getattr(mem, "kind", got)  # "hybrid" or "hybrid_iswa"
    if got != want["type"]:
        raise CheckFailed(f"kvref built a {got} memory, llama.cpp a {want['type']} one")
    leaves = leaf_parts(mem, 0)
    if not leaves:  # a memory whose state is empty (over another context's cells): its caches still have a shape
        leaves = list(getattr(mem, "parts", []))
    kv = [cast("KVCache", leaf) for leaf in leaves if type(leaf).__name__ in ("KVCache", "SharedKVCache")]
    if got == "dsv4":  # llama_kv_cache_dsv4 builds its raw iSWA caches, then the CSA, HCA and indexer caches
        kv = [cast("KVCache", c) for c in (*leaf_parts(mem.raw, 0), *mem.comp_caches)]  # type: ignore[union-attr]
    for cache in kv:
        if cache.n_stream != want["n_stream"]:
            raise CheckFailed(f"n_stream {cache.n_stream}, llama.cpp {want['n_stream']}")
        if want.get("v_trans") is not None and cache.v_trans != want["v_trans"]:
            raise CheckFailed(f"v_trans {cache.v_trans}, llama.cpp {want['v_trans']}")
    # llama.cpp's attention rotation flags, as its KV caches logged them (0.3.36 goldens recorded since the rotation
    # cases; older ones carry no such key), in construction order: base before SWA
    observed = case.get("observed_context")
    caches = observed.get("memory_log", {}).get("caches", []) if observed else []
    logged = [c for c in caches if "attn_rot_k" in c]
    if logged and len(logged) == len(kv):
        for c, cache in zip(logged, kv, strict=True):
            for which in ("k", "v"):
                got_rot = bool(getattr(cache, f"attn_rot_{which}"))
                want_rot = bool(c["attn_rot_k"] if which == "k" else c["attn_rot_v"])
                if got_rot != want_rot:
                    raise CheckFailed(f"attn_rot_{which} {got_rot}, llama.cpp {want_rot} ({c['module']})")
    sizes: dict[Literal["kv_size", "kv_size_swa"], int | None] = {
        "kv_size": kv[0].get_size() if kv else None, "kv_size_swa": kv[-1].get_size() if len(kv) > 1 else None,
    }  # fmt: skip
    if got == "dsv4":
        sizes["kv_size_swa"] = kv[1].get_size()
    for name, got_size in sizes.items():
        if want.get(name) is not None and got_size != want[name]:
            raise CheckFailed(f"{name} {got_size} cells, llama.cpp {want[name]}")


# ---------------------------------------------------------------------------------------------- memory parts
def leaf_parts(mem: AnyMemory | MemoryPart, flags: int) -> list[LeafMemory]:
    """The single-section memories (KVCache, RecurrentMemory) a state of ``mem`` with ``flags`` is made of."""
    parts = getattr(mem, "_state_parts", None)
    if parts is None:
        return [cast("LeafMemory", mem)]  # a memory without parts is one of them
    out: list[LeafMemory] = []
    for p in parts(flags):
        out.extend(leaf_parts(p, flags))
    return out


def memory_sections(obj: StateObject) -> list[AnySection]:
    return list(obj.memory.sections)


def section_bytes(sections: Sequence[AnySection]) -> bytes:
    from ..state import section_bytes as sb

    return sb(*sections)


# ---------------------------------------------------------------------------------------------- artefacts
class ArtefactHints(TypedDict, total=False):
    """`kvref.state.load` arguments for an artefact (`artefact_hints`): its kind and layout, and what the
    producer's format generation decides."""

    kind: str
    layout: str
    ext_size: int
    seq_header: bool
    outputs: bool
    n_stream_field: bool


def artefact_hints(op: TraceOp, producer: Producer | None = None) -> ArtefactHints:
    """kvref.state.load options for the artefact a save op describes (``producer``: case.json's, for the
    format generation: sequence-blob prefix, v9 output block, cell ext size)."""
    from ..state import LAYOUTS

    sections = tuple("kv" if s.startswith("kv") else s for s in op.get("sections") or ())
    # the op's layout when its sections are that layout's (dsa and iswa are the same bytes), else the sections'
    named = op.get("layout")
    layout = named if named in LAYOUTS and LAYOUTS[named] == sections else None
    layout = layout or next((name for name, kinds in LAYOUTS.items() if kinds == sections), named)
    kind = _KIND[op["kind"]]
    hints: ArtefactHints = {"kind": kind, "layout": cast(str, layout)}  # a save op names its layout (the schema)
    if op.get("cell_ext") is not None:
        hints["ext_size"] = int((producer.get("cell_ext_size") if producer else None) or 12) if op["cell_ext"] else 0
    if not producer:  # none recorded: the reader infers the rest
        return hints
    if kind == "seq_state" and producer.get("seq_data_prefix") is not None:
        hints["seq_header"] = bool(producer["seq_data_prefix"])
    if kind in ("session", "state") and producer.get("output_block") is not None:
        hints["outputs"] = bool(producer["output_block"])
    if producer.get("n_stream_field") is not None:  # False: written before PR #14363 (llama-cpp-python 0.3.12)
        hints["n_stream_field"] = bool(producer["n_stream_field"])
    return hints


def save_ops(case: Case) -> dict[str, TraceOp]:
    """The case's artefacts: ``{file: its save op}`` (a save that returned 0 bytes wrote no artefact)."""
    return {op["file"]: op for op in case["trace"] if op["op"] == "save" and op.get("file") and op.get("ret") != 0}


class Artefacts:
    """The case's artefacts, parsed once (``get(file)`` -> state object; parse errors surface there). ``golden``:
    the directory of the case's directory; ``model``: what `kvref.state.load` needs for a session of version 7
    (the ``legacy-0.2.83-*`` goldens, kept in ``golden-v7/``: most readers of ``golden/`` load without a model)."""

    def __init__(self, root: Path, case: Case, golden: str = "golden", model: object = None) -> None:
        self.dir = root / golden / case["id"]
        self.saves = save_ops(case)
        self.producer: Producer | None = case.get("producer") or None
        self.model = model
        self._cache: dict[str, StateObject] = {}

    def get(self, file: str) -> StateObject:
        if file not in self._cache:
            from .. import state

            hints = artefact_hints(self.saves[file], self.producer)
            self._cache[file] = state.load(self.dir / file, **hints, model=self.model)
        return self._cache[file]


# ---------------------------------------------------------------------------------------------- comparisons
CellRow = tuple[int, tuple[int, ...], tuple[int, ...]]  # a cell: position, sequence ids, ext


def cell_table(sec: AnySection) -> list[list[CellRow]]:
    """Per stream (one for a recurrent section): ``[(pos, seq ids, ext), ...]`` in written order."""
    from ..state import KVSection

    streams = [st.cells for st in sec.streams] if isinstance(sec, KVSection) else [sec.cells]
    out: list[list[CellRow]] = []
    for c in streams:
        if c is None:
            out.append([])
            continue
        out.append([(int(c.pos[i]), c.seq_ids(i), tuple(int(x) for x in c.ext[i])) for i in range(c.n)])
    return out


def compare_cells(mine: Sequence[AnySection], theirs: Sequence[AnySection], where: str) -> None:
    kinds = [type(s).__name__ for s in mine], [type(s).__name__ for s in theirs]
    if kinds[0] != kinds[1]:
        raise CheckFailed(f"{where}: sections {kinds[0]}, llama.cpp {kinds[1]}")
    for k, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        ta, tb = cell_table(a), cell_table(b)
        if len(ta) != len(tb):
            raise CheckFailed(f"{where}: section {k} has {len(ta)} streams, llama.cpp {len(tb)}")
        for s, (ca, cb) in enumerate(zip(ta, tb, strict=True)):
            if ca == cb:
                continue
            if len(ca) != len(cb):
                raise CheckFailed(f"{where}: section {k} stream {s}: {len(ca)} cells, llama.cpp {len(cb)}")
            i = next(i for i in range(len(ca)) if ca[i] != cb[i])
            names = ("pos", "seq ids", "ext")
            f = next(j for j in range(3) if ca[i][j] != cb[i][j])
            raise CheckFailed(f"{where}: section {k} stream {s} cell #{i}: {names[f]} {ca[i][f]}, llama.cpp {cb[i][f]}")


def first_difference(a: bytes, b: bytes) -> str:
    n = min(len(a), len(b))
    x = np.frombuffer(a[:n], np.uint8) != np.frombuffer(b[:n], np.uint8)
    at = int(np.argmax(x)) if x.any() else n
    return f"{len(a)} bytes vs llama.cpp's {len(b)}, first difference at byte {at}"


def inject_rows(
    leaves: list[LeafMemory], mine: Sequence[AnySection], theirs: Sequence[AnySection], seq_id: int
) -> list[AnySection]:
    """Copy the golden's rows into the replayed memory at the cells it writes; return its sections again.

    KV caches get the rows in their buffers (so state_write's gather is checked); recurrent sections get
    them substituted in the section objects (the recurrent memory's row bookkeeping is its own concern).
    """
    from ..memory.kv_state import copy_rows, written_cells
    from ..state import KVSection

    out: list[AnySection] = []
    for leaf, a, b in zip(leaves, mine, theirs, strict=True):
        if isinstance(b, KVSection):
            cache = cast("KVCache", leaf)  # where llama.cpp wrote a KV section
            for s, st in enumerate(b.streams):
                if st.cells is not None and st.data is not None:  # a stream with cells always has its rows
                    copy_rows(cache, s, written_cells(cache, s, seq_id), st.data)
            out.extend(cache.state_sections(seq_id, 0))
        else:
            rec = copy.copy(cast("RecurrentSection", a))
            rec.r, rec.s = b.r, b.s
            out.append(rec)
    return out


def relabel(sections: Sequence[AnySection], dest: int, n_stream_of: Callable[[AnySection], object]) -> list[AnySection]:
    """The golden sections as a restore into ``dest`` writes them back: seq ids ``dest``, stream moved."""
    from ..state import Cells, KVSection, KVStream

    def cells(c: Cells) -> Cells:
        return Cells(c.pos, np.full_like(c.seq_id, dest), c.seq_start, c.ext, c.ext_size)

    from ..state.dsv4 import DSV4Section

    out: list[AnySection] = []
    for sec in sections:
        sec = copy.copy(sec)
        if isinstance(sec, DSV4Section):  # its raw iSWA sections; the compressed parts carry no sequence id
            sec.raw = relabel(sec.raw, dest, n_stream_of)
        elif isinstance(sec, KVSection):
            full = [st for st in sec.streams if st.cells is not None]
            streams = [KVStream(None, None) for _ in sec.streams]
            target = dest if len(sec.streams) > 1 else 0
            for st in full:
                streams[target] = KVStream(cells(cast("Cells", st.cells)), st.data)  # full: streams with cells
            sec.streams = streams
        else:
            sec.cells = cells(sec.cells)
        out.append(sec)
    return out


def last_stream_only(sections: Sequence[AnySection]) -> list[AnySection]:
    """The golden sections as a whole restore with ``Profile.whole_restore_clear`` ``"per_stream"`` writes them
    back: each stream's read begins with clear(true), so of a KV section only the last non-empty stream survives."""
    from ..state import KVSection, KVStream

    out: list[AnySection] = []
    for sec in sections:
        if isinstance(sec, KVSection):
            sec = copy.copy(sec)
            full = [i for i, st in enumerate(sec.streams) if st.cells is not None]
            sec.streams = [st if full and i == full[-1] else KVStream(None, None) for i, st in enumerate(sec.streams)]
        out.append(sec)
    return out


# ---------------------------------------------------------------------------------------------- the checks
def check_parse(root: Path, case: Case, arts: Artefacts) -> str:
    n = 0
    for file in arts.saves:
        path = arts.dir / file
        if not path.exists():
            raise CheckFailed(f"{file}: missing")
        obj = arts.get(file)
        if obj.to_bytes() != path.read_bytes():
            raise CheckFailed(f"{file}: written back, {first_difference(obj.to_bytes(), path.read_bytes())}")
        n += 1
    return f"{n} artefacts"


def _observe(mem: AnyMemory, n_seq: int) -> Observed:
    return {
        "seq_pos_min": [mem.seq_pos_min(s) for s in range(n_seq)],
        "seq_pos_max": [mem.seq_pos_max(s) for s in range(n_seq)],
    }


def _decode(
    mem: AnyMemory, op: TraceOp, hp: HParams, n_ubatch: int, on_ubatch: Callable[[UBatch, AnySlot], None] | None = None
) -> int | str:
    """llama_decode's return value: 0, 1 (no slot), -1 (invalid batch); `CORRUPTS` where kvref refuses a decode that
    leaves llama.cpp's cells contradicting themselves.

    Token ids below n_vocab are checked here (the memories do not know the vocabulary); everything else,
    sequence ids included, is the memory's decode() (BatchError -> -1, NoSlotError -> 1). ``on_ubatch`` goes
    to the memory's decode (called after each ubatch is placed).
    """
    from ..memory.batch import Batch

    n_vocab = hp.n_vocab
    tokens = cast("list[int]", op["tokens"])  # a decode's tokens are recorded
    width = op.get("embd")
    if not width and any(t < 0 or (n_vocab and t >= n_vocab) for t in tokens):
        return -1  # llama_batch_allocr::init: invalid token id
    try:
        if width:  # an embeddings batch (the tokens are placeholders): the values never reach the memory
            embd = np.zeros((len(tokens), width), np.float32)
            batch = Batch(embd=embd, pos=op.get("pos"), seq_ids=op["seq_ids"], logits=op.get("logits"))
        else:
            batch = Batch(tokens=tokens, pos=op.get("pos"), seq_ids=op["seq_ids"], logits=op.get("logits"))
        if on_ubatch is None:
            mem.decode(batch, n_ubatch)
        else:
            mem.decode(batch, n_ubatch, on_ubatch=on_ubatch)
    except BatchError:
        return -1
    except NoSlotError:
        return 1
    except CorruptionError:
        return CORRUPTS
    return 0


def _encode(op: TraceOp, hp: HParams, n_seq: int, inputs: bool) -> tuple[int, Placed]:
    """llama_encode's return value (0, or -1 for a batch llama_batch_allocr::init refuses) and, with ``inputs``,
    the cache-less graph inputs of its one ubatch (``[(ubatch, None, {(tensor, swa): array})]``)."""
    from ..memory.batch import Batch, allocr_for

    batch = Batch(tokens=op["tokens"], pos=op.get("pos"), seq_ids=op["seq_ids"])  # tokens: recorded
    balloc = allocr_for(hp)
    try:
        balloc.init(batch, None, n_vocab=hp.n_vocab or None, n_seq_max=n_seq, output_all=True)
    except BatchError:
        return -1, []
    ub = balloc.split_simple(balloc.get_n_tokens())
    if not inputs:
        return 0, []
    return 0, [(ub, None, graph_inputs(None, ub, None, op["graph"], hp))]


def _capacity_refused(op: TraceOp, arts: Artefacts) -> bool:
    """llama_state_load_file / llama_state_seq_load_file refuse files with more tokens than the capacity."""
    cap = op.get("n_token_capacity")
    if cap is None or op["kind"] not in ("session", "seq"):
        return False
    return len(cast("SessionFile | SeqFile", arts.get(op["file"])).tokens) > cap


class CarriedRows:
    """Cells of a plain KV cache whose rows came from llama.cpp (copied in at a save by `inject_rows`) and that
    only kvref changed since: its K-shift (``update()``). At the next save of such a cell its K and (row-wise) V
    rows must equal llama.cpp's byte for byte, which checks kvref's K-shift on llama.cpp's own rows. Compared for
    quantized K caches (`kvref.memory.kshift_quant`; the float K-shift is checked by its own tests). A decode's placed
    cells, a restore, ``clear`` and a cross-stream ``seq_cp`` (rows copied at the next update) drop the mark.
    Inactive for composite memories."""

    def __init__(self, mem: AnyMemory) -> None:
        from ..ggml.types import traits

        kv = cast("KVCache", mem) if type(mem).__name__ == "KVCache" else None
        self.mem = kv if kv is not None and traits(kv.type_k).is_quantized else None
        self.flags: npt.NDArray[np.bool_] | None = (
            None if self.mem is None else np.zeros((self.mem.n_stream, self.mem.get_size()), dtype=bool)
        )
        self.compared = 0  # cells compared

    @property
    def active(self) -> bool:
        """Is the memory a quantized plain KV cache (else every method does nothing)?"""
        return self.mem is not None

    def placed(self, _ub: UBatch, slot: AnySlot) -> None:
        """A decode's ubatch went into ``slot``: its cells hold kvref's rows now (an ``on_ubatch`` callback)."""
        if self.flags is not None:
            sinfo = cast("SlotInfo", slot)  # active: a plain KV cache, whose slots are SlotInfo
            for strm, idxs in zip(sinfo.strm, sinfo.idxs, strict=True):
                self.flags[strm, np.asarray(idxs, dtype=np.intp)] = False

    def reset(self, stream: int | None = None) -> None:
        """Unmark every cell of ``stream`` (None: of every stream)."""
        if self.flags is not None:
            self.flags[slice(None) if stream is None else stream] = False

    def compare_and_mark(self, where: str, seq_id: int, theirs: Sequence[AnySection]) -> None:
        """Compare the carried cells a save writes with llama.cpp's rows, then mark every written cell."""
        if self.mem is None or self.flags is None:
            return
        from ..memory.kv_state import written_cells

        mem = self.mem
        for s, st in enumerate(cast("KVSection", theirs[0]).streams):  # a KV cache's one section
            if st.cells is None or st.data is None:
                continue
            idxs = written_cells(mem, s, seq_id)
            keep = self.flags[s, idxs]
            if keep.any():
                k_bufs = [layer.k[s] for layer in mem.layers]
                parts: list[tuple[str, int, npt.NDArray[np.uint8], LayerRows | TransposedRows]] = [
                    ("K", li, buf, r) for li, (buf, r) in enumerate(zip(k_bufs, st.data.k, strict=True))
                ]
                if not mem.v_trans:
                    v_bufs = [layer.v[s] for layer in mem.layers if layer.v is not None]
                    parts += [("V", li, buf, r) for li, (buf, r) in enumerate(zip(v_bufs, st.data.v, strict=True))]
                for name, li, buf, rows in parts:
                    mine, their = buf[idxs[keep]], np.asarray(rows.data)[keep]
                    bad = np.flatnonzero((mine != their).any(axis=1))
                    if bad.size:
                        cell = int(idxs[keep][bad[0]])
                        raise CheckFailed(
                            f"{where}: stream {s} cell {cell} layer {li} {name} row after kvref's K-shift differs from "
                            f"llama.cpp's in {bad.size} of {int(keep.sum())} carried cells: "
                            f"{first_difference(mine[bad[0]].tobytes(), their[bad[0]].tobytes())}"
                        )
                self.compared += int(keep.sum())
            self.flags[s, idxs] = True


def check_replay(root: Path, case: Case, arts: Artefacts) -> str:
    hp = hparams_from_case(case)
    check_hparams(root, case, hp)
    init = case["trace"][0]
    try:
        mem = create_memory_for(case, hp)
        created, why = True, ""
    except KVRefError as e:
        created, why = False, str(e)
    if bool(init.get("ret", True)) != created:
        raise CheckFailed(f"op 0 (init): kvref {'built a memory' if created else 'refused: ' + why}, "
                          f"llama.cpp {'accepted' if init.get('ret', True) else 'refused'}")  # fmt: skip
    if not created:
        return "init refused as in llama.cpp"
    if mem is None:
        raise Unsupported("create_memory returned no memory")
    check_memory_shape(case, mem)
    r = replay_trace(case, mem, arts, hp)
    rows = f", {r['carried_rows']} shifted rows" if r.get("carried_rows") else ""
    corrupting = (
        f", {r['corrupting']} refused as corrupting llama.cpp's cells ({r['not_compared']} ops until its reset not "
        "compared)"
        if r["corrupting"]
        else ""
    )
    return f"{r['ops']} ops, {r['saves']} saves, {r['restores']} restores{rows}{corrupting}"


def replay_trace(
    case: Case, mem: AnyMemory, arts: Artefacts, hp: HParams | None = None, graph: GraphCounts | None = None
) -> dict[str, int]:
    """Run the case's trace (after op 0, init) on ``mem`` and compare every step with what llama.cpp recorded: the
    one interpreter of TRACE_OPS on kvref (the replay and graph checks, the tests' golden replays).

    Raises CheckFailed at the first difference (Unsupported for an op kvref does not model); returns
    ``{"ops", "saves", "restores"}``. ``hp`` (default: the case's) gives n_vocab for the token-id check. With
    ``graph`` (a GraphCounts, which counts what was compared), every decode that carries llama.cpp's graph
    inputs (``op["graph"]``) is also checked input by input (``compare_graph_inputs``).
    """
    hp = hparams_from_case(case) if hp is None else hp
    trace = case["trace"]
    other_mem = cast("AnyMemory", getattr(mem, "other", mem))  # the memory of ctx_other, when mem reads one
    other_hp = hparams_from_case(other_case(case)) if "other" in case else hp
    observed = cast("ObservedContext", case["observed_context"])  # the context was created: it was observed
    n_seq = observed["n_seq_max"]
    n_ubatch = observed["n_ubatch"]
    saves = restores = 0
    carried = CarriedRows(mem)
    causal: bool | None = None  # llama_set_causal_attn (set_causal); None: the model's causal_attn
    # where kvref refused an op after which llama.cpp's cells contradict themselves (CORRUPTS): until a clear or a
    # whole restore resets llama.cpp's memory, nothing is compared (nor performed)
    corrupt: str | None = None
    refused = skipped = 0
    for k, op in enumerate(trace[1:], start=1):
        # an op of ctx_other's context (a draft context's target: "ctx": "other") goes to that context's memory
        mem_op, hp_op = (other_mem, other_hp) if op.get("ctx") == "other" else (mem, hp)
        kind = op["op"]
        where = f"op {k} ({kind}{' ' + op['file'] if op.get('file') else ''})"
        if corrupt is not None:
            if kind == "clear" or (kind == "state_load" and op["ret"] not in (0, False)):
                corrupt = None
            else:
                skipped += 1
                continue
        if op.get("ret") == ABORTS:
            _replay_abort(mem_op, op, where, arts, n_ubatch)
        elif kind == "decode" and graph is not None and "graph" in op:
            shifts = expected_shifts(mem_op)
            placed: Placed = []

            def on_ubatch(
                ub: UBatch,
                slot: AnySlot,
                g: Graph = op["graph"],
                out: Placed = placed,
                c: bool | None = causal,
                m: AnyMemory = mem_op,
                h: HParams = hp_op,
            ) -> None:
                out.append((ub, slot, graph_inputs(m, ub, slot, g, h, c)))
                carried.placed(ub, slot)

            ret = _decode(mem_op, op, hp_op, n_ubatch, on_ubatch)
            if ret == CORRUPTS and op["ret"] == 0:
                corrupt, refused = where, refused + 1
                continue
            if ret != op["ret"]:
                raise CheckFailed(f"{where}: decode returned {ret}, llama.cpp {op['ret']}")
            compare_graph_inputs(
                f"{case['id']}: {where}", op["graph"], shifts if ret != -1 else [], placed, graph, kq_mask_pad(case)
            )
        elif kind == "decode":
            ret = _decode(mem_op, op, hp_op, n_ubatch, carried.placed if carried.active else None)
            if ret == CORRUPTS and op["ret"] == 0:
                corrupt, refused = where, refused + 1
                continue
            if ret != op["ret"]:
                raise CheckFailed(f"{where}: decode returned {ret}, llama.cpp {op['ret']}")
        elif kind == "seq_rm":
            ret = mem_op.seq_rm(op["seq_id"], op["p0"], op["p1"])
            if ret != op["ret"]:
                raise CheckFailed(f"{where}: seq_rm returned {ret}, llama.cpp {op['ret']}")
        elif kind == "seq_cp":
            mem_op.seq_cp(op["seq_id_src"], op["seq_id_dst"], op["p0"], op["p1"])
            kv = carried.mem  # the memory itself when active (a plain KV cache)
            if kv is not None and kv.get_stream(op["seq_id_src"]) != kv.get_stream(op["seq_id_dst"]):
                carried.reset(kv.get_stream(op["seq_id_dst"]))
        elif kind == "seq_keep":
            mem_op.seq_keep(op["seq_id"])
        elif kind == "seq_add":
            mem_op.seq_add(op["seq_id"], op["p0"], op["p1"], op["delta"])
        elif kind == "seq_div":
            try:
                mem_op.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"])
            except CorruptionError:
                corrupt, refused = where, refused + 1
                continue
        elif kind == "clear":
            mem_op.clear(op.get("data", True))
            carried.reset()
        elif kind == "encode":
            # llama_encode: the encoder's one ubatch (split_simple of the whole batch); the memory is untouched
            ret, placed = _encode(op, hp_op, n_seq, graph is not None and "graph" in op)
            if ret != op["ret"]:
                raise CheckFailed(f"{where}: encode returned {ret}, llama.cpp {op['ret']}")
            if graph is not None and "graph" in op:
                compare_graph_inputs(f"{case['id']}: {where}", op["graph"], [], placed, graph)
        elif kind == "set_causal":
            causal = bool(op["causal"])  # a context setting: only the masks of later decodes change
        elif kind in ("seq_pos_min", "seq_pos_max"):
            ret = getattr(mem_op, kind)(op["seq_id"])
            if ret != op["ret"]:
                raise CheckFailed(f"{where}: {kind}({op['seq_id']}) returned {ret}, llama.cpp {op['ret']}")
        elif kind == "save" and op["ret"] == 0:
            # llama_state_seq_get_data(_ext) caught an exception (a sequence id its memory cannot hold): 0 bytes
            _refuses(mem_op, where, "wrote a state where llama.cpp wrote 0 bytes", partial(_save_call, mem_op, op))
        elif kind == "save":
            seq_id, flags = op.get("seq_id", -1), op.get("flags", 0)
            if seq_id is None:
                seq_id = -1
            theirs = memory_sections(arts.get(op["file"]))
            if getattr(mem_op, "kind", None) == "dsv4":
                _dsv4_save(mem_op, theirs, seq_id, flags, where)
                saves += 1
                continue
            leaves = leaf_parts(mem_op, flags)
            mine = [s for leaf in leaves for s in leaf.state_sections(seq_id, flags)]
            compare_cells(mine, theirs, where)
            carried.compare_and_mark(where, seq_id, theirs)
            mine = inject_rows(leaves, mine, theirs, seq_id)
            a, b = section_bytes(mine), section_bytes(theirs)
            if a != b:
                raise CheckFailed(f"{where}: memory bytes after copying llama.cpp's rows: {first_difference(a, b)}")
            saves += 1
        elif kind in ("state_load", "seq_restore"):
            carried.reset()
            ok = op["ret"] not in (0, False)
            if _capacity_refused(op, arts):
                if ok:
                    raise CheckFailed(f"{where}: llama.cpp accepted a file over its token capacity")
            elif not ok:
                # refused inside the memory (no room for the cells, a mismatching section): kvref must refuse too,
                # leaving what llama.cpp left (the observation below checks it)
                data = section_bytes(memory_sections(arts.get(op["file"])))
                seq_id = op.get("dest_seq_id", -1) if kind == "seq_restore" else -1
                try:
                    nread = mem_op.state_read(data, seq_id, op.get("flags", 0), atomic=False)
                except KVRefError:
                    pass
                else:
                    # llama_state_seq_* report a sequence restore that read 0 bytes as failed (a memory over another
                    # context's cells reads nothing), changing nothing
                    if not (kind == "seq_restore" and nread == 0):
                        raise CheckFailed(f"{where}: kvref restored what llama.cpp refused ({op.get('errors')})")
            else:
                data = section_bytes(memory_sections(arts.get(op["file"])))
                seq_id = op.get("dest_seq_id", -1) if kind == "seq_restore" else -1
                mem_op.state_read(data, seq_id, op.get("flags", 0), atomic=False)
                restores += 1
        else:
            raise Unsupported(f"{where}: not an op of the trace vocabulary (TRACE_OPS after init)")
        if "observed" in op:
            got = _observe(mem_op, n_seq)
            if got != op["observed"]:
                raise CheckFailed(f"{where}: observed {got}, llama.cpp {op['observed']}")
    return {"ops": len(trace), "saves": saves, "restores": restores, "carried_rows": carried.compared,
            "corrupting": refused, "not_compared": skipped}  # fmt: skip


def _dsv4_save(mem: AnyMemory, theirs: Sequence[AnySection], seq_id: int, flags: int, where: str) -> None:
    """A save of llama_kv_cache_dsv4 (kvref.memory.kv_cache_dsv4): the raw iSWA's cell tables, the compressed caches'
    row counts, streams and layers and the compressor states' shapes must be llama.cpp's; then llama.cpp's rows
    (raw K, compressed rows, compressor states: graph outputs) are copied in and the bytes must be equal."""
    from ..memory.kv_cache_dsv4 import KVCacheDSV4
    from ..state.dsv4 import DSV4Section

    dsv4 = cast("KVCacheDSV4", mem)
    sec = cast("DSV4Section", theirs[0])
    mine = dsv4.state_sections(seq_id, flags)[0]
    if mine.header.mode != sec.header.mode:
        raise CheckFailed(f"{where}: DSV4 mode {mine.header.mode}, llama.cpp {sec.header.mode}")
    compare_cells(mine.raw, sec.raw, where)
    for ka, kb in zip(mine.k_caches, sec.k_caches, strict=True):
        got = (ka.n_rows, ka.n_stream, [il for il, _ in ka.layers])
        want = (kb.n_rows, kb.n_stream, [il for il, _ in kb.layers])
        if got != want:
            raise CheckFailed(f"{where}: {ka.name} K cache (rows, streams, layers) {got}, llama.cpp {want}")
    for x, y in zip(mine.states, sec.states, strict=True):
        shape, want_shape = (x.state_size, x.n_embd_state, x.n_stream), (y.state_size, y.n_embd_state, y.n_stream)
        if shape != want_shape:
            raise CheckFailed(f"{where}: {x.name} state (size, width, streams) {shape}, llama.cpp {want_shape}")
    leaves = leaf_parts(cast("AnyMemory", dsv4.raw), flags)
    inject_rows(leaves, mine.raw, sec.raw, seq_id)
    dsv4.copy_rows_from(sec, seq_id)
    a, b = dsv4.state_write(seq_id, flags), section_bytes(theirs)
    if a != b:
        raise CheckFailed(f"{where}: memory bytes after copying llama.cpp's rows: {first_difference(a, b)}")


def _snapshot(mem: AnyMemory) -> tuple[bytes, list[tuple[int, int]]]:
    """What a refused op must leave as it was: the whole memory's state bytes (cells and rows) and every sequence's
    position range (ids up to LLAMA_MAX_SEQ: a unified cache holds them all)."""
    from ..constants import LLAMA_MAX_SEQ

    def ranges(ids: range) -> list[tuple[int, int]]:
        out = []
        for s in ids:
            try:
                out.append((mem.seq_pos_min(s), mem.seq_pos_max(s)))
            except KVRefError:
                out.append((-2, -2))  # an id this memory does not hold: the same answer before and after
        return out

    return bytes(mem.state_write()), ranges(range(LLAMA_MAX_SEQ))


def _refuses(mem: AnyMemory, where: str, what: str, call: Callable[[], object]) -> None:
    """``call`` must raise a KVRefError and leave ``mem`` as it was (``what``: the failure when it does not raise)."""
    before = _snapshot(mem)
    try:
        call()
    except KVRefError as e:
        if _snapshot(mem) != before:
            raise CheckFailed(f"{where}: kvref refused ({type(e).__name__}: {e}) but changed the memory") from None
        return
    raise CheckFailed(f"{where}: kvref {what}")


def _save_call(mem: AnyMemory, op: TraceOp) -> object:
    """kvref's counterpart of a save op: the bytes of the memory section(s) it writes."""
    seq_id = op.get("seq_id")
    return mem.state_write(-1 if seq_id is None else seq_id, op.get("flags", 0) or 0)


def _replay_abort(mem: AnyMemory, op: TraceOp, where: str, arts: Artefacts, n_ubatch: int) -> None:
    """An op that kills llama.cpp (``"ret": "aborts"``): kvref's call must raise a KVRefError that is not one of the
    errors standing for a return value (a decode's BatchError is -1, NoSlotError 1) and change nothing."""
    from ..memory.batch import Batch

    kind = op["op"]
    calls: dict[str, Callable[[], object]] = {
        "seq_rm": lambda: mem.seq_rm(op["seq_id"], op["p0"], op["p1"]),
        "seq_cp": lambda: mem.seq_cp(op["seq_id_src"], op["seq_id_dst"], op["p0"], op["p1"]),
        "seq_keep": lambda: mem.seq_keep(op["seq_id"]),
        "seq_add": lambda: mem.seq_add(op["seq_id"], op["p0"], op["p1"], op["delta"]),
        "seq_div": lambda: mem.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"]),
        "seq_pos_min": lambda: mem.seq_pos_min(op["seq_id"]),
        "seq_pos_max": lambda: mem.seq_pos_max(op["seq_id"]),
        "clear": lambda: mem.clear(op.get("data", True)),
        "save": lambda: _save_call(mem, op),
    }
    if kind == "decode":

        def decode() -> object:
            tokens = cast("list[int]", op["tokens"])  # a decode's tokens are recorded
            batch = Batch(tokens=tokens, pos=op.get("pos"), seq_ids=op["seq_ids"], logits=op.get("logits"))
            try:
                return mem.decode(batch, n_ubatch)
            except (BatchError, NoSlotError) as e:
                ret = -1 if isinstance(e, BatchError) else 1
                raise CheckFailed(
                    f"{where}: kvref's decode returned {ret} ({type(e).__name__}: {e}) where llama.cpp aborts"
                ) from None

        calls["decode"] = decode
    elif kind in ("state_load", "seq_restore"):
        data = section_bytes(memory_sections(arts.get(op["file"])))
        seq_id = op["dest_seq_id"] if kind == "seq_restore" else -1
        calls[kind] = lambda: mem.state_read(data, seq_id, op.get("flags", 0) or 0)
    if kind not in calls:
        raise Unsupported(f"{where}: kvref has no counterpart of an aborting {kind}")
    _refuses(mem, where, f"went on where llama.cpp aborts ({op['abort']})", calls[kind])


# ---------------------------------------------------------------------------------------------- graph inputs
@dataclass
class GraphCounts:
    """What the graph check compared: decodes, ubatches, tensors (masks, idxs, positions), K-shift inputs."""

    decodes: int = 0
    ubatches: int = 0
    tensors: int = 0
    shifts: int = 0


def decode_ints(x: Ints) -> npt.NDArray[np.int64]:
    """An int list of case.json's graph inputs: a plain list, or ``{"runs": [[first, step, count], ...]}``."""
    if isinstance(x, dict):
        parts = [f + d * np.arange(n, dtype=np.int64) for f, d, n in x["runs"]]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return np.asarray(x, dtype=np.int64)


def decode_mask(e: GraphInput) -> npt.NDArray[np.float32]:
    """A captured KQ mask, float32 ``shape``: -inf where ``finite`` (np.packbits, base64) is 0, else 0 or the
    entry of ``values`` (``[[flat index, value], ...]``)."""
    import base64

    shape = tuple(e["shape"])
    n = int(np.prod(shape))
    bits = np.unpackbits(np.frombuffer(base64.b64decode(e["finite"]), np.uint8))
    if bits.size < n or bits[n:].any():
        raise CheckFailed(f"captured mask: {bits.size} pattern bits for {n} elements")
    out = np.where(bits[:n].astype(bool), np.float32(0), np.float32(-np.inf)).astype(np.float32)
    for i, v in e.get("values", []):
        out[i] = v
    mask: npt.NDArray[np.float32] = out.reshape(shape)
    return mask


# GGML_KQ_MASK_PAD of the llama.cpp vendored by each producer of goldens: the KQ mask had its rows (per stream)
# padded to a multiple of it, the rows past the ubatch's tokens all -inf; 1: no padding. Read in each release's
# ggml.h (32 from the flash-attention kernels of spring 2024, checked in 0.2.82, not in 0.2.67's; 64 from 0.3.8;
# none once PR #16148 removed the padding, by 0.3.35).
KQ_MASK_PAD = (("0.2.82", 32), ("0.3.8", 64), ("0.3.35", 1))


def kq_mask_pad(case: Case) -> int:
    """The KQ mask row padding of the case's producer (``KQ_MASK_PAD``; 1 for the current release)."""
    producer = case.get("producer")
    release = producer.get("llama_cpp_python") if producer else None
    if not release:
        return 1
    key = tuple(int(x) for x in release.split("."))
    pad = 1
    for first, p in KQ_MASK_PAD:
        if key >= tuple(int(x) for x in first.split(".")):
            pad = p
    return pad


def has_graph_inputs(case: Case) -> bool:
    """The case's decodes carry the graph inputs llama.cpp computed with (written by conformance/capture.py)."""
    return any("graph" in op for op in case["trace"])


def _attention_caches(mem: AnyMemory) -> list[tuple[bool, KVCache]]:
    """``[(swa, KVCache), ...]``: the memory's attention caches in llama.cpp's update order (base, then SWA)."""
    from ..memory.mask import attention_cache

    out: list[tuple[bool, KVCache]] = []
    for swa in (False, True):
        try:
            cache, _ = attention_cache(mem, None, swa=swa)
        except KVRefError:
            continue
        if all(c is not cache for _, c in out):
            out.append((swa, cache))
    return out


def expected_shifts(mem: AnyMemory) -> list[tuple[bool, npt.NDArray[np.int32]]]:
    """The K-shift inputs the next memory update computes with: ``[(swa, int32[n_stream * size]), ...]`` for each
    attention cache with a pending shift and at least one roped layer (llama.cpp builds no ROPE otherwise)."""
    out = []
    for swa, cache in _attention_caches(mem):
        if getattr(cache, "other", None) is not None:
            continue  # a cache over another context's cells applies no shift (that context does)
        hp = cache.hparams
        roped = int(hp.rope_type) != -1 and any(hp.has_rope(il) for il in cache.get_layer_ids())
        if roped and cache.get_has_shift():
            out.append((swa, cache.k_shift_input()))
    return out


def _pos_input(ub: UBatch, hp: HParams) -> npt.NDArray[np.int64]:
    """llm_graph_input_pos::set_input: the positions, one block per rope section; token batches under M-RoPE
    get (p, p, p, 0)."""
    n = int(ub.n_tokens)
    npe = int(hp.n_pos_per_embd())
    pos = np.asarray(ub.pos, dtype=np.int64)
    if npe == 4 and getattr(ub, "token", None) is not None:
        p = pos[:n]
        return np.concatenate([p, p, p, np.zeros(n, np.int64)])
    return pos[: n * npe]


def graph_inputs(
    mem: AnyMemory | None, ub: UBatch, slot: AnySlot | None, graph: Graph, hp: HParams, causal: bool | None = None
) -> GraphValues:
    """kvref's value of every input llama.cpp captured for the decode's ubatches, right after ``ub`` is placed:
    ``{(tensor, swa): array}`` (masks shaped (n_stream, n_tps, n_kv)). ``causal``: the context's causal_attn
    (the trace's last ``set_causal``; None: the model's). ``mem`` None: a cache-less graph (llama_encode), whose
    only input kvref computes is T5's ``pos_bucket``."""
    from ..memory.mask import attention_cache, fill_kq_mask, fill_pos_bucket

    out: GraphValues = {}
    # a memory's graph has attention inputs only where its slots are attention slots
    attn, attn_slot = cast("AnyMemory", mem), cast("SlotInfo | ISWASlot | HybridSlot | None", slot)
    wanted = {(e["tensor"], e["swa"], e.get("type")) for u in graph.get("ubatches", []) for e in u["inputs"]}
    # a memory with inputs of its own (indexer caches, compressed caches) computes those itself
    own = getattr(mem, "graph_input", None)
    for tensor, swa, typ in sorted(wanted, key=str):
        try:
            mine = None if own is None else own(tensor, ub, slot, swa=swa, f16=typ == "f16", causal=causal)
            if mine is not None:
                out[(tensor, swa)] = mine
            elif tensor == "kq_mask":
                dtype = np.float16 if typ == "f16" else np.float32
                out[(tensor, swa)] = fill_kq_mask(attn, ub, sinfo=attn_slot, swa=swa, dtype=dtype, causal=causal)
            elif tensor in ("k_idxs", "v_idxs"):
                cache, sinfo = attention_cache(attn, attn_slot, swa=swa)
                out[(tensor, swa)] = np.asarray(getattr(cache, tensor)(ub, sinfo), dtype=np.int64)
            elif tensor == "pos":
                out[(tensor, swa)] = _pos_input(ub, hp)
            elif tensor == "pos_bucket":
                # T5: set_input_pos_bucket of the decoder's cache, or (mem None: llama_encode) the cache-less input
                if mem is None:
                    buckets = fill_pos_bucket(None, ub, n_buckets=hp.n_rel_attn_bkts)
                else:
                    buckets = fill_pos_bucket(attention_cache(mem, attn_slot, swa=swa)[0], ub)
                out[(tensor, swa)] = buckets.reshape(-1).astype(np.int64)
        except KVRefError as e:
            out[(tensor, swa)] = e
    return out


def _first_diff(a: npt.NDArray[np.generic[object]], b: npt.NDArray[np.generic[object]]) -> str:
    if a.shape != b.shape:
        return f"shape {list(a.shape)}, llama.cpp {list(b.shape)}"
    fa, fb = a.reshape(-1), b.reshape(-1)
    neq = ~((fa == fb) | (np.isnan(fa) & np.isnan(fb))) if fa.dtype.kind == "f" else fa != fb
    i = int(np.argmax(neq))
    at = tuple(int(x) for x in np.unravel_index(i, a.shape)) if a.ndim > 1 else i
    return f"first difference at {at}: kvref {fa[i]}, llama.cpp {fb[i]}"


def compare_graph_inputs(
    where: str, graph: Graph, shifts: list[tuple[bool, npt.NDArray[np.int32]]], placed: Placed, counts: GraphCounts,
    mask_pad: int = 1,
) -> None:  # fmt: skip
    """Compare llama.cpp's captured inputs of one decode (``graph``: K-shift, then per ubatch) with kvref's.
    ``mask_pad``: the producer's KQ mask row padding (`kq_mask_pad`); its padding rows must be all -inf."""
    theirs_shift = graph.get("shift", [])
    if [s["swa"] for s in theirs_shift] != [swa for swa, _ in shifts]:

        def names(xs: list[bool]) -> str:
            return ", ".join("swa" if x else "base" for x in xs) or "none"

        raise CheckFailed(f"{where}: K-shift of caches [{names([swa for swa, _ in shifts])}], "
                          f"llama.cpp [{names([s['swa'] for s in theirs_shift])}]")  # fmt: skip
    for s, (swa, mine) in zip(theirs_shift, shifts, strict=True):
        theirs = decode_ints(s["k_shift"])
        if mine.shape != theirs.shape or (mine != theirs).any():
            cache = "SWA" if swa else "base"
            raise CheckFailed(
                f"{where}: K-shift input ({cache} cache, layer {s['layer']}): {_first_diff(mine, theirs)}"
            )
        counts.shifts += 1
    ubs = graph.get("ubatches", [])
    if len(ubs) != len(placed):
        raise CheckFailed(f"{where}: {len(placed)} ubatches, llama.cpp computed {len(ubs)} graphs")
    for j, (u, (_ub, _slot, mine_all)) in enumerate(zip(ubs, placed, strict=True)):
        for e in u["inputs"]:
            name = e["tensor"] + (" (swa)" if e["swa"] else "")
            label = f"{where}: ubatch {j}: {name} (layer {e['layer']})"
            got = mine_all.get((e["tensor"], e["swa"]))
            if isinstance(got, Exception):
                raise CheckFailed(f"{label}: kvref cannot compute it: {got}")
            if got is None:
                raise CheckFailed(f"{label}: kvref has no such input")
            mine = np.asarray(got)
            if e["tensor"].startswith("kq_mask"):
                their_mask = decode_mask(e)
                mine = mine.astype(np.float32)
                if mask_pad > 1:
                    their_mask = _unpad_mask(label, mine.shape, their_mask, mask_pad)
                if mine.shape != their_mask.shape:
                    raise CheckFailed(f"{label}: shape (n_stream, n_tps, n_kv) {list(mine.shape)}, "
                                      f"llama.cpp {list(their_mask.shape)}")  # fmt: skip
                if not np.array_equal(mine, their_mask):
                    raise CheckFailed(f"{label}: {_first_diff(mine, their_mask)}")
            else:
                theirs = decode_ints(e["data"])
                if mine.shape != theirs.shape or (mine != theirs).any():
                    raise CheckFailed(f"{label}: {_first_diff(mine, theirs)}")
            counts.tensors += 1
        counts.ubatches += 1
    counts.decodes += 1


def _unpad_mask(
    label: str, shape: tuple[int, ...], theirs: npt.NDArray[np.float32], pad: int
) -> npt.NDArray[np.float32]:
    """The rows of a padded captured mask that belong to tokens, after checking the padding: ``shape`` kvref's
    (n_stream, n_tps, n_kv); llama.cpp's has ``n_tps`` rounded up to a multiple of ``pad``, the rest -inf."""
    n_stream, n_tps, n_kv = shape
    want = (n_stream, -(-n_tps // pad) * pad, n_kv)
    if theirs.shape != want:
        raise CheckFailed(f"{label}: shape (n_stream, n_tps padded to {pad}, n_kv) {list(want)}, "
                          f"llama.cpp {list(theirs.shape)}")  # fmt: skip
    padding = theirs[:, n_tps:]
    if not np.isneginf(padding).all():
        at = tuple(int(x) for x in np.argwhere(~np.isneginf(padding))[0])
        raise CheckFailed(f"{label}: padding row {n_tps + at[1]} (stream {at[0]}, cell {at[2]}) is "
                          f"{padding[at]}, not -inf")  # fmt: skip
    return theirs[:, :n_tps]


def check_graph(root: Path, case: Case, arts: Artefacts) -> str:
    """Replay the trace; at every decode with captured graph inputs, compare kvref's with llama.cpp's."""
    if not has_graph_inputs(case):
        return "no captured graph inputs (not applicable)"
    hp = hparams_from_case(case)
    mem = create_memory_for(case, hp)
    if mem is None:
        raise Unsupported("create_memory returned no memory")
    counts = GraphCounts()
    replay_trace(case, mem, arts, hp, graph=counts)
    return (f"{counts.decodes} decodes, {counts.ubatches} ubatches, {counts.tensors} tensors, "
            f"{counts.shifts} K-shift inputs")  # fmt: skip


def check_restore(root: Path, case: Case, arts: Artefacts) -> str:
    if not arts.saves:
        return "no artefacts"
    hp = hparams_from_case(case)
    n_seq = cast("ObservedContext", case["observed_context"])["n_seq_max"]  # artefacts: the context was created
    n = 0
    for file, op in arts.saves.items():
        c = other_case(case) if op.get("ctx") == "other" else case  # an artefact of ctx_other's context
        h = hparams_from_case(c) if c is not case else hp
        theirs = memory_sections(arts.get(file))
        data = section_bytes(theirs)
        flags = op.get("flags", 0) or 0
        seq_id = op.get("seq_id", -1)
        seq_id = -1 if seq_id is None or op.get("scope") == "context" else seq_id
        if not -1 <= seq_id < n_seq:
            # the save of an id past n_seq_max (kept in a unified cache): its cells carry no id, and a sequence
            # restore of them is refused (no restore round trip to check)
            continue
        targets = [seq_id] if seq_id == -1 else [seq_id] + ([(seq_id + 1) % n_seq] if n_seq > 1 else [])
        for dest in targets:
            mem = cast("AnyMemory", create_memory_for(c, h))  # a case with artefacts has a memory
            mem.state_read(data, dest, flags, atomic=False)
            want = theirs if dest == seq_id else relabel(theirs, dest, lambda s: s)
            if dest == -1 and compat_for(c).whole_restore_clear == "per_stream":
                want = last_stream_only(want)
            got = mem.state_sections(dest, flags)
            a, b = section_bytes(got), section_bytes(want)
            if a != b:
                compare_cells(got, want, f"{file} restored into seq {dest}")
                raise CheckFailed(f"{file} restored into seq {dest}, written back: {first_difference(a, b)}")
            n += 1
    return f"{n} restores"


def _invalid_entry(root: Path, e: InvalidEntry) -> str | None:
    """None when the entry behaves as the manifest says, else what happened.

    A fault a reader without the model can see must fail ``kvref.state.load`` naming its field. A
    ``needs_hparams`` fault may or may not be visible to that reader (any FormatError is fine there), but the
    memory section, restored into a memory built like the source case's, must fail naming the field.
    """
    from .. import errors, state

    want = getattr(errors, e["error"])
    fields = [e["field"], *e.get("also_accept", [])]
    case = load_case(root, e["source"]["case"])
    op = save_ops(case)[e["source"]["file"]]
    path = root / "invalid" / e["file"]
    loaded: BaseException | None
    try:
        state.load(path, **artefact_hints(op, case.get("producer")))
        loaded = None
    except want as exc:
        loaded = exc
    except Exception as exc:  # any other error is a wrong answer, reported as such
        return f"raised {type(exc).__name__}: {exc}"
    if not e.get("needs_hparams"):
        if loaded is None:
            return "loaded without error"
        f = getattr(loaded, "field", None)
        return None if f in fields else f"{type(loaded).__name__} names field {f!r}, expected {fields}"
    # the memory section is the end of the file: the faults of needs_hparams entries keep the file's length
    src = root / "golden" / e["source"]["case"] / e["source"]["file"]
    n_mem = len(section_bytes(memory_sections(state.load(src, **artefact_hints(op, case.get("producer"))))))
    blob = path.read_bytes()
    data = blob[len(src.read_bytes()) - n_mem :] if len(blob) == src.stat().st_size else None
    if data is None:
        return "needs_hparams fault changed the file length: cannot locate the memory section"
    mem = cast("AnyMemory", create_memory_for(case, hparams_from_case(case)))  # its source case has a memory
    seq_id = op.get("seq_id", -1)
    seq_id = -1 if seq_id is None or op.get("scope") == "context" else seq_id
    try:
        mem.state_read(data, seq_id, op.get("flags", 0) or 0, atomic=False)
    except want as exc:
        f = getattr(exc, "field", None)
        return None if f in fields else f"state_read: {type(exc).__name__} names field {f!r}, expected {fields}"
    except Exception as exc:
        return f"state_read raised {type(exc).__name__}: {exc}"
    return "restored into a memory without error"


def check_invalid(root: Path) -> str:
    manifest: InvalidManifest = json.loads((root / "invalid" / "manifest.json").read_text())
    for e in manifest["files"]:
        problem = _invalid_entry(root, e)
        if problem is not None:
            raise CheckFailed(f"{e['file']}: {problem}")
    return f"{len(manifest['files'])} files"


# ---------------------------------------------------------------------------------------------- running
def _run_check(name: str, fn: Callable[[], str], expected: dict[str, str]) -> CheckResult:
    try:
        detail = fn()
        status = "pass"
    except Unsupported as e:
        status, detail = "unsupported", f"not supported: {e}"
    except CheckFailed as e:
        status, detail = "fail", str(e)
    except Exception as e:  # a crash is a failure, reported with its location
        tb = traceback.extract_tb(e.__traceback__)[-1]
        status, detail = "fail", f"{type(e).__name__}: {e} (at {Path(tb.filename).name}:{tb.lineno})"
    return CheckResult(name, status, detail, expected.get(name))


def run_case(root: Path, case_id: str, expected: dict[str, dict[str, str]] | None = None) -> CaseResult:
    """Every check of one case (``invalid`` runs the invalid-input check)."""
    exp = (load_expected_failures(root) if expected is None else expected).get(case_id, {})
    t0 = time.perf_counter()
    res = CaseResult(case_id)
    if case_id == INVALID_CASE:
        res.checks.append(_run_check("invalid", lambda: check_invalid(root), exp))
    else:
        case = load_case(root, case_id)
        arts = Artefacts(root, case)
        res.checks.append(_run_check("parse", lambda: check_parse(root, case, arts), exp))
        res.checks.append(_run_check("replay", lambda: check_replay(root, case, arts), exp))
        res.checks.append(_run_check("graph", lambda: check_graph(root, case, arts), exp))
        res.checks.append(_run_check("restore", lambda: check_restore(root, case, arts), exp))
    res.seconds = time.perf_counter() - t0
    return res


def all_case_ids(root: Path) -> list[str]:
    ids = list_cases(root)
    if (root / "invalid" / "manifest.json").exists():
        ids.append(INVALID_CASE)
    return ids


def run(root: Path, case_ids: list[str] | None = None) -> Iterator[CaseResult]:
    expected = load_expected_failures(root)
    for cid in case_ids or all_case_ids(root):
        yield run_case(root, cid, expected)


def stale_expectations(root: Path) -> list[str]:
    """Manifest entries naming a case or check that does not exist."""
    ids = set(all_case_ids(root))
    out = []
    for cid, checks in load_expected_failures(root).items():
        if cid not in ids:
            out.append(f"{cid}: no such case")
        for c in checks:
            if c not in (*CHECKS, "invalid"):
                out.append(f"{cid}: no such check {c!r}")
    return out


# ---------------------------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--case", action="append", metavar="ID", help="run only this case (repeatable); 'invalid' for invalid/"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument(
        "--root", default=None, help="the conformance directory (default: ./conformance, else the checkout's)"
    )


def main(args: argparse.Namespace) -> int:
    root = find_root(args.root)
    ids: list[str] | None = args.case or None
    if ids:
        unknown = sorted(set(ids) - set(all_case_ids(root)))
        if unknown:
            raise KVRefError(f"unknown case(s): {', '.join(unknown)}")
    t0 = time.perf_counter()
    results: list[CaseResult] = []
    width = max(len(c) for c in (ids or all_case_ids(root)))
    if not args.json:
        print(about_line())
        print(f"goldens: {root}")
        print(f"{'case':<{width}}  {'checks':>7}  {'status':<6}  first failure / note")
    for r in run(root, ids):
        results.append(r)
        if not args.json:
            passed = sum(c.status == "pass" for c in r.checks)
            note = r.first_problem()
            print(f"{r.case:<{width}}  {passed:>3}/{len(r.checks):<3}  {r.status:<6}  {note}"[:220])
            sys.stdout.flush()
    stale = stale_expectations(root) if not ids else []
    failed = [r for r in results if not r.ok]
    total = time.perf_counter() - t0
    if args.json:
        out: ConformanceJSON = {
            **about(),
            "root": str(root),
            "seconds": round(total, 3),
            "ok": not failed and not stale,
            "stale_expectations": stale,
            "cases": [cast("CaseResultJSON", {**asdict(r), "ok": r.ok, "status": r.status}) for r in results],
        }
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        for s in stale:
            print(f"expected_failures.json: {s}")
        xf = sum(r.status == "xfail" for r in results)
        print(f"{len(results)} cases: {len(results) - len(failed) - xf} passed, {xf} expected failures, "
              f"{len(failed)} failed ({total:.1f} s)")  # fmt: skip
    return 1 if failed or stale else 0


__all__ = [
    "CHECKS",
    "TRACE_OPS",
    "ArtefactHints",
    "Artefacts",
    "CaseResult",
    "CheckFailed",
    "CheckResult",
    "all_case_ids",
    "artefact_hints",
    "compat_for",
    "create_memory_for",
    "find_root",
    "hparams_from_case",
    "leaf_parts",
    "list_cases",
    "load_case",
    "load_expected_failures",
    "replay_trace",
    "run",
    "run_case",
    "save_ops",
]
