"""Exceptions shared by every kvref module and by both twins of each Cython module.

Both twins raise exactly these classes, so a caller can never tell the backends apart by what they raise.
"""

from __future__ import annotations


class KVRefError(Exception):
    """Base class of every error kvref raises on purpose."""


class FormatError(KVRefError, ValueError):
    """A state file or blob that does not follow llama.cpp's layout.

    ``field`` names the field being read and ``offset`` the byte offset where it starts (or ``None``
    when the error is not tied to one place); both also appear in the message.
    """

    def __init__(self, message: str, *, field: str | None = None, offset: int | None = None) -> None:
        where = []
        if field is not None:
            where.append(f"field {field!r}")
        if offset is not None:
            where.append(f"offset {offset}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.field = field
        self.offset = offset
        # when kvref.state.load tried several readings: (reading, why it failed) for each one
        self.readings: list[tuple[str, str]] = []


class BatchError(KVRefError, ValueError):
    """A batch that llama_batch_allocr::init would reject; the message carries llama.cpp's reason."""


class NoSlotError(KVRefError):
    """A batch (or ubatch) that does not fit in the memory; the memory is left unchanged."""


class CellError(KVRefError, ValueError):
    """Misuse of the cell bookkeeping that llama.cpp only guards with an assert.

    kvref raises instead of corrupting state: the cells are unchanged when this is raised.
    """


class CorruptionError(CellError):
    """An operation after which llama.cpp's cells would contradict themselves: a cell placed or moved to position -1,
    which reads as empty but stays used and in its sequences (llama.cpp goes on; later decodes reuse the cell with
    the old sequences still in it). kvref refuses it and changes nothing; the conformance replay stops comparing
    with llama.cpp until its memory is reset."""


class SequenceError(KVRefError, ValueError):
    """A sequence id outside the range the memory accepts, or an operation not allowed on it."""


class CompatError(KVRefError, ValueError):
    """A ``compat`` value kvref does not know (not a Profile, named generation or release), or a bad Profile."""


class ArgumentError(KVRefError, ValueError):
    """An argument kvref cannot use (a value out of range, inconsistent shapes); the message names it."""


class ArgumentTypeError(KVRefError, TypeError):
    """An argument of the wrong type (say, a float where llama.cpp takes an integer); the message names it."""


class HParamsError(KVRefError, ValueError):
    """Inconsistent hyper-parameters, or a GGUF file llama.cpp would refuse to load (names the key)."""


class GGMLTypeError(KVRefError, ValueError):
    """An unknown ggml type id or name."""


class CheckFailed(AssertionError):
    """A conformance check (``kvref conformance``) found a difference from llama.cpp; the message says where."""


class Unsupported(Exception):
    """A conformance check kvref cannot run (a memory kind it does not model); the message says why."""


class BackendError(KVRefError, ImportError):
    """The requested backend cannot be used: an unknown ``KVREF_BACKEND``, or Cython asked for but not built."""


class CompatWarning(UserWarning):
    """A llama-cpp-python release outside the range whose sources kvref was checked against."""


class BackendWarning(RuntimeWarning):
    """kvref fell back to its pure-Python twins although nobody asked for them (the message says how to fix it)."""


class ConversionError(KVRefError):
    """A state cannot be written in the era layout asked for (``kvref.state.eras``; the message says what that layout
    cannot hold)."""


class EditError(KVRefError):
    """A state edit (``kvref.jobs.edit``: cut, merge, remap, restream) that cannot be made; the message says why."""


class ContextMismatch(KVRefError):
    """The context asked for cannot hold a state file (``kvref.restore``); ``param`` is the parameter to change,
    ``fix`` its value (both None when no context parameter can fix it: another model wrote the file)."""

    def __init__(self, message: str, param: str | None = None, fix: object = None) -> None:
        super().__init__(message)
        self.param = param
        self.fix = fix


class QuantError(KVRefError):
    """A type kvref cannot (de)quantize (kvref.ggml.quant), or rows that are not a whole number of its blocks."""


class KShiftError(KVRefError):
    """A K-shift llama.cpp does not get through (it aborts or crashes: a bf16 K cache, some quantized ones; the
    message names the reason and the configuration; `kvref.memory.kshift_quant`). Raised before anything changes."""


class SaveTargetError(KVRefError, ValueError):
    """A save refused before anything was written: the target exists and is not a regular file (a device, a FIFO,
    a directory, a socket), so replacing it would destroy it. The message names the path and what it is."""


class StoreError(KVRefError):
    """The prefix store's backend could not do its part (a full disk, a database it cannot write, a Redis server
    gone): the message names the store and the likely fix. What was stored before stays as it was."""


class DamagedValue(StoreError):
    """A value the store read failed its checksum or framing, or was gone when its chunk said it was there. The
    store never serves it: it drops the value, counts it (``stats()["corrupt"]``) and serves what remains."""


class CacheWarning(RuntimeWarning):
    """llama-cpp-python's cache (`kvref.store.LlamaCache`) did not store a completion's state (the completion
    itself is unaffected); the message says why."""


class NotYetImplemented(KVRefError):
    """An option that is planned but not implemented yet (the message says which)."""


__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BackendError",
    "BackendWarning",
    "BatchError",
    "CacheWarning",
    "CellError",
    "CheckFailed",
    "CompatError",
    "CompatWarning",
    "ContextMismatch",
    "ConversionError",
    "CorruptionError",
    "DamagedValue",
    "EditError",
    "FormatError",
    "GGMLTypeError",
    "HParamsError",
    "KShiftError",
    "KVRefError",
    "NoSlotError",
    "NotYetImplemented",
    "QuantError",
    "SaveTargetError",
    "SequenceError",
    "StoreError",
    "Unsupported",
]
