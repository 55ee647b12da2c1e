"""Drive a real llama.cpp (through llama-cpp-python's low-level ctypes API) and record
every call, its arguments and its return value.

This module is the only place in conformance/ that talks to llama.cpp.  A ``Run`` owns
one model and one context; each method performs one llama.cpp call and appends one
operation to ``run.trace`` in the case.json format (see case.schema.json).  Save
operations also write the artefact into the case directory and describe which memory
layout it holds, so a reader can be told what to expect without guessing.  ``Run.apply``
performs an op given in that same vocabulary (how fuzz.py runs its plans).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
from pathlib import Path

import llama_cpp as L

# ggml type ids (ggml.h enum ggml_type) for the cache types the cases use
GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}

SESSION_MAGIC = 0x6767736E  # 'ggsn'
SEQ_MAGIC = 0x67677371  # 'ggsq'

# llama_context::state_seq_get_data prefixes every raw sequence blob with this u32 and the
# source seq id (i32) in the current producer; llama_state_seq_save_file never does
SEQ_DATA_IO_MAGIC = 0xAF143CD8

# What each llama-cpp-python release's vendored llama.cpp writes (checked in its sources):
#   output_block   session/state_data carry n_outputs, output positions, logits, embeddings
#                  between the arch string and the memory
#   seq_data_prefix  raw sequence blobs start with io_magic + seq id
#   cell_ext_size  bytes of llama_kv_cell_ext per cell for M-RoPE models (0: never written)
#   swa_masked_in_seq  SWA-masked cells are still written into sequence artefacts
#   n_stream_field  u32 n_stream before each KV section (PR #14363; False: one cache, kv_unified ignored)
#   whole_restore_last_stream  a whole restore clears the cache before each non-empty stream it reads,
#                  so only the last one survives (the multistream script records one, legacy runs only)
PRODUCERS = {
    "0.3.36": {
        "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f",
        "llama_cpp_commit_date": "2026-10-01",
        "session_version": 10,
        "seq_version": 3,
        "output_block": False,
        "seq_data_prefix": True,
        "cell_ext_size": 12,
        "swa_masked_in_seq": False,
    },
    # 0.3.35 (August 2026): session v9 without the output block, seq v2, seq-blob prefix, 8-byte cell ext
    # (i32 x, y: M-RoPE only); the sdist names the commit only by its prefix (CHANGELOG.md)
    "0.3.35": {
        "llama_cpp_commit": "4df29be4f",
        "llama_cpp_commit_date": None,
        "session_version": 9,
        "seq_version": 2,
        "output_block": False,
        "seq_data_prefix": True,
        "cell_ext_size": 8,
        "swa_masked_in_seq": False,
        "whole_restore_last_stream": True,
    },
    # 0.3.12 (July 2025, before PR #14363): as 0.3.16 without streams; no *_ext state functions (no flags)
    "0.3.12": {
        "llama_cpp_commit": "a0374a67e2924f2e845cdc59dd67d9a44065a89c",
        "llama_cpp_commit_date": None,
        "session_version": 9,
        "seq_version": 2,
        "output_block": True,
        "seq_data_prefix": False,
        "cell_ext_size": 0,
        "swa_masked_in_seq": True,
        "n_stream_field": False,
        # GGML_ASSERT in ggml_view_1d (llama_kv_cache_unified::cpy_k) while llama_init_from_model
        # reserves its graphs for n_seq_max 3 with n_ubatch 256 = the cache size
        # and llama_memory_recurrent::init_batch loops until std::bad_alloc (its split loop never ends)
        "skip_cases": {
            "llama-f16-multistream": "llama_init_from_model aborts (GGML_ASSERT in cpy_k)",
            "mamba-seq-cp-rm": "llama_decode: init_batch aborts (std::bad_alloc)",
        },
    },
    "0.3.16": {
        "llama_cpp_commit": "4227c9be4268ac844921b90f31595f81236bd317",
        "llama_cpp_commit_date": None,
        "session_version": 9,
        "seq_version": 2,
        "output_block": True,
        "seq_data_prefix": False,
        "cell_ext_size": 0,
        "swa_masked_in_seq": True,
        "whole_restore_last_stream": True,
    },
    # 0.3.0 (September 2024, the first of session v9): 0.2.90's llama.cpp without the rng string (the sampler
    # refactor dropped it and bumped the version); no memory API yet (generate.py installs shim_2024's shim)
    "0.3.0": {
        "llama_cpp_commit": "ea9c32be71b91b42ecc538bd902e93cbb5fb36cb",  # CHANGELOG.md of the sdist
        "llama_cpp_commit_date": "2024-09-25",
        "session_version": 9,
        "seq_version": 2,
        "output_block": True,
        "seq_data_prefix": False,
        "cell_ext_size": 0,
        "swa_masked_in_seq": True,
        "n_stream_field": False,
        # a KV sequence save writes n_seq_id 0 per cell (no id), and a sequence restore requires it
        "seq_kv_ids": False,
        "skip_cases": {
            # one cache of n_ctx cells for every layer, the window applied in the mask only (no iSWA cache yet)
            "gemma2-swa-overflow": "no SWA cache in this llama.cpp (kvref models gemma2 as iSWA only)",
            "qwen2vl-mrope": "llama_model_load_from_file: unknown architecture qwen2vl",
        },
    },
    # 0.3.8 (2025): as 0.3.0 (no memory API yet, one KV cache, sequence saves without ids), with the llama_model_*
    # calls and KQ masks padded to 64 rows
    "0.3.8": {
        "llama_cpp_commit": "7841fc723e059d1fd9640e5c0ef19050fcc7c698",  # CHANGELOG.md of the sdist
        "llama_cpp_commit_date": None,
        "session_version": 9,
        "seq_version": 2,
        "output_block": True,
        "seq_data_prefix": False,
        "cell_ext_size": 0,
        "swa_masked_in_seq": True,
        "n_stream_field": False,
        "seq_kv_ids": False,
        "skip_cases": {
            "gemma2-swa-overflow": "no SWA cache in this llama.cpp (kvref models gemma2 as iSWA only)",
            "qwen2vl-mrope": "the captured M-RoPE positions past the token rows are uninitialised memory",
        },
    },
    # 0.2.90 (August 2024): session v8 = the 0.3.12 layout plus the sampler's rng string after the arch; no
    # memory API (shim_2024.py maps driver's calls onto llama_kv_cache_*); no SWA, no M-RoPE yet
    "0.2.90": {
        "llama_cpp_commit": "1d1ccce67613674c75c9c7e3fa4c1e24e428ba48",
        "llama_cpp_commit_date": None,
        "session_version": 8,
        "seq_version": 2,
        "output_block": True,
        "seq_data_prefix": False,
        "cell_ext_size": 0,
        "swa_masked_in_seq": True,
        "n_stream_field": False,
        "rng": True,
        # a KV sequence save writes n_seq_id 0 per cell (no id), and a sequence restore requires it
        "seq_kv_ids": False,
    },
    # 0.2.83 (July 2024): session v7 / sequence v1 (conformance/generate_legacy.py, goldens in golden-v7/)
    "0.2.83": {
        "llama_cpp_commit": "081fe431aa8fb6307145c4feb3eed4f48cab19f8",  # CHANGELOG.md of the sdist
        "llama_cpp_commit_date": None,
        "session_version": 7,
        "seq_version": 1,
        "output_block": True,
        "seq_data_prefix": False,
        "cell_ext_size": 0,
        "swa_masked_in_seq": True,
        "n_stream_field": False,
        "rng": True,
        "seq_kv_ids": False,
    },
    # 0.2.82 (July 2024): session v6 = v7 with the hparams struct of LLAMA_MAX_LAYERS 256 (3236 bytes); the same
    # bindings as 0.2.83 (generate_legacy.py's shim_0_2_83), goldens in golden-v7/
    "0.2.82": {
        "llama_cpp_commit": "7fdb6f73e35605c8dbc39e9f19cd9ed84dbc87f2",  # CHANGELOG.md of the sdist
        "llama_cpp_commit_date": None,
        "session_version": 6,
        "seq_version": 1,
        "output_block": True,
        "seq_data_prefix": False,
        "cell_ext_size": 0,
        "swa_masked_in_seq": True,
        "n_stream_field": False,
        "rng": True,
        "seq_kv_ids": False,
        "skip_cases": {
            # generate_legacy.CASES_0_2_82 runs them on stablelm-rot32-tiny instead
            "llama-f16-single-seq": "llama_load_model_from_file: attn_q must be n_embd x n_embd (4 heads of 32)",
            "llama-shared-prefix": "llama_load_model_from_file: attn_q must be n_embd x n_embd (4 heads of 32)",
        },
    },
    # 0.2.67 (April 2024): session v5 = v6 without the u32 v_trans (V always transposed); 0.2.83's bindings but for
    # flash attention (none yet); its struct ggml_tensor has the perf counters, which conformance/capture.py does not
    # declare: its goldens carry no graph inputs
    "0.2.67": {
        "llama_cpp_commit": "8843a98c2ba97a25e93319a104f9ddfaf83ce4c4",  # CHANGELOG.md of the sdist (0.2.66's)
        "llama_cpp_commit_date": None,
        "session_version": 5,
        "seq_version": 1,
        "output_block": True,
        "seq_data_prefix": False,
        "cell_ext_size": 0,
        "swa_masked_in_seq": True,
        "n_stream_field": False,
        "rng": True,
        "seq_kv_ids": False,
        "skip_cases": {
            # generate_legacy.CASES_0_2_82 runs them on stablelm-rot32-tiny instead
            "llama-f16-single-seq": "llama_load_model_from_file: invalid n_rot 32, expected 16 (n_embd / n_head)",
            "llama-shared-prefix": "llama_load_model_from_file: invalid n_rot 32, expected 16 (n_embd / n_head)",
        },
    },
}
PRODUCER = PRODUCERS[L.__version__]
# graph inputs are read through conformance/capture.py's struct ggml_tensor (declared per release); the legacy
# generators switch the capture on for the releases it was checked with
CAPTURE_GRAPHS = L.__version__ == "0.3.36"
SESSION_VERSION = PRODUCER["session_version"]
SEQ_VERSION = PRODUCER["seq_version"]

FLAGS_PARTIAL_ONLY = 1

# ------------------------------------------------------------------ logging

_log_lines: list[tuple[int, str]] = []
_log_buf = [""]
_log_level = [0]


@L.llama_log_callback
def _log_cb(level, text, _user):
    s = text.decode("utf-8", errors="replace") if text else ""
    if level != 5:  # GGML_LOG_LEVEL_CONT continues the previous message
        _log_level[0] = level
    _log_buf[0] += s
    while "\n" in _log_buf[0]:
        line, _log_buf[0] = _log_buf[0].split("\n", 1)
        _log_lines.append((_log_level[0], line))


def _take_log() -> list[tuple[int, str]]:
    out = list(_log_lines)
    _log_lines.clear()
    return out


def _errors(lines) -> list[str]:
    # GGML_LOG_LEVEL_ERROR = 4; strip the function-name prefix, which is not stable API
    return [l for lvl, l in lines if lvl == 4]


_backend_ready = [False]


def init_backend() -> None:
    if not _backend_ready[0]:
        L.llama_log_set(_log_cb, None)
        L.llama_backend_init()
        _backend_ready[0] = True


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ memory description


# llama_model::create_memory's DeepSeek-sparse-attention archs (an MTP context of a model with NextN blocks, and
# hy_v4 without an indexer, build a plain KV cache)
DSA_ARCHS = ("glm-dsa", "deepseek32", "hy_v4", "dots3note")


def memory_kind(hp: dict, ctx_type: str = "default") -> str:
    if hp.get("dsv4_compress_ratios") and hp["arch"] == "deepseek4":
        # llama_kv_cache_dsv4, an iSWA cache in an MTP context
        return "iswa" if ctx_type == "mtp" else "dsv4"
    if hp["arch"] == "minimax-m3":
        return "msa"  # llama_kv_cache_msa
    if hp["arch"] in DSA_ARCHS:
        if ctx_type == "mtp" and hp.get("n_layer_nextn", 0) > 0 and hp["arch"] != "hy_v4":
            return "kv"
        if hp["arch"] == "hy_v4" and not hp.get("indexer_top_k"):
            return "kv"
        return "dsa_iswa" if hp["arch"] == "dots3note" else "dsa"
    swa = hp["n_swa"] > 0 and any(hp["swa_layers"])
    if hp["arch"] == "glm5-next" or (hp["arch"] == "qwen4exp" and hp.get("indexer_head_size", 0) > 0 and not swa):
        return "hybrid_idx"  # llama_memory_hybrid_idx: attention, recurrent, indexer
    if any(hp["recurrent_layers"]):
        if all(hp["recurrent_layers"]):
            return "recurrent"
        # llama_memory_hybrid_iswa when the model has a swa_type (lfm2 with a window)
        return "hybrid_iswa" if hp["n_swa"] > 0 and any(hp["swa_layers"]) else "hybrid"
    if hp["n_swa"] > 0 and any(hp["swa_layers"]):
        return "iswa"
    return "kv"


def sections_for(kind: str, flags: int) -> list[str]:
    """Which memory sections an artefact holds, in file order.

    llama_kv_cache_iswa::state_write writes the base cache then the SWA cache, and skips
    the base cache under LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY; llama_memory_hybrid writes
    attention then recurrent and skips attention under the same flag; the plain KV cache
    and the recurrent memory ignore the flags."""
    partial = bool(flags & FLAGS_PARTIAL_ONLY)
    if kind == "kv":
        return ["kv"]
    if kind == "recurrent":
        return ["recurrent"]
    if kind == "iswa":
        return ["kv_swa"] if partial else ["kv_base", "kv_swa"]
    if kind == "hybrid":
        return ["recurrent"] if partial else ["kv_attn", "recurrent"]
    if kind == "dsa":
        return ["kv_mla", "kv_lid"]  # llama_kv_cache_dsa hands the flags to both caches, which ignore them
    if kind == "dsa_iswa":
        return ["kv_swa"] if partial else ["kv_mla", "kv_lid", "kv_swa"]
    if kind == "hybrid_idx":
        # the indexer section is a suffix, skipped (as the attention one) under PARTIAL_ONLY
        return ["recurrent"] if partial else ["kv_attn", "recurrent", "kv_idx"]
    if kind == "msa":
        return ["kv_base", "kv_idx"]  # llama_kv_cache_msa hands the flags to both caches, which ignore them
    if kind == "hybrid_iswa":
        # llama_memory_hybrid_iswa hands the flags to both parts: the iSWA cache drops its base
        return ["kv_swa", "recurrent"] if partial else ["kv_base", "kv_swa", "recurrent"]
    if kind == "dsv4":
        # llama_kv_cache_dsv4: its header, the raw iSWA sections, the compressed K caches (not when partial), the
        # compressor states (kvref.state.dsv4)
        return ["dsv4"]
    raise ValueError(kind)


_KV_SIZE_RE = re.compile(r"^(\w+): size = .*?\(\s*(\d+) cells,\s*(\d+) layers,\s*(\d+)(?:/(\d+))? seqs")
# llama_memory_recurrent before PR #14363 (0.3.12) logs its size only in this line
_RS_OLD_RE = re.compile(r"^(\w+): mem_size = (\d+), n_seq_max = (\d+), .*n_layer = (\d+)")
_ISWA_RE = re.compile(r"creating\s+(non-SWA|SWA) KV cache, size = (\d+) cells")
# llama_kv_cache's constructor (0.3.36) after its size line: "attn_rot_k = 1, n_embd_head_k_all = 64" (the V line
# names its head size n_embd_head_k_all too)
_ROT_RE = re.compile(r"^(\w+): attn_rot_([kv]) = (\d+), n_embd_head_k_all = (-?\d+)")


def _parse_memory_log(lines) -> dict:
    """Cache sizes as llama.cpp reports them while building the memory."""
    out: dict = {"caches": []}
    for _lvl, l in lines:
        m = _KV_SIZE_RE.search(l)
        if m:
            ent = {
                "module": m.group(1),
                "cells": int(m.group(2)),
                "layers": int(m.group(3)),
                "n_seq_max": int(m.group(4)),
            }
            if m.group(5) is not None:
                ent["n_stream"] = int(m.group(5))
            out["caches"].append(ent)
        m = _RS_OLD_RE.search(l)
        if m:
            out["caches"].append(
                {
                    "module": m.group(1),
                    "cells": int(m.group(2)),
                    "layers": int(m.group(4)),
                    "n_seq_max": int(m.group(3)),
                }
            )
        m = _ROT_RE.search(l)
        if m and out["caches"]:
            # the cache whose size line came last
            out["caches"][-1][f"attn_rot_{m.group(2)}"] = bool(int(m.group(3)))
            out["caches"][-1][f"n_embd_head_{m.group(2)}_all"] = int(m.group(4))
        m = _ISWA_RE.search(l)
        if m:
            out["kv_size_swa" if m.group(1) == "SWA" else "kv_size_base"] = int(m.group(2))
    return out


# ------------------------------------------------------------------ the run


ROWS_FILE = "rows.npz"  # a case's K/V rows before and after the attention rotation (capture_rows)


class Run:
    def __init__(
        self,
        case_dir: Path,
        model_path: Path,
        hp: dict,
        cparams: dict,
        capture_rows: bool = False,
        other: Run | None = None,
        tag: str | None = None,
    ):
        """``other``: the Run of the context this one reads (llama_context_params.ctx_other: gemma4-assistant's
        target); its ops then go to this Run's trace marked ``"ctx": "other"``. ``tag``: that mark, for the other
        Run itself (its artefacts are named ``<tag>-NN-...``)."""
        init_backend()
        self.dir = case_dir
        self.hp = hp
        ctx_type = cparams.get("ctx_type", "default")
        self.kind = memory_kind(hp, ctx_type)
        self.trace: list[dict] = []
        self.other = other
        self.tag = tag
        # a draft context over another context's cache writes no memory section of its own
        self.shares_other = other is not None and hp["arch"] == "gemma4-assistant"
        # gemma4-assistant decodes a batch of tokens and the target's hidden states (embedding_length_out wide)
        self.embd_width = int(hp.get("n_embd_out") or 0) if hp["arch"] == "gemma4-assistant" else 0
        self.n_saves = 0
        self.latest_files: dict = {}
        self.cp = dict(cparams)
        self.ctx = None
        self.model = None
        self.capture = None
        if CAPTURE_GRAPHS:
            import capture

            # dsv4: the raw attention reads the SWA cache
            swa_cache = self.kind in ("iswa", "hybrid_iswa", "dsa_iswa", "dsv4")
            swa_flags = hp["swa_layers"]
            if other is not None and cparams["flash_attn"]:
                # a shared cache's FLASH_ATTN_EXT reads the target's cache_k_l<il>: the layer is the target's
                swa_flags = other.hp["swa_layers"]
            idx_width = int(hp.get("indexer_head_size") or 0) if self.kind == "msa" else 0
            self.capture = capture.Capture(
                lambda il: swa_cache and bool(swa_flags[il]),
                rows=capture_rows,
                idx_width=idx_width,
                kpool=self.kind == "hybrid_idx",
            )
        # op index -> [(k | v, layer, ubatch, pre, post)]: written to ROWS_FILE by close()
        self.rows: dict[int, list] = {}

        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mtp = cparams.get("ctx_type", "default") == "mtp"
        if mtp:
            mp.load_mtp = True  # a draft context of the NextN blocks needs their tensors
        mp.use_mmap = True
        if ctx_type == "mtp":
            mp.load_mtp = True  # an MTP draft context runs the NextN blocks, which load_mtp false skips
        if cparams.get("ctx_type", "default") == "mtp":
            mp.load_mtp = True  # a draft context of the MTP blocks needs their tensors
        _take_log()
        self.model = L.llama_model_load_from_file(str(model_path).encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp failed to load {model_path}: {_errors(_take_log())}")
        _take_log()
        m = self.model
        self.observed_model = {
            "n_layer": L.llama_model_n_layer(m),
            "n_embd": L.llama_model_n_embd(m),
            "n_head": L.llama_model_n_head(m),
            "n_head_kv": L.llama_model_n_head_kv(m),
            "n_swa": L.llama_model_n_swa(m) if hasattr(L, "llama_model_n_swa") else None,
            "rope_type": L.llama_model_rope_type(m),
            "n_ctx_train": L.llama_model_n_ctx_train(m),
            "n_vocab": L.llama_vocab_n_tokens(L.llama_model_get_vocab(m)),
            "is_recurrent": bool(L.llama_model_is_recurrent(m)),
            "is_hybrid": bool(L.llama_model_is_hybrid(m)) if hasattr(L, "llama_model_is_hybrid") else None,
        }

        p = L.llama_context_default_params()
        p.n_ctx = cparams["n_ctx"]
        p.n_batch = cparams["n_batch"]
        p.n_ubatch = cparams["n_ubatch"]
        p.n_seq_max = cparams["n_seq_max"]
        if hasattr(p, "n_rs_seq"):
            p.n_rs_seq = cparams["n_rs_seq"]
        p.n_threads = cparams["n_threads"]
        if cparams.get("ctx_type", "default") == "mtp":
            p.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        p.n_threads_batch = cparams["n_threads"]
        if hasattr(p, "flash_attn_type"):
            on, off = L.LLAMA_FLASH_ATTN_TYPE_ENABLED, L.LLAMA_FLASH_ATTN_TYPE_DISABLED
            p.flash_attn_type = on if cparams["flash_attn"] else off
        else:  # older bindings: a plain bool
            p.flash_attn = bool(cparams["flash_attn"])
        p.type_k = GGML_TYPES[cparams["type_k"]]
        p.type_v = GGML_TYPES[cparams["type_v"]]
        p.swa_full = cparams["swa_full"]
        p.kv_unified = cparams["kv_unified"]
        if ctx_type == "mtp":
            p.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        if mtp:
            p.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
        p.offload_kqv = False
        p.op_offload = False
        p.no_perf = True
        p.embeddings = False
        if self.capture is not None:
            self.capture.install(p)
        if other is not None:
            p.ctx_other = other.ctx
        self.ctx = L.llama_init_from_model(self.model, p)
        lines = _take_log()
        op = {"op": "init", "ret": bool(self.ctx)}
        if not self.ctx:
            op["errors"] = _errors(lines)
            self.trace.append(op)
            self.mem = None
            self.observed_ctx = None
            return
        self.mem = L.llama_get_memory(self.ctx)
        self.n_seq_max = L.llama_n_seq_max(self.ctx)
        self.observed_ctx = {
            "n_ctx": L.llama_n_ctx(self.ctx),
            "n_ctx_seq": L.llama_n_ctx_seq(self.ctx) if hasattr(L, "llama_n_ctx_seq") else None,
            "n_batch": L.llama_n_batch(self.ctx),
            "n_ubatch": L.llama_n_ubatch(self.ctx),
            "n_seq_max": self.n_seq_max,
            "memory_can_shift": bool(L.llama_memory_can_shift(self.mem)),
            "memory_log": _parse_memory_log(lines),
        }
        op["observed"] = self._observe()
        self.trace.append(op)
        if other is not None:
            self.other_init = other.trace[0] if other.trace else None
            other.trace = self.trace  # one trace: the other context's ops marked "ctx": "other"

    # -------------------------------------------------------------- helpers

    def close(self):
        if self.rows:
            import numpy as np

            arrays = {
                (f"op{k}-ub{ub}-" if ub >= 0 else f"op{k}-shift{-ub}-") + f"{which}{il}-{stage}": a
                for k, entries in self.rows.items()
                for which, il, ub, pre, post in entries
                for stage, a in (("pre", pre), ("post", post))
            }
            np.savez_compressed(self.dir / ROWS_FILE, **arrays)
            self.rows = {}
        if self.ctx:
            L.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None

    def pos_min(self, s: int) -> int:
        return int(L.llama_memory_seq_pos_min(self.mem, s))

    def pos_max(self, s: int) -> int:
        return int(L.llama_memory_seq_pos_max(self.mem, s))

    def _observe(self) -> dict:
        return {
            "seq_pos_min": [self.pos_min(s) for s in range(self.n_seq_max)],
            "seq_pos_max": [self.pos_max(s) for s in range(self.n_seq_max)],
        }

    def _push(self, op: dict, lines=None) -> dict:
        if lines:
            errs = _errors(lines)
            if errs:
                op["errors"] = errs
        op["observed"] = self._observe()
        if self.tag is not None:
            op["ctx"] = self.tag
        self.trace.append(op)
        return op

    # -------------------------------------------------------------- decode

    def _run_batch(self, call, tokens, pos, seq_ids, logits, embd_only: int = 0) -> tuple[int, list[str]]:
        """``call(ctx, batch)`` (llama_decode / llama_encode) on a llama_batch of these entries; returns its
        result and what llama.cpp logged meanwhile (the capture's previous graphs are dropped first).
        ``embd_only``: an embeddings batch of that row width (no token ids: ``tokens`` are not sent)."""
        n = len(tokens)
        b = L.llama_batch_init(n, embd_only, max(max(len(s) for s in seq_ids), 1))
        b.n_tokens = n
        embd = None
        if embd_only:
            for j in range(n * embd_only):
                b.embd[j] = 0.01
        if self.embd_width:  # tokens and hidden states in one batch (a draft head's input): fixed values
            embd = (ctypes.c_float * (n * self.embd_width))(*([0.01] * (n * self.embd_width)))
            b.embd = ctypes.cast(embd, ctypes.POINTER(ctypes.c_float))
        for i in range(n):
            if not embd_only:
                b.token[i] = int(tokens[i])
            b.pos[i] = int(pos[i])
            b.n_seq_id[i] = len(seq_ids[i])
            for j, s in enumerate(seq_ids[i]):
                b.seq_id[i][j] = int(s)
            b.logits[i] = int(bool(logits[i]))
        _take_log()
        if self.capture is not None:
            self.capture.take()
        ret = int(call(self.ctx, b))
        lines = _take_log()
        if embd is not None:
            b.embd = None  # Python's buffer: llama_batch_free must not free it
        L.llama_batch_free(b)
        return ret, lines

    def decode(self, tokens, pos, seq_ids, logits=None, embd: int = 0) -> int:
        """llama_decode; ``embd``: a batch of embeddings of that row width instead of token ids (``tokens`` are then
        recorded as 0 placeholders: DFlash's KV-injection batch of target features)."""
        n = len(tokens)
        assert len(pos) == n and len(seq_ids) == n
        if logits is None:
            logits = [0] * (n - 1) + [1]
        if embd:
            tokens = [0] * n
        ret, lines = self._run_batch(L.llama_decode, tokens, pos, seq_ids, logits, embd_only=embd)
        graphs = None
        if self.capture is not None:
            if self.capture.error is not None:
                raise RuntimeError(f"reading llama.cpp's graph inputs failed: {self.capture.error!r}")
            graphs = self.capture.take()
            if graphs["rows"]:
                self.rows[len(self.trace)] = graphs["rows"]
        op = {
            "op": "decode",
            "tokens": [int(t) for t in tokens],
            "pos": [int(p) for p in pos],
            "seq_ids": [[int(s) for s in ss] for ss in seq_ids],
            "logits": [int(bool(x)) for x in logits],
            "ret": ret,
        }
        if embd:
            op["embd"] = int(embd)
        if graphs is not None and (ret == 0 or graphs["shift"] or graphs["ubatches"]):
            import capture

            # what the graphs of this llama_decode computed with: K-shift, then per ubatch
            op["graph"] = capture.encode(graphs)
        self._push(op, lines)
        return ret

    def encode(self, tokens, pos, seq_ids) -> int:
        """llama_encode (an encoder-decoder model's encoder: one ubatch, non-causal, no memory touched); its
        ``graph`` keeps only the inputs kvref computes for a cache-less graph (T5's ``pos_bucket``)."""
        ret, lines = self._run_batch(L.llama_encode, tokens, pos, seq_ids, [1] * len(tokens))
        op = {
            "op": "encode",
            "tokens": [int(t) for t in tokens],
            "pos": [int(p) for p in pos],
            "seq_ids": [[int(s) for s in ss] for ss in seq_ids],
            "ret": ret,
        }
        if self.capture is not None:
            if self.capture.error is not None:
                raise RuntimeError(f"reading llama.cpp's graph inputs failed: {self.capture.error!r}")
            graphs = self.capture.take()
            for u in graphs["ubatches"]:
                # the cache-less encoder mask (llm_graph_input_attn_no_cache) is not a KV cache's input
                u["inputs"] = [e for e in u["inputs"] if e["tensor"] == "pos_bucket"]
            if ret == 0 or graphs["ubatches"]:
                import capture

                op["graph"] = capture.encode(graphs)
        self._push(op, lines)
        return ret

    def decode_seq(self, seq_id: int, tokens, start: int | None = None, also=()) -> int:
        """Decode ``tokens`` for one sequence (optionally shared with ``also``), positions
        continuing after the sequence's current maximum unless ``start`` is given."""
        if start is None:
            start = self.pos_max(seq_id) + 1
        ids = [[seq_id, *also]] * len(tokens)
        return self.decode(tokens, list(range(start, start + len(tokens))), ids)

    # -------------------------------------------------------------- sequence ops

    def seq_rm(self, seq_id, p0, p1) -> bool:
        _take_log()
        ret = bool(L.llama_memory_seq_rm(self.mem, seq_id, p0, p1))
        self._push({"op": "seq_rm", "seq_id": seq_id, "p0": p0, "p1": p1, "ret": ret}, _take_log())
        return ret

    def seq_cp(self, src, dst, p0, p1):
        _take_log()
        L.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
        self._push({"op": "seq_cp", "seq_id_src": src, "seq_id_dst": dst, "p0": p0, "p1": p1}, _take_log())

    def seq_keep(self, seq_id):
        _take_log()
        L.llama_memory_seq_keep(self.mem, seq_id)
        self._push({"op": "seq_keep", "seq_id": seq_id}, _take_log())

    def seq_add(self, seq_id, p0, p1, delta):
        _take_log()
        L.llama_memory_seq_add(self.mem, seq_id, p0, p1, delta)
        self._push({"op": "seq_add", "seq_id": seq_id, "p0": p0, "p1": p1, "delta": delta}, _take_log())

    def seq_div(self, seq_id, p0, p1, d):
        _take_log()
        L.llama_memory_seq_div(self.mem, seq_id, p0, p1, d)
        self._push({"op": "seq_div", "seq_id": seq_id, "p0": p0, "p1": p1, "d": d}, _take_log())

    def seq_pos_min_op(self, seq_id) -> int:
        """llama_memory_seq_pos_min of any id, recorded as an op (the observation after every op covers the ids
        below n_seq_max only)."""
        _take_log()
        ret = int(L.llama_memory_seq_pos_min(self.mem, seq_id))
        self._push({"op": "seq_pos_min", "seq_id": seq_id, "ret": ret}, _take_log())
        return ret

    def seq_pos_max_op(self, seq_id) -> int:
        """llama_memory_seq_pos_max of any id, recorded as an op."""
        _take_log()
        ret = int(L.llama_memory_seq_pos_max(self.mem, seq_id))
        self._push({"op": "seq_pos_max", "seq_id": seq_id, "ret": ret}, _take_log())
        return ret

    def clear(self, data=True):
        L.llama_memory_clear(self.mem, data)
        self._push({"op": "clear", "data": data})

    def record_abort(self, op: dict, abort: dict) -> dict:
        """Record ``op`` (its call's arguments, as Run.apply takes them) as one that kills llama.cpp: ``ret``
        "aborts", ``abort`` what the dead process showed (signal, return code, GGML_ASSERT message), and the
        memory as it was before the call (the op is not performed: the process that performed it died, and the
        trace goes on in one that skipped it)."""
        return self._push({**op, "ret": "aborts", "abort": abort})

    def set_causal(self, causal: bool):
        """llama_set_causal_attn: the following decodes build their KQ masks causally or not (the image path of
        vision models decodes with causal false; llama.cpp then asserts n_ubatch >= the batch's tokens)."""
        _take_log()
        L.llama_set_causal_attn(self.ctx, bool(causal))
        self._push({"op": "set_causal", "causal": bool(causal)}, _take_log())

    # -------------------------------------------------------------- saves

    def _artefact(self, kind: str, seq_id, flags: int, ext: str) -> tuple[str, Path]:
        self.n_saves += 1
        tag = kind if seq_id is None else f"{kind}-seq{seq_id}"
        if flags:
            tag += f"-flags{flags}"
        name = f"{self.n_saves:02d}-{tag}.{ext}"
        if self.tag is not None:
            name = f"{self.tag}-{name}"
        self.latest_files[(kind, seq_id, flags)] = name
        return name, self.dir / name

    def latest(self, kind: str, seq_id=None, flags: int = 0) -> str:
        """File name of the most recent artefact of this kind (for later restores)."""
        return self.latest_files[(kind, seq_id, flags)]

    def _describe(self, op: dict, path: Path, seq_id, flags: int, whole: bool):
        op["layout"] = self.kind
        op["sections"] = sections_for(self.kind, flags)
        if self.shares_other:  # llama_kv_cache with mem_other: state_write writes nothing
            op["layout"], op["sections"] = "none", []
        op["cell_ext"] = bool(self.hp["has_cell_ext"]) and PRODUCER["cell_ext_size"] > 0
        if whole:
            op["output_block"] = PRODUCER["output_block"]
        op["v_trans"] = (not self.cp["flash_attn"]) if self.kind != "recurrent" else None
        op["n_stream"] = 1 if self.cp["kv_unified"] or not PRODUCER.get("n_stream_field", True) else self.n_seq_max
        op["scope"] = "context" if whole else "sequence"
        data = path.read_bytes() if path.exists() else b""  # a save of 0 bytes writes no file
        op["size"] = len(data)
        op["sha256"] = hashlib.sha256(data).hexdigest()

    def _obs_sizes(self, op: dict, seq_id):
        op.setdefault("observed_sizes", {})["state_size"] = int(L.llama_state_get_size(self.ctx))
        if seq_id is not None:
            op["observed_sizes"]["seq_state_size"] = int(L.llama_state_seq_get_size(self.ctx, seq_id))

    def save_session(self, tokens) -> bool:
        name, path = self._artefact("session", None, 0, "ggsn")
        arr = (L.llama_token * max(len(tokens), 1))(*tokens)
        _take_log()
        ret = bool(L.llama_state_save_file(self.ctx, str(path).encode(), arr, len(tokens)))
        lines = _take_log()
        op = {
            "op": "save",
            "kind": "session",
            "file": name,
            "tokens": list(tokens),
            "ret": ret,
            "header": {"magic": SESSION_MAGIC, "version": SESSION_VERSION, "n_token_count": len(tokens)},
            "arch": self.hp["arch"],
        }
        self._describe(op, path, None, 0, True)
        self._obs_sizes(op, None)
        self._push(op, lines)
        return ret

    def save_seq(self, seq_id: int, tokens) -> int:
        name, path = self._artefact("seq", seq_id, 0, "ggsq")
        arr = (L.llama_token * max(len(tokens), 1))(*tokens)
        _take_log()
        ret = int(L.llama_state_seq_save_file(self.ctx, str(path).encode(), seq_id, arr, len(tokens)))
        lines = _take_log()
        op = {
            "op": "save",
            "kind": "seq",
            "file": name,
            "seq_id": seq_id,
            "tokens": list(tokens),
            "ret": ret,
            "flags": 0,
            "header": {"magic": SEQ_MAGIC, "version": SEQ_VERSION, "n_token_count": len(tokens)},
        }
        self._describe(op, path, seq_id, 0, False)
        self._obs_sizes(op, seq_id)
        self._push(op, lines)
        return ret

    def save_state_data(self) -> int:
        name, path = self._artefact("state", None, 0, "bin")
        size = int(L.llama_state_get_size(self.ctx))
        buf = (ctypes.c_uint8 * size)()
        _take_log()
        ret = int(L.llama_state_get_data(self.ctx, buf, size))
        lines = _take_log()
        path.write_bytes(bytes(buf)[:ret])
        op = {
            "op": "save",
            "kind": "state_data",
            "file": name,
            "ret": ret,
            "get_size": size,
            "arch": self.hp["arch"],
            "header": None,
        }
        self._describe(op, path, None, 0, True)
        self._obs_sizes(op, None)
        self._push(op, lines)
        return ret

    def save_seq_data(self, seq_id: int, flags: int = 0) -> int:
        name, path = self._artefact("seqdata", seq_id, flags, "bin")
        if hasattr(L, "llama_state_seq_get_size_ext"):
            size = int(L.llama_state_seq_get_size_ext(self.ctx, seq_id, flags))
        else:
            assert flags == 0, "these bindings have no *_ext state functions"
            size = int(L.llama_state_seq_get_size(self.ctx, seq_id))
        buf = (ctypes.c_uint8 * max(size, 1))()
        _take_log()
        if hasattr(L, "llama_state_seq_get_data_ext"):
            ret = int(L.llama_state_seq_get_data_ext(self.ctx, buf, size, seq_id, flags))
        else:
            ret = int(L.llama_state_seq_get_data(self.ctx, buf, size, seq_id))
        lines = _take_log()
        if ret:  # 0 bytes: llama.cpp caught an exception writing it, and there is no artefact
            path.write_bytes(bytes(buf)[:ret])
        op = {
            "op": "save",
            "kind": "seq_data",
            "file": name,
            "seq_id": seq_id,
            "flags": flags,
            "ret": ret,
            "get_size": size,
            "header": {"io_magic": SEQ_DATA_IO_MAGIC, "seq_id": seq_id} if PRODUCER["seq_data_prefix"] else None,
        }
        self._describe(op, path, seq_id, flags, False)
        self._obs_sizes(op, seq_id)
        self._push(op, lines)
        return ret

    def save_all(self, tokens_by_seq: dict[int, list[int]], session_tokens=None, seq_data_flags=(0,)):
        """Session file, raw state, and per sequence a .ggsq file and raw seq blobs."""
        if session_tokens is None:
            session_tokens = tokens_by_seq.get(0, [])
        self.save_session(session_tokens)
        self.save_state_data()
        for s, toks in tokens_by_seq.items():
            self.save_seq(s, toks)
            for f in seq_data_flags:
                if f and not hasattr(L, "llama_state_seq_get_data_ext"):
                    continue  # older bindings: no flags
                self.save_seq_data(s, f)

    # -------------------------------------------------------------- restores

    def load_session(self, file: str, capacity: int = 4096) -> bool:
        arr = (L.llama_token * capacity)()
        n = ctypes.c_size_t(0)
        _take_log()
        ret = bool(L.llama_state_load_file(self.ctx, str(self.dir / file).encode(), arr, capacity, ctypes.byref(n)))
        lines = _take_log()
        self._push(
            {
                "op": "state_load",
                "kind": "session",
                "file": file,
                "n_token_capacity": capacity,
                "ret": ret,
                "tokens": [int(arr[i]) for i in range(n.value)] if ret else None,
            },
            lines,
        )
        return ret

    def load_seq(self, file: str, dest_seq_id: int, capacity: int = 4096) -> int:
        arr = (L.llama_token * max(capacity, 1))()
        n = ctypes.c_size_t(0)
        _take_log()
        ret = int(
            L.llama_state_seq_load_file(
                self.ctx, str(self.dir / file).encode(), dest_seq_id, arr, capacity, ctypes.byref(n)
            )
        )
        lines = _take_log()
        self._push(
            {
                "op": "seq_restore",
                "kind": "seq",
                "file": file,
                "dest_seq_id": dest_seq_id,
                "n_token_capacity": capacity,
                "ret": ret,
                "tokens": [int(arr[i]) for i in range(n.value)] if ret else None,
            },
            lines,
        )
        return ret

    def set_state_data(self, file: str) -> int:
        data = (self.dir / file).read_bytes()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        _take_log()
        ret = int(L.llama_state_set_data(self.ctx, buf, len(data)))
        lines = _take_log()
        self._push({"op": "state_load", "kind": "state_data", "file": file, "ret": ret}, lines)
        return ret

    def set_seq_data(self, file: str, dest_seq_id: int, flags: int = 0) -> int:
        data = (self.dir / file).read_bytes()
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        _take_log()
        if hasattr(L, "llama_state_seq_set_data_ext"):
            ret = int(L.llama_state_seq_set_data_ext(self.ctx, buf, len(data), dest_seq_id, flags))
        else:
            assert flags == 0, "these bindings have no *_ext state functions"
            ret = int(L.llama_state_seq_set_data(self.ctx, buf, len(data), dest_seq_id))
        lines = _take_log()
        self._push(
            {
                "op": "seq_restore",
                "kind": "seq_data",
                "file": file,
                "dest_seq_id": dest_seq_id,
                "flags": flags,
                "ret": ret,
            },
            lines,
        )
        return ret

    # -------------------------------------------------------------- one op of case.json's vocabulary

    def apply(self, op: dict):
        """Perform ``op``, given in case.json's vocabulary with the fields a trace op has before llama.cpp
        answers (no ``ret`` / ``observed`` / ``graph``; a save names no ``file``: the recorder does), and record
        it; returns what the llama.cpp call returned. ``init`` is the constructor, not an op to apply. An op marked
        ``"ctx": "other"`` goes to the Run of the ctx_other context."""
        if op.get("ctx") == "other" and self.other is not None:
            return self.other.apply({k: v for k, v in op.items() if k != "ctx"})
        return _APPLY[op["op"]](self, op)


def _apply_save(r: Run, op: dict):
    kind = op["kind"]
    if kind == "session":
        return r.save_session(op.get("tokens", []))
    if kind == "seq":
        return r.save_seq(op["seq_id"], op.get("tokens", []))
    if kind == "state_data":
        return r.save_state_data()
    if kind == "seq_data":
        return r.save_seq_data(op["seq_id"], op.get("flags", 0))
    raise ValueError(f"save: unknown kind {kind!r}")


def _apply_state_load(r: Run, op: dict):
    if op["kind"] == "session":
        return r.load_session(op["file"], op.get("n_token_capacity", 4096))
    if op["kind"] == "state_data":
        return r.set_state_data(op["file"])
    raise ValueError(f"state_load: unknown kind {op['kind']!r}")


def _apply_seq_restore(r: Run, op: dict):
    if op["kind"] == "seq":
        return r.load_seq(op["file"], op["dest_seq_id"], op.get("n_token_capacity", 4096))
    if op["kind"] == "seq_data":
        return r.set_seq_data(op["file"], op["dest_seq_id"], op.get("flags", 0))
    raise ValueError(f"seq_restore: unknown kind {op['kind']!r}")


# case.json op -> the Run method that performs and records it (every op of case.schema.json but init)
_APPLY = {
    "decode": lambda r, op: r.decode(op["tokens"], op["pos"], op["seq_ids"], op.get("logits")),
    "seq_rm": lambda r, op: r.seq_rm(op["seq_id"], op["p0"], op["p1"]),
    "seq_cp": lambda r, op: r.seq_cp(op["seq_id_src"], op["seq_id_dst"], op["p0"], op["p1"]),
    "seq_keep": lambda r, op: r.seq_keep(op["seq_id"]),
    "seq_add": lambda r, op: r.seq_add(op["seq_id"], op["p0"], op["p1"], op["delta"]),
    "seq_div": lambda r, op: r.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"]),
    "clear": lambda r, op: r.clear(op.get("data", True)),
    "save": _apply_save,
    "state_load": _apply_state_load,
    "seq_restore": _apply_seq_restore,
    "set_causal": lambda r, op: r.set_causal(op["causal"]),
    "encode": lambda r, op: r.encode(op["tokens"], op["pos"], op["seq_ids"]),
    "seq_pos_min": lambda r, op: r.seq_pos_min_op(op["seq_id"]),
    "seq_pos_max": lambda r, op: r.seq_pos_max_op(op["seq_id"]),
}
