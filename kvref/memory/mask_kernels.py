"""The mask twin ``KVREF_BACKEND`` picks, ``_mask_c`` or ``_mask_py`` (see ``kvref._backend``): the fills of the graph
inputs, from raw arrays (``fill_kq_mask_raw`` and friends, stated in full in ``kvref/memory/_mask_py.py``), and the
one input a KV cache gathers for itself, its K-shift (`k_shift_input`).

``kvref.memory.mask`` gathers the other inputs from a memory (it sits above the memories) and re-exports these names;
a KV cache reaches this module for its K-shift without the mask glue. Both read ``impl`` when they call, so a test
plugs a twin into both by assigning ``impl``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from .._backend import select

if TYPE_CHECKING:
    from .cells import KVCells

impl = select("memory.mask")
BACKEND = "cython" if impl.__name__.endswith("_c") else "python"

if TYPE_CHECKING:  # type checkers see the Python twin's functions (the twins share one API, see _mask_c.pyi)
    from ._mask_py import (
        NonCausalType,
        fill_k_shift_raw,
        fill_kq_mask_raw,
        fill_pos_bucket_raw,
        relative_position_bucket,
    )
else:
    fill_kq_mask_raw = impl.fill_kq_mask_raw
    fill_pos_bucket_raw = impl.fill_pos_bucket_raw
    fill_k_shift_raw = impl.fill_k_shift_raw
    relative_position_bucket = impl.relative_position_bucket
    NonCausalType = impl.NonCausalType


class ShiftSource(Protocol):
    """What `k_shift_input` reads of a KV cache (a `kvref.memory.kv_cache.KVCache`): its streams' cells."""

    @property
    def n_stream(self) -> int: ...
    def cells(self, stream: int) -> KVCells: ...
    def get_size(self) -> int: ...


def k_shift_input(cache: ShiftSource, out: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.int32]:
    """llama_kv_cache::set_input_k_shift: int32 ``(n_stream, size)``, each cell's pending shift, 0 when empty.

    ``.reshape(-1)`` gives llama.cpp's flat ``[n_stream * size]`` tensor.
    """
    cells = [cache.cells(s) for s in range(cache.n_stream)]
    if out is None:
        out = np.empty((len(cells), cache.get_size()), dtype=np.int32)
    shift: npt.NDArray[np.int32] = impl.fill_k_shift_raw(out, [c.pos for c in cells], [c.shift for c in cells])
    return shift


__all__ = [
    "BACKEND",
    "NonCausalType",
    "ShiftSource",
    "fill_k_shift_raw",
    "fill_kq_mask_raw",
    "fill_pos_bucket_raw",
    "impl",
    "k_shift_input",
    "relative_position_bucket",
]
