"""What this kvref is: its version, the twin in use, and the llama.cpp it follows (``kvref --version``).

Its own module, so that the wings (the CLI, the conformance runner, the sidecar) read it without importing the
package's face, which names every wing.
"""

from __future__ import annotations

from typing import TypedDict

__version__ = "0.1.0"


def backend() -> str:
    """``"cython"`` or ``"python"``: the twin the selector modules picked (see ``KVREF_BACKEND``)."""
    from .memory.cells import BACKEND

    return BACKEND


class About(TypedDict):
    """What `about` returns: kvref's version, the active backend, the default compat generation, and the
    llama-cpp-python release and llama.cpp commit it follows."""

    kvref: str
    backend: str
    compat: str
    llama_cpp_python: str
    llama_cpp: str


def about() -> About:
    """What this kvref is: its version, the active backend, and the llama.cpp it follows by default."""
    from .compat import DEFAULT, NAMED, REFERENCE_COMMIT

    return {
        "kvref": __version__,
        "backend": backend(),
        "compat": DEFAULT,
        "llama_cpp_python": NAMED[DEFAULT],
        "llama_cpp": REFERENCE_COMMIT,
    }


def about_line() -> str:
    """`about` as one line, as ``kvref --version`` and ``kvref conformance`` print it."""
    a = about()
    return (
        f"kvref {a['kvref']} ({a['backend']} backend), following llama.cpp {a['llama_cpp']} "
        f"(llama-cpp-python {a['llama_cpp_python']}, compat {a['compat']!r})"
    )


__all__ = ["About", "__version__", "about", "about_line", "backend"]
