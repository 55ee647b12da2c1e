"""File -> memory in one call: `restore` builds the memory a state file needs and restores the file into it.

What the file says is inferred (`requirements`): the K/V types, ``v_trans`` (so ``flash_attn = not v_trans``),
the stream count (``kv_unified = n_stream == 1``; ``n_seq_max`` from the streams or the sequence ids), the
layout (and so whether a composite memory's state was saved with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY), the
cells each cache must hold (``n_ctx`` at least that; ``swa_full`` when the SWA section holds more than the
default SWA cache), and the era (``compat``). The rest comes from the model: ``model=`` (a GGUF path, read with
``HParams.from_gguf``) or ``hparams=``. A context parameter given explicitly wins; when it cannot hold the file,
`ContextMismatch` names the parameter and the value that works::

    r = kvref.restore("slot0.bin", model="model.gguf")          # r.memory, r.state; or: mem, st = r
    r = kvref.restore(blob, hparams=hp, n_ctx=4096, seq_id=2)     # a sequence file / blob into sequence 2
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict, cast

from ..errors import ContextMismatch, FormatError, KVRefError
from ..ggml.types import type_name
from ..hparams import HParams, SWAType
from ..profile import Profile

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..ggml.types import TypeLike
    from ..memory.base import MemoryPart
    from ..state import KVSection, RecurrentSection, StateObject
    from ..state.load import LoadOptions
    from ._types import AnyMemory, LeafMemory, ModelSource, StateSource

    class RestoreLoadOptions(TypedDict, total=False):
        """What `restore` hands `kvref.state.load`: the ``layout`` and its keyword options (`LoadOptions`) but
        the model, which is restore's own."""

        layout: str
        ext_size: int | None
        n_stream_field: bool | None
        has_v: bool | None
        outputs: bool | None
        ple: bool
        n_state_layers: int | None
        seq_header: bool | None


PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def memory_layout(hp: HParams) -> tuple[str, str | None]:
    """The layout a model's memory writes (``kvref.state.LAYOUTS`` name), and the layout of its partial state
    (LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY; None when the flag changes nothing)."""
    swa = hp.swa_type != SWAType.NONE
    # llama_kv_cache_dsa (MLA, indexer) / llama_kv_cache_dsa_iswa (MLA, indexer, SWA): the default context's memory
    if hp.arch in ("glm-dsa", "deepseek32") or (hp.arch == "hy_v4" and hp.indexer_top_k > 0):
        return "dsa", None
    if hp.arch == "dots3note":
        return "dsa_iswa", "kv"
    if hp.arch == "minimax-m3":
        return "msa", None  # llama_kv_cache_msa: base, then the indexer keys; the flags change nothing
    if hp.arch == "deepseek4":
        return "dsv4", "dsv4"  # llama_kv_cache_dsv4: one section either way (its mode word says partial)
    if hp.is_recurrent_arch():
        return "recurrent", None
    if hp.memory_kind() == "hybrid_idx":
        return "hybrid_idx", "recurrent"  # PARTIAL_ONLY: the recurrent section alone
    if hp.is_hybrid_arch():
        return ("hybrid_iswa", "hybrid") if swa else ("hybrid", "recurrent")
    return ("iswa", "kv") if swa else ("kv", None)


@dataclass
class Requirements:
    """What a state file fixes about the memory it restores into (None: the file does not say)."""

    layout: str
    scope: str  # "context" (session file, state blob) or "sequence"
    v_trans: bool | None = None
    type_k: str | None = None
    type_v: str | None = None
    n_stream: int | None = None
    max_seq_id: int = -1
    kv_cells: list[int] = field(default_factory=list)  # per KV section, the most cells of one stream
    rs_cells: int = 0
    kv_layers: list[int | None] = field(default_factory=list)  # per KV section, the n_layer written
    rs_layers: int | None = None
    eras: list[str] = field(default_factory=list)
    arch: str | None = None

    @property
    def flash_attn(self) -> bool | None:
        """The flash attention setting that writes this ``v_trans`` (llama.cpp transposes V exactly when it is off)."""
        return None if self.v_trans is None else not self.v_trans


class MemoryArgs(TypedDict, total=False):
    """``create_memory`` keyword arguments (`context_for` gives every one of them)."""

    n_ctx: int
    n_seq_max: int
    kv_unified: bool
    flash_attn: bool
    type_k: TypeLike
    type_v: TypeLike
    swa_full: bool
    n_ubatch: int
    compat: Profile


def requirements(obj: StateObject) -> Requirements:
    """What the loaded state ``obj`` fixes about its memory (see `Requirements`)."""
    from ..state.eras import matching_eras

    req = Requirements(
        obj.memory.layout,
        "sequence" if obj.kind in ("seq", "seq_state") else "context",
        arch=getattr(obj, "arch", None),
    )
    req.eras = matching_eras(obj)
    for sec in obj.memory.kv_sections:
        if sec.has_n_stream:
            req.n_stream = max(req.n_stream or 0, sec.n_stream)
        cells = 0
        n_layer: int | None = None
        for st in sec.streams:
            if st.data is not None:
                n_layer = st.data.n_layer
            if st.cells is None:
                continue
            cells = max(cells, st.cells.n)
            if len(st.cells.seq_id):
                req.max_seq_id = max(req.max_seq_id, int(st.cells.seq_id.max()))
            d = st.data
            if d is not None and req.v_trans is None:
                req.v_trans = bool(d.v_trans)
                if d.k:
                    req.type_k = type_name(d.k[0].type)
                if d.v:
                    req.type_v = type_name(d.v[0].type)
        req.kv_cells.append(cells)
        req.kv_layers.append(n_layer)
    for rsec in obj.memory.recurrent_sections:
        req.rs_cells = max(req.rs_cells, rsec.cell_count)
        req.rs_layers = len(rsec.r)
        if len(rsec.cells.seq_id):
            req.max_seq_id = max(req.max_seq_id, int(rsec.cells.seq_id.max()))
    return req


def _load(source: StateSource, hp: HParams | None, kind: str, options: RestoreLoadOptions) -> tuple[StateObject, int]:
    """Load ``source`` (a path, bytes or an already loaded state) reading the layout the model's memory writes;
    returns the object and the flags it was saved with (PARTIAL_ONLY when it holds only the partial layout)."""
    from .. import state

    obj: StateObject | None
    if isinstance(source, state.StateObject):
        obj = source
    else:
        if isinstance(source, str | os.PathLike) and not os.path.exists(source):
            raise FileNotFoundError(source)
        given = "layout" in options
        layout = options.pop("layout", "auto")
        load_options = cast("LoadOptions", options)  # the rest are load's keyword options
        if hp is not None:  # what a session of version 5 .. 7 needs to be read at all
            load_options = {"model": hp, **load_options}
        layouts: list[str | None] = list(memory_layout(hp)) if hp is not None and not given else []
        obj = None
        first: FormatError | None = None
        for lay in [x for x in layouts if x]:
            try:
                obj = state.load(source, kind, lay, **load_options)
                break
            except FormatError as e:
                first = first or e
        if obj is None:
            try:
                obj = state.load(source, kind, layout, **load_options)
            except FormatError:
                if first is not None:
                    raise first from None
                raise
    assert obj is not None
    flags = 0
    if hp is not None:
        full, partial = memory_layout(hp)
        if obj.memory.layout != full and obj.memory.layout == partial:
            flags = PARTIAL_ONLY
    return obj, flags


def _compat_of(req: Requirements) -> str:
    from ..state.eras import CURRENT

    return req.eras[-1] if req.eras else CURRENT


def context_for(
    req: Requirements, hp: HParams, *, seq_id: int = -1, n_ctx: int | None = None, n_seq_max: int | None = None,
    kv_unified: bool | None = None, flash_attn: bool | str | None = None, type_k: TypeLike | None = None,
    type_v: TypeLike | None = None, swa_full: bool | None = None, n_ubatch: int = 512,
    compat: Profile | str | None = None,
) -> MemoryArgs:  # fmt: skip
    """The ``create_memory`` keyword arguments of a memory that can restore a state with these requirements: the
    parameters given, the rest inferred. A given parameter that cannot work raises `ContextMismatch` naming it.
    ``seq_id``: the destination of a sequence restore (-1 for a whole one)."""
    from ..memory.factory import context_params
    from ..profile import resolve

    if hp.arch != (req.arch or hp.arch):
        raise ContextMismatch(
            f"the file was written by a {req.arch!r} model, this model is {hp.arch!r}: use the model that wrote it",
            "model",
        )
    profile = resolve(compat if compat is not None else _compat_of(req))
    if req.flash_attn is not None:
        fa_given = None if flash_attn is None else flash_attn not in (False, "off", "disabled")
        if fa_given is not None and fa_given != req.flash_attn:
            raise ContextMismatch(
                f"the file was written with flash attention {'on' if req.flash_attn else 'off'} (v_trans "
                f"{int(bool(req.v_trans))}); build the memory with flash_attn={req.flash_attn}",
                "flash_attn",
                req.flash_attn,
            )
        flash_attn = req.flash_attn
    for name, given, want in (("type_k", type_k, req.type_k), ("type_v", type_v, req.type_v)):
        if want is not None and given is not None and type_name(_type_id(given)) != want:
            raise ContextMismatch(
                f"the file holds {want} {name[-1].upper()} rows, the context asks for {type_name(_type_id(given))}: "
                f"build the memory with {name}={want!r} (or retype the file)",
                name,
                want,
            )
    type_k = type_k if type_k is not None else (req.type_k or "f16")
    type_v = type_v if type_v is not None else (req.type_v or "f16")
    # streams and sequences
    n_stream = req.n_stream if req.n_stream is not None and profile.kv_streams else 1
    if n_stream > 1:
        if kv_unified:
            raise ContextMismatch(
                f"the file has {n_stream} streams (one per sequence); build the memory with kv_unified=False and "
                f"n_seq_max={n_stream}",
                "kv_unified",
                False,
            )
        if n_seq_max is not None and n_seq_max != n_stream:
            raise ContextMismatch(
                f"the file has {n_stream} streams, one per sequence; build the memory with n_seq_max={n_stream}",
                "n_seq_max",
                n_stream,
            )
        kv_unified, n_seq_max = False, n_stream
    else:
        has_kv = bool(req.kv_cells)
        if has_kv and kv_unified is False and (n_seq_max or 1) > 1 and req.n_stream is not None:
            raise ContextMismatch(
                f"the file has one stream (a unified cache); build the memory with kv_unified=True "
                f"(or n_seq_max=1), not {n_seq_max} streams",
                "kv_unified",
                True,
            )
        kv_unified = True if kv_unified is None else kv_unified
        need = max(req.max_seq_id + 1 if req.scope == "context" else 0, seq_id + 1, 1)
        if not has_kv or "recurrent" in req.layout:
            need = max(need, req.rs_cells)
        if n_seq_max is not None and n_seq_max < need:
            what = (
                f"sequence id {max(req.max_seq_id, seq_id)}"
                if max(req.max_seq_id, seq_id) + 1 >= need
                else f"{req.rs_cells} recurrent cells"
            )
            raise ContextMismatch(
                f"the file holds {what}; build the memory with n_seq_max={need} (or more)", "n_seq_max", need
            )
        n_seq_max = max(n_seq_max or 1, need)
    # cells
    cells = max(req.kv_cells or [0])
    want_seq = cells if kv_unified or n_seq_max == 1 else cells * n_seq_max
    if n_ctx is None:
        # the cells the file needs, as the context rounds them up anyway (the same memory): a context of fewer would
        # also take fewer tokens per decode (llama.cpp's n_batch is at most the n_ctx asked for)
        rounded = context_params(hp, max(want_seq, 1), n_seq_max, kv_unified=kv_unified, compat=profile)
        n_ctx = max(want_seq, rounded.n_ctx, 1)
    cp = context_params(hp, n_ctx, n_seq_max, kv_unified=kv_unified, flash_attn=bool(flash_attn), compat=profile)
    size = cp.n_ctx_seq  # create_memory's kv_size (cells per stream)
    if req.kv_cells and req.kv_cells[0] > size:
        raise ContextMismatch(
            f"the file holds {req.kv_cells[0]} cells in one stream, a context of n_ctx={n_ctx} has {size}: build the "
            f"memory with n_ctx={want_seq} (or more)",
            "n_ctx",
            want_seq,
        )
    # the SWA section: an iSWA memory's second, a DSA-iSWA memory's third (after the MLA and indexer sections)
    i_swa = 2 if req.layout == "dsa_iswa" else 1
    if req.layout in ("iswa", "hybrid_iswa", "dsa_iswa") and len(req.kv_cells) > i_swa and swa_full is not True:
        from ..memory.kv_cache_iswa import swa_cache_size

        pad = (profile.swa_size_pad or 1) if req.layout != "dsa_iswa" else 256
        swa_size = swa_cache_size(size, hp.n_swa, n_seq_max, min(cp.n_ubatch, n_ubatch), kv_unified, False, pad)
        if req.kv_cells[i_swa] > swa_size:
            if swa_full is False:
                raise ContextMismatch(
                    f"the file's SWA section holds {req.kv_cells[i_swa]} cells, the SWA cache of this context "
                    f"{swa_size}: build the memory with swa_full=True",
                    "swa_full",
                    True,
                )
            swa_full = True
    return {
        "n_ctx": n_ctx,
        "n_seq_max": n_seq_max,
        "kv_unified": bool(kv_unified),
        "flash_attn": bool(flash_attn),
        "type_k": type_k,
        "type_v": type_v,
        "swa_full": bool(swa_full),
        "n_ubatch": n_ubatch,
        "compat": profile,
    }


def _type_id(t: TypeLike) -> int:
    from ..ggml.types import ggml_type

    return int(ggml_type(t))


@dataclass
class Restored:
    """What `restore` built: ``memory`` (restored), ``state`` (the loaded file), the sequence it went into
    (``seq_id``, -1 for a whole restore), the ``flags`` it was read with, and ``context`` (the ``create_memory``
    arguments used; empty after ``restore(into=...)``). Unpacks as ``memory, state``."""

    memory: AnyMemory
    state: StateObject
    seq_id: int = -1
    flags: int = 0
    context: MemoryArgs = field(default_factory=MemoryArgs)

    def __iter__(self) -> Iterator[AnyMemory | StateObject]:
        yield self.memory
        yield self.state

    @property
    def tokens(self) -> list[int]:
        """The token list of a session or sequence file (empty for blobs)."""
        t = getattr(self.state, "tokens", None)
        return [] if t is None else [int(x) for x in t]


def model_hparams(model: ModelSource | None = None, hparams: HParams | None = None) -> HParams:
    """``hparams``, or the hyper-parameters of the GGUF file ``model`` (an HParams passes through)."""
    if hparams is not None:
        return hparams
    if isinstance(model, HParams):
        return model
    if model is None:
        raise KVRefError(
            "the memory's shape comes from the model: pass model= (a GGUF path; --model M.gguf) or hparams="
        )
    return HParams.from_gguf(model)


def leaf_caches(mem: AnyMemory | MemoryPart, flags: int = 0) -> list[LeafMemory]:
    """The single-section memories (KVCache, RecurrentMemory) ``mem``'s state is made of, in write order."""
    parts = getattr(mem, "_state_parts", None)
    if parts is None:
        return [cast("LeafMemory", mem)]  # a memory without parts is one of them
    return [leaf for p in parts(flags) for leaf in leaf_caches(p, flags)]


def memory_has_ext(mem: AnyMemory) -> bool:
    """Does the memory's attention cache write a cell ext (M-RoPE; PLE from 2026-10)?"""
    from ..memory.kv_cache import KVCache
    from ..memory.kv_state import has_cell_ext

    return any(has_cell_ext(c) for c in leaf_caches(mem) if isinstance(c, KVCache))


def restore(
    source: StateSource, model: ModelSource | None = None, *, hparams: HParams | None = None,
    into: AnyMemory | None = None, kind: str = "auto", seq_id: int | None = None, n_ctx: int | None = None,
    n_seq_max: int | None = None, kv_unified: bool | None = None, flash_attn: bool | str | None = None,
    type_k: TypeLike | None = None, type_v: TypeLike | None = None, swa_full: bool | None = None,
    n_ubatch: int = 512, compat: Profile | str | None = None, **load_options: Unpack[RestoreLoadOptions],
) -> Restored:  # fmt: skip
    """Build the memory a state file needs and restore the file into it; returns a `Restored` (``memory, state``).

    ``source``: a path, the bytes of a blob, or a loaded state object; every layout (kv, iswa, recurrent, hybrid,
    hybrid_iswa) and every era ``kvref.state.load`` reads. ``model`` (GGUF path) or ``hparams`` give the model.
    The context parameters left at None are inferred from the file (`requirements`, `context_for`); ``compat``
    defaults to the newest era whose layout the file has. ``into``: an existing memory to restore into instead
    (as ``llama_state_load_file`` loads into a context): its model and context are used as they are, so neither
    ``model`` nor a context parameter may be given with it. A session file or state blob is restored whole; a
    sequence file or blob into ``seq_id`` (default: the id in the blob's prefix, else 0). The file's sections are
    rewritten into the memory's era layout first when they differ (`kvref.state.eras.convert_sections`).
    ``load_options`` go to ``kvref.state.load`` (``layout=``, ``ext_size=``, ...).

    Raises `ContextMismatch` (naming the parameter to change), FormatError (a malformed or mismatching file,
    naming the field) or ConversionError.
    """
    from ..memory.factory import create_memory
    from ..state import section_bytes
    from ..state.eras import convert_sections, era

    if into is not None:
        given = dict(model=model, hparams=hparams, n_ctx=n_ctx, n_seq_max=n_seq_max, kv_unified=kv_unified,
                     flash_attn=flash_attn, type_k=type_k, type_v=type_v, swa_full=swa_full, compat=compat)  # fmt: skip
        clash = [k for k, v in given.items() if v is not None]
        if clash:
            raise KVRefError(
                f"restore(into=...) uses the memory's own model and context; drop {', '.join(clash)} "
                "(or drop into= to build a new memory from them)"
            )
        if not isinstance(getattr(into, "hparams", None), HParams):
            raise KVRefError(f"into= takes a kvref memory (create_memory's result), not {type(into).__name__}")
    hp = into.hparams if into is not None else model_hparams(model, hparams)
    obj, flags = _load(source, hp, kind, load_options)  # a dict of its own already (the ** call made it)
    req = requirements(obj)
    if req.scope == "sequence":
        dest = seq_id if seq_id is not None else getattr(obj, "seq_id", None)
        dest = 0 if dest is None else int(dest)
    else:
        if seq_id not in (None, -1):
            raise KVRefError(
                f"a {obj.kind} holds the whole context: it restores into every sequence, not seq_id {seq_id}"
            )
        dest = -1
    if into is not None:
        if req.arch and req.arch != hp.arch:
            raise ContextMismatch(
                f"the file was written by a {req.arch!r} model, the memory is of a {hp.arch!r} model", "model"
            )
        ctx: MemoryArgs = {}
        mem: AnyMemory | None = into
    else:
        ctx = context_for(
            req, hp, seq_id=dest, n_ctx=n_ctx, n_seq_max=n_seq_max, kv_unified=kv_unified, flash_attn=flash_attn,
            type_k=type_k, type_v=type_v, swa_full=swa_full, n_ubatch=n_ubatch, compat=compat,
        )  # fmt: skip
        mem = cast("AnyMemory | None", create_memory(hp, **ctx))  # create_memory builds one of them
    if mem is None:
        raise KVRefError(f"a {hp.arch!r} model has no memory: there is nothing to restore into")
    sections = convert_sections(obj.memory, era(mem.profile), has_ext=memory_has_ext(mem)).sections
    data = _memory_bytes(source, obj.memory.sections, sections)
    mem.state_read(section_bytes(*sections) if data is None else data, dest, flags)
    return Restored(mem, obj, dest, flags, ctx)


Sections = Sequence["KVSection | RecurrentSection"]


def _unchanged(old: Sections, new: Sections) -> bool:
    """Are the converted sections the loaded ones as they are (same layout: cells, rows and n_stream field)?"""
    if len(old) != len(new):
        return False
    for a, b in zip(old, new, strict=True):
        if a is b:
            continue
        if type(a) is not type(b) or getattr(a, "has_n_stream", None) != getattr(b, "has_n_stream", None):
            return False
        streams_a, streams_b = getattr(a, "streams", None), getattr(b, "streams", None)
        if streams_a is None or streams_b is None or len(streams_a) != len(streams_b):
            return False
        if any(x.cells is not y.cells or x.data is not y.data for x, y in zip(streams_a, streams_b, strict=True)):
            return False
    return True


def _memory_bytes(source: StateSource, old: Sections, new: Sections) -> memoryview | None:
    """The loaded file's own memory bytes when they are restored as they are: a view of the bytes given, or of a
    read-only mapping of the file (the memory is the last part of every state file and blob). None when the
    sections changed on the way (another era's layout) or the source is an object: they are then serialized."""
    from .. import state

    if not new or not _unchanged(old, new) or isinstance(source, state.StateObject):
        return None
    offsets = getattr(old[0], "offsets", None)  # where the loaded sections start in the file (a DSV4 section: None)
    if not offsets:
        return None
    start = min(offsets.values())
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as f:
            if os.fstat(f.fileno()).st_size <= start:
                return None
            view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))  # lives as long as its views
    elif isinstance(source, bytes | bytearray | memoryview):
        view = memoryview(source).cast("B")
    else:  # a llama-cpp-python LlamaState: its sections are serialized
        return None
    return view[start:]


__all__ = [
    "PARTIAL_ONLY",
    "ContextMismatch",
    "MemoryArgs",
    "Requirements",
    "Restored",
    "context_for",
    "leaf_caches",
    "memory_has_ext",
    "memory_layout",
    "model_hparams",
    "requirements",
    "restore",
]
