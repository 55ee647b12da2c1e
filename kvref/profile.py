"""Behaviour profiles: what the llama.cpp a memory reproduces does, one named field per difference.

kvref follows llama.cpp as vendored by llama-cpp-python 0.3.36 by default. Where an older llama.cpp behaves
differently, a memory built with that llama.cpp's ``Profile`` reproduces it: every memory (``create_memory``,
``KVCache``, ``KVCacheISWA``, ``RecurrentMemory``, ``HybridMemory``) takes ``compat=`` -- a ``Profile``, a
named generation (``"2026-10"``, ``"2026-08"``, ``"2025"``, ``"2025-07"``) or a llama-cpp-python release
(``"0.3.12"`` .. ``"0.3.36"``) -- keeps the resolved profile as ``memory.profile`` and asks it named
questions (``memory.profile.cell_ext_size``), never a date.

``TABLE`` is the one place that says in which llama-cpp-python release each behaviour changed (from reading
every release's vendored sources: llama-kv-cache(-unified).cpp, llama-kv-cells.h, llama-context.cpp,
llama-memory-recurrent.cpp, llama-batch.cpp, llama.h); ``for_release`` computes a release's profile from it,
and ``Profile``'s own defaults are the newest values. A llama.cpp build kvref has never seen gets a profile
of its own: ``dataclasses.replace(for_release("0.3.36"), cell_ext_size=8)`` or ``Profile(cell_ext_size=8)``
(every field not given keeps the newest value).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeAlias, TypeVar

from .errors import CompatError

# every llama-cpp-python release whose vendored llama.cpp sources were read (oldest first)
RELEASES = tuple(f"0.3.{i}" for i in range(12, 37))
# the named generations (goldens pin each) and the release each one is (its goldens were produced with it)
COMPAT_2026_10 = "2026-10"  # llama.cpp 0c1e570 as vendored by llama-cpp-python 0.3.36 (October 2026)
COMPAT_2026_08 = "2026-08"  # llama.cpp 4df29be as vendored by llama-cpp-python 0.3.35 (August 2026)
COMPAT_2025 = "2025"  # llama.cpp 4227c9b as vendored by llama-cpp-python 0.3.16 (August 2025)
COMPAT_2025_07 = "2025-07"  # llama.cpp a0374a6 as vendored by llama-cpp-python 0.3.12 (July 2025)
NAMED = {COMPAT_2025_07: "0.3.12", COMPAT_2025: "0.3.16", COMPAT_2026_08: "0.3.35", COMPAT_2026_10: "0.3.36"}
COMPATS = (COMPAT_2026_10, COMPAT_2026_08, COMPAT_2025, COMPAT_2025_07)
DEFAULT = COMPAT_2026_10
CUSTOM = "custom"  # the name of a profile that no release in RELEASES behaves as

# llm_arch_supports_rs_rollback: the archs that keep their n_rs_seq (other archs get it clamped to 0)
RS_ROLLBACK_ARCHS = frozenset({
    "kimi-k3", "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "glm5-next", "nemotron_h", "nemotron_h_moe",
    "lfm2", "lfm2moe", "bailingmoe3",
})  # fmt: skip
# the list as llama-cpp-python 0.3.35 has it; assumed from 0.3.24 on (llama-arch.cpp was not checked there: an
# arch a release lacks cannot be loaded by it anyway)
RS_ROLLBACK_ARCHS_2026_08 = frozenset({"qwen35", "qwen35moe", "deepseek4", "nemotron_h", "nemotron_h_moe"})

# ------------------------------------------------------------------------------------------------ the table
# what a behaviour's value is: the type of its Profile field
Behaviour: TypeAlias = bool | int | str | tuple[int, int] | frozenset[str]
_B = TypeVar("_B", bool, int, str, tuple[int, int], frozenset[str])

# field -> ((first llama-cpp-python release with the value, value), ...), oldest first. The only place a
# release is tied to a behaviour; ``Profile`` documents what each value means.
TABLE: dict[str, tuple[tuple[str, Behaviour], ...]] = {
    # PR #14363
    "kv_streams": (("0.3.12", False), ("0.3.15", True)),
    "whole_restore_clear": (("0.3.12", "once"), ("0.3.15", "per_stream"), ("0.3.36", "once")),
    "kv_seq_rm_all_asserts": (("0.3.12", False), ("0.3.15", True), ("0.3.16", False)),
    # context / cache sizing
    "n_ctx_pad": (("0.3.12", 1), ("0.3.17", 256)),
    "n_kv_pad": (("0.3.12", (32, 256)), ("0.3.17", (1, 1))),
    "n_batch_min": (("0.3.12", 64), ("0.3.17", 0)),
    "swa_size_pad": (("0.3.12", 0), ("0.3.17", 256)),
    "get_n_kv_pad": (("0.3.12", 1), ("0.3.17", 256)),
    "get_n_kv_streams": (("0.3.12", "all"), ("0.3.17", "slot")),
    # KV cells, K-shift, state
    "cell_ext_size": (("0.3.12", 0), ("0.3.17", 8), ("0.3.36", 12)),
    "cell_ext_ple": (("0.3.12", False), ("0.3.36", True)),
    "shift_refuses_mrope": (("0.3.12", False), ("0.3.17", True)),
    "kshift_skips_nope": (("0.3.12", False), ("0.3.35", True)),
    "seq_restore_contiguous": (("0.3.12", True), ("0.3.17", False)),
    "seq_save_keeps_masked_swa": (("0.3.12", True), ("0.3.26", False)),
    "decode_seq_id_bound": (("0.3.12", "llama_max_seq_if_unified"), ("0.3.36", "n_seq_max")),
    # recurrent memory
    "recurrent_seq_rm_rule": (("0.3.12", "any_end_inside"), ("0.3.17", "cuts_tail")),
    "recurrent_seq_rm_checks_n_seq_max": (("0.3.12", False), ("0.3.36", True)),
    "recurrent_split_sequential": (("0.3.12", False), ("0.3.17", True)),
    "recurrent_restore_seq_bound": (("0.3.12", "mem_size"), ("0.3.17", "n_seq_max")),
    "rs_rollback_archs": (
        ("0.3.12", frozenset()), ("0.3.24", RS_ROLLBACK_ARCHS_2026_08), ("0.3.36", RS_ROLLBACK_ARCHS),
    ),
    "recurrent_rows_from_src": (("0.3.12", False), ("0.3.24", True)),
    "recurrent_rollback_split": (("0.3.12", "seq"), ("0.3.34", "equal")),
    "recurrent_rollback_single_use": (("0.3.12", False), ("0.3.36", True)),
    # hybrid memory
    "hybrid_restore_undo": (("0.3.12", False), ("0.3.36", True)),
    # attention rotation of quantized K/V (llama-kv-cache.cpp attn_rot_k / attn_rot_v): read in 0.3.36's sources;
    # older releases are taken as not rotating (their sources were not checked for it)
    "attn_rotation": (("0.3.12", False), ("0.3.36", True)),
    # a sequence save's KV cells list the saved id (and a sequence restore requires exactly one); llama.cpp before
    # the unified cache of 0.3.10 (llama-cpp-python 0.2.84 .. 0.3.9: read in their state code, 0.2.90 and 0.3.0
    # checked by goldens) wrote none and required none: kvref.compat's profile for those releases has False
    "kv_seq_save_ids": (("0.3.12", True),),
}  # fmt: skip

# the values a field may take, where it is one of a few
CHOICES: dict[str, tuple[Behaviour, ...]] = {
    "whole_restore_clear": ("once", "per_stream"),
    "cell_ext_size": (0, 8, 12),
    "get_n_kv_streams": ("all", "slot"),
    "decode_seq_id_bound": ("llama_max_seq_if_unified", "n_seq_max"),
    "recurrent_seq_rm_rule": ("any_end_inside", "cuts_tail"),
    "recurrent_restore_seq_bound": ("mem_size", "n_seq_max"),
    "recurrent_rollback_split": ("seq", "equal"),
}


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split("."))


def value_at(name: str, release: str) -> Behaviour:
    """The value of behaviour ``name`` in ``release`` (a release in RELEASES), read off TABLE."""
    value = TABLE[name][0][1]
    for first, v in TABLE[name]:
        if _key(release) >= _key(first):
            value = v
    return value


def _newest(name: str, kind: type[_B]) -> _B:
    """The newest value of behaviour ``name``: its Profile field's default, of the field's type ``kind``."""
    value = TABLE[name][-1][1]
    if not isinstance(value, kind):
        raise TypeError(f"TABLE[{name!r}] holds {value!r}, not the {kind.__name__} of Profile.{name}")
    return value


@dataclass(frozen=True, repr=False)
class Profile:
    """What a llama.cpp build does where kvref models a difference: one field per behaviour.

    Two profiles are equal when every behaviour is (``name`` is not compared). ``name`` (also ``compat``) is
    the named generation or release the profile behaves as, or ``"custom"``; ``str(profile)`` is the name.
    TABLE says which releases have which value; a field's docstring says what llama.cpp does under each.
    """

    kv_streams: bool = _newest("kv_streams", bool)
    """True: one cell table per stream (the context's ``kv_unified`` chooses one or ``n_seq_max``), the KV
    section starts with ``u32 n_stream``, an empty stream is only its zero ``cell_count`` and restoring it
    changes nothing. False (before PR #14363): one cache for every sequence (``kv_unified`` is forced), no
    ``n_stream`` field, an empty section still carries the data header (``v_trans``, ``n_layer``, each layer's
    type and row size), and a sequence restore of an empty section fails (``find_slot`` of zero tokens)."""
    whole_restore_clear: str = _newest("whole_restore_clear", str)
    """A whole restore (``seq_id == -1``): ``"once"``: ``clear(true)`` up front (even of an empty section),
    then every stream is read; ``"per_stream"``: empty streams are skipped and every other stream's read begins
    with ``clear(true)``, so only the last non-empty stream survives and an all-empty section changes nothing."""
    kv_seq_rm_all_asserts: bool = _newest("kv_seq_rm_all_asserts", bool)
    """True: KV ``seq_rm(-1, ...)`` hits ``GGML_ASSERT(seq_id >= 0 ...)`` before its ``seq_id < 0`` branch (an
    abort: kvref raises SequenceError). False: it removes every sequence."""
    n_ctx_pad: int = _newest("n_ctx_pad", int)
    """The context pads ``n_ctx`` to this (not unified: ``n_ctx_seq = pad(n_ctx / n_seq_max)``). 1: the
    context does not pad; create_memory pads to ``n_kv_pad`` per stream instead (``pad(ceil(n_ctx /
    n_seq_max))``, a recurrent model's n_ctx as given, a hybrid model's as if unified)."""
    n_kv_pad: tuple[int, int] = _newest("n_kv_pad", tuple)
    """The KV cache's ``n_pad`` as create_memory builds it: (without, with flash attention)."""
    n_batch_min: int = _newest("n_batch_min", int)
    """``n_batch`` is raised to at least this (GGML_KQ_MASK_PAD 64); 0: no minimum."""
    swa_size_pad: int = _newest("swa_size_pad", int)
    """The iSWA cache pads its SWA cache size to this; 0: to the cache's ``n_pad``."""
    get_n_kv_pad: int = _newest("get_n_kv_pad", int)
    """``get_n_kv`` pads ``used_max_p1`` to ``max(n_pad, get_n_kv_pad)``."""
    get_n_kv_streams: str = _newest("get_n_kv_streams", str)
    """``get_n_kv`` takes the maximum over ``"all"`` streams, or over the ``"slot"``'s streams only."""
    cell_ext_size: int = _newest("cell_ext_size", int)
    """Bytes of ``llama_kv_cell_ext`` per cell in the state of a cache that has one: 0 (none written or read),
    8 (``i32 x, y``) or 12 (``i32 x, y, tok``). M-RoPE caches have one (see also ``cell_ext_ple``)."""
    cell_ext_ple: bool = _newest("cell_ext_ple", bool)
    """True: a model with per-layer-embedding n-grams (``ple_n_heads > 0``) has a cell ext too (its token)."""
    shift_refuses_mrope: bool = _newest("shift_refuses_mrope", bool)
    """True: ``get_can_shift`` is false for M-RoPE (and step35's per-layer rope dims); False: always true."""
    kshift_skips_nope: bool = _newest("kshift_skips_nope", bool)
    """True: the K-shift leaves layers without rope (``!hparams.has_rope(il)``) alone; False: ropes every layer."""
    seq_restore_contiguous: bool = _newest("seq_restore_contiguous", bool)
    """True: a sequence restore places its cells with ``find_slot(cont=true)`` (one contiguous block) and moves
    the stream's head to the first restored cell; False: ``find_slot(cont=false)``, head left by apply_ubatch."""
    seq_save_keeps_masked_swa: bool = _newest("seq_save_keeps_masked_swa", bool)
    """True: a sequence save writes every non-empty cell of the sequence; False: it leaves out the cells
    SWA-masked against the sequence's last position."""
    decode_seq_id_bound: str = _newest("decode_seq_id_bound", str)
    """The bound llama_decode puts on seq ids: ``"n_seq_max"`` (the context's, unified or not:
    llama_batch_ext) or ``"llama_max_seq_if_unified"`` (``kv_unified ? LLAMA_MAX_SEQ : n_seq_max``)."""
    recurrent_seq_rm_rule: str = _newest("recurrent_seq_rm_rule", str)
    """Which partial removals recurrent ``seq_rm`` refuses: ``"cuts_tail"``: ``0 < p0 <= pos < p1`` (unless a
    rollback snapshot serves it; a whole-range removal resets the rollback index); ``"any_end_inside"``: any
    range with an end strictly inside ``(0, pos]`` (no rollback: ``n_rs_seq`` is refused)."""
    recurrent_seq_rm_checks_n_seq_max: bool = _newest("recurrent_seq_rm_checks_n_seq_max", bool)
    """True: recurrent ``seq_rm`` refuses any id outside ``[0, n_seq_max)`` (every negative id too); False: a
    negative id is accepted for the whole range (or an empty one), and an id ``>= mem_size`` is refused."""
    recurrent_split_sequential: bool = _newest("recurrent_split_sequential", bool)
    """The recurrent memory's equal splits: ``split_equal(sequential=true)`` (consecutive sequences only) or
    ``false``."""
    recurrent_restore_seq_bound: str = _newest("recurrent_restore_seq_bound", str)
    """A recurrent whole restore bounds seq ids by ``"n_seq_max"`` or by the cell count (``"mem_size"``)."""
    rs_rollback_archs: frozenset[str] = _newest("rs_rollback_archs", frozenset)
    """llm_arch_supports_rs_rollback: the archs that keep ``n_rs_seq`` (rollback snapshots); other archs get it
    clamped to 0. Empty: llama.cpp has no ``n_rs_seq`` (a RecurrentMemory refuses one)."""
    recurrent_rows_from_src: bool = _newest("recurrent_rows_from_src", bool)
    """True: recurrent state files take each cell's rows from its ``src`` in the rollback plane; False: from
    the cell itself."""
    recurrent_rollback_split: str = _newest("recurrent_rollback_split", str)
    """With ``n_rs_seq > 0`` the recurrent memory splits ``"equal"`` (``split_equal(..., n_rs_seq + 1)``) or by
    sequence (``"seq"``: ``split_seq``)."""
    recurrent_rollback_single_use: bool = _newest("recurrent_rollback_single_use", bool)
    """True: a rollback is refused while one is pending (single use); False: the pending index is replaced."""
    hybrid_restore_undo: bool = _newest("hybrid_restore_undo", bool)
    """True: when a hybrid restore's recurrent part fails, the attention part just restored is cleared for the
    sequence again; False: it is kept."""
    attn_rotation: bool = _newest("attn_rotation", bool)
    """True: a quantized K (V) cache whose head size is a multiple of 64 is stored Walsh-Hadamard rotated unless
    LLAMA_ATTN_ROT_DISABLE is set (`kvref.ggml.rotation`); False: never rotated."""
    kv_seq_save_ids: bool = _newest("kv_seq_save_ids", bool)
    """True: the KV cells of a sequence save list the saved id (``n_seq_id`` 1) and a sequence restore requires
    that; False (llama.cpp of 2024): they list none (``n_seq_id`` 0), and a restore requires none."""
    name: str = field(default="", compare=False)
    """The named generation or release this profile behaves as, ``"custom"``, or a name of the caller's."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "rs_rollback_archs", frozenset(self.rs_rollback_archs))
        object.__setattr__(self, "n_kv_pad", tuple(int(x) for x in self.n_kv_pad))
        for f, choices in CHOICES.items():
            if getattr(self, f) not in choices:
                raise CompatError(f"Profile.{f} must be one of {choices}, got {getattr(self, f)!r}")
        if len(self.n_kv_pad) != 2 or min(self.n_kv_pad) < 1:
            raise CompatError(f"Profile.n_kv_pad must be two paddings >= 1, got {self.n_kv_pad!r}")
        for f in ("n_ctx_pad", "get_n_kv_pad"):
            if int(getattr(self, f)) < 1:
                raise CompatError(f"Profile.{f} must be >= 1, got {getattr(self, f)!r}")
        for f in ("n_batch_min", "swa_size_pad"):
            if int(getattr(self, f)) < 0:
                raise CompatError(f"Profile.{f} must be >= 0, got {getattr(self, f)!r}")
        sig = self.signature
        if not self.name or (self.name in _KNOWN and _signature(_KNOWN[self.name]) != sig):
            object.__setattr__(self, "name", name_of(sig))

    @property
    def compat(self) -> str:
        """The profile's name: what ``compat=`` names for a named generation or release."""
        return self.name

    @property
    def signature(self) -> tuple[Behaviour, ...]:
        """Every behaviour field's value, in field order (what ``kvref.compat.era`` compares)."""
        return tuple(getattr(self, f) for f in TABLE)

    @classmethod
    def of(cls, compat: Profile | str) -> Profile:
        """The profile of a compat value (``resolve``)."""
        return resolve(compat)

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        if self.name in _KNOWN:
            return f"Profile.of({self.name!r})"
        newest = for_release(RELEASES[-1])
        diff = [f"{f}={getattr(self, f)!r}" for f in TABLE if getattr(self, f) != getattr(newest, f)]
        return f"Profile({', '.join([f'name={self.name!r}', *diff])})"


# every field but ``name`` is a behaviour with a row in TABLE (and the other way round)
assert tuple(f.name for f in dataclasses.fields(Profile))[:-1] == tuple(TABLE), "TABLE and Profile disagree"

# compat names -> the release whose behaviour each names
_KNOWN: dict[str, str] = {**NAMED, **{r: r for r in RELEASES}}


@functools.cache
def _signature(release: str) -> tuple[Behaviour, ...]:
    return tuple(value_at(f, release) for f in TABLE)


def name_of(signature: Iterable[Behaviour]) -> str:
    """The compat name of a behaviour signature: the named generation that behaves so, else the first release
    that does, else ``"custom"``."""
    sig = tuple(signature)
    for name, rel in NAMED.items():
        if _signature(rel) == sig:
            return name
    return next((r for r in RELEASES if _signature(r) == sig), CUSTOM)


@functools.cache
def _profile(name: str) -> Profile:
    release = _KNOWN[name]
    # each row's value is its field's (the fields' defaults are checked so, _newest): mypy cannot pair names and types
    return Profile(**{f: value_at(f, release) for f in TABLE}, name=name)  # type: ignore[arg-type]


def for_release(release: str) -> Profile:
    """The profile of a llama-cpp-python release in RELEASES (named after the release), from TABLE."""
    if release not in RELEASES:
        raise CompatError(f"not a llama-cpp-python release kvref knows: {release!r} (one of {RELEASES[0]} .. "
                          f"{RELEASES[-1]}; kvref.compat.for_llama_cpp_python maps any other)")  # fmt: skip
    return _profile(release)


def resolve(compat: Profile | str) -> Profile:
    """A memory's ``compat=``: a Profile as it is; a named generation or a release in RELEASES via TABLE.

    Anything else is a CompatError (a KVRefError and ValueError)."""
    if isinstance(compat, Profile):
        return compat
    if isinstance(compat, str) and compat in _KNOWN:
        return _profile(compat)
    raise CompatError(
        f"unknown compat {compat!r}: expected a kvref.Profile, a named generation {COMPATS} or a "
        f"llama-cpp-python release {RELEASES[0]} .. {RELEASES[-1]} (kvref.compat.for_llama_cpp_python maps "
        "any other release)"
    )


def first_release(name: str, value: Behaviour, after: str | None = None) -> str:
    """The first release (after ``after``, when given) in which behaviour ``name`` takes ``value`` (from TABLE)."""
    return next(r for r, v in TABLE[name] if v == value and (after is None or _key(r) > _key(after)))


__all__ = [
    "CHOICES",
    "COMPATS",
    "CUSTOM",
    "DEFAULT",
    "NAMED",
    "RELEASES",
    "RS_ROLLBACK_ARCHS",
    "RS_ROLLBACK_ARCHS_2026_08",
    "TABLE",
    "Behaviour",
    "CompatError",
    "Profile",
    "first_release",
    "for_release",
    "name_of",
    "resolve",
    "value_at",
]
