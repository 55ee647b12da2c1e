"""Every public name kvref advertises resolves and is documented; an unknown one is an AttributeError."""

import dataclasses
import functools
import inspect

import kvref


def test_every_exported_name_resolves():
    for name in kvref.__all__:
        assert getattr(kvref, name) is not None, name


def test_unknown_attribute_is_an_attribute_error():
    try:
        kvref.NoSuchThing  # noqa: B018
    except AttributeError as exc:
        assert "NoSuchThing" in str(exc)
    else:
        raise AssertionError("kvref.NoSuchThing resolved")


def _public_classes() -> dict[str, type]:
    """Every class of the public surface: ``kvref.__all__``, both KVCells twins and ``kvref.state.__all__``."""
    import kvref.state
    from kvref import _backend
    from kvref.memory import _cells_py

    classes = {f"kvref.{name}": getattr(kvref, name) for name in kvref.__all__}
    classes["kvref.memory._cells_py.KVCells"] = _cells_py.KVCells
    compiled = _backend._load_compiled("memory.cells")
    if compiled is not None:
        classes["kvref.memory._cells_c.KVCells"] = compiled.KVCells
    classes.update({f"kvref.state.{name}": getattr(kvref.state, name) for name in kvref.state.__all__})
    return {label: obj for label, obj in classes.items() if inspect.isclass(obj)}


def _own_doc(cls: type) -> str:
    doc = (cls.__dict__.get("__doc__") or "").strip()
    if dataclasses.is_dataclass(cls) and doc.startswith(f"{cls.__name__}("):
        return ""  # the signature @dataclass writes when the class has no docstring
    return doc


def _documentable(value: object) -> object | None:
    """The object carrying a member's docstring, or None for a plain data attribute (field, slot, enum member)."""
    if isinstance(value, (staticmethod, classmethod)):
        return value.__func__
    if isinstance(value, (property, functools.cached_property)) or inspect.isgetsetdescriptor(value):
        return value  # getset: a Cython @property
    return value if callable(value) else None


def test_public_classes_and_members_have_docstrings():
    """Each public class, and each public method / property kvref defines on it or on a kvref base class."""
    missing: set[str] = set()
    for label, cls in _public_classes().items():
        if not _own_doc(cls):
            missing.add(f"{label} (class)")
        seen: set[str] = set()
        # members of builtins / enum / int / object / typing are not kvref's to document
        for klass in [k for k in cls.__mro__ if k.__module__.split(".")[0] == "kvref"]:
            for name, value in vars(klass).items():
                if name.startswith("_") or name.isupper() or name in seen:
                    continue
                seen.add(name)
                member = _documentable(value)
                if member is not None and not (getattr(member, "__doc__", None) or "").strip():
                    missing.add(f"{klass.__module__}.{klass.__qualname__}.{name}")
    assert not missing, f"{len(missing)} public names without a docstring:\n" + "\n".join(sorted(missing))


def test_dir_lists_the_lazy_public_names():
    listed = set(dir(kvref))
    assert set(kvref.__all__) <= listed
    assert {"KVCache", "create_memory", "HParams", "state", "mask"} <= listed
    assert "importlib" not in listed and "Any" not in listed  # implementation imports stay out of the way


def test_every_exception_class_lives_in_errors():
    import importlib
    import inspect
    import pkgutil

    import kvref.errors

    homes = {}
    for mod in pkgutil.walk_packages(kvref.__path__, "kvref."):
        if mod.name.endswith("_c") or mod.name == "kvref.__main__":
            continue
        m = importlib.import_module(mod.name)
        for name, obj in vars(m).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__.startswith("kvref"):
                homes[name] = obj.__module__
    assert set(homes.values()) == {"kvref.errors"}, homes
    assert set(kvref.errors.__all__) == set(homes)


def test_misuse_raises_kvref_errors_that_are_also_builtin_kinds():
    import numpy as np
    import pytest

    from kvref.errors import ArgumentError, ArgumentTypeError, KVRefError
    from kvref.memory.mask import fill_kq_mask_raw

    with pytest.raises(ArgumentTypeError) as e:
        fill_kq_mask_raw("not an array", [np.zeros(1, np.int32)], [np.zeros((1, 4), np.uint64)], None, [0], [0], [0])
    assert isinstance(e.value, KVRefError) and isinstance(e.value, TypeError)
    assert issubclass(ArgumentError, ValueError) and issubclass(ArgumentError, KVRefError)
