"""What a cache must match for a section to be read into it: the specs a memory gives `kvref.state.cache_api`.

A spec is the cache's own description (stream count, cells per stream, sequence limit, V transposition, cell
ext size and, per layer, the types and row sizes of its buffers); the section parse checks each field against
it as llama.cpp's state_read_meta / state_read_data do.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayerSpec:
    """One cache layer: K type and row size; V type, row size and width, or None for a cache without V (MLA)."""

    k_type: int
    k_row_size: int
    v_type: int | None = None
    v_row_size: int | None = None
    n_embd_v_gqa: int | None = None


@dataclass(frozen=True)
class KVSpec:
    """What a KV section must match to be read into a cache: its streams, cells per stream, n_seq_max, v_trans,
    layers and cell ext size."""

    n_stream: int
    kv_size: int  # cells per stream
    n_seq_max: int
    v_trans: bool
    layers: tuple[KVLayerSpec, ...]
    ext_size: int = 0  # 0 (no ext), 8 (x, y), 12 (x, y, tok): kvref.profile.Profile.cell_ext_size
    has_n_stream: bool = True  # False to read sections written before llama.cpp PR #14363
    seq_cell_ids: int = 1  # n_seq_id of every cell a sequence restore accepts (0: llama.cpp of 2024)

    @property
    def has_v(self) -> bool:
        """The cache stores V (False for an MLA cache, whose layers have no V type)."""
        return bool(self.layers) and self.layers[0].v_type is not None


@dataclass(frozen=True)
class RecurrentLayerSpec:
    """One layer with recurrent state: R type and row size; S type and row size (``n_embd_s``: the S width, which
    a transposed S needs); the PLE row size when the model has PLE rows."""

    r_type: int
    r_row_size: int
    s_type: int
    s_row_size: int  # row-wise S; for s_trans the element size and width come from s_type and n_embd_s
    n_embd_s: int = 0
    p_row_size: int | None = None  # PLE conv-history rows, when the model has them


@dataclass(frozen=True)
class RecurrentSpec:
    """What a recurrent section must match to be read into a memory: its cells, n_seq_max, the model's layer
    count, the layers with state and s_trans."""

    size: int  # cells
    n_seq_max: int
    n_layer: int  # every model layer
    layers: tuple[RecurrentLayerSpec, ...]  # only the layers with state, in order
    s_trans: bool = False


__all__ = ["KVLayerSpec", "KVSpec", "RecurrentLayerSpec", "RecurrentSpec"]
