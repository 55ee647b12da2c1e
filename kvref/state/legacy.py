"""What the state files of llama.cpp before session version 9 add to the layouts of `files` and `sections`.

Session version 8 (llama.cpp from PR #8699, July 2024, to the sampler refactor of September 2024;
llama-cpp-python 0.2.84 .. 0.2.90) wrote the sampler's random-number generator into every context state::

    context state (v8) = string arch, string rng, v9 output block, memory

``rng`` is the ``std::mt19937`` of the context as the C++ standard library prints it: the 624 state words
then the index of the next word, in decimal, separated by single spaces (``"x0 x1 ... x623 624"``). Everything
else is the layout of the oldest version 9 (llama-cpp-python 0.3.12): the output block, a KV section without
``n_stream`` whose data header (``v_trans``, ``n_layer``, per layer the types and row sizes) is written even when
the section has no cell, sequence files of version 2, raw sequence blobs without a prefix. A recurrent model
(Mamba) kept its states in the KV cache under the names K and V with every layer present, which reads as the
recurrent section of 0.3.12.

`RNG` is the field: a session file carries it exactly when its version is 8; a state blob, which has no
version, carries it when the bytes after the arch string are such a string (nothing else llama.cpp writes
there can be: an output count or a stream count followed by at least 1,249 digits and spaces).
"""

from __future__ import annotations

from ..errors import FormatError
from .codec import Reader, Writer
from .dsl import Env, Field, Str, env_int

# the session version of the era, the oldest kvref reads
SESSION_VERSION_RNG = 8

_MT_N = 624  # std::mt19937's state words
_RNG_MIN = 2 * _MT_N + 1  # 625 numbers of one digit and 624 spaces
_RNG_MAX = 11 * (_MT_N + 1)  # 625 numbers of at most 10 digits, with their spaces
_RNG_CHARS = frozenset(b"0123456789 ")


def _mt19937_words(seed: int) -> list[int]:
    """The state words of ``std::mt19937(seed)`` (the standard's seeding recurrence)."""
    words = [seed & 0xFFFFFFFF]
    for i in range(1, _MT_N):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return words


def rng_text(seed: int = 5489) -> str:
    """The text llama.cpp writes for a freshly seeded generator (5489: a default-constructed ``std::mt19937``)."""
    return " ".join(str(w) for w in [*_mt19937_words(seed), _MT_N])


def check_rng(text: str) -> str | None:
    """Why ``text`` is not a generator state llama.cpp can read back, or None."""
    parts = text.split(" ")
    if len(parts) != _MT_N + 1 or not all(p.isdigit() and p.isascii() for p in parts):
        return f"not {_MT_N + 1} decimal numbers separated by single spaces (a std::mt19937 state)"
    if any(int(p) > 0xFFFFFFFF for p in parts[:_MT_N]):
        return "a state word does not fit in 32 bits"
    if int(parts[-1]) > _MT_N:
        return f"index {parts[-1]} exceeds {_MT_N}"
    return None


def rng_length_at(buf: memoryview, at: int) -> int | None:
    """The length of the rng string whose ``u32`` length prefix starts at ``at``, or None when there is none."""
    if at + 4 > len(buf):
        return None
    n = int.from_bytes(buf[at : at + 4], "little")
    if not _RNG_MIN <= n <= _RNG_MAX or at + 4 + n > len(buf):
        return None
    body = bytes(buf[at + 4 : at + 4 + n])
    return n if _RNG_CHARS.issuperset(body) and check_rng(body.decode("ascii")) is None else None


def rng_present(buf: memoryview, at: int, version: int | None) -> bool:
    """Whether a context state's rng string starts at ``at``: by the version of a session file, else by the bytes."""
    if version is not None:
        return version <= SESSION_VERSION_RNG
    return rng_length_at(buf, at) is not None


class RngField(Field[object]):
    """``string rng`` after the arch string of session version 8 (see the module docstring)."""

    min_size = 0  # absent from every later version

    def __init__(self) -> None:
        self.name = self.attr = "rng"
        self._str = Str("rng", max_len=_RNG_MAX)

    @staticmethod
    def _version(env: Env) -> int | None:
        return env_int(env, "version") if "version" in env else None

    def read(self, r: Reader, env: Env) -> str | None:
        at = r.pos
        if not rng_present(r.buf[: r.end], at, self._version(env)):
            return None
        text = self._str.read(r, env)
        msg = check_rng(text)
        if msg:
            raise FormatError(msg, field="rng", offset=at + 4)
        return text

    def write(self, w: Writer, value: object, env: Env) -> None:
        version = self._version(env)
        want = value is not None if version is None else version <= SESSION_VERSION_RNG
        if want and value is None:
            raise FormatError(f"missing: session version {version} carries the rng string", field="rng", offset=w.n)
        if not want and value is not None:
            raise FormatError(f"present, but session version {version} has no rng string", field="rng", offset=w.n)
        if value is not None:
            msg = check_rng(value) if isinstance(value, str) else f"a {type(value).__name__}, not a str"
            if msg:
                raise FormatError(f"refusing to write: {msg}", field="rng", offset=w.n)
            self._str.write(w, value, env)


RNG = RngField()

__all__ = ["RNG", "SESSION_VERSION_RNG", "RngField", "check_rng", "rng_length_at", "rng_present", "rng_text"]
