"""``kvref check``: will llama.cpp, with this model and this context, load this state file?

`check_file` makes the checks llama.cpp makes, in its order, and stops at the first that fails, naming the
``kvref check`` option (and the value) that fixes it:

1. the identity sidecar ``<file>.kvref.json`` when present (`kvref.jobs.sidecar`): the payload's sha256, the model's;
2. the container: magic and version (llama.cpp reads only its own version), and the era layout (a version-9
   file of 0.3.16 has the output block a 0.3.17+ llama.cpp does not read) -- fix: ``kvref convert``;
3. the arch string of a session / state (llama.cpp: "wrong model arch");
4. the memory: stream count (``--kv-unified`` / ``--no-kv-unified --n-seq-max N``), layer count and row sizes
   (another model wrote it), ``v_trans`` (``--flash-attn``), K / V types (``--type-k`` / ``--type-v``), sequence
   ids below n_seq_max (``--n-seq-max``), cells that fit the cache (``--n-ctx``), and then the restore itself
   into a kvref memory built as llama.cpp builds it (what find_slot needs for a sequence restore).

A file that is no state at all (empty, truncated, random bytes) is a `FormatError`, not a "no".

Context defaults are llama_context_default_params' (n_ctx 512, n_seq_max 1, kv_unified off, flash attention auto
-- V not transposed --, f16 K and V, swa_full on); ``compat`` the llama.cpp (default: the one kvref follows).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict, cast

from ..errors import FormatError, KVRefError
from ..profile import Profile
from ..state.eras import Era

if TYPE_CHECKING:
    from ..ggml.types import TypeLike
    from ..state import SeqFile, SessionFile
    from ._types import AnyMemory, ModelSource

Fix = str | int | None  # the value of the option that fixes a mismatch (None: the option alone)

# which kvref check option fixes a mismatch the restore blames on a field
_FIELD_OPTION = {
    "v_trans": "--flash-attn",
    "n_stream": "--kv-unified / --no-kv-unified --n-seq-max",
    "cell_count": "--n-ctx",
    "k_type": "--type-k",
    "v_type": "--type-v",
    "seq_id": "--n-seq-max",
    "n_layer": None,
    "k_row_size": None,
    "v_row_size": None,
    "n_embd_v_gqa": None,
    "r_row_size": None,
    "s_row_size": None,
}


class LoadCheckJSON(TypedDict):
    """`LoadCheck.to_json`: what ``kvref check --json`` prints."""

    ok: bool
    reason: str | None
    option: str | None
    fix: Fix
    notes: list[str]


@dataclass
class LoadCheck:
    """The answer: ``ok``; else ``reason`` (the first mismatch), ``option`` (the kvref check option / command that
    fixes it, None when only another model would) and ``fix`` (its value). ``notes``: what was checked."""

    ok: bool
    reason: str = ""
    option: str | None = None
    fix: Fix = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> LoadCheckJSON:
        """A JSON-ready dict."""
        return {"ok": self.ok, "reason": self.reason or None, "option": self.option, "fix": self.fix,
                "notes": self.notes}  # fmt: skip

    def line(self) -> str:
        """``yes: ...`` or ``no: <reason>; fix: <option> <value>``."""
        if self.ok:
            return "yes: " + "; ".join(self.notes)
        fix = ""
        if self.option:
            fix = f"\nfix: {self.option}" + (f" {self.fix}" if self.fix is not None else "")
        elif self.option is None and self.fix is None:
            fix = "\nfix: none in the context: the file belongs to another model"
        return f"no: {self.reason}{fix}"


def _no(reason: str, option: str | None = None, fix: Fix = None, notes: list[str] | None = None) -> LoadCheck:
    return LoadCheck(False, reason, option, fix, notes or [])


def _llama_cpp(compat: Profile | str | None) -> tuple[Profile, Era]:
    """The behaviour profile and file-layout era of the llama.cpp ``compat`` names: a profile, a compat name, a
    llama-cpp-python release (0.2.58 and later: `kvref.compat.for_llama_cpp_python`) or an era name (its last
    release) -- every era `kvref convert --to-era` writes."""
    from ..compat import for_llama_cpp_python
    from ..errors import CompatError, CompatWarning
    from ..profile import DEFAULT, resolve
    from ..state.eras import ERAS, era

    if compat is None or isinstance(compat, Profile):
        profile = resolve(compat if compat is not None else DEFAULT)
        return profile, era(profile)
    try:
        profile = resolve(compat)
        return profile, era(profile)
    except CompatError:
        target = era(compat)  # an era name, or a release older than kvref's profiles (else a ConversionError)
    with warnings.catch_warnings():  # the answer's notes name the era; the warning would repeat it
        warnings.simplefilter("ignore", CompatWarning)
        return for_llama_cpp_python(target.last if compat in ERAS else compat), target


def check_file(
    path: str | os.PathLike[str] | bytes, model: ModelSource, *, n_ctx: int = 512, n_seq_max: int = 1,
    kv_unified: bool = False, flash_attn: bool | str = "auto", type_k: TypeLike = "f16", type_v: TypeLike = "f16",
    swa_full: bool = True, seq_id: int | None = None, compat: Profile | str | None = None,
) -> LoadCheck:  # fmt: skip
    """Would llama.cpp (``compat``) with the GGUF ``model`` (or an HParams) and this context load the state file
    at ``path``? Returns a `LoadCheck`: ok, or the first mismatch and the option that fixes it. A sequence file is
    checked as restored into ``seq_id`` (default 0)."""
    from .. import state
    from ..ggml.types import type_name
    from ..memory.factory import create_memory
    from ..state.eras import describe_eras, is_mrope_arch
    from .restore import _load, memory_layout, model_hparams, requirements
    from .sidecar import verify_sidecar

    profile, target = _llama_cpp(compat)
    notes: list[str] = []
    model_path = model if isinstance(model, str | os.PathLike) else None
    if isinstance(path, str | os.PathLike):
        problems = verify_sidecar(path, model_path)
        if problems:
            return _no(f"identity sidecar: {problems[0]}", None, None)
    hp = model_hparams(model)
    try:
        obj, flags = _load(path, hp, "auto", {})
    except FormatError as e:
        try:  # a state of another model parses without this one's widths; anything else is not a state at all
            state.load(path)
        except FormatError:
            raise e from None
        return _no(f"the file does not parse as a state of this model: {e}", None, None)
    req = requirements(obj)
    # 2. container version and era layout
    if obj.kind in ("session", "seq"):
        version = cast("SessionFile | SeqFile", obj).version
        want = target.session_version if obj.kind == "session" else target.seq_version
        if version != want:
            return _no(
                f"{obj.kind} file version {version}; llama.cpp of era {target.name} ({target.releases}) reads "
                f"only version {want}",
                # a session of version 5 .. 7 is read with the model's layer widths, on conversion too
                "kvref convert FILE OUT --model MODEL --to-era"
                if obj.kind == "session" and version < 8
                else "kvref convert FILE OUT --to-era",
                target.name,
            )
    if req.eras and target.name not in req.eras:
        return _no(
            f"the file has the layout of {describe_eras(req.eras)}, not of {target.name} ({target.releases})",
            "kvref convert FILE OUT --to-era",
            target.name,
        )
    notes.append(f"{obj.kind} in the {target.name} layout")
    # 3. arch
    if req.arch is not None and req.arch != hp.arch:
        return _no(f"wrong model arch: the file was written by a {req.arch!r} model, this one is {hp.arch!r}")
    # the cell ext: an M-RoPE model's cache reads one per cell; without it llama.cpp misreads every later field
    exts = {st.cells.ext_size for sec in obj.memory.kv_sections for st in sec.streams if st.cells is not None}
    if is_mrope_arch(hp.arch) and target.ext_size and exts == {0} and any(req.kv_cells):
        return _no(
            f"the file's KV cells carry no M-RoPE position ext, which a {hp.arch!r} cache of the {target.name} layout "
            f"reads ({target.ext_size} bytes a cell): the file was converted without naming its model",
            f"kvref convert FILE OUT --arch {hp.arch}  (or --model MODEL)",
        )
    # 4. memory
    full, partial = memory_layout(hp)
    if obj.memory.layout not in (full, partial):
        return _no(f"the file holds a {obj.memory.layout} memory, this model has a {full} memory")
    try:
        mem = cast(
            "AnyMemory | None",  # create_memory builds one of them
            create_memory(hp, n_ctx, n_seq_max, kv_unified, flash_attn, type_k, type_v, swa_full, compat=profile),
        )
    except KVRefError as e:
        return _no(f"llama.cpp would not create this context: {e}")
    if mem is None:
        return _no(f"a {hp.arch!r} model has no memory")
    from ..memory.kv_cache import KVCache
    from .restore import leaf_caches

    leaves = leaf_caches(mem, flags)
    kv = [c for c in leaves if isinstance(c, KVCache)]
    if kv and req.n_stream is not None and req.n_stream != kv[0].n_stream:
        if req.n_stream == 1:
            return _no(f"the file has 1 stream, the context {kv[0].n_stream} (one per sequence)", "--kv-unified")
        return _no(
            f"the file has {req.n_stream} streams (one per sequence), the context {kv[0].n_stream}",
            "--no-kv-unified --n-seq-max",
            req.n_stream,
        )
    kv_secs = obj.memory.kv_sections
    for k, (sec, cache) in enumerate(zip(kv_secs, kv, strict=False)):
        want_layers = len(cache.layers)
        for st in sec.streams:
            if st.data is None:
                continue
            if st.data.n_layer != want_layers:
                return _no(f"section {k}: the file has {st.data.n_layer} attention layers, the model {want_layers}")
            if bool(st.data.v_trans) != cache.v_trans:
                fa = "off" if st.data.v_trans else "on"
                return _no(
                    f"the file was written with flash attention {fa} (v_trans {st.data.v_trans}), the context "
                    f"has it {'off' if cache.v_trans else 'on'}",
                    "--flash-attn",
                    fa,
                )
            for name, rows, want in (("k", st.data.k, cache.type_k), ("v", st.data.v, cache.type_v)):
                if rows and rows[0].type != int(want):
                    return _no(
                        f"the file holds {type_name(rows[0].type)} {name.upper()} rows, the context {type_name(want)}",
                        f"--type-{name}",
                        type_name(rows[0].type),
                    )
    if req.scope == "context" and req.max_seq_id >= n_seq_max and not (kv and kv[0].n_stream > 1):
        return _no(f"the file holds sequence {req.max_seq_id}, the context n_seq_max {n_seq_max}", "--n-seq-max",
                   req.max_seq_id + 1)  # fmt: skip
    for k, (cells, cache) in enumerate(zip(req.kv_cells, kv, strict=False)):
        if cells > cache.get_size():
            what = "SWA " if k == 1 and full.endswith("iswa") else ""
            if what and not swa_full:
                return _no(f"the file holds {cells} cells in its SWA section, the SWA cache {cache.get_size()}",
                           "--swa-full")  # fmt: skip
            need = cells if cache.n_stream == 1 else cells * cache.n_stream
            return _no(
                f"the file holds {cells} cells in one stream, the {what}cache of n_ctx {n_ctx} has {cache.get_size()}",
                "--n-ctx",
                need,
            )
    # the restore itself
    dest = -1 if req.scope == "context" else (seq_id if seq_id is not None else 0)
    try:
        mem.state_read(state.section_bytes(*obj.memory.sections), dest, flags)
    except KVRefError as e:
        f = getattr(e, "field", None)
        return _no(f"the restore fails: {e}", _FIELD_OPTION.get(f or ""), None)
    # every stream's cells (req.kv_cells holds the most of one stream: what the context must fit)
    cells = sum(st.cells.n for sec in obj.memory.kv_sections for st in sec.streams if st.cells is not None)
    cells += sum(rsec.cell_count for rsec in obj.memory.recurrent_sections)
    into = f"sequence {dest}" if dest >= 0 else "the context"
    notes.append(f"{cells} cell{'s' if cells != 1 else ''} restored into {into}")
    return LoadCheck(True, notes=notes)


__all__ = ["LoadCheck", "LoadCheckJSON", "check_file"]
