"""The JSON `kvref.state.summary.summarize` returns (``StateObject.summary()``), as TypedDicts: what
``kvref inspect --json`` prints, with the keys ``kvref inspect`` adds (`kvref.jobs.cli_jobs.enrich_summary`).

Types only: the dicts are plain dicts at run time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeAlias, TypedDict

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    from typing_extensions import NotRequired  # typing.NotRequired from Python 3.11


class SeqSummary(TypedDict):
    """The cells one sequence holds in a cell table."""

    pos_min: int
    pos_max: int
    n_cells: int


class CellsSummary(TypedDict):
    """A cell table: its cell count, cell ext size and positions (absent for an empty stream), per sequence."""

    cell_count: int
    ext_size: NotRequired[int]
    pos_min: NotRequired[int | None]
    pos_max: NotRequired[int | None]
    sequences: dict[str, SeqSummary]  # by sequence id (JSON object keys are strings)


class RowsSummary(TypedDict):
    """The rows of one K / V / S tensor: type name, row size, bytes; a transposed tensor's element size and width."""

    type: str
    row_size: int
    bytes: int
    transposed: NotRequired[bool]
    el_size: NotRequired[int]
    n_embd: NotRequired[int]


class KVLayerSummary(TypedDict):
    """One layer of a KV stream (``v`` absent without V)."""

    layer: int
    il: NotRequired[int]  # the model's layer (kvref inspect --model)
    k: RowsSummary
    v: NotRequired[RowsSummary]


class StreamSummary(CellsSummary):
    """One stream of a KV section: its cells, and its rows' header when it has cells."""

    stream: int
    v_trans: NotRequired[int]
    n_layer: NotRequired[int]
    layers: NotRequired[list[KVLayerSummary]]


class KVSectionSummary(TypedDict):
    """An attention KV section (``n_stream`` None: written without the n_stream field)."""

    kind: Literal["kv"]
    n_stream: int | None
    streams: list[StreamSummary]
    label: NotRequired[str]  # kvref inspect: the section's heading
    rotation: NotRequired[str]  # kvref inspect: the note on llama.cpp's attention rotation


class RecurrentRowsSummary(TypedDict):
    """The R rows of one recurrent layer."""

    type: str
    row_size: int
    bytes: int


class PLERowsSummary(TypedDict):
    """The PLE rows of one recurrent layer."""

    row_size: int
    bytes: int


class RecurrentLayerSummary(TypedDict):
    """One recurrent layer with state."""

    index: int
    il: NotRequired[int]  # the model's layer (kvref inspect --model)
    r: RecurrentRowsSummary
    s: RowsSummary
    p: NotRequired[PLERowsSummary]


class RecurrentSectionSummary(CellsSummary):
    """A recurrent section: its cells and layers with state."""

    kind: Literal["recurrent"]
    s_trans: int
    n_layer: int
    n_state_layers: int
    layers: list[RecurrentLayerSummary]
    label: NotRequired[str]  # kvref inspect: the section's heading


SectionSummary: TypeAlias = "KVSectionSummary | RecurrentSectionSummary"


class MediaSummary(TypedDict):
    """A media chunk of llama-server's packed prompt: where it starts, its size."""

    start: int
    bytes: int


class TokenFieldSummary(TypedDict):
    """Which form a file's token field has (`kvref.state.server_tokens`) and the prompt it packs."""

    form: str
    error: NotRequired[str]
    n_prompt_tokens: NotRequired[int]
    first_prompt_tokens: NotRequired[list[int]]
    media: NotRequired[list[MediaSummary]]


class OutputsSummary(TypedDict):
    """The v9 output block: its counts."""

    n_outputs: int
    logits: int
    embeddings: int


class RngSummary(TypedDict):
    """Session version 8's sampler state (its size)."""

    bytes: int


class EraSummary(TypedDict):
    """An era whose layout the state has (`kvref.state.eras`) and its llama-cpp-python releases."""

    era: str
    llama_cpp_python: str


class StateSummary(TypedDict):
    """A session file, sequence file or blob: its container fields, memory layout and sections."""

    format: str
    magic: NotRequired[str]
    version: NotRequired[int]
    n_tokens: NotRequired[int]
    first_tokens: NotRequired[list[int]]
    token_field: NotRequired[TokenFieldSummary]
    seq_id: NotRequired[int | None]
    arch: NotRequired[str]
    outputs: NotRequired[OutputsSummary]
    rng: NotRequired[RngSummary]
    layout: str
    note: NotRequired[str]
    sections: list[SectionSummary]
    # what kvref inspect adds
    file_size: NotRequired[int]
    eras: NotRequired[list[EraSummary]]
    tokens: NotRequired[npt.NDArray[np.int32]]  # every token (dump_json writes the array as a JSON list)
    tokens_omitted: NotRequired[int]  # instead of tokens, for a long list: their count (--all lists them)
    text: NotRequired[str]
    text_of_tokens: NotRequired[int]  # text of only the first tokens


__all__ = [
    "CellsSummary",
    "EraSummary",
    "KVLayerSummary",
    "KVSectionSummary",
    "MediaSummary",
    "OutputsSummary",
    "PLERowsSummary",
    "RecurrentLayerSummary",
    "RecurrentRowsSummary",
    "RecurrentSectionSummary",
    "RngSummary",
    "RowsSummary",
    "SectionSummary",
    "SeqSummary",
    "StateSummary",
    "StreamSummary",
    "TokenFieldSummary",
]
