"""The identity sidecar ``<file>.kvref.json``: which model, llama.cpp and context a state file belongs to.

A state file does not say which model wrote it (a session file names only the arch) nor with which context.
`write_sidecar` (``save_memory(..., sidecar=True)``, ``kvref convert --sidecar``) records it beside the file;
``kvref check`` verifies it when present (`verify_sidecar`). The format (JSON object, version 1)::

    {
      "kvref_sidecar": 1,                       # format version
      "file": "prompt.ggsn",                    # the state file's name (same directory)
      "kind": "session",                        # session | seq | state | seq_state
      "payload": {"size": 123456, "sha256": "..."},       # the state file's bytes
      "era": "2026-10",                         # kvref.state.eras layout of the file
      "llama_cpp": {"profile": "2026-10", "llama_cpp_python": "0.3.36"},   # behaviour profile (may be null)
      "model": {"file": "model.gguf", "sha256": "...", "arch": "llama"},   # sha256 null when not given
      "context": {"n_ctx": 4096, "n_seq_max": 1, "kv_unified": true, "flash_attn": false,
                  "type_k": "f16", "type_v": "f16", "swa_full": false},   # null when not known
      "written_by": "kvref 0.1.0"
    }

Unknown keys are ignored, so later versions may add some. A sidecar is read as untrusted input: only a regular
file of at most `MAX_BYTES`, every known field of the type above (a `FormatError` names the field otherwise); it is
written like the state file (temporary file, fsync, rename), replacing a planted symlink rather than following it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, cast

from ..errors import FormatError
from ..state.atomic import atomic_write

if TYPE_CHECKING:
    from ..profile import Profile
    from ..state import StateObject
    from ._types import AnyMemory

SUFFIX = ".kvref.json"
VERSION = 1
MAX_BYTES = 1 << 20  # a sidecar is well under a kilobyte; anything larger is not one
_HEX64 = frozenset("0123456789abcdef")


class Payload(TypedDict):
    """The state file's bytes: ``size`` and ``sha256`` (hex)."""

    size: int
    sha256: str


class LlamaCpp(TypedDict):
    """The behaviour profile the file was saved with (`kvref.profile`) and the llama-cpp-python release it names."""

    profile: str
    llama_cpp_python: str


class SidecarModel(TypedDict):
    """The model: its file name and sha256 (None when not given) and the arch."""

    file: str | None
    sha256: str | None
    arch: str | None


class SidecarContext(TypedDict):
    """The context parameters of the memory the file was saved from (`memory_context`)."""

    n_ctx: int
    n_seq_max: int
    kv_unified: bool
    flash_attn: bool
    type_k: str | None
    type_v: str | None
    swa_full: bool


class Sidecar(TypedDict):
    """``<file>.kvref.json`` (the module doc): what `write_sidecar` writes and `read_sidecar` returns. A reader
    keeps to the keys it knows (later versions may add some) and treats a missing one as unknown."""

    kvref_sidecar: int
    file: str
    kind: str
    payload: Payload
    era: str | None
    llama_cpp: LlamaCpp | None
    model: SidecarModel
    context: SidecarContext | None
    written_by: str


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """``<path>.kvref.json``."""
    p = Path(path)
    return p.with_name(p.name + SUFFIX)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The sha256 of a regular file's bytes (hex), read in 1 MiB blocks; anything else (a FIFO, a device, a
    socket, a directory) is a `FormatError`, never read (it could block or never end)."""
    not_regular = FormatError(f"{os.fspath(path)}: not a regular file, so no sidecar describes it")
    if not stat.S_ISREG(os.stat(path).st_mode):  # a socket cannot even be opened
        raise not_regular
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped since the stat
            raise not_regular
        h = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def memory_context(mem: AnyMemory) -> SidecarContext | None:
    """The context parameters a memory was built with (None when it was built without ``create_memory``)."""
    from ..ggml.types import type_name
    from ..memory.kv_cache import KVCache
    from .restore import leaf_caches

    cp = getattr(mem, "cparams", None)
    if cp is None:
        return None
    kv = [c for c in leaf_caches(mem) if isinstance(c, KVCache)]
    return {
        "n_ctx": cp.n_ctx,
        "n_seq_max": cp.n_seq_max,
        "kv_unified": cp.kv_unified,
        "flash_attn": cp.flash_attn,
        "type_k": type_name(kv[0].type_k) if kv else None,
        "type_v": type_name(kv[0].type_v) if kv else None,
        "swa_full": cp.swa_full,
    }


def write_sidecar(
    path: str | os.PathLike[str], *, model: str | os.PathLike[str] | None = None, memory: AnyMemory | None = None,
    state: StateObject | None = None, context: SidecarContext | None = None,
) -> Path:  # fmt: skip
    """Write ``<path>.kvref.json`` for the state file at ``path``; returns the sidecar's path.

    ``model``: the GGUF file (its sha256 is recorded); ``memory``: the memory the file was saved from (its profile
    and context); ``state``: the loaded state (default: ``path`` loaded); ``context`` overrides the context.
    """
    from .. import state as st
    from ..about import __version__
    from ..profile import NAMED
    from ..state.eras import era, matching_eras

    obj = state if state is not None else st.load(path)
    eras = matching_eras(obj)
    profile: Profile | None = getattr(memory, "profile", None)
    llama: LlamaCpp | None = None
    if profile is not None:
        llama = {"profile": profile.name, "llama_cpp_python": NAMED.get(profile.name, profile.name)}
    doc: Sidecar = {
        "kvref_sidecar": VERSION,
        "file": Path(path).name,
        "kind": obj.kind,
        "payload": {"size": os.path.getsize(path), "sha256": sha256_file(path)},
        "era": era(profile).name if profile is not None else (eras[-1] if eras else None),
        "llama_cpp": llama,
        "model": {
            "file": Path(model).name if model is not None else None,
            "sha256": sha256_file(model) if model is not None else None,
            "arch": getattr(obj, "arch", None) or (memory.hparams.arch if memory is not None else None),
        },
        "context": context if context is not None else (memory_context(memory) if memory is not None else None),
        "written_by": f"kvref {__version__}",
    }
    out = sidecar_path(path)
    text = (json.dumps(doc, indent=2) + "\n").encode()
    atomic_write(out, lambda f: f.write(text), follow_symlinks=False)
    return out


def read_sidecar(path: str | os.PathLike[str]) -> Sidecar | None:
    """The sidecar of the state file at ``path`` as a dict, or None when there is none. A sidecar that is not a
    regular file, is larger than `MAX_BYTES`, is not JSON or has a field of the wrong type is a `FormatError`."""
    p = sidecar_path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO planted there must not block the check
    except FileNotFoundError:
        return None
    except OSError as e:
        raise FormatError(f"{p}: cannot be read ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FormatError(f"{p}: not a regular file; a sidecar is a small JSON file (remove it, or save again "
                              "with sidecar=True)")  # fmt: skip
        raw = f.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise FormatError(f"{p}: larger than {MAX_BYTES} bytes, so not a kvref sidecar")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise FormatError(f"{p}: not valid JSON ({why})") from None
    if not isinstance(doc, dict) or doc.get("kvref_sidecar") != VERSION:
        raise FormatError(f'{p}: not a kvref sidecar of version {VERSION} (no "kvref_sidecar": {VERSION})')
    _check_fields(p, doc)
    return cast(Sidecar, doc)  # its version's layout, every known field of its type (checked above)


# field -> (allowed JSON types, whether null is allowed); a sha256 is also checked to be 64 lowercase hex digits
_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "file": ((str,), True),
    "kind": ((str,), False),
    "payload": ((dict,), True),
    "payload.size": ((int,), True),
    "payload.sha256": ((str,), True),
    "era": ((str,), True),
    "llama_cpp": ((dict,), True),
    "llama_cpp.profile": ((str,), True),
    "llama_cpp.llama_cpp_python": ((str,), True),
    "model": ((dict,), True),
    "model.file": ((str,), True),
    "model.sha256": ((str,), True),
    "model.arch": ((str,), True),
    "context": ((dict,), True),
    "written_by": ((str,), True),
}


def _check_fields(p: Path, doc: dict[str, object]) -> None:
    for name, (types, nullable) in _FIELDS.items():
        parent, _, leaf = name.rpartition(".")
        holder = doc.get(parent) if parent else doc
        if not isinstance(holder, dict) or leaf not in holder:
            continue
        value: object = holder[leaf]
        if value is None and nullable:
            continue
        ok = isinstance(value, types) and not isinstance(value, bool)
        if ok and isinstance(value, str) and leaf == "sha256":
            ok = len(value) == 64 and set(value) <= _HEX64
        if ok and isinstance(value, int) and leaf == "size":
            ok = value >= 0
        if not ok:
            want = {"sha256": "64 hex digits", "size": "a byte count"}.get(leaf, " or ".join(t.__name__ for t in types))
            raise FormatError(f"{p}: {name} is {json.dumps(value)[:60]}, not {want}{' or null' if nullable else ''}")


def verify_sidecar(path: str | os.PathLike[str], model: str | os.PathLike[str] | None = None) -> list[str]:
    """What the sidecar of ``path`` contradicts: the payload's size and sha256, and the model's sha256 (when
    ``model`` is given and the sidecar names one). Empty when there is no sidecar or everything agrees."""
    doc = read_sidecar(path)
    if doc is None:
        return []
    problems = []
    payload = doc.get("payload")
    size, sha = (payload.get("size"), payload.get("sha256")) if payload else (None, None)
    if size is not None and size != os.path.getsize(path):
        problems.append(f"the file has {os.path.getsize(path)} bytes, its sidecar says {size}")
    elif sha and sha != sha256_file(path):
        problems.append("the file's sha256 differs from its sidecar's: the file changed after it was written")
    doc_model = doc.get("model")
    want = doc_model.get("sha256") if doc_model else None
    if model is not None and want and want != sha256_file(model):
        name = (doc_model.get("file") if doc_model else None) or "another model"
        problems.append(f"the sidecar says the file was written with {name} (sha256 {want[:12]}...), not {model}")
    return problems


__all__ = [
    "SUFFIX",
    "LlamaCpp",
    "Payload",
    "Sidecar",
    "SidecarContext",
    "SidecarModel",
    "memory_context",
    "read_sidecar",
    "sha256_file",
    "sidecar_path",
    "verify_sidecar",
    "write_sidecar",
]
