"""Placeholder until the backends land: memory: only."""

from __future__ import annotations

import os

from .backend import Backend, MemoryBackend


def open_backend(url: str | os.PathLike[str]) -> Backend:
    if str(url) == "memory:":
        return MemoryBackend()
    raise NotImplementedError(url)
