"""A KV cache over another context's cells: llama.cpp's ``llama_kv_cache`` built with ``mem_other`` and a
``layer_share`` callback (the gemma4-assistant draft context, llama_context_params.ctx_other).

llama.cpp's constructor takes the other cache's cell vector itself (``v_cells_impl`` is shared), its size (a
``kv_size`` that differs is overridden), and for every layer ``share(il) >= 0`` the other cache's K/V tensors of
layer ``share(il)``: nothing of its own is allocated. While ``other`` is set (src/llama-kv-cache.cpp,
TAG_KV_CACHE_SHARE_CELLS) the sequence operations do nothing (``seq_rm`` returns true for any id), positions are
the other cache's, ``update`` applies nothing, ``apply_ubatch`` does nothing, and ``state_write`` / ``state_read``
write and read nothing. What still runs: ``find_slot`` over the shared cells from this cache's own heads (which
never move: ``prepare`` puts them back and nothing applies), so a draft decode places no token and its KQ masks
read the target's cells; and ``clear``, which is not guarded: it resets the shared cells (the target's!) and this
cache's heads, and its buffer holds no tensor of its own to zero.

`shared_iswa` builds llama_kv_cache_iswa over another iSWA memory's two caches (what create_memory builds for
gemma4-assistant: SWA layers share the target's last-but-one layer, full layers its last).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..args import as_int, as_state_args
from ..errors import KVRefError
from ..ggml.types import GGMLType
from ..hparams import HParams, SWAType
from ..profile import DEFAULT, Profile, resolve
from .base import ContextParams
from .kv_cache import CacheLayer, KVCache
from .kv_cache_iswa import KVCacheISWA
from .slots import SlotInfo

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from ..state import KVSection
    from .batch import Batch, UBatch
    from .cells import KVCells
    from .kv_cache import SinglePlan


class SharedKVCache(KVCache):
    """llama_kv_cache with ``other`` set: the cells of ``other`` (the same objects), layers of ``other`` (by
    ``layer_share``), own heads; see the module docstring for what each operation does."""

    def __init__(
        self,
        hparams: HParams,
        other: KVCache,
        *,
        layer_share: Callable[[int], int],
        type_k: GGMLType | int | str = "f16",
        type_v: GGMLType | int | str = "f16",
        v_trans: bool = True,
        kv_unified: bool = True,
        n_seq_max: int = 1,
        n_pad: int = 1,
        n_swa: int = 0,
        swa_type: SWAType | int = SWAType.NONE,
        layer_filter: Callable[[int], bool] | None = None,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        self.other = other
        # the size follows the shared source (llama.cpp overrides kv_size); no layer of its own is allocated
        super().__init__(
            hparams, type_k=type_k, type_v=type_v, v_trans=v_trans, kv_unified=kv_unified, kv_size=other.get_size(),
            n_seq_max=n_seq_max, n_pad=n_pad, n_swa=n_swa, swa_type=swa_type, layer_filter=lambda il: False,
            compat=compat, cparams=cparams,
        )  # fmt: skip
        if self.n_stream != other.n_stream:
            raise KVRefError(f"a cache of {self.n_stream} streams cannot share the cells of one of {other.n_stream}")
        self.layers = []
        self.map_layer_ids = {}
        for il in range(hparams.n_layer):
            if not hparams.has_kv(il) or (layer_filter is not None and not layer_filter(il)):
                continue
            il_share = layer_share(il)
            if il_share < 0:
                # llama.cpp would allocate the layer itself; the draft contexts llama.cpp builds share every layer
                raise KVRefError(f"layer {il} is not shared: kvref models only caches whose every layer is shared")
            if not other.layers:
                raise KVRefError(f"layer {il} shares layer {il_share} of a cache without layers")
            # other->map_layer_ids[il_share] (std::map::operator[]: a layer the source lacks reads as its first)
            src = other.layers[other.map_layer_ids.get(il_share, 0)]
            self.map_layer_ids[il] = len(self.layers)
            self.layers.append(CacheLayer(il, src.k, src.v))

    # the cells are the other cache's (llama.cpp's shared v_cells_impl): always its current list
    @property
    def _cells(self) -> list[KVCells]:
        return self.other._cells

    @_cells.setter
    def _cells(self, value: list[KVCells]) -> None:
        pass  # KVCache.__init__ builds cells of its own: the shared ones are used instead

    # --- sequence operations: nothing while ``other`` is set --------------------------------------------------
    def check_op(self, op: str, *args: object) -> tuple[int, ...]:
        """llama.cpp returns before checking anything: every argument is accepted (an int, as the C API takes)."""
        return tuple(as_int(a, f"{op} argument {i}") for i, a in enumerate(args))

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Nothing removed; true (llama_kv_cache::seq_rm with ``other``)."""
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Nothing copied."""

    def seq_keep(self, seq_id: int) -> None:
        """Nothing dropped."""

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Nothing shifted."""

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Nothing divided."""

    def seq_pos_min(self, seq_id: int) -> int:
        """The other cache's."""
        return self.other.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """The other cache's."""
        return self.other.seq_pos_max(seq_id)

    def clear(self, data: bool = True) -> None:
        """llama_kv_cache::clear is not guarded: the shared cells (the other cache's) are reset, and this cache's
        heads; its buffers hold no tensor (the layers are the other cache's), so ``data`` zeroes nothing."""
        for s in range(self.n_stream):
            self._cells[s].reset()
            self.heads[s] = 0

    def update(self, **kw: object) -> bool:
        """Nothing applied: the other context applies its own pending shift and copies."""
        return False

    # --- slots: found over the shared cells, never applied ------------------------------------------------------
    def apply_ubatch(self, sinfo: SlotInfo, ubatch: UBatch) -> None:
        """Nothing written (llama_kv_cache::apply_ubatch with ``other``)."""

    def prepare(self, ubatches: Sequence[UBatch]) -> list[SlotInfo]:
        """find_slot for each ubatch over the unchanged shared cells (the trial apply does nothing, the heads are put
        back); [] when one does not fit."""
        res = []
        for ub in ubatches:
            sinfo = self.find_slot(ub, False)
            if sinfo is None:
                return []
            res.append(sinfo)
        return res

    def _single(self, batch: Batch, n_ubatch: int, write: bool) -> SinglePlan | None:
        return None  # the one-call decode step writes cells: the generic path places nothing

    def _apply(self, sinfo: SlotInfo, ubatch: UBatch) -> SlotInfo:
        return sinfo

    # --- state: nothing written or read -----------------------------------------------------------------------
    def state_sections(self, seq_id: int = -1, flags: int = 0, *, copy: bool = True) -> list[KVSection]:
        """No section: llama_kv_cache::state_write writes nothing while ``other`` is set."""
        as_state_args(seq_id, flags)
        return []

    def state_write(self, seq_id: int = -1, flags: int = 0) -> bytes:
        """Nothing."""
        as_state_args(seq_id, flags)
        return b""

    def state_size(self, seq_id: int = -1, flags: int = 0) -> int:
        """0."""
        as_state_args(seq_id, flags)
        return 0

    def state_write_into(self, dst: object, seq_id: int = -1, flags: int = 0) -> int:
        """Nothing written; 0."""
        as_state_args(seq_id, flags)
        return 0

    def stage_state(
        self, data: Buffer, seq_id: int = -1, flags: int = 0, offset: int = 0
    ) -> tuple[Callable[[], None], int]:
        """Nothing read: ``(no-op, offset)``."""
        as_state_args(seq_id, flags)
        return (lambda: None), offset

    def state_read(self, data: Buffer, seq_id: int = -1, flags: int = 0, *, atomic: bool = True) -> int:
        """Nothing read; 0."""
        as_state_args(seq_id, flags)
        return 0

    def state_read_failed(self, seq_id: int, exc: Exception) -> None:
        """Nothing to undo."""

    def __repr__(self) -> str:
        return f"SharedKVCache(size={self.get_size()}, layers={[(lay.il) for lay in self.layers]}, over {self.other!r})"


class KVCacheISWAShared(KVCacheISWA):
    """llama_kv_cache_iswa built with ``mem_other`` (another context's llama_kv_cache_iswa): its base and SWA caches
    are `SharedKVCache` objects over the other memory's base and SWA caches. Its state is empty."""

    def __init__(
        self,
        hparams: HParams,
        other: KVCacheISWA,
        *,
        layer_share: Callable[[int], int],
        type_k: GGMLType | int | str = "f16",
        type_v: GGMLType | int | str = "f16",
        v_trans: bool = True,
        swa_full: bool = False,
        kv_unified: bool = True,
        n_seq_max: int = 1,
        n_pad: int = 1,
        layer_filter: Callable[[int], bool] | None = None,
        compat: Profile | str = DEFAULT,
        cparams: ContextParams | None = None,
    ) -> None:
        self.hparams = hparams
        self.kv_unified = bool(kv_unified)
        self.cparams = cparams
        self.profile = resolve(compat)
        self.swa_full = bool(swa_full)
        self.other = other

        def filter_base(il: int) -> bool:
            return (layer_filter is None or layer_filter(il)) and not hparams.is_swa(il)

        def filter_swa(il: int) -> bool:
            return (layer_filter is None or layer_filter(il)) and hparams.is_swa(il)

        common = dict(
            layer_share=layer_share, type_k=type_k, type_v=type_v, v_trans=v_trans, kv_unified=kv_unified,
            n_seq_max=n_seq_max, n_pad=n_pad, compat=self.profile,
        )  # fmt: skip
        self.base = SharedKVCache(hparams, other.base, layer_filter=filter_base, **common)  # type: ignore[arg-type]
        self.swa = SharedKVCache(
            hparams,
            other.swa,
            layer_filter=filter_swa,
            n_swa=hparams.n_swa,
            swa_type=hparams.swa_type,
            **common,  # type: ignore[arg-type]
        )

    def _state_parts(self, flags: int) -> list[KVCache]:
        return []  # both caches write nothing

    def __repr__(self) -> str:
        return f"KVCacheISWAShared(base={self.base.get_size()} cells, swa={self.swa.get_size()} cells, shared)"


def shared_iswa(
    hparams: HParams,
    mem_other: object,
    *,
    type_k: GGMLType | int | str = "f16",
    type_v: GGMLType | int | str = "f16",
    v_trans: bool = True,
    swa_full: bool = False,
    kv_unified: bool = True,
    n_seq_max: int = 1,
    n_pad: int = 1,
    layer_filter: Callable[[int], bool] | None = None,
    compat: Profile | str = DEFAULT,
    cparams: ContextParams | None = None,
) -> KVCacheISWAShared:
    """What create_memory builds for gemma4-assistant: llama_kv_cache_iswa over ``mem_other`` (ctx_other's memory,
    a llama_kv_cache_iswa), each SWA layer sharing the other model's layer ``n_layer - 2``, each full layer its
    ``n_layer - 1``."""
    if mem_other is None:
        raise KVRefError(f"{hparams.arch} requires ctx_other to be set (mem_other: the target context's memory)")
    if not isinstance(mem_other, KVCacheISWA) or isinstance(mem_other, KVCacheISWAShared):
        raise KVRefError(
            f"{hparams.arch} reads an iSWA cache (llama_kv_cache_iswa) of its target context, not a "
            f"{type(mem_other).__name__} (llama.cpp would misread it)"
        )
    n_layer_other = mem_other.hparams.n_layer

    def layer_share(il: int) -> int:
        return n_layer_other - 2 if hparams.is_swa(il) else n_layer_other - 1

    return KVCacheISWAShared(
        hparams, mem_other, layer_share=layer_share, type_k=type_k, type_v=type_v, v_trans=v_trans,
        swa_full=swa_full, kv_unified=kv_unified, n_seq_max=n_seq_max, n_pad=n_pad, layer_filter=layer_filter,
        compat=compat, cparams=cparams,
    )  # fmt: skip


__all__ = ["KVCacheISWAShared", "SharedKVCache", "shared_iswa"]
