"""state_size / state_write_into: the bytes of state_write, written into a caller's buffer or file.

llama.cpp's llama_state_get_data fills a buffer its caller allocated with llama_state_get_size; every kvref
memory offers the same pair. The bytes must be state_write's exactly, for every memory kind, whole or one
sequence, whatever writable buffer holds them.
"""

from __future__ import annotations

import io
import mmap

import numpy as np
import pytest
from recurrent_helpers import jamba_hparams, mamba_hparams

import kvref
from kvref.errors import ArgumentError, ArgumentTypeError
from kvref.memory.hybrid import HybridMemory
from kvref.memory.kv_cache import KVCache
from kvref.memory.kv_cache_iswa import KVCacheISWA
from kvref.memory.recurrent import RecurrentMemory


def _llama() -> kvref.HParams:
    return kvref.HParams(arch="llama", n_layer=2, n_embd=64, n_head=2, n_ctx_train=4096)


def _gemma2() -> kvref.HParams:
    hp = kvref.HParams(
        arch="gemma2", n_layer=2, n_embd=64, n_head=2, n_swa=8, swa_type=kvref.SWAType.STANDARD, n_ctx_train=4096
    )
    hp.set_swa_pattern(2)
    return hp


def _jamba() -> kvref.HParams:
    return jamba_hparams([True, False], n_head_kv=[0, 1], rope_type=kvref.RopeType.NONE, n_ctx_train=4096)


MEMORIES = {
    "kv": lambda: kvref.create_memory(_llama(), 256, 3),
    "kv-flash-attn": lambda: kvref.create_memory(_llama(), 256, 3, flash_attn=True),
    "kv-streams": lambda: kvref.create_memory(_llama(), 256, 3, kv_unified=False),
    "iswa": lambda: kvref.create_memory(_gemma2(), 256, 3),
    "recurrent": lambda: kvref.create_memory(mamba_hparams(2, n_ctx_train=4096), 256, 3),
    "hybrid": lambda: kvref.create_memory(_jamba(), 256, 3),
}


def _filled(kind: str):
    mem = MEMORIES[kind]()
    n = 30
    rec = kind in ("recurrent", "hybrid")  # one token per sequence and step keeps the recurrent cells simple
    for step in range(n // 3 if rec else 1):
        toks = range(3) if rec else range(n)
        mem.decode(
            kvref.Batch(
                tokens=[t % 7 for t in toks],
                seq_ids=[[t % 3] for t in toks],
                pos=[step if rec else t // 3 for t in toks],
            )
        )
    rng = np.random.default_rng(3)
    for buf in _buffers(mem):
        buf[...] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
    return mem


def _buffers(mem) -> list[np.ndarray]:
    """Every K/V/R/S byte buffer of the memory (so the rows written are not all zero)."""
    if isinstance(mem, KVCacheISWA):
        return _buffers(mem.base) + _buffers(mem.swa)
    if isinstance(mem, HybridMemory):
        return _buffers(mem.attn) + _buffers(mem.recr)
    if isinstance(mem, KVCache):
        return [x for layer in mem.layers for x in (layer.k, layer.v) if x is not None]
    assert isinstance(mem, RecurrentMemory)
    return [x for x in (*mem.r_l, *mem.s_l) if x is not None]


@pytest.mark.parametrize("kind", list(MEMORIES))
@pytest.mark.parametrize("seq_id", [-1, 1])
def test_write_into_gives_state_write_bytes(kind: str, seq_id: int) -> None:
    mem = _filled(kind)
    want = mem.state_write(seq_id)
    assert mem.state_size(seq_id) == len(want)
    buf = bytearray(len(want))
    assert mem.state_write_into(buf, seq_id) == len(want)
    assert bytes(buf) == want
    # a larger buffer: the state fills its first bytes, the rest is left alone
    big = bytearray(b"\xaa" * (len(want) + 7))
    assert mem.state_write_into(big, seq_id) == len(want)
    assert bytes(big[: len(want)]) == want and big[len(want) :] == b"\xaa" * 7
    # a binary file, a NumPy array and an anonymous mapping take the same bytes
    f = io.BytesIO()
    assert mem.state_write_into(f, seq_id) == len(want) and f.getvalue() == want
    arr = np.zeros(len(want) // 2 + 1, np.uint16)
    assert mem.state_write_into(arr, seq_id) == len(want) and arr.tobytes()[: len(want)] == want
    with mmap.mmap(-1, len(want)) as m:
        assert mem.state_write_into(m, seq_id) == len(want) and m[:] == want


def test_long_transposed_v_rows_go_in_one_strided_copy() -> None:
    """V stored transposed with rows of 2,500 cells (5,000 bytes: `Writer.array` writes them as rows): a buffer
    takes them in one strided copy, a file row by row; the same bytes, and a buffer one byte short is refused."""
    mem = kvref.create_memory(_llama(), 4096, 1, n_batch=4096)  # a decode takes at most n_batch tokens
    mem.decode(kvref.Batch(tokens=[t % 7 for t in range(2500)]), n_ubatch=2500)
    rng = np.random.default_rng(5)
    for buf in _buffers(mem):
        buf[...] = rng.integers(0, 256, buf.shape, dtype=np.uint8)
    assert mem.v_trans
    want = mem.state_write()
    buf = bytearray(len(want))
    assert mem.state_write_into(buf) == len(want) and bytes(buf) == want
    f = io.BytesIO()
    assert mem.state_write_into(f) == len(want) and f.getvalue() == want
    with pytest.raises(ArgumentError, match=f"needs {len(want)}"):
        mem.state_write_into(bytearray(len(want) - 1))


@pytest.mark.parametrize("kind", ["kv", "iswa", "hybrid"])
def test_a_buffer_too_small_names_the_size_needed(kind: str) -> None:
    mem = _filled(kind)
    need = mem.state_size()
    with pytest.raises(ArgumentError, match=f"needs {need}"):
        mem.state_write_into(bytearray(need - 1))


def test_a_read_only_buffer_or_another_object_is_refused() -> None:
    mem = _filled("kv")
    with pytest.raises(ArgumentTypeError):
        mem.state_write_into(bytes(mem.state_size()))
    with pytest.raises(ArgumentTypeError):
        mem.state_write_into([0] * mem.state_size())  # type: ignore[arg-type]
    with pytest.raises(ArgumentTypeError):
        mem.state_write_into(np.zeros((mem.state_size(), 2), np.uint8)[:, 0])  # not contiguous


def test_the_bytes_written_restore() -> None:
    mem = _filled("kv")
    buf = bytearray(mem.state_size(1))
    mem.state_write_into(buf, 1)
    other = MEMORIES["kv"]()
    assert other.state_read(buf, 1) == len(buf)
    assert other.state_write(1) == mem.state_write(1)
