"""Model hyper-parameters the memory modules need (a subset of llama.cpp's ``llama_hparams``).

CONTRACT (lead): the attribute and method names below are what KVCache, the mask and the recurrent
memory use. Extend freely (``from_gguf``, per-arch defaults, validation), keep these names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum


class SWAType(IntEnum):
    """llama_swa_type, with llama.cpp's numeric values."""

    NONE = 0
    STANDARD = 1
    CHUNKED = 2
    SYMMETRIC = 3


class RopeType(IntEnum):
    """llama_rope_type, with llama.cpp's numeric values (LLAMA_ROPE_TYPE_* in llama.h)."""

    NONE = -1
    NORM = 0
    NEOX = 2
    MROPE = 8
    IMROPE = 40
    VISION = 24


def is_masked_swa(n_swa: int, swa_type: SWAType | int, p0: int, p1: int) -> bool:
    """llama_hparams::is_masked_swa: is key position p0 outside the window of query position p1."""
    if swa_type == SWAType.STANDARD:
        return p1 - p0 >= n_swa
    if swa_type == SWAType.CHUNKED:
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == SWAType.SYMMETRIC:
        half = n_swa // 2
        d = p1 - p0
        return d < -half or d > half
    return False


@dataclass
class HParams:
    arch: str = "llama"
    n_layer: int = 1
    n_embd: int = 0
    n_head: int | Sequence[int] = 1
    n_head_kv: int | Sequence[int] = 1
    n_embd_head_k: int = 0
    n_embd_head_v: int = 0
    # per layer: does it attend with a sliding window / does it have recurrent state
    swa_layers: bool | Sequence[bool] = False
    recurrent_layers: bool | Sequence[bool] = False
    n_swa: int = 0
    swa_type: SWAType = SWAType.NONE
    n_layer_kv_from_start: int = -1
    rope_type: RopeType = RopeType.NORM
    n_rot: int = 0
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    rope_freq_base_swa: float | None = None
    rope_freq_scale_swa: float | None = None
    use_alibi: bool = False
    causal_attn: bool = True
    n_vocab: int = 0
    # recurrent (Mamba / RWKV) sizes, see n_embd_r() / n_embd_s()
    ssm_d_conv: int = 0
    ssm_d_inner: int = 0
    ssm_d_state: int = 0
    ssm_n_group: int = 0
    extra: dict = field(default_factory=dict)

    def n_head_kv_l(self, il: int) -> int: ...
    def n_embd_k_gqa(self, il: int = 0) -> int: ...
    def n_embd_v_gqa(self, il: int = 0) -> int: ...
    def is_swa(self, il: int) -> bool: ...
    def is_recurrent(self, il: int) -> bool: ...
    def has_kv(self, il: int) -> bool: ...
    def n_pos_per_embd(self) -> int: ...
    def n_embd_r(self) -> int: ...
    def n_embd_s(self) -> int: ...
