"""llama.cpp's constants and per-arch tables have one home each (kvref/constants.py, kvref/archs.py)."""

from __future__ import annotations

import re
from pathlib import Path

import kvref
from kvref import archs, constants

PKG = Path(kvref.__file__).resolve().parent


def test_the_cython_declarations_match_the_python_values() -> None:
    pxd = (PKG / "constants.pxd").read_text()
    declared = dict(re.findall(r"^\s+(\w+) = (\d+)", pxd, re.M))
    assert declared, "no enum values found in constants.pxd"
    for name, value in declared.items():
        assert getattr(constants, name) == int(value), name


def test_no_module_defines_a_constant_again() -> None:
    names = ("LLAMA_MAX_SEQ", "N_SEQ_WORDS", "LLAMA_MAX_LAYERS", "TOKEN_NULL", "POS_MAX", "INT32_MIN")
    pattern = re.compile(rf"^({'|'.join(names)})\s*(:\s*\w+\s*)?=", re.M)
    offenders = [
        f"{path.relative_to(PKG)}: {m.group(1)}"
        for path in sorted(PKG.rglob("*.py*"))
        if path.suffix in (".py", ".pyx") and path.name != "constants.py"
        for m in pattern.finditer(path.read_text())
    ]
    assert not offenders, offenders
    assert not re.search(r"(?<![\w.])256(?![\w.])", (PKG / "memory" / "_cells_c.pyx").read_text())


def test_every_reader_uses_the_one_arch_table() -> None:
    import importlib

    from kvref import hparams
    from kvref.memory import factory as memory

    load = importlib.import_module("kvref.state.load")

    assert load.HYBRID_ARCHS is hparams.HYBRID_ARCHS is archs.HYBRID_ARCHS
    assert load.RECURRENT_ARCHS is hparams.RECURRENT_ARCHS is archs.RECURRENT_ARCHS
    assert memory.NO_MEMORY_ARCHS is archs.NO_MEMORY_ARCHS
    assert "deepseek4" in archs.HYBRID_ARCHS  # llm_arch_is_hybrid, 0.3.36 (the old state-loader copy lacked it)


def test_one_sliding_window_rule() -> None:
    from kvref import hparams
    from kvref.memory import _mask_py, _slots_py, kv_state

    assert _mask_py.is_masked_swa is _slots_py.is_masked_swa is kv_state.is_masked_swa is hparams.is_masked_swa
