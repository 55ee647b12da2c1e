"""Type stub of the Cython slots twin; the API and semantics are those of kvref/_slots_py.py."""

from kvref._cells_py import KVCells

def find_cells(cells: KVCells, head: int, n_tokens: int, cont: bool, n_swa: int, swa_type: int) -> list[int] | None: ...
def used_targets(cells: KVCells, idxs: list[int], size: int) -> list[tuple[int, int, int]]: ...

__all__ = ["find_cells", "used_targets"]
