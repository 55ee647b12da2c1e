"""What must be equal for two states' K/V rows of the same tokens to be the same bytes: the store's namespace.

A namespace is the model's identity (`kvref.store.model_id`: its weights), the state's geometry (layout, every
section's layer types and row sizes, ``v_trans`` / ``s_trans``: this is where K/V types and flash attention
show), the layout era of the llama.cpp that wrote it, the cell ext size, the SWA window and type, the RoPE
parameters and whether quantized K/V were rotated (LLAMA_ATTN_ROT_DISABLE). Its id hashes all of it, so a state
from another model or another context never meets a chunk of this one. The record is kept whole in the store: it
is what turns chunks back into sections.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, cast

from ..errors import ArgumentError, FormatError
from ..ggml import type_name

if TYPE_CHECKING:
    from ..hparams import HParams
    from ..state import KVSection, LayerRows, RecurrentSection, StateObject, TransposedRows

# JSON shapes of a section's geometry: ("rows", type, row_size) / ("trans", type, el_size, n_embd)
Rows = list[int | str]


@dataclass(frozen=True)
class KVGeometry:
    """One attention KV section: ``swa`` for the sliding-window cache of an iSWA memory."""

    swa: bool
    v_trans: int
    k: list[Rows]  # ("rows", type, row_size) per layer
    v: list[Rows]  # ("rows", type, row_size) or ("trans", type, el_size, n_embd) per layer; [] without V
    kind: str = "kv"


@dataclass(frozen=True)
class RecurrentGeometry:
    """The recurrent section: R rows (with PLE rows when ``r`` has a third size) and S rows per state layer."""

    s_trans: int
    n_layer: int
    r: list[list[int | None]]  # (type, row_size, p_row_size or None) per state layer
    s: list[Rows]
    kind: str = "recurrent"


Geometry = KVGeometry | RecurrentGeometry


@dataclass(frozen=True)
class Namespace:
    """Everything that decides the bytes of K/V for given tokens; ``id`` hashes it."""

    model: str  # "sha256:..." of the weights
    arch: str
    layout: str
    era: str  # the layout era of the writer (kvref.state.eras)
    ext_size: int
    sections: tuple[Geometry, ...]
    n_swa: int = 0
    swa_type: int = 0
    rope: tuple[float, ...] = ()
    attn_rot: bool = False
    extra: tuple[tuple[str, str], ...] = field(default=())  # the caller's own context keys (rope overrides, ...)

    @cached_property
    def id(self) -> str:
        """32 hex digits of the BLAKE2b of the record's canonical JSON."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=16).hexdigest()

    def to_json(self) -> str:
        """The record as canonical JSON (what the store keeps)."""
        return self._json

    @cached_property
    def _json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Namespace:
        """The record `to_json` wrote."""
        d = json.loads(text)
        secs: list[Geometry] = []
        for s in d.pop("sections"):
            if s["kind"] == "kv":
                secs.append(KVGeometry(**s))
            else:
                secs.append(RecurrentGeometry(**s))
        d["rope"] = tuple(d["rope"])
        d["extra"] = tuple(tuple(x) for x in d["extra"])
        return cls(sections=tuple(secs), **d)

    @property
    def kv(self) -> list[tuple[int, KVGeometry]]:
        """(section index, geometry) of the attention sections."""
        return [(i, g) for i, g in enumerate(self.sections) if isinstance(g, KVGeometry)]

    @property
    def recurrent(self) -> tuple[int, RecurrentGeometry] | None:
        """(section index, geometry) of the recurrent section, if the memory has one."""
        for i, g in enumerate(self.sections):
            if isinstance(g, RecurrentGeometry):
                return i, g
        return None

    def type_k(self) -> str | None:
        """The K type of the first attention layer (``f16``, ``q8_0``, ...)."""
        for _, g in self.kv:
            if g.k:
                return type_name(int(g.k[0][1]))
        return None

    def type_v(self) -> str | None:
        """The V type of the first attention layer."""
        for _, g in self.kv:
            if g.v:
                return type_name(int(g.v[0][1]))
        return None

    def flash_attn(self) -> bool | None:
        """Flash attention as the rows show it: V transposed without it (when V is stored at all)."""
        for _, g in self.kv:
            if g.v:
                return not g.v_trans
        return None

    def matches(self, context: Mapping[str, object]) -> bool:
        """Does this namespace fit a caller's context (only the keys given are compared)?"""
        for key, want in context.items():
            if want is None:
                continue
            if key in ("type_k", "type_v"):
                have = self.type_k() if key == "type_k" else self.type_v()
                if have is not None and type_name_of(want) != have:
                    return False
            elif key == "flash_attn":
                have_fa = self.flash_attn()
                if have_fa is not None and flash_attn_flag(want) != have_fa:
                    return False
            elif key == "era":
                from ..state.eras import era

                if era(cast("str", want)).name != self.era:
                    return False
            elif key == "arch":
                if want != self.arch:
                    return False
            elif key == "extra":
                if _extra(cast("Mapping[str, object]", want)) != self.extra:
                    return False
            else:
                raise ArgumentError(f"unknown context key {key!r} for the store's namespace")
        return True


def type_name_of(t: object) -> str:
    """A ggml type given by name or id, as its name."""
    if isinstance(t, str):
        return t.lower()
    return type_name(cast("int", t))


def flash_attn_flag(v: object) -> bool:
    """llama.cpp's flash attention setting as a bool (``"on"``, ``"enabled"``, True ...)."""
    if isinstance(v, str):
        if v.lower() in ("on", "enabled", "true", "1"):
            return True
        if v.lower() in ("off", "disabled", "false", "0"):
            return False
        raise ArgumentError(f"flash_attn={v!r}: pass on/off (the store needs to know which one wrote the rows)")
    return bool(v)


def _extra(extra: Mapping[str, object] | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), repr(v)) for k, v in (extra or {}).items()))


def _rows(r: LayerRows | TransposedRows) -> Rows:
    from ..state import TransposedRows

    if isinstance(r, TransposedRows):
        return ["trans", int(r.type), int(r.el_size), int(r.n_embd)]
    return ["rows", int(r.type), int(r.row_size)]


def _kv_geometry(sec: KVSection, swa: bool, where: str) -> KVGeometry:
    for st in sec.streams:
        if st.data is not None:
            d = st.data
            return KVGeometry(swa=swa, v_trans=int(d.v_trans), k=[_rows(r) for r in d.k], v=[_rows(r) for r in d.v])
    raise FormatError(f"{where}: the attention section holds no cells, so the store cannot tell its row layout")


def _recurrent_geometry(sec: RecurrentSection) -> RecurrentGeometry:
    r = [[int(x.type), int(x.row_size), None if x.p_row_size is None else int(x.p_row_size)] for x in sec.r]
    return RecurrentGeometry(s_trans=int(sec.s_trans), n_layer=int(sec.n_layer), r=r, s=[_rows(x) for x in sec.s])


def namespace_of(
    obj: StateObject, model: str, hp: HParams | None, *, arch: str | None = None,
    extra: Mapping[str, object] | None = None,
) -> Namespace:  # fmt: skip
    """The namespace of a loaded state written by the model ``model`` (its id) with hyper-parameters ``hp``."""
    from ..ggml.rotation import rotation_disabled
    from ..ggml.types import traits
    from ..state.eras import matching_eras

    layout = obj.memory.layout
    swa_index = {"iswa": 1, "hybrid_iswa": 1}.get(layout, -1)
    secs: list[Geometry] = []
    for i, sec in enumerate(obj.memory.sections):
        if sec.kind == "kv":
            secs.append(_kv_geometry(cast("KVSection", sec), i == swa_index, f"section {i}"))
        else:
            secs.append(_recurrent_geometry(cast("RecurrentSection", sec)))
    if swa_index >= 0 and hp is None:
        raise ArgumentError(
            "an iSWA state needs the model's hyper-parameters (its window): pass model= as the GGUF path"
        )
    eras = matching_eras(obj)
    arch = arch or getattr(obj, "arch", None) or (hp.arch if hp is not None else None)
    if not arch:
        raise ArgumentError("a sequence state does not name its arch: pass model= as the GGUF path")
    ext = 0
    for sec in obj.memory.kv_sections:
        for st in sec.streams:
            if st.cells is not None:
                ext = max(ext, st.cells.ext_size)
    quantized = any(traits(int(r[1])).is_quantized for g in secs if isinstance(g, KVGeometry) for r in (*g.k, *g.v))
    rope: tuple[float, ...] = ()
    if hp is not None:
        rope = (float(hp.rope_type), float(hp.n_rot), hp.rope_freq_base, hp.rope_freq_scale,
                hp.rope_freq_base_swa or 0.0, hp.rope_freq_scale_swa or 0.0)  # fmt: skip
    return Namespace(
        model=model, arch=arch, layout=layout, era=eras[-1] if eras else "unknown", ext_size=ext,
        sections=tuple(secs), n_swa=hp.n_swa if hp is not None and swa_index >= 0 else 0,
        swa_type=int(hp.swa_type) if hp is not None and swa_index >= 0 else 0, rope=rope,
        attn_rot=quantized and not rotation_disabled(os.environ), extra=_extra(extra),
    )  # fmt: skip


__all__ = ["Geometry", "KVGeometry", "Namespace", "RecurrentGeometry", "namespace_of"]
