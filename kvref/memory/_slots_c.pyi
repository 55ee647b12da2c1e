"""Type stub of the Cython slots twin; the API and semantics are those of kvref/memory/_slots_py.py."""

import numpy as np
import numpy.typing as npt

from kvref.memory._cells_py import KVCells
from kvref.memory._slots_py import RecurrentCells

def find_cells(
    cells: KVCells, head: int, n_tokens: int, cont: bool, n_swa: int, swa_type: int
) -> npt.NDArray[np.int64] | None: ...
def used_targets(cells: KVCells, idxs: list[int] | npt.NDArray[np.int64], size: int) -> list[tuple[int, int, int]]: ...
def int32_values(values: object, lo: int) -> npt.NDArray[np.int64] | None: ...
def token_batch(
    tokens: object, pos: object, seq_ids: object
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None, list[list[int]] | None] | None: ...
def plain_seq_ids(seq_ids: object) -> list[list[int]] | None: ...
def single_seq_ids(
    seq_ids: list[list[int]] | None, n_tokens: int, n_seq_max: int
) -> tuple[npt.NDArray[np.int32], list[int], npt.NDArray[np.int32]] | None: ...
def single_seq_batch(
    tokens: npt.NDArray[np.int64],
    pos: npt.NDArray[np.int64] | None,
    seq: npt.NDArray[np.int32],
    present: list[int],
    mem_pos_max: list[int],
    n_vocab: int,
    mrope: bool,
) -> npt.NDArray[np.int32] | None: ...
def place_planned(
    cells: KVCells,
    plan: tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]],
) -> bool: ...
def place_single(
    cells: KVCells,
    head: int,
    tokens: npt.NDArray[np.int64],
    pos: npt.NDArray[np.int64] | None,
    seq_ids: list[list[int]] | None,
    n_seq_max: int,
    n_swa: int,
    swa_type: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]] | None: ...
def plan_single(
    cells: KVCells,
    head: int,
    tokens: npt.NDArray[np.int64],
    pos: npt.NDArray[np.int64] | None,
    seq_ids: list[list[int]] | None,
    n_seq_max: int,
    n_swa: int,
    swa_type: int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int32], npt.NDArray[np.int32]] | None: ...
def seq_lists(seq: npt.NDArray[np.int32]) -> tuple[list[list[int]], list[int], npt.NDArray[np.int32]]: ...
def single_ubatch(
    token: npt.NDArray[np.int32],
    pos: npt.NDArray[np.int32],
    seq: npt.NDArray[np.int32],
    logits: npt.NDArray[np.bool_] | None,
) -> dict[str, object]: ...
def recurrent_owned_step(
    mem: RecurrentCells,
    tokens: npt.NDArray[np.int64],
    pos: npt.NDArray[np.int64] | None,
    seq_ids: list[list[int]] | None,
    logits: npt.NDArray[np.bool_] | None,
    n_seq_max: int,
) -> tuple[dict[str, object], int, npt.NDArray[np.int32]] | None: ...
def seq_flat(
    seq_ids: list[list[int]],
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], int, int, bool] | None: ...

__all__ = [
    "find_cells",
    "int32_values",
    "place_planned",
    "place_single",
    "plain_seq_ids",
    "plan_single",
    "recurrent_owned_step",
    "seq_flat",
    "seq_lists",
    "single_seq_batch",
    "single_seq_ids",
    "single_ubatch",
    "token_batch",
    "used_targets",
]
