"""Type stub of the Cython QSA twin; the API is the Python twin's (``kvref/memory/_qsa_py.py``)."""

import numpy as np
import numpy.typing as npt

from kvref.memory._qsa_py import std_sort as std_sort

def rank_order(
    cells: npt.NDArray[np.int64], pos: npt.NDArray[np.int64], y: npt.NDArray[np.int64], x: npt.NDArray[np.int64]
) -> npt.NDArray[np.int64]: ...

__all__: list[str]
