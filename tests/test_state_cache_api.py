"""The API the memory classes use: build a section, serialize it, parse-and-validate it against a cache spec."""

from __future__ import annotations

import numpy as np
import pytest

import kvref.state as S
from kvref.errors import FormatError
from kvref.ggml.types import GGMLType, row_size

F16 = int(GGMLType.F16)
ROW = row_size(F16, 8)


def _section(seq_ids: list[list[int]], *, v_trans: int = 0, n_layer: int = 2, n_stream: int = 1) -> S.KVSection:
    n = len(seq_ids)
    cells = S.Cells.from_lists(range(n), seq_ids)
    k = [S.LayerRows(F16, ROW, np.full((n, ROW), il, np.uint8)) for il in range(n_layer)]
    if v_trans:
        v = [S.TransposedRows(F16, 2, 8, np.zeros((8, n * 2), np.uint8)) for _ in range(n_layer)]
    else:
        v = [S.LayerRows(F16, ROW, np.zeros((n, ROW), np.uint8)) for _ in range(n_layer)]
    streams = [S.KVStream(cells, S.KVData(v_trans, k, v))] + [S.KVStream(None, None)] * (n_stream - 1)
    return S.KVSection(streams)


def _spec(**over: object) -> S.KVSpec:
    base = {
        "n_stream": 1,
        "kv_size": 16,
        "n_seq_max": 4,
        "v_trans": False,
        "layers": (S.KVLayerSpec(F16, ROW, F16, ROW, 8),) * 2,
    }
    base.update(over)
    return S.KVSpec(**base)  # type: ignore[arg-type]


def test_write_then_read_validated() -> None:
    sec = _section([[0], [0, 1], [1]])
    blob = S.section_bytes(sec)
    back, end = S.read_kv_section(blob, _spec())
    assert end == len(blob)
    assert back.streams[0].cells == sec.streams[0].cells
    assert S.section_bytes(back) == blob


@pytest.mark.parametrize(
    "spec, seq_id, field",
    [
        (_spec(n_stream=2), -1, "n_stream"),
        (_spec(kv_size=2), -1, "cell_count"),
        (_spec(n_seq_max=1), -1, "seq_id"),
        (_spec(layers=(S.KVLayerSpec(F16, ROW, F16, ROW, 8),)), -1, "n_layer"),
        (_spec(v_trans=True), -1, "v_trans"),
        (_spec(layers=(S.KVLayerSpec(0, ROW * 2, F16, ROW, 8),) * 2), -1, "k_type"),
        (_spec(layers=(S.KVLayerSpec(F16, ROW * 2, F16, ROW, 8),) * 2), -1, "k_row_size"),
        (_spec(layers=(S.KVLayerSpec(F16, ROW, 0, ROW, 8),) * 2), -1, "v_type"),
        (_spec(layers=(S.KVLayerSpec(F16, ROW, F16, ROW + 2, 8),) * 2), -1, "v_row_size"),
        (_spec(), 0, "n_seq_id"),  # a sequence restore needs exactly one id per cell
    ],
)
def test_validation_failures(spec: S.KVSpec, seq_id: int, field: str) -> None:
    blob = S.section_bytes(_section([[0], [0, 1], [1]]))
    with pytest.raises(FormatError) as ei:
        S.read_kv_section(blob, spec, seq_id=seq_id)
    assert ei.value.field == field, ei.value
    assert ei.value.offset is not None


def test_transposed_width_checked() -> None:
    blob = S.section_bytes(_section([[0]], v_trans=1))
    spec = _spec(v_trans=True, layers=(S.KVLayerSpec(F16, ROW, F16, None, 4),) * 2)
    with pytest.raises(FormatError) as ei:
        S.read_kv_section(blob, spec)
    assert ei.value.field == "n_embd_v_gqa"
    back, _ = S.read_kv_section(blob, _spec(v_trans=True, layers=(S.KVLayerSpec(F16, ROW, F16, None, 8),) * 2))
    assert back.streams[0].data.v[0].n_embd == 8


def test_composite_and_trailing() -> None:
    a, b = _section([[0]]), _section([[1], [1]])
    blob = S.section_bytes(a, b)
    secs, end = S.read_sections(blob, [_spec(), _spec()])
    assert len(secs) == 2 and end == len(blob)
    with pytest.raises(FormatError) as ei:
        S.read_sections(blob + b"\0", [_spec(), _spec()])
    assert ei.value.field == "trailing"
    with pytest.raises(FormatError):
        S.read_sections(blob[:-1], [_spec(), _spec()])


def test_recurrent_spec() -> None:
    n = 2
    cells = S.Cells.from_lists([4, 9], [[], []])  # a sequence save: n_seq_id = 0
    r = [S.RecurrentLayer(0, 12, np.zeros((n, 12), np.uint8))]
    s = [S.LayerRows(0, 16, np.zeros((n, 16), np.uint8))]
    sec = S.RecurrentSection(cells, 0, 3, r, s)
    blob = S.section_bytes(sec)
    spec = S.RecurrentSpec(size=4, n_seq_max=2, n_layer=3, layers=(S.RecurrentLayerSpec(0, 12, 0, 16),))
    back, end = S.read_recurrent_section(blob, spec, seq_id=1)
    assert end == len(blob) and back.cells.n == 2
    for bad, field in [
        (S.RecurrentSpec(1, 2, 3, spec.layers), "cell_count"),
        (S.RecurrentSpec(4, 2, 4, spec.layers), "n_layer"),
        (S.RecurrentSpec(4, 2, 3, (S.RecurrentLayerSpec(1, 12, 0, 16),)), "r_type"),
        (S.RecurrentSpec(4, 2, 3, (S.RecurrentLayerSpec(0, 12, 0, 20),)), "s_row_size"),
        (S.RecurrentSpec(4, 2, 3, spec.layers, s_trans=True), "s_trans"),
    ]:
        with pytest.raises(FormatError) as ei:
            S.read_recurrent_section(blob, bad, seq_id=1)
        assert ei.value.field == field
