"""llama-cpp-python's prompt cache (``Llama.set_cache``) kept in a kvref store::

    llm = llama_cpp.Llama(model_path="m.gguf", ...)
    llm.set_cache(kvref.store.LlamaCache("/var/cache/kvref", capacity_bytes=8 << 30))

Why not llama-cpp-python's own caches: `LlamaRAMCache` / `LlamaDiskCache` keep every completion's whole state plus
its ``scores`` (n_tokens x n_vocab floats: ~1.5 GB for a 300-token prompt of a 32k-vocabulary model, issue #1303),
scan every key for the longest prefix (#280), pop the entry they serve (the disk cache) and do not honour their
capacity (#1402). Here a state is cut into chunks kept once however many prompts share them, found through the
store's chained index, served token-exactly (the longest prefix any stored state shares with the prompt, not only
whole stored prompts), never removed by a read, and evicted least recently used past ``capacity_bytes``.

The model and context a state belongs to: llama-cpp-python calls the cache from ``Llama._create_completion`` with
only the tokens, so `LlamaCache` finds the calling ``Llama`` on the stack (the first frame whose ``self`` is one)
and takes the model (``model_path``, identified by its weights' SHA-256, `kvref.store.model_id`) and the context
settings that decide the state's bytes from it: K/V types (``context_params.type_k`` / ``type_v``), flash
attention (``context_params.flash_attn_type``; see `flash_attn_of`) and the KV streams (``n_seq_max`` unless
``kv_unified``). Used directly (``tokens in cache``, ``llm.load_state(cache[tokens])``), it answers for the last
``Llama`` that called it, else for ``model=`` in a default context (f16 K/V, either flash attention, one stream;
``input_ids`` as long as the model's training context). ``model=`` with a calling ``Llama`` must be its model.
Keyword ``context`` overrides any of these (``type_k``, ``type_v``, ``flash_attn``, ``n_stream``, ``era``,
``extra``).
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np

from ..errors import ArgumentError, BackendError, CacheWarning, KVRefError
from .prefix import Store

if TYPE_CHECKING:
    from collections.abc import Sequence
    from types import FrameType

    from llama_cpp import Llama
    from llama_cpp.llama import LlamaState

    from ..hparams import HParams
    from .prefix import Hit

CONTEXT_KEYS = ("type_k", "type_v", "flash_attn", "n_stream", "era", "extra")
INSTALL = "pip install llama-cpp-python"


@dataclass
class _Bound:
    """What one ``Llama`` (or ``model=`` alone) fixes for the store: read once per ``Llama``, its context does not
    change after it is made."""

    model: str  # the GGUF path (or sha256 id) handed to the store
    hparams: HParams | None
    type_k: object
    type_v: object
    flash_attn: bool | None  # None: either (no Llama), or auto not yet resolved (`resolved` False)
    resolved: bool
    n_stream: int
    era: str | None
    n_vocab: int
    n_ctx: int  # the length of LlamaState.input_ids: load_state makes it the Llama's token buffer


def flash_attn_of(flash_attn_type: int, n_gpu_layers: int, gpu_offload: bool) -> bool | None:
    """Flash attention as a context with ``flash_attn_type`` runs it, or None when only its states can tell.

    ``Llama()`` sets enabled (1) or disabled (0) from its ``flash_attn`` flag. llama.cpp's auto (-1) enables it
    unless a layer's flash-attention op would run on another device than its KV: on a CPU-only model it resolves
    to enabled (checked with llama-cpp-python 0.3.36 on llama, gemma3 and jamba: ``v_trans`` 0 in the state, as
    with enabled); with layers offloaded to a GPU it depends on the device, so the first state the context saves
    says (`LlamaCache` serves nothing to it until then)."""
    if flash_attn_type == 1:
        return True
    if flash_attn_type == 0:
        return False
    if n_gpu_layers == 0 or not gpu_offload:
        return True
    return None


def _llama_class() -> type[Llama]:
    try:
        import llama_cpp
    except Exception as e:  # not installed, or installed without its shared library
        raise BackendError(f"LlamaCache needs llama-cpp-python ({INSTALL}): {type(e).__name__}: {e}") from e
    cls: type[Llama] = llama_cpp.Llama  # typed here: without llama-cpp-python's stubs mypy sees Any
    return cls


def _calling_llama() -> tuple[Llama, FrameType] | None:
    """The innermost ``Llama`` method on the stack (llama-cpp-python reads and writes its cache only from
    ``Llama._create_completion``), with its frame."""
    cls = _llama_class()
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        obj = f.f_locals.get("self")
        if isinstance(obj, cls):
            return obj, f
        f = f.f_back
    return None


class _LlamaCache:
    """A `BaseLlamaCache` over a kvref prefix store (``kvref.store.LlamaCache`` is this class with llama-cpp-python's
    base class, made on first use so that ``kvref.store`` imports without llama-cpp-python).

    ``url_or_dir``: the store (`kvref.store.open`: a directory, ``sqlite:///...``, ``redis://...``, ``memory:``),
    shared by any number of caches, processes and models; ``capacity_bytes`` bounds its bytes (None: no bound);
    ``chunk_tokens`` the chunk size of a new store. ``model``: the GGUF file when no ``Llama`` calls the cache (or
    to check the one that does); ``context``: overrides of the calling ``Llama``'s context (`CONTEXT_KEYS`)."""

    def __init__(
        self, url_or_dir: str | os.PathLike[str], capacity_bytes: int | None = 2 << 30, *,
        model: str | os.PathLike[str] | None = None, chunk_tokens: int | None = None, **context: object,
    ) -> None:  # fmt: skip
        from .backends import open_backend

        unknown = sorted(set(context) - set(CONTEXT_KEYS))
        if unknown:
            raise ArgumentError(f"LlamaCache: unknown context key(s) {unknown}; known: {', '.join(CONTEXT_KEYS)}")
        # BaseLlamaCache's attribute is an int: sys.maxsize stands for no bound
        self.capacity_bytes: int = sys.maxsize if capacity_bytes is None else capacity_bytes
        self.store = Store(open_backend(url_or_dir), capacity_bytes=capacity_bytes, chunk_tokens=chunk_tokens)
        self.model = None if model is None else os.fspath(model)
        self.context = context
        self._bound: weakref.WeakKeyDictionary[Llama, _Bound] = weakref.WeakKeyDictionary()
        self._alone: _Bound | None = None
        self._last: weakref.ref[Llama] | None = None
        self._hparams: dict[str, HParams] = {}

    # --- who is asking --------------------------------------------------------------------------------------

    def _hp(self, model: str) -> HParams | None:
        if model.startswith("sha256:"):
            return None  # the store then needs no window, or says so
        if model not in self._hparams:
            from ..hparams import HParams

            self._hparams[model] = HParams.from_gguf(model)
        return self._hparams[model]

    def _era(self) -> str | None:
        """The layout era of the llama.cpp in this process: a state of another era would not load in it."""
        from ..state.eras import era

        try:
            import llama_cpp

            return era(str(llama_cpp.__version__)).name
        except (KVRefError, ImportError, AttributeError):
            return None  # a release kvref does not know: any era

    def _bind(self) -> tuple[_Bound, Llama | None, FrameType | None]:
        found = _calling_llama()
        if found is None:  # used directly: as the last Llama that called it, else as model= says
            last = self._last() if self._last is not None else None
            if last is not None and last in self._bound:
                return self._apply(self._bound[last]), None, None
            if self.model is None:
                raise ArgumentError(
                    "LlamaCache was called outside a llama_cpp.Llama completion, before any Llama used it and "
                    "without model=: pass LlamaCache(..., model='model.gguf') to use it directly"
                )
            if self._alone is None:
                hp = self._hp(self.model)
                n_ctx = hp.n_ctx_train if hp is not None else 0
                self._alone = _Bound(self.model, hp, "f16", "f16", None, True, 1, self._era(), 1, n_ctx)
            return self._apply(self._alone), None, None
        llm, frame = found
        bound = self._bound.get(llm)
        if bound is None:
            bound = self._bound[llm] = self._bind_llama(llm)
        self._last = weakref.ref(llm)
        return self._apply(bound), llm, frame

    def _bind_llama(self, llm: Llama) -> _Bound:
        import llama_cpp

        from .model_id import model_id

        path = os.fspath(llm.model_path)
        model = path
        if self.model is not None:
            if model_id(self.model) != model_id(path):
                raise ArgumentError(f"LlamaCache(model={self.model!r}) is called by a Llama of another model ({path})")
            model = self.model
        cp = llm.context_params
        fa = flash_attn_of(int(cp.flash_attn_type), int(llm.model_params.n_gpu_layers),
                           bool(llama_cpp.llama_supports_gpu_offload()))  # fmt: skip
        n_stream = 1 if cp.kv_unified else max(1, int(cp.n_seq_max))
        return _Bound(model, self._hp(model), int(cp.type_k), int(cp.type_v), fa, fa is not None, n_stream,
                      self._era(), int(llm.n_vocab()), int(llm.n_ctx()))  # fmt: skip

    def _apply(self, b: _Bound) -> _Bound:
        """``b`` with the caller's ``context`` overrides."""
        c = self.context
        if not c:
            return b
        fa = c.get("flash_attn", b.flash_attn)
        return _Bound(b.model, b.hparams, c.get("type_k", b.type_k), c.get("type_v", b.type_v),
                      None if fa is None else bool(fa), b.resolved or "flash_attn" in c,
                      int(cast("int", c.get("n_stream", b.n_stream))), cast("str | None", c.get("era", b.era)),
                      b.n_vocab, b.n_ctx)  # fmt: skip

    def _extra(self) -> dict[str, object] | None:
        return cast("dict[str, object] | None", self.context.get("extra"))

    # --- BaseLlamaCache -------------------------------------------------------------------------------------

    @property
    def cache_size(self) -> int:
        """The bytes the store holds (all models' chunks: the store is shared)."""
        return int(cast("int", self.store.stats()["bytes"]))

    def _get(self, key: Sequence[int]) -> tuple[Hit | None, _Bound, Llama | None]:
        b, llm, frame = self._bind()
        if not b.resolved:
            return None, b, llm  # flash attention auto on a GPU, before the context saved a state
        if frame is not None and llm is not None and llm._logits_all:
            loc = frame.f_locals
            if loc.get("echo") and loc.get("logprobs") is not None:
                return None, b, llm  # the prompt's logprobs come from the scores a hit does not carry
        hit = self.store.get(
            np.asarray(key, dtype=np.int64), b.model, kind="state", seq_id=0, n_stream=b.n_stream,
            type_k=b.type_k, type_v=b.type_v, flash_attn=b.flash_attn, era=b.era, extra=self._extra(),
        )  # fmt: skip
        return hit, b, llm

    def __getitem__(self, key: Sequence[int]) -> LlamaState:
        """The longest stored prefix of ``key`` as a ``LlamaState`` for ``Llama.load_state``; KeyError when none.

        ``scores`` is one row of zeros (``load_state`` broadcasts it over the prefix): with ``logits_all=False``
        nothing reads them, and ``Llama.generate`` always decodes at least the prompt's last token again after
        ``load_state`` (``_requires_eval``), so sampling never sees them. The state's ``seed`` is the calling
        ``Llama``'s own, so loading a hit leaves its seed as a run without the cache would. ``input_ids`` is as
        long as the Llama's context (``load_state`` makes it the Llama's token buffer; without a calling ``Llama``,
        the model's training context), the hit's tokens first."""
        from llama_cpp.llama import LlamaState

        hit, b, llm = self._get(key)
        if hit is None:
            raise KeyError(f"no stored prefix of this {len(key)}-token prompt")
        data = hit.data
        ids = np.zeros(max(b.n_ctx, len(key)), dtype=np.intc)  # load_state takes it as the Llama's whole buffer
        ids[: hit.n_tokens] = hit.tokens
        return LlamaState(
            input_ids=ids, scores=np.zeros((1, b.n_vocab), dtype=np.single),
            n_tokens=hit.n_tokens, llama_state=data, llama_state_size=len(data),
            seed=int(llm._seed) if llm is not None else 0,
        )  # fmt: skip

    def __contains__(self, key: Sequence[int]) -> bool:
        """Whether some prefix of ``key`` is servable (metadata only: no state is built)."""
        b, _, _ = self._bind()
        if not b.resolved:
            return False
        look = self.store.lookup(np.asarray(key, dtype=np.int64), b.model, type_k=b.type_k, type_v=b.type_v,
                                 flash_attn=b.flash_attn, era=b.era, extra=self._extra())  # fmt: skip
        return look.n_tokens > 0

    def __setitem__(self, key: Sequence[int], value: LlamaState) -> None:
        """Store the state's K/V (its tokens are ``value.input_ids[:n_tokens]``: ``key`` minus the last sampled token,
        which was never decoded). Its ``scores`` are dropped. A state the store cannot keep (a context shift moved
        its positions, ...) is skipped with a `CacheWarning`: the completion that saved it is not failed."""
        b, llm, _ = self._bind()
        try:
            stored = self.store.put(value, b.model, hparams=b.hparams, extra=self._extra())
        except KVRefError as e:
            warnings.warn(f"LlamaCache: state of {value.n_tokens} tokens not stored: {e}", CacheWarning, stacklevel=2)
            return
        if not b.resolved and llm is not None:  # flash attention auto: the first state says what it resolved to
            ns = next((n for n in self.store.namespaces(b.model) if n.id == stored.namespace), None)
            if ns is not None:
                own = self._bound[llm]
                own.flash_attn, own.resolved = ns.flash_attn(), True

    # no __len__: llama-cpp-python tests ``if self.cache:``, and an empty cache must still be used

    def close(self) -> None:
        """Close the store."""
        self.store.close()


_built: type[_LlamaCache] | None = None


def _build() -> type[_LlamaCache]:
    global _built
    if _built is None:
        _llama_class()
        from llama_cpp.llama_cache import BaseLlamaCache

        class LlamaCache(_LlamaCache, BaseLlamaCache):
            __doc__ = _LlamaCache.__doc__

        LlamaCache.__module__ = __name__
        _built = LlamaCache
    return _built


if TYPE_CHECKING:
    LlamaCache = _LlamaCache
else:

    def __getattr__(name: str) -> object:
        """``LlamaCache`` is made on first use: llama-cpp-python's base class is imported only then."""
        if name == "LlamaCache":
            return _build()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CONTEXT_KEYS", "CacheWarning", "LlamaCache", "flash_attn_of"]
