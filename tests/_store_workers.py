"""Child-process bodies for tests/test_store_backends.py (a module of their own, so a spawned child imports little).

Every value a worker writes carries its own checksum: ``payload + sha256(payload)``, see `make_value`.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from pathlib import Path

from kvref.store.sqlite_backend import INLINE_MAX, SQLiteBackend


def make_value(tag: str, size: int) -> bytes:
    """``size`` bytes (at least 40) whose last 32 are the sha256 of the rest, which starts with ``tag``."""
    head = tag.encode() + b"|"
    payload = head + random.Random(tag).randbytes(max(0, size - 32 - len(head)))
    return payload + hashlib.sha256(payload).digest()


def whole(value: bytes) -> bool:
    return hashlib.sha256(value[:-32]).digest() == value[-32:]


def size_for(i: int) -> int:
    """Mostly small values, every fourth one large enough to go to a file."""
    return INLINE_MAX + 1000 * (i % 7) if i % 4 == 0 else 100 + 37 * (i % 50)


def writer(path: str, worker: int, n: int) -> int:
    """Put ``n`` keys shared by every worker and ``n`` of its own; returns how many shared puts it won."""
    won = 0
    with SQLiteBackend(path) as store:
        for i in range(n):
            won += store.put(f"same-{i}", make_value(f"same-{i}-w{worker}", size_for(i)))
            assert store.put(f"w{worker}-{i}", make_value(f"w{worker}-{i}", size_for(i + worker)))
            if i % 5 == 0:
                store.add_link(f"same-{i}", f"w{worker}-{i}")
                store.incr("puts", 2)
    return won


def churner(path: str, progress: str) -> None:
    """Puts, replaces, deletes and evicts until killed (a test sends SIGKILL); ``progress`` names a file whose size
    grows by one byte per step done, so the test can kill it mid-sequence."""
    store = SQLiteBackend(path)
    rng = random.Random(0)
    with open(progress, "ab", buffering=0) as mark:
        for step in range(1_000_000):
            k = f"c{rng.randrange(200)}"
            op = rng.randrange(10)
            if op < 6:
                store.put(k, make_value(f"{k}-{step}", size_for(step)), replace=op < 3)
            elif op < 8:
                store.get(k)
            elif op < 9:
                store.delete([k])
            else:
                store.evict(4 * INLINE_MAX)
            mark.write(b".")


def progress_of(progress: Path) -> int:
    return progress.stat().st_size if progress.exists() else 0


def kill_after(target: Callable[..., None], args: tuple[object, ...], progress: Path, steps: int) -> None:
    """Run ``target(*args, str(progress))`` in a spawned process and SIGKILL it once ``progress`` shows ``steps``
    steps done (asserting it was still running, and that the signal is what ended it)."""
    import multiprocessing
    import os
    import signal
    import time

    child = multiprocessing.get_context("spawn").Process(target=target, args=(*args, str(progress)))
    child.start()
    try:
        while progress_of(progress) < steps and child.is_alive():
            time.sleep(0.002)
        assert child.is_alive(), f"the writer stopped by itself (exit code {child.exitcode})"
        os.kill(child.pid or 0, signal.SIGKILL)
    finally:
        child.join()
    assert child.exitcode == -signal.SIGKILL


# -- the prefix store (tests/test_store_faults.py) ---------------------------------------------------------------

SEQ_FILE = Path(__file__).resolve().parent.parent / "conformance/golden/llama-f16-single-seq/03-seq-seq0.ggsq"


def labels(prompt: int, n: int) -> list[int]:
    """Token ids for prompt ``prompt``: the first 8 shared by all prompts, the rest its own."""
    return list(range(1, 9)) + [10 + prompt] * (n - 8)


def store_putter(url: str, model: str, prompts: list[int]) -> int:
    """Put the golden sequence under each prompt's labels; returns the chunks it wrote."""
    from kvref import state
    from kvref.store import open as open_store

    n = len(state.load(SEQ_FILE).tokens)
    with open_store(url, chunk_tokens=4) as st:
        return sum(st.put(SEQ_FILE, model=model, tokens=labels(p, n)).new_chunks for p in prompts)


def store_churner(url: str, model: str, progress: str) -> None:
    """Put prompts until killed; ``progress`` grows by a byte per put done."""
    from kvref import state
    from kvref.store import open as open_store

    n = len(state.load(SEQ_FILE).tokens)
    st = open_store(url, chunk_tokens=4, capacity_bytes=60_000)
    with open(progress, "ab", buffering=0) as mark:
        for i in range(1_000_000):
            st.put(SEQ_FILE, model=model, tokens=labels(i % 40, n))
            mark.write(b".")


def store_put_limited(url: str, model: str, max_file_bytes: int) -> str:
    """Put with the process's file size limit at ``max_file_bytes`` (a full disk, as far as the store can tell);
    returns the error's class and message, or "" when the put fit."""
    import resource
    import signal

    from kvref import state
    from kvref.store import open as open_store

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing
    n = len(state.load(SEQ_FILE).tokens)
    st = open_store(url, chunk_tokens=4)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    try:
        for p in range(100, 140):
            st.put(SEQ_FILE, model=model, tokens=labels(p, n))
    except Exception as e:  # the test reads what it was
        return f"{type(e).__module__}.{type(e).__name__}: {e}"
    return ""
