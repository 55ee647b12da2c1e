"""The slots twin ``KVREF_BACKEND`` picks, ``_slots_c`` or ``_slots_py`` (see ``kvref._backend``): the per-token and
per-cell kernels of a decode step, stated in full in ``kvref/memory/_slots_py.py``.

Three modules call them: the batch allocator (``kvref.memory.batch``: ``single_seq_ids``, ``single_seq_batch``,
``seq_lists``, ...), the slot code (``kvref.memory.slots``: ``find_cells``, ``used_targets``, ``seq_flat``) and the
one-call decode step of a KV cache (``kvref.memory.kv_cache``: ``place_single``, ``plan_single``,
``place_planned``). The choice is made here, below all three, so that the batch allocator needs nothing of the slot
code; each reads ``impl`` when it calls, so a test plugs a twin into all of them by assigning ``impl``.
"""

from __future__ import annotations

from .._backend import select

impl = select("memory.slots")
BACKEND = "cython" if impl.__name__.endswith("_c") else "python"

__all__ = ["BACKEND", "impl"]
