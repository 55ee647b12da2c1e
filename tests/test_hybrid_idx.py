"""HybridIdxMemory: scenarios derived from llama_memory_hybrid_idx (src/llama-memory-hybrid-idx.cpp, October 2026).

The expected values come from reading the C++ (the comments say which line of reasoning) or from the qwen4exp
goldens llama.cpp 0.3.36 wrote (conformance/golden/qwen4exp-hybrid-idx*).
"""

from __future__ import annotations

import pytest
from golden import GOLDEN, load_case

import kvref
from kvref.errors import FormatError, KVRefError, SequenceError
from kvref.hparams import HParams, RopeType
from kvref.jobs import conformance as C
from kvref.memory.batch import Batch
from kvref.memory.factory import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, create_memory
from kvref.memory.hybrid_idx import HybridIdxMemory, idx_hparams
from kvref.profile import DEFAULT, resolve

CASE = "qwen4exp-hybrid-idx"


def qwen4exp() -> HParams:
    return C.hparams_from_case(load_case(CASE))


def glm5_next(n_layer_nextn: int = 1) -> HParams:
    """glm5-next's shape: 4 trunk layers (KDA, nope-MLA with an indexer, KDA, MLA sharing the previous indexer)
    plus ``n_layer_nextn`` MTP blocks; the MLA cache holds the 32-wide latent (one KV head), k-pool 4."""
    n = 4 + n_layer_nextn
    return HParams(
        arch="glm5-next", n_layer=n, n_embd=64, n_head=2, n_head_kv=[0, 1, 0, 1] + [1] * n_layer_nextn,
        n_embd_head_k=32, n_embd_head_v=32, n_embd_head_k_mla=32, n_embd_head_v_mla=32, n_rot=0,
        rope_type=RopeType.NONE, recurrent_layers=[True, False, True, False] + [False] * n_layer_nextn,
        n_layer_nextn=n_layer_nextn, n_embd_head_kda=16, ssm_d_conv=4, indexer_head_size=16, indexer_kpool=4,
        indexer_full_layers=[True, True, True, False] + [True] * n_layer_nextn, n_ctx_train=4096,
    )  # fmt: skip


def mem_q(n_seq_max: int = 3, kv_unified: bool = True) -> HybridIdxMemory:
    m = create_memory(qwen4exp(), 256, n_seq_max, kv_unified)
    assert isinstance(m, HybridIdxMemory)
    return m


def test_qwen4exp_with_an_indexer_builds_the_three_caches():
    mem = mem_q()
    assert mem.kind == "hybrid_idx"
    assert [la.il for la in mem.attn.layers] == [1] and mem.recr.layers == [0]
    assert mem.idx is not None and [la.il for la in mem.idx.layers] == [1]
    # one key head of indexer_head_size per layer, no V (an MLA-shaped cache), no RoPE
    hp = mem.hparams_idx
    assert hp is not None and (hp.n_embd_k_gqa(1), hp.is_mla(), hp.rope_type) == (16, True, RopeType.NONE)
    assert mem.idx.layers[0].v is None and mem.idx.layers[0].k.shape == (1, 256, 32)
    assert mem.idx.get_size() == mem.attn.get_size() and mem.idx.n_stream == mem.attn.n_stream
    assert mem.total_size() == mem.attn.total_size() + mem.recr.total_size() + mem.idx.total_size()


def test_qwen4exp_without_an_indexer_is_a_plain_hybrid():
    import dataclasses

    mem = create_memory(dataclasses.replace(qwen4exp(), indexer_head_size=0), 256, 2)
    assert type(mem).__name__ == "HybridMemory" and mem.kind == "hybrid"


def test_glm5_next_filters():
    hp = glm5_next()
    mem = create_memory(hp, 256, 2)
    assert isinstance(mem, HybridIdxMemory)
    # trunk: attention on the MLA layers, the indexer only where the layer has its own, recurrent on KDA layers
    assert [la.il for la in mem.attn.layers] == [1, 3]
    assert mem.idx is not None and [la.il for la in mem.idx.layers] == [1]
    assert mem.recr.layers == [0, 2]
    # the MLA cache keeps no V; the indexer caches key | gate | pooled: 3 x 16 per token
    assert mem.attn.layers[0].v is None
    assert mem.idx.layers[0].k.shape[-1] == 3 * 16 * 2  # f16


def test_glm5_next_mtp_context_keeps_the_nextn_layers_only():
    """What llama_model::create_memory builds for the MTP context (before llama.cpp 0.3.36 fails to build its graph:
    create_memory refuses, conformance/golden/glm5-next-mtp-refused)."""
    from kvref.memory.factory import _hybrid_idx, context_params

    hp = glm5_next()
    with pytest.raises(KVRefError, match="NextN graph not implemented"):
        create_memory(hp, 256, 2, ctx_type="mtp")
    mem = _hybrid_idx(hp, context_params(hp, 256, 2), "mtp", "f16", "f16", True, 1, resolve(DEFAULT))
    assert [la.il for la in mem.attn.layers] == [4]
    assert mem.idx is not None and [la.il for la in mem.idx.layers] == [4]
    assert mem.recr.layers == []


def test_glm5_next_mtp_without_nextn_blocks_throws():
    with pytest.raises(KVRefError, match="NextN"):
        create_memory(glm5_next(0), 256, 2, ctx_type="mtp")


def test_ops_mirror_the_attention_cells_in_the_indexer():
    mem = mem_q()
    mem.decode(Batch(tokens=list(range(10)), seq_ids=[[0]] * 10))
    mem.seq_cp(0, 1, -1, -1)
    mem.decode(Batch(tokens=[3, 4], pos=[10, 11], seq_ids=[[1], [1]]))
    assert mem.idx is not None
    a, i = mem.attn.cells(0), mem.idx.cells(0)
    assert (a.pos == i.pos).all() and (a.seq == i.seq).all()
    # the recurrent part cannot drop a tail: False, nothing changed
    assert mem.seq_rm(1, 5, -1) is False
    assert mem.idx.seq_pos_max(1) == 11
    assert mem.seq_rm(1, -1, -1) is True
    assert mem.idx.seq_pos_max(1) == -1 and mem.attn.seq_pos_max(1) == -1
    mem.seq_keep(0)
    assert (a.pos == i.pos).all()
    mem.clear()
    assert mem.idx.cells(0).get_used() == 0


def test_m_rope_refuses_position_edits_before_anything_changes():
    mem = mem_q()
    mem.decode(Batch(tokens=list(range(4)), seq_ids=[[0]] * 4))
    before = mem.state_write()
    with pytest.raises(SequenceError):
        mem.seq_add(0, 0, -1, 2)  # llama_kv_cache::seq_add asserts n_pos_per_embd() == 1 (the attention part)
    assert mem.state_write() == before


def test_state_sections_and_partial_only():
    mem = mem_q()
    mem.decode(Batch(tokens=list(range(6)), seq_ids=[[0]] * 6))
    whole = mem.state_write(0)
    attn, recr = mem.attn.state_write(0), mem.recr.state_write(0)
    assert mem.idx is not None
    assert whole == attn + recr + mem.idx.state_write(0)  # attention, recurrent, then the indexer suffix
    assert mem.state_size(0) == len(whole)
    assert mem.state_write(0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == recr


def test_a_restore_places_the_indexer_cells_where_the_attention_ones_go():
    mem = mem_q()
    mem.decode(Batch(tokens=list(range(6)), seq_ids=[[0]] * 6))
    blob = mem.state_write(0)
    mem.decode(Batch(tokens=[1, 2], seq_ids=[[2], [2]]))
    mem.state_read(blob, 1)
    assert mem.idx is not None
    a, i = mem.attn.cells(0), mem.idx.cells(0)
    assert (a.pos == i.pos).all() and (a.seq == i.seq).all() and mem.seq_pos_max(1) == 5


def test_an_indexer_section_of_another_cell_count_fails_the_restore():
    src = mem_q()
    src.decode(Batch(tokens=list(range(6)), seq_ids=[[0]] * 6))
    other = mem_q()
    other.decode(Batch(tokens=list(range(4)), seq_ids=[[0]] * 4))
    assert src.idx is not None and other.idx is not None
    # attention and recurrent of a 6-token sequence, the indexer section of a 4-token one
    bad = src.attn.state_write(0) + src.recr.state_write(0) + other.idx.state_write(0)
    mem = mem_q()
    mem.decode(Batch(tokens=list(range(3)), seq_ids=[[1]] * 3))
    before = mem.state_write()
    with pytest.raises(FormatError, match="indexer section restores 4 cells"):
        mem.state_read(bad, 1)
    assert mem.state_write() == before  # kvref's atomic restore: nothing changed


def test_a_failed_restore_drops_the_sequence_from_every_cache():
    """llama_memory_hybrid_idx::state_read catches any failure and calls state_drop(seq_id): the sequence leaves
    the three caches whichever section failed (here the recurrent one, which comes second)."""
    mem = mem_q()
    mem.decode(Batch(tokens=list(range(5)), seq_ids=[[0]] * 5))
    mem.decode(Batch(tokens=list(range(3)), seq_ids=[[1]] * 3))
    blob = mem.state_write(0)
    n_attn = len(mem.attn.state_write(0))
    truncated = blob[: n_attn + 10]  # the attention section whole, the recurrent one cut
    with pytest.raises(FormatError):
        mem.state_read(truncated, 1, atomic=False)
    assert mem.idx is not None
    assert (mem.attn.seq_pos_max(1), mem.recr.seq_pos_max(1), mem.idx.seq_pos_max(1)) == (-1, -1, -1)
    assert mem.seq_pos_max(0) == 4  # the other sequence stays
    # PARTIAL_ONLY reads only the recurrent section, yet a failure drops the sequence from all three too
    mem.decode(Batch(tokens=list(range(3)), seq_ids=[[1]] * 3))
    with pytest.raises(FormatError):
        mem.state_read(b"\x01\x00", 1, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, atomic=False)
    assert (mem.attn.seq_pos_max(1), mem.idx.seq_pos_max(1)) == (-1, -1)
    # a whole-context restore that fails clears everything
    with pytest.raises(FormatError):
        mem.state_read(b"\x01\x00", -1, atomic=False)
    assert mem.seq_pos_max(0) == -1 and mem.idx.cells(0).get_used() == 0


def test_golden_session_round_trips_through_the_memory():
    """The golden's whole-context state restored into the memory kvref builds, then written back byte for byte."""
    case = load_case(CASE)
    mem = C.create_memory_for(case, qwen4exp())
    obj = kvref.state.load(GOLDEN / CASE / "02-state.bin", **C.artefact_hints(C.save_ops(case)["02-state.bin"]))
    blob = C.section_bytes(C.memory_sections(obj))
    mem.state_read(blob)
    assert mem.state_write() == blob


def test_inspect_labels_the_three_sections(capsys: pytest.CaptureFixture[str]) -> None:
    from kvref.jobs.cli import main

    main(["inspect", str(GOLDEN / CASE / "01-session.ggsn")])
    out = capsys.readouterr().out
    assert "memory layout: hybrid_idx" in out
    assert "section 0: attention KV" in out and "section 1: recurrent" in out and "section 2: indexer KV" in out


def test_idx_hparams_needs_an_indexer():
    with pytest.raises(KVRefError):
        idx_hparams(HParams(arch="qwen4exp", n_layer=2, n_embd=64, n_head=2))


@pytest.mark.parametrize(
    "file", ["qwen4exp-hybrid-idx/01-session.ggsn", "qwen4exp-hybrid-idx/03-seq-seq0.ggsq",
             "qwen4exp-hybrid-idx-streams/01-session.ggsn"],
)  # fmt: skip
def test_restore_then_save_gives_llama_cpps_bytes(file: str, tmp_path) -> None:
    """kvref.restore builds the hybrid_idx memory from the committed GGUF and the file; saved again it is the file."""
    model = GOLDEN.parent / "models" / "qwen4exp-tiny.gguf"
    src = GOLDEN / file
    mem = kvref.restore(src, model=model).memory
    assert isinstance(mem, HybridIdxMemory)
    tokens = list(kvref.state.load(src).tokens)
    out = tmp_path / "again"
    seq = file.endswith(".ggsq")
    kvref.save_memory(mem, out, kind="seq" if seq else "session", tokens=tokens, **({"seq_id": 0} if seq else {}))
    assert out.read_bytes() == src.read_bytes()


def test_check_accepts_the_partial_state_of_a_hybrid_idx_model() -> None:
    from kvref.jobs.restore import memory_layout

    assert memory_layout(qwen4exp()) == ("hybrid_idx", "recurrent")
