"""Wire constants of llama.cpp's state files, declared once (C names beside them).

Versions that llama.cpp has retired stay listed so that their numbers are never reused by accident.
"""

from __future__ import annotations

from enum import IntEnum


class Magic(IntEnum):
    """The magic numbers of llama.cpp's state containers (C names beside them)."""

    SESSION = 0x6767736E  # LLAMA_SESSION_MAGIC = LLAMA_FILE_MAGIC_GGSN ('ggsn')
    STATE_SEQ = 0x67677371  # LLAMA_STATE_SEQ_MAGIC = LLAMA_FILE_MAGIC_GGSQ ('ggsq')
    SEQ_BLOB = 0xAF143CD8  # io_magic in llama-context.cpp, in front of llama_state_seq_get_data() blobs


# LLAMA_SESSION_VERSION: 8 from PR #8699 (July 2024) until the sampler refactor (September 2024) dropped the rng
# string (`kvref.state.legacy`); 9 until the qwen4exp PR (#27742, Aug/Sep 2026) bumped it to 10.
SESSION_VERSIONS = (8, 9, 10)
SESSION_VERSION = 10
# LLAMA_STATE_SEQ_VERSION: 2 until the same PR bumped it to 3.
SEQ_VERSIONS = (2, 3)
SEQ_VERSION = 3


# Cell ext: llama_kv_cell_ext {x, y} (M-RoPE 2-D position), later {x, y, tok} (PLE n-gram hash).
EXT_SIZES = (0, 8, 12)

# The memory layouts: which sections follow each other, in write order.
LAYOUTS: dict[str, tuple[str, ...]] = {
    "none": (),  # a context without memory (llama_context::memory == nullptr)
    "kv": ("kv",),  # llama_kv_cache (also iSWA or hybrid saved with LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
    "iswa": ("kv", "kv"),  # llama_kv_cache_iswa: base, then SWA
    "recurrent": ("recurrent",),  # llama_memory_recurrent
    "hybrid": ("kv", "recurrent"),  # llama_memory_hybrid: attention, then recurrent
    "hybrid_iswa": ("kv", "kv", "recurrent"),  # llama_memory_hybrid_iswa
    "hybrid_idx": ("kv", "recurrent", "kv"),  # llama_memory_hybrid_idx: the indexer cache is a suffix
    "dsa": ("kv", "kv"),  # llama_kv_cache_dsa: MLA, then the lightning-indexer keys (reads as "iswa": never guessed)
    "dsa_iswa": ("kv", "kv", "kv"),  # llama_kv_cache_dsa_iswa: MLA, indexer, then SWA
    "msa": ("kv", "kv"),  # llama_kv_cache_msa: base, then the indexer key cache (auto-detection reads it as iswa)
    "dsv4": ("dsv4",),  # llama_kv_cache_dsv4: header, raw iSWA sections, compressed K caches, compressor states
}

# The field vocabulary shared with the conformance suite's invalid-input manifest.
FIELDS = (
    "magic",
    "version",
    "n_token_count",
    "tokens",
    "arch_length",
    "arch",
    "rng_length",
    "rng",
    "n_outputs",
    "output_pos",
    "logits_size",
    "logits",
    "embd_size",
    "embeddings",
    "n_stream",
    "cell_count",
    "pos",
    "n_seq_id",
    "seq_id",
    "ext",
    "v_trans",
    "n_layer",
    "k_type",
    "k_row_size",
    "k_data",
    "v_type",
    "v_row_size",
    "v_el_size",
    "n_embd_v_gqa",
    "v_data",
    "s_trans",
    "r_type",
    "r_row_size",
    "r_data",
    "p_row_size",
    "p_data",
    "s_type",
    "s_row_size",
    "s_el_size",
    "n_embd_s",
    "s_data",
    "io_magic",
    "io_seq_id",
    # sessions of version 5 .. 7 and sequence files of version 1 (kvref.state.legacy)
    "hparams",
    "rng_size",
    "kv_buf_size",
    "kv_head",
    "size_t_size",
    "layout",
    "trailing",
)
