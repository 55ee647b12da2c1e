"""The JSON the conformance runner reads and prints, as TypedDicts (types only: plain dicts at run time).

- `Case`: a golden's ``case.json``, as ``conformance/case.schema.json`` declares it (the tests validate every golden
  against that schema); `TraceOp` is one operation of its trace, every op's fields in one dict (``op`` says which
  are there: the schema's ``op_*`` definitions);
- `InvalidManifest`: ``conformance/invalid/manifest.json``; `ExpectedFailures`: ``conformance/expected_failures.json``;
- `ConformanceJSON`: what ``kvref conformance --json`` prints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeAlias, TypedDict

from ..about import About

if TYPE_CHECKING:
    from typing_extensions import NotRequired  # typing.NotRequired from Python 3.11


# ---------------------------------------------------------------------------------------------- case.json
class Producer(TypedDict):
    """The llama-cpp-python (and llama.cpp) that wrote the goldens, and the layout choices of its state files."""

    llama_cpp_python: str
    llama_cpp_commit: str
    llama_cpp_commit_date: str | None
    gguf: str
    session_version: int
    seq_version: int
    cell_ext_size: int
    output_block: bool
    seq_data_prefix: bool
    swa_masked_in_seq: bool
    n_stream_field: NotRequired[bool]
    rng: NotRequired[bool]
    rng_seed: NotRequired[int]
    seq_kv_ids: NotRequired[bool]


class SSMParams(TypedDict, total=False):
    """Recurrent (SSM) sizes of the model."""

    d_conv: int
    d_inner: int
    d_state: int
    dt_rank: int
    n_group: int


class CaseHParams(TypedDict):
    """The model facts that decide the memory layout (per-layer lists have ``n_layer`` entries)."""

    arch: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ff: int
    n_head: list[int]
    n_head_kv: list[int]
    n_embd_head_k: int
    n_embd_head_v: int
    n_embd_k_gqa: list[int]
    n_embd_v_gqa: list[int]
    n_rot: int
    rope_type: str  # none, norm, neox, mrope, imrope, vision
    rope_freq_base: float
    rope_freq_scale: float
    rope_sections: list[int] | None
    n_pos_per_embd: int
    causal_attn: bool
    n_swa: int
    swa_type: str  # none, standard, chunked, symmetric
    swa_pattern: NotRequired[int]
    rope_freq_base_swa: NotRequired[float]
    wkv_head_size: NotRequired[int]
    token_shift_count: NotRequired[int]
    n_shortconv_l_cache: NotRequired[int]
    non_causal_type: NotRequired[int]
    f_max_alibi_bias: NotRequired[float]
    n_rel_attn_bkts: NotRequired[int]
    n_layer_kv_from_start: NotRequired[int]
    n_layer_nextn: NotRequired[int]
    n_embd_head_k_swa: NotRequired[int]
    n_embd_head_v_swa: NotRequired[int]
    n_embd_head_k_mla: NotRequired[int]
    n_embd_head_v_mla: NotRequired[int]
    n_lora_kv: NotRequired[int]
    indexer_head_size: NotRequired[int]
    indexer_top_k: NotRequired[int]
    indexer_full_layers: NotRequired[list[bool]]
    indexer_kpool: NotRequired[int]  # llama_memory_hybrid_idx
    dsv4_compress_ratios: NotRequired[list[int]]
    dsv4_hc_mult: NotRequired[int]
    n_embd_head_kda: NotRequired[int]
    indexer_kpool_select_tail: NotRequired[bool]
    n_layer_dense_lead: NotRequired[int]  # minimax-m3
    indexer_block_size: NotRequired[int]
    indexer_local_blocks: NotRequired[int]
    n_embd_out: NotRequired[int]  # gemma4-assistant
    n_embd_inp_enc: NotRequired[int]  # dflash
    swa_layers: list[bool]
    recurrent_layers: list[bool]
    n_embd_r: int
    n_embd_s: int
    ssm: SSMParams | None
    n_ctx_train: int
    has_cell_ext: bool


class CaseModel(TypedDict):
    """The model GGUF (committed under conformance/models/ or not) and its facts."""

    file: str
    committed: bool
    path: str | None  # relative to conformance/ when committed
    sha256: str
    size: int
    builder: str
    hparams: CaseHParams


class CaseContext(TypedDict):
    """llama_context_params as requested."""

    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    kv_unified: bool
    flash_attn: bool
    type_k: str
    type_v: str
    swa_full: bool
    n_rs_seq: int
    n_threads: int
    ctx_type: NotRequired[str]  # "default" (absent) or "mtp"


class LoggedCache(TypedDict):
    """One cache llama.cpp logged while it built the memory (base before SWA)."""

    module: str
    cells: int
    layers: int
    n_seq_max: int
    n_stream: NotRequired[int]
    attn_rot_k: NotRequired[bool]
    attn_rot_v: NotRequired[bool]
    n_embd_head_k_all: NotRequired[int]
    n_embd_head_v_all: NotRequired[int]


class MemoryLog(TypedDict, total=False):
    """Cache sizes parsed from llama.cpp's log."""

    caches: list[LoggedCache]
    kv_size_base: int
    kv_size_swa: int


class ObservedContext(TypedDict):
    """What llama.cpp reported after creating the context."""

    n_ctx: int
    n_ctx_seq: int | None
    n_batch: int
    n_ubatch: int
    n_seq_max: int
    memory_can_shift: bool
    memory_log: MemoryLog


class ObservedModel(TypedDict):
    """llama_model_* accessors on the loaded model (rope_type: enum llama_rope_type)."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_swa: int
    rope_type: int
    n_ctx_train: int
    n_vocab: int
    is_recurrent: bool
    is_hybrid: bool


class CaseMemory(TypedDict):
    """The memory llama.cpp built: its kind (a layout name), V layout, streams and sizes."""

    type: str
    v_trans: bool | None
    n_stream: int
    cell_ext: bool
    kv_size: int | None
    kv_size_swa: int | None
    rs_size: int | None


class Observed(TypedDict):
    """llama_memory_seq_pos_min / _max of every sequence id below n_seq_max, right after an operation."""

    seq_pos_min: list[int]
    seq_pos_max: list[int]


class IntRuns(TypedDict):
    """An int list as arithmetic runs ``[first, step, count]``."""

    runs: list[list[int]]


Ints: TypeAlias = "list[int] | IntRuns"


class GraphShift(TypedDict):
    """One cache's K-shift input (set_input_k_shift), read through ``layer``."""

    swa: bool
    layer: int
    k_shift: Ints


class GraphInput(TypedDict):
    """One graph input of a ubatch: a KQ mask (``shape``, ``finite``, ``values``) or an int list (``data``)."""

    tensor: str  # kq_mask, k_idxs, v_idxs, pos, pos_bucket
    layer: int
    swa: bool
    type: str  # f32, f16, i32, i64
    shape: NotRequired[list[int]]
    finite: NotRequired[str]  # base64 of np.packbits(isfinite) over the flattened mask
    values: NotRequired[list[tuple[int, float]]]  # [flat index, value] where a finite element is not 0
    data: NotRequired[Ints]


class GraphUBatch(TypedDict):
    """The inputs of one ubatch's graph."""

    inputs: list[GraphInput]


class Graph(TypedDict):
    """What the graphs of one llama_decode computed with: the K-shift inputs, then one entry per ubatch."""

    shift: NotRequired[list[GraphShift]]
    ubatches: list[GraphUBatch]


class SaveHeader(TypedDict, total=False):
    """The fixed fields in front of a saved state."""

    magic: int
    version: int
    n_token_count: int
    io_magic: int
    seq_id: int


class SaveSizes(TypedDict, total=False):
    """What llama.cpp's *_get_size calls returned."""

    state_size: int
    seq_state_size: int


class OpAbort(TypedDict):
    """How llama.cpp died in an op (``"ret": "aborts"``): the signal and the GGML_ASSERT / exception line."""

    signal: str
    message: str | None


class TraceOp(TypedDict):
    """One llama.cpp call of a trace (the schema's ``op``, ``op_init`` .. ``op_encode``): ``op`` and, per op, its
    arguments and results."""

    op: str  # one of kvref.jobs.conformance.TRACE_OPS
    ret: NotRequired[int | bool | str]  # bool: init, seq_rm, a session save / load; "aborts": llama.cpp died
    abort: NotRequired[OpAbort]  # with "ret": "aborts"
    errors: NotRequired[list[str]]
    observed: NotRequired[Observed]
    ctx: NotRequired[str]  # "other": the op ran in the case's ctx_other context (CaseOther)
    # decode, encode
    tokens: NotRequired[list[int] | None]  # and save / state_load / seq_restore (None: not recorded)
    pos: NotRequired[list[int]]
    seq_ids: NotRequired[list[list[int]]]
    embd: NotRequired[int]  # decode: an embeddings batch of this row width (tokens are 0 placeholders)
    logits: NotRequired[list[int]]
    graph: NotRequired[Graph]
    # sequence operations
    seq_id: NotRequired[int]
    p0: NotRequired[int]
    p1: NotRequired[int]
    seq_id_src: NotRequired[int]
    seq_id_dst: NotRequired[int]
    delta: NotRequired[int]
    d: NotRequired[int]
    data: NotRequired[bool]  # clear
    causal: NotRequired[bool]  # set_causal
    # save, state_load, seq_restore
    kind: NotRequired[str]  # session, seq, state_data, seq_data
    file: NotRequired[str]
    flags: NotRequired[int]
    dest_seq_id: NotRequired[int]
    n_token_capacity: NotRequired[int]
    arch: NotRequired[str]
    get_size: NotRequired[int]
    header: NotRequired[SaveHeader | None]
    layout: NotRequired[str]
    sections: NotRequired[list[str]]
    cell_ext: NotRequired[bool]
    output_block: NotRequired[bool]
    v_trans: NotRequired[bool | None]
    n_stream: NotRequired[int]
    scope: NotRequired[str]  # context, sequence
    size: NotRequired[int]
    sha256: NotRequired[str]
    observed_sizes: NotRequired[SaveSizes]


class Case(TypedDict):
    """A golden case: the model and context llama.cpp ran with and the trace of its calls."""

    schema_version: int
    id: str
    description: str
    covers: list[str]
    producer: Producer
    model: CaseModel
    context: CaseContext
    observed_context: ObservedContext | None  # None: llama_init_from_model refused the context
    observed_model: ObservedModel
    memory: CaseMemory
    trace: list[TraceOp]
    other: NotRequired[CaseOther]  # the ctx_other context (gemma4-assistant's target)


class CaseOther(TypedDict):
    """The context a case's context reads (llama_context_params.ctx_other), created first, same parameters."""

    model: CaseModel
    context: CaseContext
    init: NotRequired[TraceOp]
    observed_context: ObservedContext | None
    observed_model: ObservedModel
    memory: CaseMemory


# ---------------------------------------------------------------------------------------------- invalid/
class InvalidSource(TypedDict):
    """The golden artefact an invalid file was derived from."""

    case: str
    file: str


class LlamaCheck(TypedDict, total=False):
    """What the producing llama.cpp did with the invalid file (``make_invalid.py --llama-check``)."""

    accepted: bool
    ret: int | bool
    errors: list[str]


class InvalidEntry(TypedDict):
    """One corrupt file: the error class a reader raises and the field it names."""

    file: str
    error: str  # a class name of kvref.errors
    field: str
    also_accept: NotRequired[list[str]]
    fault: NotRequired[str]
    offset: NotRequired[int]
    source: InvalidSource
    needs_hparams: NotRequired[bool]
    sha256: NotRequired[str]
    note: NotRequired[str]
    llama_cpp: NotRequired[LlamaCheck]


class InvalidManifest(TypedDict):
    """``invalid/manifest.json``."""

    description: NotRequired[str]
    files: list[InvalidEntry]


# ---------------------------------------------------------------------------------------------- expected failures
class ExpectedFailure(TypedDict):
    """A case whose listed checks must fail, and why."""

    id: str
    checks: list[str]
    reason: str


class ExpectedFailures(TypedDict, total=False):
    """``expected_failures.json``."""

    description: str
    cases: list[ExpectedFailure]


# ------------------------------------------------------------------------------------------ kvref conformance --json
class CheckResultJSON(TypedDict):
    """One check of a case (`kvref.jobs.conformance.CheckResult`)."""

    name: str
    status: str
    detail: str
    expected_failure: str | None


class CaseResultJSON(TypedDict):
    """One case (`kvref.jobs.conformance.CaseResult`) with its outcome."""

    case: str
    checks: list[CheckResultJSON]
    seconds: float
    ok: bool
    status: str


class ConformanceJSON(About):
    """What ``kvref conformance --json`` prints: `kvref.about`, then the run."""

    root: str
    seconds: float
    ok: bool
    stale_expectations: list[str]
    cases: list[CaseResultJSON]


__all__ = [
    "Case",
    "CaseContext",
    "CaseHParams",
    "CaseMemory",
    "CaseModel",
    "CaseOther",
    "CaseResultJSON",
    "CheckResultJSON",
    "ConformanceJSON",
    "ExpectedFailure",
    "ExpectedFailures",
    "Graph",
    "GraphInput",
    "GraphShift",
    "GraphUBatch",
    "IntRuns",
    "Ints",
    "InvalidEntry",
    "InvalidManifest",
    "InvalidSource",
    "LlamaCheck",
    "LoggedCache",
    "MemoryLog",
    "Observed",
    "ObservedContext",
    "ObservedModel",
    "OpAbort",
    "Producer",
    "SSMParams",
    "SaveHeader",
    "SaveSizes",
    "TraceOp",
]
