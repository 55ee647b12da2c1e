"""Memory -> file in one call: `save_memory` writes what llama.cpp's state-saving functions write for a memory.

=============== ================================ =======================================================
``kind``        llama.cpp                        container
=============== ================================ =======================================================
``session``     llama_state_save_file            'ggsn', version, tokens, arch, [v9 outputs], memory
``seq``         llama_state_seq_save_file        'ggsq', version, tokens, memory of ``seq_id``
``state``       llama_state_get_data             arch, [v9 outputs], memory
``seq_state``   llama_state_seq_get_data(_ext)   [io_magic, seq_id], memory of ``seq_id``
=============== ================================ =======================================================

The layout is the era of the memory's own profile (``memory.profile``) unless ``era=`` asks for another one
(`kvref.state.eras`): an older era is written where its layout can hold the content, else a ConversionError says why
(a 12-byte cell ext with tokens into the 8-byte era; several streams into the layout before ``n_stream``).
``sidecar=True`` also writes ``<path>.kvref.json`` (`kvref.jobs.sidecar`)::

    kvref.save_memory(mem, "prompt.ggsn", tokens=toks)                     # what llama_state_save_file writes
    kvref.save_memory(mem, "slot2.ggsq", kind="seq", seq_id=2, era="2025") # a 0.3.16-era sequence file
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import ArgumentError, KVRefError
from ..profile import Profile

if TYPE_CHECKING:
    from ..state import KVSection, RecurrentSection, SeqStateBlob, StateObject
    from ..state.load import LoadOptions
    from ._types import AnyMemory

KINDS = ("session", "seq", "state", "seq_state")


def _layout_of(sections: Sequence[KVSection | RecurrentSection]) -> str:
    from ..state import LAYOUTS

    kinds = tuple(s.kind for s in sections)
    for name, ks in LAYOUTS.items():
        if ks == kinds:
            return name
    raise KVRefError(f"no state layout has the sections {kinds}")


def state_of(
    mem: AnyMemory, kind: str = "session", *, seq_id: int = -1, tokens: Sequence[int] = (), arch: str | None = None,
    flags: int = 0, era: Profile | str | None = None, copy: bool = True,
) -> StateObject:  # fmt: skip
    """The state object (``kvref.state.SessionFile`` / ``SeqFile`` / ``StateBlob`` / ``SeqStateBlob``) llama.cpp
    would write for ``mem``, in the layout of ``era`` (default: the memory's own profile). Rows are copies, or with
    ``copy=False`` may be views of the memory's buffers, valid until it changes (`Memory.state_sections`)."""
    from .. import state
    from ..state.eras import era as era_of
    from ..state.eras import to_era
    from .restore import memory_has_ext

    if kind not in KINDS:
        raise ArgumentError(f"kind must be one of {KINDS}, not {kind!r}")
    scoped = kind in ("seq", "seq_state")
    if scoped and seq_id < 0:
        raise ArgumentError(f"a {kind} holds one sequence: pass seq_id >= 0")
    if not scoped and seq_id != -1:
        raise ArgumentError(f"a {kind} holds the whole context: seq_id must be -1, not {seq_id}")
    own = era_of(mem.profile)
    sections = list(mem.state_sections(seq_id, flags, copy=copy))
    memory = state.MemorySections(_layout_of(sections), sections)
    toks = np.asarray(list(tokens), dtype=np.int32)
    arch = arch or mem.hparams.arch
    obj: StateObject
    if kind == "session":
        obj = state.SessionFile(version=own.session_version, tokens=toks, arch=arch, outputs=None, memory=memory)
    elif kind == "seq":
        obj = state.SeqFile(version=own.seq_version, tokens=toks, memory=memory)
    elif kind == "state":
        obj = state.StateBlob(arch=arch, outputs=None, memory=memory)
    else:
        obj = state.SeqStateBlob(memory=memory, seq_id=seq_id if own.seq_header else None, has_header=own.seq_header)
    return to_era(obj, era if era is not None else own, has_ext=memory_has_ext(mem), seq_id=seq_id)


def save_memory(
    mem: AnyMemory, path: str | os.PathLike[str] | None = None, kind: str = "session", *, seq_id: int = -1,
    tokens: Sequence[int] = (), arch: str | None = None, flags: int = 0, era: Profile | str | None = None,
    compat: Profile | str | None = None, sidecar: bool = False, model: str | os.PathLike[str] | None = None,
    durable: bool = True,
) -> StateObject:  # fmt: skip
    """Write ``mem`` as llama.cpp's ``kind`` of state to ``path`` (crash-safe, `kvref.state.save`; ``durable=False``
    skips its fsyncs, as llama.cpp's save does); returns the state object written: read back from ``path``
    (memory-mapped; the rows are written straight from the memory's buffers), or with no ``path`` built with copies
    of the rows.

    ``kind``: "session", "seq", "state" or "seq_state"; ``seq_id`` the sequence of a "seq" / "seq_state"
    (-1 for the others); ``tokens`` the token list of a file; ``arch`` the arch string (default the model's);
    ``flags`` LLAMA_STATE_SEQ_FLAGS (PARTIAL_ONLY: only the SWA cache of an iSWA memory / the recurrent part of
    a hybrid); ``era`` (or its alias ``compat``) the layout to write (an era name, compat name, release or
    Profile; default the memory's own: a memory `kvref.restore` built from an older file writes that file's
    layout again, pass ``era="2026-10"`` to upgrade). ``sidecar=True`` writes ``<path>.kvref.json`` too
    (``model``: the GGUF file, for its sha256). Raises ConversionError when the era cannot hold the memory's content.
    """
    if era is not None and compat is not None and era != compat:
        raise ArgumentError("era= and compat= name the same thing: pass one")
    obj = state_of(mem, kind, seq_id=seq_id, tokens=tokens, arch=arch, flags=flags, era=era or compat,
                   copy=path is None)  # fmt: skip
    if path is not None:
        from .. import state

        state.save(obj, path, durable=durable)
        # the object the file holds: independent of the memory, whose buffers the rows were written from
        header: LoadOptions = {"seq_header": cast("SeqStateBlob", obj).has_header} if kind == "seq_state" else {}
        obj = state.load(path, kind, obj.memory.layout, **header)
        if sidecar:
            from .sidecar import write_sidecar

            write_sidecar(path, model=model, memory=mem, state=obj)
    return obj


__all__ = ["KINDS", "save_memory", "state_of"]
