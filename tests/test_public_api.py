"""Every public name kvref advertises resolves; an unknown one is an AttributeError."""

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
