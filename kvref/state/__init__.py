"""llama.cpp's state files and blobs: read, inspect, edit and write them byte for byte.

Formats (each declared once in a small layout DSL, `kvref.state.dsl`, and walked both ways):

- session file 'ggsn' (llama_state_save_file): version 10 (current), 9 and 8 (2024: the sampler's rng string,
  `kvref.state.legacy`), and 7 (before July 2024: raw K/V rows without types, read given the model, ``model=``);
- sequence file 'ggsq' (llama_state_seq_save_file): version 3 (current), 2 and 1 (before July 2024);
- raw blobs: llama_state_get_data ("state") and llama_state_seq_get_data ("seq_state");
- memory sections: attention KV (multi-stream, v_trans 0/1, cell ext of 0/8/12 bytes, any ggml type, with or
  without V), recurrent (R/S rows, s_trans, layers without state, PLE rows), and their compositions
  iSWA (base, SWA), hybrid (attention, recurrent), hybrid_iswa and hybrid_idx.

History (details, with sources, in docs/state-format.md):

- PR #8699 (July 2024) unified whole-context and per-sequence state code: both write the same memory section
  (session version 8, which also saved the sampler's rng after the arch; a KV sequence save's cells carried no
  seq id).
- PR #14363 "llama : add high-throughput mode" (merged July 2025) added ``u32 n_stream`` in front of the KV
  section and one cell table per stream, without a version bump: version-9 sessions and version-2 sequence
  files exist with and without it (``n_stream_field=``).
- M-RoPE models started to save a cell ext (``i32 x, y``) after ``n_seq_id`` (``ext_size=8``; the release is
  ``kvref.profile.TABLE["cell_ext_size"]``'s).
- PR #18862 "llama : remove write/read of output ids/logits/embeddings" (opened 2026-01-15, approved
  2026-02-19) dropped the v9 output block (``n_outputs``, ``output_pos``, logits, embeddings) from the context
  state, again without a version bump (``outputs=``).
- 2026: llama_state_seq_get_data blobs gained the ``u32 io_magic (0xaf143cd8), i32 seq_id`` prefix along with
  LLAMA_STATE_SEQ_FLAGS_ON_DEVICE (documented by PR #23520, 2026-05-22). Sequence *files* do not carry it.
- PR #27742 (qwen4exp, Aug/Sep 2026) bumped the session version to 10 and the sequence version to 3; with it the
  cell ext grew a ``tok`` (``ext_size=12``), recurrent layers may carry PLE rows (``ple=``) and the
  hybrid_idx memory appends its indexer KV section.

Public API::

    obj = kvref.state.load(path_or_bytes, kind="auto", layout="auto", *, ext_size=None,
                           n_stream_field=None, has_v=None, outputs=None, ple=False,
                           n_state_layers=None, seq_header=None, model=None)
        -> SessionFile | SeqFile | StateBlob | SeqStateBlob         (FormatError on anything malformed)
    obj.to_bytes() -> bytes;  obj.write_to(f) -> int;  obj.save(path) / kvref.state.save(obj, path) -> int
    obj.summary() -> dict (what `kvref inspect --json` prints)
    obj.memory.layout, obj.memory.sections[i]: KVSection(streams=[KVStream(cells, data)], has_n_stream)
                                                | RecurrentSection(cells, s_trans, n_layer, r, s)
    Cells: .pos, .ext, .seq_id/.seq_start (CSR), .n_seq_id, .seq_ids(i), .seq_set(i), .sequences()
    KVData(v_trans, k=[LayerRows], v=[LayerRows | TransposedRows]);  rows are (n_cells, row_size) uint8 views

Files are memory-mapped: loading touches only the metadata; tensor rows stay views into the mapping until used,
and saving streams them straight back out (through a temporary file, so saving over the source is safe).

Cache integration (for KVCache, RecurrentMemory, KVCacheISWA, HybridMemory)::

    # state_write(seq_id): build the section from cells + buffers, then serialize
    sec = KVSection(streams=[KVStream(cells=Cells.from_lists(pos, seq_id_lists, ext=None),
                                      data=KVData(v_trans=0, k=[LayerRows(type, row_size, k_rows)],
                                                  v=[LayerRows(...)]  # or [TransposedRows(type, el_size,
                                                                      #     n_embd, rows)], [] without V
                                                  ))])
    blob = section_bytes(sec)            # or write_section(sec, f); iSWA/hybrid: section_bytes(a, b)
    n = write_sections_into(buf, sec)    # into a caller's buffer of sections_size(sec) bytes (or a file)
    # state_read(blob, seq_id): parse AND validate everything first, then apply (atomic)
    spec = KVSpec(n_stream, kv_size, n_seq_max, v_trans, layers=(KVLayerSpec(k_type, k_row_size, v_type,
                  v_row_size, n_embd_v_gqa), ...), ext_size=0)
    sec, end = read_kv_section(blob, spec, seq_id=seq_id, offset=0)
    sections, end = read_sections(blob, [spec_base, spec_swa], seq_id=seq_id)   # composites, trailing checked
    # RecurrentSpec(size, n_seq_max, n_layer, layers=(RecurrentLayerSpec(r_type, r_row_size, s_type,
    #               s_row_size, n_embd_s, p_row_size), ...), s_trans=False) with read_recurrent_section.
  Validation covers stream count, cell count vs cache size, n_seq_id (1 for KV, or 0 with
  ``KVSpec(seq_cell_ids=0)`` as llama.cpp of 2024 wrote; 0 for recurrent sequence states), seq id range, layer
  count, v_trans/s_trans, every type, row size, element size and V width, and trailing bytes; each failure is a
  FormatError naming the field and its byte offset.
"""

from __future__ import annotations

from ..errors import FormatError
from .cache_api import (
    KVLayerSpec,
    KVSpec,
    RecurrentLayerSpec,
    RecurrentSpec,
    read_kv_section,
    read_recurrent_section,
    read_sections,
    section_bytes,
    sections_size,
    validate_kv_section,
    validate_recurrent_section,
    write_section,
    write_sections_into,
)
from .cells import Cells, SeqRange
from .constants import FIELDS, LAYOUTS, SEQ_VERSION, SESSION_VERSION, Magic
from .files import Outputs, SeqFile, SeqStateBlob, SessionFile, StateBlob, StateObject, save
from .load import KINDS, detect_kind, load
from .sections import (
    KVData,
    KVSection,
    KVStream,
    LayerRows,
    MemorySections,
    RecurrentLayer,
    RecurrentSection,
    TransposedRows,
)
from .summary import summarize

__all__ = [
    "FIELDS",
    "KINDS",
    "LAYOUTS",
    "SEQ_VERSION",
    "SESSION_VERSION",
    "Cells",
    "FormatError",
    "KVData",
    "KVLayerSpec",
    "KVSection",
    "KVSpec",
    "KVStream",
    "LayerRows",
    "Magic",
    "MemorySections",
    "Outputs",
    "RecurrentLayer",
    "RecurrentLayerSpec",
    "RecurrentSection",
    "RecurrentSpec",
    "SeqFile",
    "SeqRange",
    "SeqStateBlob",
    "SessionFile",
    "StateBlob",
    "StateObject",
    "TransposedRows",
    "detect_kind",
    "load",
    "read_kv_section",
    "read_recurrent_section",
    "read_sections",
    "save",
    "section_bytes",
    "sections_size",
    "summarize",
    "validate_kv_section",
    "validate_recurrent_section",
    "write_section",
    "write_sections_into",
]
