"""``kvref convert``: rewrite a state file -- upgrade its era, cut out a sequence, merge sequences, remap ids,
change its streams -- without a model and without llama.cpp.

`convert` loads the input(s), applies the edits in this order -- merge (or extract), remap, streams -- then writes
the layout of ``era`` (default: the current one, so a plain ``convert(old, new)`` upgrades). Each step is one
function of ``kvref.jobs.edit`` / ``kvref.state.eras``::

    kvref.convert("old-0.3.16.ggsn", "new.ggsn")                        # session v9 -> v10
    kvref.convert("session.ggsn", "seq3.ggsq", seq=3)                   # one sequence, as a sequence file
    kvref.convert("a.ggsq", "ab.ggsn", merge=["b.ggsq"], arch="llama")  # a -> seq 0, b -> seq 1
    kvref.convert("s.ggsn", "t.ggsn", seq_map={0: 3}, streams="per-seq", n_stream=4)
    kvref.convert("new.ggsn", "old.ggsn", era="2025")                   # write 0.3.16's layout, where it can

    kvref.convert("f16.ggsn", "q8.ggsn", type_k="q8_0", type_v="q8_0", model="m.gguf")  # retype K/V
    kvref.convert("0.2.83.ggsn", "new.ggsn", model="m.gguf")    # session v7: its KV rows need the model
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from ..errors import ArgumentError, ConversionError, NotYetImplemented
from ..profile import Profile

if TYPE_CHECKING:
    from ..ggml.types import TypeLike
    from ..hparams import HParams
    from ..state import MemorySections, SeqFile, SeqStateBlob, SessionFile, StateObject
    from ._types import ModelSource, StateSource


def parse_map(text: str) -> dict[int, int]:
    """``"0:3,1:2"`` -> ``{0: 3, 1: 2}`` (the ``--map`` syntax)."""
    out: dict[int, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        a, sep, b = part.partition(":")
        if not sep:
            raise ArgumentError(f"--map entries are OLD:NEW, got {part!r}")
        try:
            out[int(a)] = int(b)
        except ValueError:
            raise ArgumentError(f"--map entries are integer OLD:NEW, got {part!r}") from None
    return out


def _load(src: StateSource, model: ModelSource | None = None) -> StateObject:
    import copy

    from .. import state

    # the model: what a session of version 5 .. 7 needs to be read (kvref.state.legacy); other files ignore it
    return copy.copy(src) if isinstance(src, state.StateObject) else state.load(src, model=model)


def _arch(arch: str | None, model: ModelSource | None, obj: StateObject) -> str | None:
    if arch is not None:
        return arch
    if model is not None:
        from ..hparams import HParams

        return (model if isinstance(model, HParams) else HParams.from_gguf(model)).arch
    own: str | None = getattr(obj, "arch", None)  # sessions and state blobs name it
    return own


def _era_rotates(obj: StateObject) -> bool:
    from .tensors import _era_rotates as rotates

    return rotates(obj)


def _hparams_of(model: ModelSource | None) -> HParams | None:
    if model is None:
        return None
    from ..hparams import HParams

    return model if isinstance(model, HParams) else HParams.from_gguf(model)


def _container(
    kind: str, memory: MemorySections, *, tokens: npt.ArrayLike | None, arch: str | None, seq_id: int | None
) -> StateObject:
    from .. import state

    toks = np.asarray([] if tokens is None else tokens, dtype=np.int32)
    if kind in ("session", "state") and arch is None:
        raise ArgumentError(
            f"a {kind} names the model's arch, which sequence states do not carry: pass arch= or model= "
            "(kvref convert --arch ARCH or --model M.gguf)"
        )
    if kind == "session":
        assert arch is not None
        return state.SessionFile(version=10, tokens=toks, arch=arch, outputs=None, memory=memory)
    if kind == "state":
        assert arch is not None
        return state.StateBlob(arch=arch, outputs=None, memory=memory)
    if kind == "seq":
        return state.SeqFile(version=3, tokens=toks, memory=memory)
    if kind == "seq_state":
        return state.SeqStateBlob(memory=memory, seq_id=seq_id, has_header=True)
    raise ArgumentError(f"kind must be session, seq, state or seq_state, not {kind!r}")


def convert(
    src: StateSource, dst: str | os.PathLike[str] | None = None, *, era: Profile | str | None = None,
    seq: int | None = None, merge: Sequence[StateSource] = (), seq_map: Mapping[int, int] | str | None = None,
    streams: str | None = None, n_stream: int | None = None, kind: str | None = None,
    tokens: Sequence[int] | None = None, arch: str | None = None, model: ModelSource | None = None,
    type_k: TypeLike | None = None, type_v: TypeLike | None = None, sidecar: bool = False,
    head_dim: int | None = None, progress: bool | None = None,
) -> StateObject:  # fmt: skip
    """Rewrite the state ``src`` (a path, bytes or loaded state) and write it to ``dst`` (when given); returns the
    new state object.

    - ``merge``: more sequence states; ``src`` becomes sequence 0, ``merge[k]`` sequence ``k + 1`` of one
      session (``kind`` "state" for a blob); ``arch=`` / ``model=`` give the arch a session names;
    - ``seq``: cut sequence ``seq`` out of a session / state into a sequence file (``kind`` "seq_state" for a
      blob; the token list is kept when the input holds only that sequence, else ``tokens=``);
    - ``seq_map``: rename sequence ids (``{0: 3}`` or ``"0:3,1:2"``);
    - ``streams``: "unified" or "per-seq" (``n_stream`` streams, default the largest id + 1);
    - ``era``: the layout to write (`kvref.state.eras`; default the current one); ``kind``: another container of the
      same scope (session <-> state, seq <-> seq_state);
    - ``sidecar``: write ``<dst>.kvref.json`` too (``model``: the GGUF file, for its sha256).

    - ``type_k`` / ``type_v``: retype the K / V rows (`kvref.jobs.retype`: dequantize, undo / apply llama.cpp's
      attention rotation, quantize); ``model=`` (or ``head_dim=``) gives the head size a rotation needs;
      ``progress``: a bar on stderr (None: when it is a terminal).

    Raises QuantError for a type kvref cannot write; ConversionError / EditError when the edit or the era
    cannot hold the content.
    """
    from .. import state as st
    from ..state.eras import CURRENT, ext_unknown, is_mrope_arch, to_era
    from .edit import extract_sequence, merge_sequences, remap_sequences, restream, sequences

    if merge and seq is not None:
        raise ArgumentError("merge= and seq= exclude each other: extract first, then merge")
    obj = _load(src, model)
    edits = seq is not None or merge or seq_map or streams or n_stream or type_k or type_v
    if obj.memory.layout == "dsv4" and edits:
        raise NotYetImplemented(
            "convert does not cut, merge, remap, restream or retype a DSV4 (deepseek4) state yet (compressed caches, "
            "compressor states); it rewrites its container only"
        )
    the_arch = _arch(arch, model, obj)
    src_rotates = _era_rotates(obj)  # the era of the input, before any container change
    if merge:
        objs = [obj, *(_load(m, model) for m in merge)]
        for o in objs:
            if o.kind not in ("seq", "seq_state"):
                raise ArgumentError(f"merge takes sequence files or blobs; one input is a {o.kind}")
        ids = list(range(len(objs)))
        memory = merge_sequences([o.memory for o in objs], ids, per_seq_streams=streams == "per-seq",
                                 n_stream=n_stream)  # fmt: skip
        toks = tokens if tokens is not None else getattr(objs[0], "tokens", None)
        obj = _container(kind or "session", memory, tokens=toks, arch=the_arch, seq_id=None)
    elif seq is not None:
        if obj.kind not in ("session", "state"):
            raise ArgumentError(f"seq= cuts a sequence out of a session or state; this is a {obj.kind}")
        only = sequences(obj.memory) == [seq]
        memory = extract_sequence(obj.memory, seq)
        toks = tokens if tokens is not None else (getattr(obj, "tokens", None) if only else None)
        obj = _container(kind or "seq", memory, tokens=toks, arch=None, seq_id=seq)
    elif kind is not None and kind != obj.kind:
        scope = {"session": 0, "state": 0, "seq": 1, "seq_state": 1}
        if scope.get(kind) != scope[obj.kind]:
            raise ArgumentError(f"a {obj.kind} cannot become a {kind} by itself: use seq= or merge=")
        sid = getattr(obj, "seq_id", None)
        sid = sid if sid is not None else (sequences(obj.memory) or [0])[0]
        toks = tokens if tokens is not None else getattr(obj, "tokens", None)
        obj = _container(kind, obj.memory, tokens=toks, arch=the_arch, seq_id=sid)
    elif tokens is not None and hasattr(obj, "tokens"):
        cast("SessionFile | SeqFile", obj).tokens = np.asarray(tokens, np.int32)
    if seq_map:
        mapping = parse_map(seq_map) if isinstance(seq_map, str) else dict(seq_map)
        obj.memory = remap_sequences(obj.memory, mapping)
        blob = cast("SeqStateBlob", obj) if obj.kind == "seq_state" else None
        if blob is not None and blob.seq_id is not None:
            blob.seq_id = mapping.get(blob.seq_id, blob.seq_id)
    if streams is not None and not (merge and streams == "per-seq"):
        obj.memory = restream(obj.memory, streams, n_stream)
    if type_k is not None or type_v is not None:
        from ..state.eras import era as era_of
        from .retype import retype
        from .tensors import era_rotates

        hp = _hparams_of(model)
        dst_rotates = era_rotates(era_of(era if era is not None else CURRENT).name)
        obj = retype(obj, type_k=type_k, type_v=type_v, src_rotates=src_rotates, dst_rotates=dst_rotates,
                     hparams=hp, head_dim=head_dim, progress=progress)  # fmt: skip
    target = era if era is not None else CURRENT
    if the_arch is None and ext_unknown(obj, target):
        raise ConversionError(
            f"whether this {obj.kind} needs llama.cpp's M-RoPE cell ext in the layout written cannot be known: its "
            "cells have none, as llama.cpp before 0.3.17 wrote them for every model, and it names no arch. Say "
            "which model wrote it: model= or arch= (kvref convert --model M.gguf, or --arch llama / qwen2vl / ...)"
        )
    out = to_era(obj, target, has_ext=is_mrope_arch(the_arch))
    if dst is not None:
        st.save(out, dst)
        if sidecar:
            from .sidecar import write_sidecar

            write_sidecar(dst, model=model if isinstance(model, str | os.PathLike) else None, state=out)
    return out


__all__ = ["NotYetImplemented", "convert", "parse_map"]
