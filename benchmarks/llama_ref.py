"""llama.cpp's own memory code, cut out of the llama-cpp-python sdist at run time and built for ctypes.

Nothing of llama.cpp is stored in this repository: `source_dir()` fetches the llama-cpp-python sdist with pip
(``pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36``) into a cache directory
(``$KVREF_BENCH_CACHE``, else ``$XDG_CACHE_HOME/kvref-bench``, else ``~/.cache/kvref-bench``) and unpacks its
``vendor/llama.cpp`` headers and sources there. ``KVREF_LLAMA_SRC`` points at an already unpacked llama.cpp tree
instead (a directory with ``src/`` and ``include/``; ``ggml/include`` or the ggml headers in ``include/``).

`build()` then writes one C++ translation unit into the cache:

- the real headers (``llama-kv-cells.h``, ``llama-hparams.h``, ``llama-batch.h``, ``llama-memory.h`` and what
  they include) are included as they are;
- ``llama_kv_cache``'s ``slot_info`` / ``stream_copy_info`` are cut out of ``llama-kv-cache.h`` and placed in a
  stand-in ``llama_kv_cache`` class that holds only the members the cut functions touch (cells, heads,
  seq_to_stream, n_stream, n_pad, n_swa, swa_type, hparams, ``other``, ``debug``); no ggml context, buffer or
  model is built;
- these member functions are cut out of ``src/llama-kv-cache.cpp`` by name, verbatim: ``seq_rm``,
  ``seq_pos_min``, ``seq_pos_max``, ``get_size``, ``get_n_kv``, ``prepare``, ``find_slot``, ``apply_ubatch``,
  and ``set_input_kq_mask`` with ``args_set_input_kq_mask`` and its ``set_input_kq_mask_impl`` templates; and
  ``llama_memory_seq_pos_max`` out of ``src/llama-context.cpp``;
- ``llama_memory_recurrent``'s ``mem_cell`` and the whole ``llama_memory_recurrent_context`` class are cut out of
  ``llama-memory-recurrent.h``; a stand-in ``llama_memory_recurrent`` holds the members its cut functions touch
  (head, size, used, n, rs_z, n_rs_seq, rs_idx, cells; no tensors); ``seq_pos_min``, ``seq_pos_max``,
  ``init_batch``, ``prepare`` and ``find_slot`` are cut out of ``src/llama-memory-recurrent.cpp`` by name, and the
  context's member functions (``apply``, ``next``, ``s_copy``, ...) as the file's last section, verbatim. The hybrid
  step (``kr_decode`` with an attention cache) follows ``llama_memory_hybrid::init_batch`` and its context's
  ``apply`` over the two stand-ins (written out: that context also holds a llama_kv_cache_context);
- ``src/llama-batch.cpp`` (``llama_batch_allocr``: init, split_simple, split_equal, ...; ``llama_batch_ext`` and
  ``llama_batch_compat``) is compiled whole, as its own object;
- stubs: ``llama_log_internal`` (silent), ``ggml_backend_buffer_is_host`` (true: the mask buffer is host
  memory), ``ggml_fp32_to_fp16`` / ``ggml_fp16_to_fp32``; every other symbol the two objects reference but
  never reach on these paths (llama_context, vocab, model, ggml graph functions used by other functions of
  llama-batch.cpp) becomes a trap (``ud2``) generated from the linker's list of undefined symbols.

The library times itself (``std::chrono::steady_clock`` around the measured call only), so ctypes' call cost
is not part of llama.cpp's numbers. `LlamaRef` wraps the C entry points.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

LLAMA_CPP_PYTHON = "0.3.36"
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"


class Unavailable(RuntimeError):
    """The llama.cpp reference cannot be built here (no sdist, no compiler, a function not found)."""


def cache_dir() -> Path:
    env = os.environ.get("KVREF_BENCH_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvref-bench"


# ----------------------------------------------------------------------------------------- the sources
def _unpack(tarball: Path, dest: Path) -> None:
    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    wanted = ("src/", "include/", "ggml/include/")
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(tarball) as tf:
        members = []
        for m in tf.getmembers():
            if not m.name.startswith(prefix) or not (m.isfile() or m.isdir()):
                continue
            rel = m.name[len(prefix) :]
            if not rel.startswith(wanted) or rel.startswith("src/models/"):
                continue
            m.name = rel
            members.append(m)
        if not members:
            raise Unavailable(f"{tarball} holds no vendor/llama.cpp sources")
        kwargs = {"filter": "data"} if sys.version_info >= (3, 12) else {}
        tf.extractall(tmp, members=members, **kwargs)
    tmp.rename(dest)


def source_dir(log=print) -> Path:
    """An unpacked llama.cpp tree (``src/``, ``include/``): KVREF_LLAMA_SRC, or the sdist fetched with pip."""
    env = os.environ.get("KVREF_LLAMA_SRC")
    if env:
        root = Path(env)
        if not (root / "src" / "llama-kv-cache.cpp").is_file():
            raise Unavailable(f"KVREF_LLAMA_SRC={env} has no src/llama-kv-cache.cpp")
        return root
    cache = cache_dir()
    dest = cache / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (dest / "src" / "llama-kv-cache.cpp").is_file():
        return dest
    cache.mkdir(parents=True, exist_ok=True)
    tarball = cache / SDIST
    if not tarball.is_file():
        # --no-binary for llama-cpp-python only: ":all:" would also build its build backend's own
        # dependencies (cmake, ninja) from source just to read the sdist's metadata, which takes many minutes
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            "-d",
            str(cache),
        ]
        log("fetching the llama-cpp-python sdist: " + " ".join(cmd[2:]))
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"pip download failed: {exc}") from exc
        if res.returncode != 0 or not tarball.is_file():
            tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
            raise Unavailable("pip download of the llama-cpp-python sdist failed: " + " | ".join(tail))
    _unpack(tarball, dest)
    return dest


# ----------------------------------------------------------------------------------------- cutting
def _function(src: str, qualified: str, *, what: str) -> str:
    """The definition of ``qualified(`` at the start of a line, through the first ``}`` alone on a line."""
    pat = re.compile(r"^[A-Za-z_][^\n;{}]*\b" + re.escape(qualified) + r"\s*\(", re.M)
    hits = [m for m in pat.finditer(src)]
    if len(hits) != 1:
        raise Unavailable(f"{what}: found {len(hits)} definitions of {qualified}")
    start = hits[0].start()
    end = src.find("\n}\n", start)
    if end < 0:
        raise Unavailable(f"{what}: no end for {qualified}")
    return src[start : end + 3]


def _upto(src: str, last_func: str, *, what: str) -> str:
    body = _function(src, last_func, what=what)
    return src[: src.find(body) + len(body)]


def cut_sources(root: Path) -> dict[str, str]:
    """The pieces of llama.cpp the harness compiles, cut by name from the sources."""
    kv_h = (root / "src" / "llama-kv-cache.h").read_text()
    kv_cpp = (root / "src" / "llama-kv-cache.cpp").read_text()
    m = re.search(r"^    struct stream_copy_info \{.*?^    using slot_info_vec_t = [^\n]*\n", kv_h, re.M | re.S)
    if m is None:
        raise Unavailable("llama-kv-cache.h: slot_info / stream_copy_info not found")
    funcs = [
        _function(kv_cpp, f"llama_kv_cache::{name}", what="llama-kv-cache.cpp")
        for name in ("seq_rm", "seq_pos_min", "seq_pos_max", "get_size", "get_n_kv", "find_slot", "apply_ubatch")
    ]
    funcs.append(_function(kv_cpp, "llama_kv_cache::prepare", what="llama-kv-cache.cpp"))
    # llama_batch_compat::init (llama_decode's first step) asks the memory through this C API function
    ctx_cpp = (root / "src" / "llama-context.cpp").read_text()
    funcs.append(_function(ctx_cpp, "llama_memory_seq_pos_max", what="llama-context.cpp"))
    start = kv_cpp.find("struct args_set_input_kq_mask {")
    if start < 0:
        raise Unavailable("llama-kv-cache.cpp: struct args_set_input_kq_mask not found")
    mask = _upto(kv_cpp[start:], "llama_kv_cache::set_input_kq_mask", what="llama-kv-cache.cpp")
    return {"types": m.group(0), "funcs": "\n".join(funcs), "mask": mask, **cut_recurrent(root)}


def cut_recurrent(root: Path) -> dict[str, str]:
    """llama_memory_recurrent's pieces: its ``mem_cell`` and the ``llama_memory_recurrent_context`` class out of the
    header; ``seq_pos_min``, ``seq_pos_max``, ``init_batch``, ``prepare`` and ``find_slot`` out of the source, and
    every member function of ``llama_memory_recurrent_context`` (the source's last section, from its first
    constructor to the end of the file: ``apply`` runs find_slot, ``s_copy`` fills the graph's state-copy input)."""
    h = (root / "src" / "llama-memory-recurrent.h").read_text()
    cpp = (root / "src" / "llama-memory-recurrent.cpp").read_text()
    cell = re.search(r"^    struct mem_cell \{.*?^    \};\n", h, re.M | re.S)
    ctx_class = r"^class llama_memory_recurrent_context : public llama_memory_context_i \{.*?^\};\n"
    ctx = re.search(ctx_class, h, re.M | re.S)
    if cell is None or ctx is None:
        raise Unavailable("llama-memory-recurrent.h: mem_cell / llama_memory_recurrent_context not found")
    funcs = [
        _function(cpp, f"llama_memory_recurrent::{name}", what="llama-memory-recurrent.cpp")
        for name in ("seq_pos_min", "seq_pos_max", "init_batch", "prepare", "find_slot")
    ]
    first = re.search(r"^llama_memory_recurrent_context::llama_memory_recurrent_context\(", cpp, re.M)
    if first is None:
        raise Unavailable("llama-memory-recurrent.cpp: llama_memory_recurrent_context's members not found")
    return {"rs_cell": cell.group(0), "rs_ctx_class": ctx.group(0), "rs_funcs": "\n".join(funcs),
            "rs_ctx": cpp[first.start():]}  # fmt: skip


# ----------------------------------------------------------------------------------------- our C++ side
_PRELUDE = r"""
// generated by benchmarks/llama_ref.py: llama.cpp functions cut from the sources, around a stand-in cache
#include "llama-batch.h"
#include "llama-hparams.h"
#include "llama-kv-cells.h"
#include "llama-memory.h"
#include "llama-impl.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <unordered_map>
#include <vector>

// ---- stubs for what the cut functions touch outside the cache
void llama_log_internal(ggml_log_level, const char *, ...) {}
void ggml_abort(const char * file, int line, const char * fmt, ...) {
    std::fprintf(stderr, "llama.cpp assertion at %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "\n");
    std::abort();
}
bool ggml_backend_buffer_is_host(ggml_backend_buffer_t) { return true; }
ggml_fp16_t ggml_fp32_to_fp16(float f) {
    _Float16 h = (_Float16) f;
    ggml_fp16_t r;
    std::memcpy(&r, &h, sizeof r);
    return r;
}
float ggml_fp16_to_fp32(ggml_fp16_t x) {
    _Float16 h;
    std::memcpy(&h, &x, sizeof h);
    return (float) h;
}

// ---- a stand-in llama_kv_cache: only the members the cut functions use
class llama_kv_cache {
public:
@TYPES@
    llama_kv_cache(const llama_hparams & hparams, uint32_t size, uint32_t n_stream, uint32_t n_seq_max,
                   uint32_t n_pad, uint32_t n_swa, llama_swa_type swa_type)
        : hparams(hparams), n_seq_max(n_seq_max), n_stream(n_stream), n_pad(n_pad), n_swa(n_swa),
          swa_type(swa_type), v_cells(v_cells_store) {
        v_cells.resize(n_stream);
        for (auto & c : v_cells) c.resize(size);
        v_heads.assign(n_stream, 0);
        seq_to_stream.resize(LLAMA_MAX_SEQ, 0);
        if (n_stream > 1) for (uint32_t s = 0; s < n_stream; ++s) seq_to_stream[s] = s;
    }

    bool seq_rm(llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    llama_pos seq_pos_min(llama_seq_id seq_id) const;
    llama_pos seq_pos_max(llama_seq_id seq_id) const;
    uint32_t get_size() const;
    uint32_t get_n_kv(const slot_info & sinfo) const;
    slot_info_vec_t prepare(const std::vector<llama_ubatch> & ubatches);
    slot_info find_slot(const llama_ubatch & ubatch, bool cont) const;
    void apply_ubatch(const slot_info & sinfo, const llama_ubatch & ubatch);
    void set_input_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch, bool causal_attn) const;

    const llama_hparams & hparams;
    bool v_trans = true;
    const uint32_t n_seq_max = 1;
    const uint32_t n_stream = 1;
    const uint32_t n_pad = 1;
    const uint32_t n_swa = 0;
    int debug = 0;
    const llama_swa_type swa_type = LLAMA_SWA_TYPE_NONE;
    std::vector<uint32_t> v_heads;
    llama_kv_cache * other = nullptr;
    llama_kv_cells_vec v_cells_store;
    llama_kv_cells_vec & v_cells;
    std::vector<uint32_t> seq_to_stream;
};

// ---- cut from src/llama-kv-cache.cpp
@FUNCS@

@MASK@

// ---- a stand-in llama_memory_recurrent: only the members the cut functions use (no tensors: r_l / s_l / p_l stay
// empty; the graph's gathers are not the memory's bookkeeping)
class llama_memory_recurrent {
public:
    llama_memory_recurrent(const llama_hparams & hparams, uint32_t mem_size, uint32_t n_seq_max)
        : hparams(hparams), n_seq_max(n_seq_max) {
        size = mem_size;
        cells.resize(mem_size);
        rs_idx.assign(n_seq_max, 0);
    }

    llama_memory_context_ptr init_batch(llama_batch_allocr & balloc, uint32_t n_ubatch, bool embd_all);
    llama_pos seq_pos_min(llama_seq_id seq_id) const;
    llama_pos seq_pos_max(llama_seq_id seq_id) const;
    bool prepare(const std::vector<llama_ubatch> & ubatches);
    bool find_slot(const llama_ubatch & ubatch);

    uint32_t head = 0;
    uint32_t size = 0;
    uint32_t used = 0;
    uint32_t n_rs_seq = 0;
    std::vector<uint32_t> rs_idx;
    uint32_t n = 0;
    int32_t rs_z = -1;
@RS_CELL@
    std::vector<mem_cell> cells;
    std::vector<ggml_tensor *> r_l;
    std::vector<ggml_tensor *> s_l;
    std::vector<ggml_tensor *> p_l;

    const llama_hparams & hparams;
    const uint32_t n_seq_max = 1;
};

// ---- cut from src/llama-memory-recurrent.h
@RS_CTX_CLASS@
// ---- cut from src/llama-memory-recurrent.cpp
@RS_FUNCS@

@RS_CTX@
"""

_ENTRY = r"""
// ---- the harness's C entry points
namespace {
using clk = std::chrono::steady_clock;
double secs(clk::time_point a, clk::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// what llama_batch_allocr::init asks the memory (llama_memory_i) for: the sequences' position ranges
struct kb_mem final : llama_memory_i {
    llama_kv_cache * kv = nullptr;
    llama_memory_context_ptr init_batch(llama_batch_allocr &, uint32_t, bool) override { return nullptr; }
    llama_memory_context_ptr init_full() override { return nullptr; }
    llama_memory_context_ptr init_update(llama_context *, bool) override { return nullptr; }
    bool get_can_shift() const override { return true; }
    void clear(bool) override {}
    bool seq_rm(llama_seq_id s, llama_pos p0, llama_pos p1) override { return kv->seq_rm(s, p0, p1); }
    void seq_cp(llama_seq_id, llama_seq_id, llama_pos, llama_pos) override {}
    void seq_keep(llama_seq_id) override {}
    void seq_add(llama_seq_id, llama_pos, llama_pos, llama_pos) override {}
    void seq_div(llama_seq_id, llama_pos, llama_pos, int) override {}
    llama_pos seq_pos_min(llama_seq_id s) const override { return kv->seq_pos_min(s); }
    llama_pos seq_pos_max(llama_seq_id s) const override { return kv->seq_pos_max(s); }
    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override { return {}; }
    void state_write(llama_io_write_i &, llama_seq_id, llama_state_seq_flags) const override {}
    void state_read(llama_io_read_i &, llama_seq_id, llama_state_seq_flags) override {}
};

// the caller's llama_batch: its arrays allocated once (reserve, before the clock, as llama_batch_init does), then
// filled with the step's tokens, one sequence id each (fill, inside the clock: what a program does every step)
struct step_batch {
    std::vector<llama_token> tok;
    std::vector<llama_pos> pos;
    std::vector<int32_t> n_seq_id;
    std::vector<llama_seq_id> seq_store;
    std::vector<llama_seq_id *> seq_id;
    std::vector<int8_t> logits;
    void reserve(int32_t n) {
        if ((int32_t) tok.size() >= n) return;
        tok.resize(n);
        pos.resize(n);
        n_seq_id.resize(n);
        seq_store.resize(n);
        seq_id.resize(n);
        logits.resize(n);
        for (int32_t i = 0; i < n; ++i) seq_id[i] = &seq_store[i];
    }
    llama_batch fill(int32_t n, const int32_t * t, const int32_t * p, const int32_t * s) {
        llama_batch batch = {n, tok.data(), nullptr, pos.data(), n_seq_id.data(), seq_id.data(), logits.data()};
        for (int32_t i = 0; i < n; ++i) {
            batch.token[i] = t[i];
            batch.pos[i] = p[i];
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = s[i];
            batch.logits[i] = i == n - 1;
        }
        return batch;
    }
};

struct kb_ctx {
    llama_hparams hp{};
    std::unique_ptr<llama_kv_cache> kv;
    kb_mem mem;
    llama_batch_allocr balloc{1};
    std::vector<llama_ubatch> ubatches;
    llama_kv_cache::slot_info_vec_t sinfos;
    std::vector<uint8_t> mask;
    int64_t mask_ne[4] = {0, 0, 0, 0};
    step_batch b;
    uint32_t n_seq_max = 1;
    alignas(8) char vocab_storage[64] = {0};  // llama_batch_allocr::init keeps a pointer; never read here
};
}  // namespace

extern "C" {

void * kb_new(uint32_t size, uint32_t n_stream, uint32_t n_seq_max, uint32_t n_pad, uint32_t n_swa, int swa_type) {
    auto * c = new kb_ctx();
    c->hp.n_swa = n_swa;
    c->hp.swa_type = (llama_swa_type) swa_type;
    c->n_seq_max = n_seq_max;
    c->kv.reset(new llama_kv_cache(c->hp, size, n_stream, n_seq_max, n_pad, n_swa, (llama_swa_type) swa_type));
    c->mem.kv = c->kv.get();
    return c;
}

void kb_free(void * p) { delete (kb_ctx *) p; }

// place cells directly: cell idx[i] of `stream` gets position pos[i] and sequence seq[i]; the head is set
void kb_fill(void * p, uint32_t stream, int64_t n, const int32_t * idx, const int32_t * pos, const int32_t * seq,
             uint32_t head) {
    auto * c = (kb_ctx *) p;
    auto & cells = c->kv->v_cells[stream];
    for (int64_t i = 0; i < n; ++i) {
        if (cells.is_empty(idx[i])) cells.pos_set(idx[i], pos[i]);
        cells.seq_add(idx[i], seq[i]);
    }
    c->kv->v_heads[stream] = head;
}

// One decode step as a program calling llama_decode does it, without the graph: fill the llama_batch from the
// step's arrays, then llama_decode's memory work: llama_batch_compat (the llama_batch as a llama_batch_ext),
// llama_batch_allocr::init, the split (init_batch), prepare, then apply_ubatch for every ubatch. Only the
// batch's arrays are allocated before the clock starts (once, as a caller's llama_batch_init does). With a second
// cache `swa` it is llama_kv_cache_iswa's step: the batch checked against the SWA cache's positions (the memory's),
// a simple split, prepare in the base then the SWA cache, and each ubatch applied to both.
static int kb_step(kb_ctx * c, kb_ctx * swa, int32_t n, const int32_t * tok, const int32_t * pos,
                   const int32_t * seq, uint32_t n_ubatch, double * t) {
    c->b.reserve(n);
    const llama_vocab & vocab = *reinterpret_cast<const llama_vocab *>(c->vocab_storage);
    const auto t0 = clk::now();
    llama_batch batch = c->b.fill(n, tok, pos, seq);
    // llama_context::decode(llama_batch): a llama_batch_compat news the llama_batch_ext and deletes it on return
    auto b = std::make_unique<llama_batch_ext>((size_t) 1 << 30, 0, 0, (llama_seq_id) c->n_seq_max,
                                               swa ? &swa->mem : &c->mem, 1 << 30, 1);
    llama_batch_compat::init(*b, batch);
    if (!c->balloc.init(*b, vocab, false)) return -1;
    c->balloc.split_reset();
    c->ubatches.clear();
    while (true) {
        auto ub = c->kv->n_stream == 1 ? c->balloc.split_simple(n_ubatch) : c->balloc.split_equal(n_ubatch, true, 0);
        if (ub.n_tokens == 0) break;
        c->ubatches.push_back(std::move(ub));
    }
    if (c->balloc.get_n_used() < c->balloc.get_n_tokens()) return -2;
    c->sinfos = c->kv->prepare(c->ubatches);
    if (c->sinfos.empty()) return -3;
    if (swa) {
        swa->sinfos = swa->kv->prepare(c->ubatches);
        if (swa->sinfos.empty()) return -4;
    }
    for (size_t i = 0; i < c->ubatches.size(); ++i) {
        c->kv->apply_ubatch(c->sinfos[i], c->ubatches[i]);
        if (swa) swa->kv->apply_ubatch(swa->sinfos[i], c->ubatches[i]);
    }
    b.reset();
    *t = secs(t0, clk::now());
    return (int) c->ubatches.size();
}

int kb_decode(void * p, int32_t n, const int32_t * tok, const int32_t * pos, const int32_t * seq, uint32_t n_ubatch,
              double * t) {
    return kb_step((kb_ctx *) p, nullptr, n, tok, pos, seq, n_ubatch, t);
}

int kb_decode_iswa(void * base, void * swa, int32_t n, const int32_t * tok, const int32_t * pos,
                   const int32_t * seq, uint32_t n_ubatch, double * t) {
    return kb_step((kb_ctx *) base, (kb_ctx *) swa, n, tok, pos, seq, n_ubatch, t);
}

// the cells of the last decoded ubatch's slot (stream 0 part), for checking against kvref
int64_t kb_last_idxs(void * p, uint32_t * out, int64_t cap) {
    auto * c = (kb_ctx *) p;
    if (c->sinfos.empty()) return -1;
    const auto & si = c->sinfos.back();
    int64_t n = 0;
    for (const auto & v : si.idxs)
        for (uint32_t x : v) { if (n < cap) out[n] = x; ++n; }
    return n;
}

// set_input_kq_mask for the last decoded ubatch, n_kv = get_n_kv(its slot); returns n_kv
int64_t kb_mask(void * p, int f16, double * t) {
    auto * c = (kb_ctx *) p;
    if (c->ubatches.empty()) return -1;
    const auto & ub = c->ubatches.back();
    const auto & si = c->sinfos.back();
    const int64_t n_kv = c->kv->get_n_kv(si);
    const int64_t n_stream = c->kv->n_stream == 1 ? 1 : (int64_t) ub.n_seqs_unq;
    ggml_tensor dst;
    std::memset(&dst, 0, sizeof dst);
    dst.type = f16 ? GGML_TYPE_F16 : GGML_TYPE_F32;
    dst.ne[0] = n_kv; dst.ne[1] = ub.n_tokens / n_stream; dst.ne[2] = 1; dst.ne[3] = n_stream;
    const size_t el = f16 ? 2 : 4;
    const size_t need = (size_t) n_kv * ub.n_tokens * el;
    if (c->mask.size() < need) c->mask.resize(need);
    dst.data = c->mask.data();
    const auto t0 = clk::now();
    c->kv->set_input_kq_mask(&dst, &ub, true);
    *t = secs(t0, clk::now());
    std::memcpy(c->mask_ne, dst.ne, sizeof c->mask_ne);
    return n_kv;
}

int64_t kb_mask_copy(void * p, void * out, int64_t nbytes) {
    auto * c = (kb_ctx *) p;
    const int64_t n = std::min<int64_t>(nbytes, (int64_t) c->mask.size());
    std::memcpy(out, c->mask.data(), n);
    return n;
}

int kb_seq_rm(void * p, int32_t seq_id, int32_t p0, int32_t p1, double * t) {
    auto * c = (kb_ctx *) p;
    const auto t0 = clk::now();
    const bool r = c->kv->seq_rm(seq_id, p0, p1);
    *t = secs(t0, clk::now());
    return r;
}

int32_t kb_seq_pos_max(void * p, int32_t seq_id) { return ((kb_ctx *) p)->kv->seq_pos_max(seq_id); }
int32_t kb_seq_pos_min(void * p, int32_t seq_id) { return ((kb_ctx *) p)->kv->seq_pos_min(seq_id); }
uint32_t kb_used(void * p, uint32_t stream) { return ((kb_ctx *) p)->kv->v_cells[stream].get_used(); }
uint32_t kb_head(void * p, uint32_t stream) { return ((kb_ctx *) p)->kv->v_heads[stream]; }

// get_n_kv over a one-stream slot, `iters` times; returns n_kv, *t the total time
uint32_t kb_get_n_kv(void * p, uint32_t stream, int64_t iters, double * t) {
    auto * c = (kb_ctx *) p;
    llama_kv_cache::slot_info si{};
    si.s0 = si.s1 = stream;
    si.strm = {(llama_seq_id) stream};
    si.idxs = {{0}};
    volatile uint32_t sink = 0;
    const auto t0 = clk::now();
    for (int64_t i = 0; i < iters; ++i) sink = c->kv->get_n_kv(si);
    *t = secs(t0, clk::now());
    return sink;
}

}  // extern "C"

// ---- llama_memory_recurrent, and llama_memory_hybrid's step over a recurrent memory and a KV cache
namespace {
// what llama_batch_allocr::init asks the memory: llama_memory_recurrent's own answers, or llama_memory_hybrid's
// (the max of the parts' seq_pos_min, the min of their seq_pos_max)
struct kr_mem final : llama_memory_i {
    llama_memory_recurrent * rs = nullptr;
    llama_kv_cache * kv = nullptr;  // the attention part of a hybrid memory, else null
    llama_memory_context_ptr init_batch(llama_batch_allocr &, uint32_t, bool) override { return nullptr; }
    llama_memory_context_ptr init_full() override { return nullptr; }
    llama_memory_context_ptr init_update(llama_context *, bool) override { return nullptr; }
    bool get_can_shift() const override { return false; }
    void clear(bool) override {}
    bool seq_rm(llama_seq_id, llama_pos, llama_pos) override { return false; }
    void seq_cp(llama_seq_id, llama_seq_id, llama_pos, llama_pos) override {}
    void seq_keep(llama_seq_id) override {}
    void seq_add(llama_seq_id, llama_pos, llama_pos, llama_pos) override {}
    void seq_div(llama_seq_id, llama_pos, llama_pos, int) override {}
    llama_pos seq_pos_min(llama_seq_id s) const override {
        return kv ? std::max(kv->seq_pos_min(s), rs->seq_pos_min(s)) : rs->seq_pos_min(s);
    }
    llama_pos seq_pos_max(llama_seq_id s) const override {
        return kv ? std::min(kv->seq_pos_max(s), rs->seq_pos_max(s)) : rs->seq_pos_max(s);
    }
    std::map<ggml_backend_buffer_type_t, size_t> memory_breakdown() const override { return {}; }
    void state_write(llama_io_write_i &, llama_seq_id, llama_state_seq_flags) const override {}
    void state_read(llama_io_read_i &, llama_seq_id, llama_state_seq_flags) override {}
};

struct kr_ctx {
    llama_hparams hp{};
    std::unique_ptr<llama_memory_recurrent> rs;
    kb_ctx * attn = nullptr;  // a hybrid memory's attention cache (kb_new), not owned
    kr_mem mem;
    llama_batch_allocr balloc{1};
    std::vector<int32_t> s_copy;  // the graph's s_copy input of the last ubatch (llm_graph_input_rs::set_input)
    uint32_t last_head = 0, last_n = 0;
    int32_t last_rs_z = -1;
    step_batch b;
    uint32_t n_seq_max = 1;
    alignas(8) char vocab_storage[64] = {0};
};
}  // namespace

extern "C" {

void * kr_new(uint32_t mem_size, uint32_t n_seq_max, void * attn) {
    auto * c = new kr_ctx();
    c->n_seq_max = n_seq_max;
    c->rs.reset(new llama_memory_recurrent(c->hp, mem_size, n_seq_max));
    c->attn = (kb_ctx *) attn;
    c->mem.rs = c->rs.get();
    c->mem.kv = c->attn ? c->attn->kv.get() : nullptr;
    return c;
}

void kr_free(void * p) { delete (kr_ctx *) p; }

// One decode step of a recurrent memory as llama_decode does it, without the graph: fill the llama_batch,
// llama_batch_compat, llama_batch_allocr::init, then llama_memory_recurrent::init_batch (split_equal, prepare); for
// every ubatch the context's apply() (find_slot) and the graph's s_copy input (s_copy(i) for the n_rs cells), then
// next(). With an attention cache (a hybrid memory), llama_memory_hybrid::init_batch's steps: split_equal (not
// sequential: one stream), the recurrent prepare, then the attention prepare; each ubatch applied to the attention
// cache, then the recurrent context (llama_memory_hybrid_context::apply).
int kr_decode(void * p, int32_t n, const int32_t * tok, const int32_t * pos, const int32_t * seq, uint32_t n_ubatch,
              double * t) {
    auto * c = (kr_ctx *) p;
    c->b.reserve(n);
    const llama_vocab & vocab = *reinterpret_cast<const llama_vocab *>(c->vocab_storage);
    const auto t0 = clk::now();
    llama_batch batch = c->b.fill(n, tok, pos, seq);
    auto b = std::make_unique<llama_batch_ext>((size_t) 1 << 30, 0, 0, (llama_seq_id) c->n_seq_max, &c->mem,
                                               1 << 30, 1);
    llama_batch_compat::init(*b, batch);
    if (!c->balloc.init(*b, vocab, false)) return -1;
    int n_ub = 0;
    if (!c->attn) {
        auto mctx = c->rs->init_batch(c->balloc, n_ubatch, false);
        if (mctx->get_status() != LLAMA_MEMORY_STATUS_SUCCESS) return -3;
        auto * rctx = static_cast<llama_memory_recurrent_context *>(mctx.get());
        do {
            rctx->apply();
            const uint32_t n_rs = rctx->get_n_rs();
            c->s_copy.resize(n_rs);
            for (uint32_t i = 0; i < n_rs; ++i) c->s_copy[i] = rctx->s_copy(i);
            c->last_head = rctx->get_head();
            c->last_n = n_rs;
            c->last_rs_z = rctx->get_rs_z();
            ++n_ub;
        } while (rctx->next());
    } else {
        auto * kv = c->attn->kv.get();
        c->balloc.split_reset();
        std::vector<llama_ubatch> ubatches;
        while (true) {
            auto ub = c->balloc.split_equal(n_ubatch, kv->n_stream != 1, 0);
            if (ub.n_tokens == 0) break;
            ubatches.push_back(std::move(ub));
        }
        if (c->balloc.get_n_used() < c->balloc.get_n_tokens()) return -2;
        if (!c->rs->prepare(ubatches)) return -3;
        auto sinfos = kv->prepare(ubatches);
        if (sinfos.empty()) return -4;
        // the recurrent context, as llama_memory_hybrid_context holds it (its own copy of the ubatches)
        llama_memory_recurrent_context rctx(c->rs.get(), ubatches);
        for (size_t i = 0; i < ubatches.size(); ++i) {
            kv->apply_ubatch(sinfos[i], ubatches[i]);
            rctx.apply();
            const uint32_t n_rs = rctx.get_n_rs();
            c->s_copy.resize(n_rs);
            for (uint32_t k = 0; k < n_rs; ++k) c->s_copy[k] = rctx.s_copy(k);
            c->last_head = rctx.get_head();
            c->last_n = n_rs;
            c->last_rs_z = rctx.get_rs_z();
            rctx.next();
            ++n_ub;
        }
        c->attn->sinfos = std::move(sinfos);
        c->attn->ubatches = std::move(ubatches);
    }
    b.reset();
    *t = secs(t0, clk::now());
    return n_ub;
}

// the last ubatch's recurrent slot: head, n, rs_z and s_copy (into out, up to cap); returns n
int64_t kr_last(void * p, int32_t * head_n_rsz, int32_t * out, int64_t cap) {
    auto * c = (kr_ctx *) p;
    head_n_rsz[0] = (int32_t) c->last_head;
    head_n_rsz[1] = (int32_t) c->last_n;
    head_n_rsz[2] = c->last_rs_z;
    for (int64_t i = 0; i < (int64_t) c->s_copy.size() && i < cap; ++i) out[i] = c->s_copy[i];
    return (int64_t) c->s_copy.size();
}

int32_t kr_seq_pos_max(void * p, int32_t seq_id) { return ((kr_ctx *) p)->rs->seq_pos_max(seq_id); }
uint32_t kr_used(void * p) { return ((kr_ctx *) p)->rs->used; }

}  // extern "C"

extern "C" {

// llama_kv_cells alone, for the bulk workloads of benchmarks/bench_cells.py: each loop as llama.cpp writes it
void * kc_new(uint32_t n) {
    auto * c = new llama_kv_cells();
    c->resize(n);
    return c;
}
void * kc_clone(void * p) { return new llama_kv_cells(*(llama_kv_cells *) p); }
void kc_free(void * p) { delete (llama_kv_cells *) p; }
uint32_t kc_used(void * p) { return ((llama_kv_cells *) p)->get_used(); }

static std::vector<uint32_t> kc_all(const llama_kv_cells & c) {
    std::vector<uint32_t> idxs(c.size());
    for (uint32_t i = 0; i < c.size(); ++i) idxs[i] = i;
    return idxs;
}

// (e) pos_set + seq_add of every cell
double kc_fill(void * p, int64_t n, const int32_t * pos, const int32_t * seq) {
    auto & c = *(llama_kv_cells *) p;
    const auto t0 = clk::now();
    for (int64_t i = 0; i < n; ++i) {
        c.pos_set(i, pos[i]);
        c.seq_add(i, seq[i]);
    }
    return secs(t0, clk::now());
}

// (f) llama_kv_cache::seq_rm's loop over the cells for one sequence and a position range
double kc_seq_rm(void * p, int32_t seq_id, int32_t p0, int32_t p1) {
    auto & c = *(llama_kv_cells *) p;
    const auto t0 = clk::now();
    for (uint32_t i = 0; i < c.size(); ++i) {
        if (c.pos_in(i, p0, p1) && c.seq_has(i, seq_id)) c.seq_rm(i, seq_id);
    }
    return secs(t0, clk::now());
}

// (g) pos_add on every used cell (llama_kv_cache::seq_add's loop, every sequence)
double kc_pos_add_used(void * p, int32_t d) {
    auto & c = *(llama_kv_cells *) p;
    const auto t0 = clk::now();
    for (uint32_t i = 0; i < c.size(); ++i) {
        if (!c.is_empty(i)) c.pos_add(i, d);
    }
    return secs(t0, clk::now());
}

// (h) seq_pos_max queries
double kc_seq_pos_max(void * p, int64_t n, const int32_t * q, int32_t * out) {
    auto & c = *(llama_kv_cells *) p;
    const auto t0 = clk::now();
    for (int64_t k = 0; k < n; ++k) out[k] = c.seq_pos_max(q[k]);
    return secs(t0, clk::now());
}

// (i) cp + set of every cell (prepare's backup and restore); (i2) with `saved`, a copy of other cells, set back
void * kc_cp_all(void * p) {
    auto & c = *(llama_kv_cells *) p;
    return new llama_kv_cells(c.cp(kc_all(c)));
}
double kc_cp_set(void * p, void * saved) {
    auto & c = *(llama_kv_cells *) p;
    const auto idxs = kc_all(c);
    const auto t0 = clk::now();
    auto copy = c.cp(idxs);
    c.set(idxs, saved ? *(llama_kv_cells *) saved : copy);
    return secs(t0, clk::now());
}

}  // extern "C"
"""


def _cxx() -> str:
    env = os.environ.get("CXX")
    cxx = shutil.which(env) if env else shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise Unavailable(f"no C++ compiler ({'$CXX=' + env if env else 'g++ / c++'}) on PATH")
    return cxx


def _includes(root: Path) -> list[str]:
    incs = [root / "src", root / "include", root / "ggml" / "include"]
    return [f"-I{p}" for p in incs if p.is_dir()]


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        errs = [ln for ln in res.stderr.splitlines() if "error" in ln][:8] or res.stderr.splitlines()[-8:]
        raise Unavailable(f"{what} failed:\n  " + "\n  ".join(errs))
    return res


def build(root: Path, log=print) -> Path:
    """Compile the cut functions and llama-batch.cpp into a shared library (cached by content hash)."""
    pieces = cut_sources(root)
    tu = _PRELUDE.replace("@TYPES@", pieces["types"]).replace("@FUNCS@", pieces["funcs"])
    tu = tu.replace("@MASK@", pieces["mask"]).replace("@RS_CELL@", pieces["rs_cell"])
    tu = tu.replace("@RS_CTX_CLASS@", pieces["rs_ctx_class"]).replace("@RS_FUNCS@", pieces["rs_funcs"])
    tu = tu.replace("@RS_CTX@", pieces["rs_ctx"]) + _ENTRY
    batch_cpp = (root / "src" / "llama-batch.cpp").read_bytes()
    cxx = _cxx()
    flags = ["-O2", "-std=c++17", "-fPIC", "-DNDEBUG", "-w", *_includes(root)]
    key = hashlib.sha256(tu.encode() + batch_cpp + " ".join([cxx, *flags]).encode()).hexdigest()[:16]
    out_dir = cache_dir() / f"build-{key}"
    lib = out_dir / "libkvref_llama_ref.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "kv_cut.cpp").write_text(tu)
    log(f"compiling llama.cpp's cut functions with {cxx} -O2 -std=c++17 (into {out_dir})")
    objs = []
    for name, src in (("kv_cut", out_dir / "kv_cut.cpp"), ("llama-batch", root / "src" / "llama-batch.cpp")):
        obj = out_dir / f"{name}.o"
        _run([cxx, *flags, "-c", str(src), "-o", str(obj)], f"compiling {src.name}")
        objs.append(str(obj))
    link = [cxx, "-shared", "-o", str(lib), *objs]
    # first link with --no-undefined to learn which symbols nothing here defines, then trap them
    res = subprocess.run([*link, "-Wl,--no-undefined", "-Wl,--no-demangle"], capture_output=True, text=True)
    if res.returncode != 0:
        missing = sorted(set(re.findall(r"undefined reference to `([^']+)'", res.stderr)))
        if not missing:
            raise Unavailable("linking failed:\n  " + "\n  ".join(res.stderr.splitlines()[-8:]))
        asm = ["\t.text"]
        for sym in missing:
            asm += [f"\t.globl {sym}", f"\t.type {sym}, @function", f"{sym}:", "\tud2"]
        (out_dir / "traps.s").write_text("\n".join(asm) + "\n")
        _run([cxx, "-c", str(out_dir / "traps.s"), "-o", str(out_dir / "traps.o")], "assembling traps")
        _run([*link, str(out_dir / "traps.o"), "-Wl,--no-undefined"], "linking")
        (out_dir / "traps.txt").write_text("\n".join(missing) + "\n")
    return lib


# ----------------------------------------------------------------------------------------- ctypes wrapper
_i32p = np.ctypeslib.ndpointer(np.int32, flags="C_CONTIGUOUS")
_u32p = np.ctypeslib.ndpointer(np.uint32, flags="C_CONTIGUOUS")
_dp = ctypes.POINTER(ctypes.c_double)


class LlamaRef:
    """One stand-in llama_kv_cache with llama.cpp's cut functions, driven through ctypes."""

    _lib: ctypes.CDLL | None = None

    @classmethod
    def load(cls, lib_path: Path) -> None:
        lib = ctypes.CDLL(str(lib_path))
        u32, i32, i64, vp = ctypes.c_uint32, ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
        sigs = {
            "kb_new": (vp, [u32, u32, u32, u32, u32, ctypes.c_int]),
            "kb_free": (None, [vp]),
            "kb_fill": (None, [vp, u32, i64, _i32p, _i32p, _i32p, u32]),
            "kb_decode": (ctypes.c_int, [vp, i32, _i32p, _i32p, _i32p, u32, _dp]),
            "kb_decode_iswa": (ctypes.c_int, [vp, vp, i32, _i32p, _i32p, _i32p, u32, _dp]),
            "kb_last_idxs": (i64, [vp, _u32p, i64]),
            "kb_mask": (i64, [vp, ctypes.c_int, _dp]),
            "kb_mask_copy": (i64, [vp, vp, i64]),
            "kb_seq_rm": (ctypes.c_int, [vp, i32, i32, i32, _dp]),
            "kb_seq_pos_max": (i32, [vp, i32]),
            "kb_seq_pos_min": (i32, [vp, i32]),
            "kb_used": (u32, [vp, u32]),
            "kb_head": (u32, [vp, u32]),
            "kb_get_n_kv": (u32, [vp, u32, i64, _dp]),
            "kr_new": (vp, [u32, u32, vp]),
            "kr_free": (None, [vp]),
            "kr_decode": (ctypes.c_int, [vp, i32, _i32p, _i32p, _i32p, u32, _dp]),
            "kr_last": (i64, [vp, _i32p, _i32p, i64]),
            "kr_seq_pos_max": (i32, [vp, i32]),
            "kr_used": (u32, [vp]),
            "kc_new": (vp, [u32]),
            "kc_clone": (vp, [vp]),
            "kc_free": (None, [vp]),
            "kc_used": (u32, [vp]),
            "kc_fill": (ctypes.c_double, [vp, i64, _i32p, _i32p]),
            "kc_seq_rm": (ctypes.c_double, [vp, i32, i32, i32]),
            "kc_pos_add_used": (ctypes.c_double, [vp, i32]),
            "kc_seq_pos_max": (ctypes.c_double, [vp, i64, _i32p, _i32p]),
            "kc_cp_all": (vp, [vp]),
            "kc_cp_set": (ctypes.c_double, [vp, vp]),
        }
        for name, (res, args) in sigs.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        cls._lib = lib

    def __init__(self, size: int, n_stream: int = 1, n_seq_max: int = 1, n_pad: int = 1, n_swa: int = 0, swa_type=0):
        if self._lib is None:
            raise Unavailable("LlamaRef.load() first")
        self.lib = self._lib
        self.h = self.lib.kb_new(size, n_stream, n_seq_max, n_pad, n_swa, int(swa_type))
        self._t = ctypes.c_double(0.0)

    def close(self) -> None:
        if self.h:
            self.lib.kb_free(self.h)
            self.h = None

    def __del__(self) -> None:
        self.close()

    def fill(self, stream: int, idx: np.ndarray, pos: np.ndarray, seq: np.ndarray, head: int) -> None:
        a = [np.ascontiguousarray(x, dtype=np.int32) for x in (idx, pos, seq)]
        self.lib.kb_fill(self.h, stream, len(a[0]), a[0], a[1], a[2], head)

    def decode(self, tok: np.ndarray, pos: np.ndarray, seq: np.ndarray, n_ubatch: int = 512) -> float:
        a = [np.ascontiguousarray(x, dtype=np.int32) for x in (tok, pos, seq)]
        rc = self.lib.kb_decode(self.h, len(a[0]), a[0], a[1], a[2], n_ubatch, ctypes.byref(self._t))
        if rc < 0:
            raise RuntimeError(f"llama.cpp decode failed ({rc})")
        return self._t.value

    def decode_iswa(
        self, swa: LlamaRef, tok: np.ndarray, pos: np.ndarray, seq: np.ndarray, n_ubatch: int = 512
    ) -> float:
        """llama_kv_cache_iswa's decode step, this cache the base and ``swa`` the SWA cache."""
        a = [np.ascontiguousarray(x, dtype=np.int32) for x in (tok, pos, seq)]
        rc = self.lib.kb_decode_iswa(self.h, swa.h, len(a[0]), a[0], a[1], a[2], n_ubatch, ctypes.byref(self._t))
        if rc < 0:
            raise RuntimeError(f"llama.cpp iSWA decode failed ({rc})")
        return self._t.value

    def last_idxs(self) -> np.ndarray:
        out = np.zeros(1 << 16, np.uint32)
        n = self.lib.kb_last_idxs(self.h, out, out.shape[0])
        return out[: max(n, 0)].copy()

    def mask(self, f16: bool) -> tuple[float, int]:
        n_kv = self.lib.kb_mask(self.h, int(f16), ctypes.byref(self._t))
        return self._t.value, int(n_kv)

    def mask_bytes(self, nbytes: int) -> bytes:
        buf = ctypes.create_string_buffer(nbytes)
        n = self.lib.kb_mask_copy(self.h, buf, nbytes)
        return buf.raw[:n]

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> float:
        self.lib.kb_seq_rm(self.h, seq_id, p0, p1, ctypes.byref(self._t))
        return self._t.value

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self.lib.kb_seq_pos_max(self.h, seq_id))

    def used(self, stream: int = 0) -> int:
        return int(self.lib.kb_used(self.h, stream))

    def head(self, stream: int = 0) -> int:
        return int(self.lib.kb_head(self.h, stream))

    def get_n_kv(self, stream: int, iters: int) -> tuple[float, int]:
        n = self.lib.kb_get_n_kv(self.h, stream, iters, ctypes.byref(self._t))
        return self._t.value / iters, int(n)


class RecurrentRef:
    """One stand-in llama_memory_recurrent with llama.cpp's cut functions (``attn``: a LlamaRef KV cache, which makes
    the pair llama_memory_hybrid's step), driven through ctypes."""

    def __init__(self, mem_size: int, n_seq_max: int = 1, attn: LlamaRef | None = None) -> None:
        if LlamaRef._lib is None:
            raise Unavailable("LlamaRef.load() first")
        self.lib = LlamaRef._lib
        self.attn = attn  # kept alive: the C side holds its pointer
        self.h = self.lib.kr_new(mem_size, n_seq_max, attn.h if attn is not None else None)
        self._t = ctypes.c_double(0.0)

    def close(self) -> None:
        if self.h:
            self.lib.kr_free(self.h)
            self.h = None

    def __del__(self) -> None:
        self.close()

    def decode(self, tok: np.ndarray, pos: np.ndarray, seq: np.ndarray, n_ubatch: int = 512) -> float:
        a = [np.ascontiguousarray(x, dtype=np.int32) for x in (tok, pos, seq)]
        rc = self.lib.kr_decode(self.h, len(a[0]), a[0], a[1], a[2], n_ubatch, ctypes.byref(self._t))
        if rc < 0:
            raise RuntimeError(f"llama.cpp recurrent decode failed ({rc})")
        return self._t.value

    def last(self) -> tuple[int, int, int, list[int]]:
        """The last ubatch's (head, n, rs_z, s_copy)."""
        hn = np.zeros(3, np.int32)
        out = np.zeros(1 << 12, np.int32)
        n = self.lib.kr_last(self.h, hn, out, out.shape[0])
        return int(hn[0]), int(hn[1]), int(hn[2]), out[:n].tolist()

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self.lib.kr_seq_pos_max(self.h, seq_id))

    def used(self) -> int:
        return int(self.lib.kr_used(self.h))


class CellsRef:
    """One llama_kv_cells (llama.cpp's real header), driven through ctypes; each call returns llama.cpp's time."""

    def __init__(self, n: int = 0, handle: int | None = None) -> None:
        if LlamaRef._lib is None:
            raise Unavailable("LlamaRef.load() first")
        self.lib = LlamaRef._lib
        self.h = handle if handle is not None else self.lib.kc_new(n)

    def close(self) -> None:
        if self.h:
            self.lib.kc_free(self.h)
            self.h = None

    def __del__(self) -> None:
        self.close()

    def clone(self) -> CellsRef:
        return CellsRef(handle=self.lib.kc_clone(self.h))

    def cp_all(self) -> CellsRef:
        return CellsRef(handle=self.lib.kc_cp_all(self.h))

    def used(self) -> int:
        return int(self.lib.kc_used(self.h))

    def fill(self, pos: np.ndarray, seq: np.ndarray) -> float:
        a, b = (np.ascontiguousarray(x, dtype=np.int32) for x in (pos, seq))
        return float(self.lib.kc_fill(self.h, len(a), a, b))

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> float:
        return float(self.lib.kc_seq_rm(self.h, seq_id, p0, p1))

    def pos_add_used(self, d: int) -> float:
        return float(self.lib.kc_pos_add_used(self.h, d))

    def seq_pos_max(self, queries: np.ndarray) -> tuple[float, np.ndarray]:
        q = np.ascontiguousarray(queries, dtype=np.int32)
        out = np.empty_like(q)
        return float(self.lib.kc_seq_pos_max(self.h, len(q), q, out)), out

    def cp_set(self, saved: CellsRef | None = None) -> float:
        return float(self.lib.kc_cp_set(self.h, saved.h if saved is not None else None))


def prepare(log=print) -> Path:
    """Fetch, cut and build; returns the shared library (raises Unavailable with the reason)."""
    root = source_dir(log)
    lib = build(root, log)
    LlamaRef.load(lib)
    return lib
