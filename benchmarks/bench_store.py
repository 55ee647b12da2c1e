"""kvref.store with the real Gemma 3 270M: ``python benchmarks/bench_store.py [--quick] [--redis URL]``.

The workload of the issue: 16 prompts sharing a 2,000-token system prompt, each with 200 tokens of its own. Each
prompt is prefilled once by llama.cpp (llama-cpp-python's low-level API, the same context settings on both sides:
n_ctx 4096, n_batch = n_ubatch = 512, f16 K/V, flash attention off, 2 threads), saved whole
(``llama_state_get_data``, what llama-cpp-python's ``save_state`` keeps) and put into the store. (A *sequence*
save of Gemma 3 keeps only the last 512 positions of its SWA cache, so the shared 2,000-token prefix of a longer
prompt is not servable from it: the store says so instead of serving it.) Then, for every prompt, a new prompt with
the same system prompt and a tail of its own is served what the store holds of it (the 2,000 shared tokens):

- time to first token cold: prefill of all 2,200 tokens, logits of the last;
- time to first token from the store: ``store.get`` (kind ``seq_state``) + ``llama_state_seq_set_data`` + the
  prefill of the tokens not served + logits of the last; its greedy token is compared with a fresh prefill's;
- the store's bytes against the sum of the 16 states; put and get throughput against a plain copy of the same
  bytes (``bytes(bytearray(blob))``: an allocation and a copy, what any cache at least does);
- lookup time (metadata only) with 10^5 chunks stored (synthetic chunks of the same namespace);
- eviction on a trace: hit rate of the store's LRU (a chain's head kept newest) vs FIFO, for a capacity of a
  quarter of the trace's distinct bytes.

Backends: the embedded default in a temporary directory, and Redis when ``--redis URL`` is given (or
``KVREF_REDIS_URL``). The model comes from ``KVREF_GEMMA3_GGUF`` or ``~/.cache/kvref-models``
(``python conformance/gen_real_kshift.py --fetch-only`` fetches it). Prints the machine's CPU and a table.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "conformance"))

import kvref.store  # noqa: E402
from kvref.store.prefix import Store  # noqa: E402

SYSTEM, OWN, N_PROMPTS, N_CTX = 2000, 200, 16, 4096


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class Llama:
    """One llama.cpp context on the model (low-level API), torn down and made again per measurement."""

    def __init__(self, model: Path) -> None:
        import llama_cpp as L

        self.L = L

        @L.llama_log_callback
        def quiet(level, text, user):  # type: ignore[no-untyped-def]
            return None

        self._quiet = quiet
        L.llama_log_set(quiet, None)
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(model).encode(), mp)
        assert self.model, f"llama.cpp could not load {model}"
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.ctx = None

    def new_context(self) -> None:
        L = self.L
        if self.ctx:
            L.llama_free(self.ctx)
        p = L.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = N_CTX, 512, 512, 1
        p.n_threads = p.n_threads_batch = 2
        p.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        p.type_k = p.type_v = 1  # f16
        p.offload_kqv = p.op_offload = False
        p.no_perf = True
        self.ctx = L.llama_init_from_model(self.model, p)
        assert self.ctx

    def prefill(self, tokens: list[int], start: int = 0) -> np.ndarray:
        """Decode ``tokens`` at positions from ``start`` (batches of 512); the logits of the last."""
        L = self.L
        for i in range(0, len(tokens), 512):
            part = tokens[i : i + 512]
            b = L.llama_batch_init(len(part), 0, 1)
            b.n_tokens = len(part)
            for j, t in enumerate(part):
                b.token[j], b.pos[j], b.n_seq_id[j] = int(t), start + i + j, 1
                b.seq_id[j][0] = 0
                b.logits[j] = int(i + j == len(tokens) - 1)
            assert L.llama_decode(self.ctx, b) == 0
            L.llama_batch_free(b)
        return np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,)).copy()

    def state_blob(self) -> bytes:
        """llama_state_get_data: what llama-cpp-python's ``Llama.save_state`` keeps (``LlamaState.llama_state``)."""
        L = self.L
        n = L.llama_state_get_size(self.ctx)
        buf = (ctypes.c_uint8 * n)()
        got = L.llama_state_get_data(self.ctx, buf, n)
        return bytes(buf[:got])

    def set_seq(self, blob: bytes) -> None:
        L = self.L
        arr = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        assert L.llama_state_seq_set_data(self.ctx, arr, len(blob), 0) == len(blob)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _p10(xs: list[float]) -> float:
    return float(np.percentile(xs, 10))


def run_backend(
    label: str, st: Store, llm: Llama, model: Path, prompts: list[list[int]], blobs: list[bytes], cold: list[float]
) -> list[str]:
    rows = []
    # put each prompt's state; time put vs a plain copy
    t_put, t_copy = [], []
    for toks, blob in zip(prompts, blobs, strict=True):
        t0 = time.perf_counter()
        st.put(blob, model=model, tokens=toks)
        t_put.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        bytes(bytearray(blob))
        t_copy.append(time.perf_counter() - t0)
    total = sum(len(b) for b in blobs)
    held = st.stats()["bytes"]
    assert isinstance(held, int)
    # serve each prompt from what the others stored: a prompt that differs in its own last token
    ttft, t_get, same = [], [], 0
    for toks in prompts:
        probe = [*toks[:SYSTEM], *((np.asarray(toks[SYSTEM:]) + 1) % 1000 + 2).tolist()]  # shares the system prompt
        llm.new_context()
        t0 = time.perf_counter()
        hit = st.get(probe, model=model, kind="seq_state")
        t1 = time.perf_counter()
        assert hit is not None, st.lookup(probe, model=model)
        llm.set_seq(hit.data)
        logits = llm.prefill(probe[hit.n_tokens :], start=hit.n_tokens)
        ttft.append(time.perf_counter() - t0)
        t_get.append(t1 - t0)
        llm.new_context()
        ref = llm.prefill(probe)
        same += int(np.argmax(ref) == np.argmax(logits))
    get_bytes = [len(blobs[0])] * len(t_get)
    rows.append(
        f"| {label}: time to first token from the store | {_med(ttft) * 1e3:.0f} ms (p10 {_p10(ttft) * 1e3:.0f}) | "
        f"cold prefill {_med(cold) * 1e3:.0f} ms: **{_med(cold) / _med(ttft):.1f}x** faster; greedy token equal "
        f"to a fresh prefill's in {same}/{len(prompts)} |"
    )
    rows.append(f"| {label}: store bytes / sum of the {len(blobs)} states | {held / 2**20:.1f} MiB / "
                f"{total / 2**20:.1f} MiB | **{held / total:.2f}** |")  # fmt: skip
    mbps = lambda n, t: n / t / 2**20  # noqa: E731
    rows.append(f"| {label}: put throughput (new + kept chunks) | {mbps(total, sum(t_put)):.0f} MiB/s | plain copy "
                f"{mbps(total, sum(t_copy)):.0f} MiB/s: {sum(t_put) / sum(t_copy):.1f}x the copy's time |")  # fmt: skip
    t_c = []
    for _ in range(len(t_get)):
        t0 = time.perf_counter()
        bytes(bytearray(blobs[0]))
        t_c.append(time.perf_counter() - t0)
    rows.append(
        f"| {label}: get (assemble a 2,000-token seq_state) | {_med(t_get) * 1e3:.1f} ms | plain copy of a "
        f"whole state ({get_bytes[0] / 2**20:.1f} MiB) {_med(t_c) * 1e3:.1f} ms |"
    )
    return rows


def lookup_rows(st: Store, model: Path, n_chunks: int) -> list[str]:
    """Lookup latency with ``n_chunks`` chunk metas stored (synthetic: one namespace, random token chunks)."""
    from kvref.store.chunks import ChunkMeta
    from kvref.store.prefix import chain_key, root_key

    ns = st.namespaces(model)[0]
    rng = np.random.default_rng(0)
    T = st.chunk_tokens
    root = root_key(ns)
    be = st.backend
    parents = [root]
    for i in range(n_chunks):
        parent = parents[int(rng.integers(len(parents)))] if i % 4 else root
        toks = rng.integers(0, 1 << 18, T).astype(np.int32)
        key = chain_key(parent, toks)
        be.put("c:" + key, ChunkMeta(parent, toks, np.zeros((T, 0), np.int32), [T] * len(ns.sections)).encode())
        be.add_link("c:" + parent, key)
        parents.append(key)
    probe = rng.integers(0, 1 << 18, 2200).astype(np.int32)
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        st.lookup(probe, model=model)
        ts.append(time.perf_counter() - t0)
    return [f"| lookup of a 2,200-token prompt, {n_chunks:,} chunks stored (root has {n_chunks // 4:,} children) "
            f"| {_med(ts) * 1e3:.2f} ms (p10 {_p10(ts) * 1e3:.2f}) | metadata only |"]  # fmt: skip


def eviction_rows(model: Path, blob: bytes, toks: list[int]) -> list[str]:
    """Hit tokens on a trace (Zipf-popular system prompts, random tails) for the store's LRU vs FIFO."""
    from kvref.store.backend import MemoryBackend

    class FIFO(MemoryBackend):
        def touch(self, keys: object) -> None:  # a use does not renew a value
            return None

        def get_many(self, keys):  # type: ignore[no-untyped-def]
            with self._lock:
                return [self._values.get(k) for k in keys]

    rng = np.random.default_rng(1)
    n = len(toks)
    systems = [rng.integers(1, 200, n - OWN).tolist() for _ in range(8)]
    trace = []
    for _ in range(200):
        s = min(int(rng.zipf(1.5)) - 1, 7)
        trace.append(systems[s] + rng.integers(1, 200, OWN).tolist())
    probe_st = Store(MemoryBackend(), chunk_tokens=256)
    for t in trace:
        probe_st.put(blob, model=model, tokens=t)
    distinct = probe_st.stats()["bytes"]
    assert isinstance(distinct, int)
    out = []
    for name, be in (("LRU, chain heads kept newest (kvref.store)", MemoryBackend()), ("FIFO", FIFO())):
        st = Store(be, capacity_bytes=distinct // 4, chunk_tokens=256)
        served = 0
        for t in trace:
            look = st.lookup(t, model=model)
            hit = st.get(t, model=model) if look.n_tokens else None
            served += hit.n_tokens if hit else 0
            st.put(blob, model=model, tokens=t)
        out.append(
            f"| eviction, capacity 1/4 of the trace's {distinct / 2**20:.0f} MiB: {name} | "
            f"{served / (len(trace) * n):.1%} of prompt tokens served | 200 prompts, 8 system prompts (Zipf) |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="4 prompts and 10^4 chunks")
    ap.add_argument("--redis", default=os.environ.get("KVREF_REDIS_URL"), help="a Redis URL for the shared backend")
    args = ap.parse_args(argv)
    from gen_real_kshift import find_model  # type: ignore[import-not-found]

    model = find_model()
    if model is None:
        print("Gemma 3 270M not found (KVREF_GEMMA3_GGUF, ~/.cache/kvref-models): "
              "python conformance/gen_real_kshift.py --fetch-only")  # fmt: skip
        return 0
    try:
        llm = Llama(model)
    except ImportError:
        print("llama-cpp-python is not installed: the benchmark needs the real llama.cpp")
        return 0
    n_prompts = 4 if args.quick else N_PROMPTS
    rng = np.random.default_rng(0)
    system = rng.integers(100, 200_000, SYSTEM).tolist()
    prompts = [system + rng.integers(100, 200_000, OWN).tolist() for _ in range(n_prompts)]
    blobs, cold = [], []
    for toks in prompts:
        llm.new_context()
        t0 = time.perf_counter()
        llm.prefill(toks)
        cold.append(time.perf_counter() - t0)
        blobs.append(llm.state_blob())
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores; model {model.name}; n_threads 2")
    print(f"{n_prompts} prompts: {SYSTEM} shared + {OWN} own tokens; states of {len(blobs[0]) / 2**20:.1f} MiB each\n")
    rows = ["| what | kvref.store | against |", "|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        st = kvref.store.open(Path(d) / "store")
        rows += run_backend("embedded", st, llm, model, prompts, blobs, cold)
        rows += lookup_rows(st, model, 10_000 if args.quick else 100_000)
        st.close()
    if args.redis:
        st = kvref.store.open(args.redis.rstrip("/") + ("&" if "?" in args.redis else "?") + "prefix=kvref-bench:")
        st.backend.delete(st.backend.keys())
        rows += run_backend("Redis", st, llm, model, prompts, blobs, cold)
        st.backend.delete(st.backend.keys())
        st.close()
    else:
        rows.append("| Redis | not run | pass --redis URL or set KVREF_REDIS_URL |")
    rows += eviction_rows(model, blobs[0], prompts[0])
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
