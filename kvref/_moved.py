"""Module paths of kvref before its wings (kvref 0.1's flat package), kept importable for one release.

``import kvref.kv_cache`` still works: a finder on ``sys.meta_path`` hands back the module at its new home
(``kvref.memory.kv_cache``), the same object, with a `DeprecationWarning` naming the new path. The public paths
``kvref.cells`` and ``kvref.mask`` are real modules and never warn.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# old path -> new path (README's changelog lists the same moves)
MOVED: dict[str, str] = {
    **{f"kvref.{m}": f"kvref.memory.{m}" for m in (
        "batch", "slots", "kv_cache", "kv_cache_iswa", "recurrent", "hybrid", "kshift", "kshift_quant", "kv_state",
        "recurrent_state", "_cells_c", "_cells_py", "_slots_c", "_slots_py", "_mask_c", "_mask_py")},
    "kvref.memory_base": "kvref.memory.base",
    "kvref.quant": "kvref.ggml.quant",
    "kvref.rotation": "kvref.ggml.rotation",
    "kvref.rows": "kvref.ggml.rows",
    "kvref.eras": "kvref.state.eras",
    "kvref.server_tokens": "kvref.state.server_tokens",
    "kvref.from_file": "kvref.jobs.restore",
    "kvref.to_file": "kvref.jobs.save",
    "kvref.conversion": "kvref.jobs.convert",
    "kvref.load_check": "kvref.jobs.check",
    "kvref.state_diff": "kvref.jobs.diff",
    **{f"kvref.{m}": f"kvref.jobs.{m}" for m in (
        "retype", "edit", "sidecar", "tensors", "export", "plot", "progress", "conformance", "cli", "cli_jobs")},
}  # fmt: skip


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {MOVED[spec.name]}; import it from there", DeprecationWarning,
                      stacklevel=2)  # fmt: skip
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        """The module was executed at its new path."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
