"""llama_kv_cache_dsa / llama_kv_cache_dsa_iswa (KVCacheDSA, KVCacheDSAISWA) and create_memory's DSA cases.

Expected values come from reading llama.cpp 0.3.36 (src/llama-kv-cache-dsa*.cpp, llama_model::create_memory,
llama_kv_cache's constructor); the goldens of conformance/golden/glm-dsa-* and dots3note-* check the same against the
real llama.cpp.
"""

from __future__ import annotations

import pytest

import kvref
from kvref.errors import FormatError, HParamsError, KVRefError, NoSlotError
from kvref.hparams import HParams, RopeType, SWAType
from kvref.memory.batch import Batch
from kvref.memory.factory import LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, create_memory
from kvref.memory.kv_cache import KVCache
from kvref.memory.kv_cache_dsa import KVCacheDSA, lid_hparams
from kvref.memory.kv_cache_dsa_iswa import KVCacheDSAISWA

KV_LORA, ROPE, IDX = 32, 16, 64  # MLA cache rows: kv_lora + rope = 48 values; indexer keys: 64


def mla(arch: str, n_layer: int = 3, nextn: int = 1, **kw: object) -> HParams:
    """An absorbed-MLA model: one KV head of kv_lora + rope, no V (both MLA head sizes set)."""
    args: dict = dict(
        arch=arch, n_layer=n_layer, n_layer_nextn=nextn, n_embd=32, n_head=2, n_head_kv=1,
        n_embd_head_k=KV_LORA + ROPE, n_embd_head_v=KV_LORA, n_rot=ROPE, n_embd_head_k_mla=48, n_embd_head_v_mla=32,
        n_lora_kv=KV_LORA, indexer_head_size=IDX, indexer_top_k=4, n_ctx_train=4096,
    )  # fmt: skip
    args.update(kw)
    return HParams(**args)


def layers(cache: KVCache) -> list[int]:
    return cache.get_layer_ids()


def tokens(n: int, seq: int = 0, start: int = 0) -> Batch:
    return Batch(tokens=list(range(4, 4 + n)), pos=list(range(start, start + n)), seq_ids=[[seq]] * n)


# ------------------------------------------------------------------ create_memory


def test_glm_dsa_trunk_and_indexer_layers():
    hp = mla("glm-dsa", n_layer=4, indexer_full_layers=[True, False, True, False])
    mem = create_memory(hp, 256)
    assert isinstance(mem, KVCacheDSA) and mem.kind == "dsa"
    assert layers(mem.mla) == [0, 1, 2]  # the NextN block (3) is never attended by the trunk
    assert layers(mem.lid) == [0, 2]  # only layers that own an indexer
    # the MLA cache: K rows of kv_lora + rope, no V; the indexer cache: one head of indexer_head_size
    assert [layer.k.shape for layer in mem.mla.layers] == [(1, 256, 96)] * 3
    assert all(layer.v is None for layer in mem.mla.layers + mem.lid.layers)
    assert [layer.k.shape for layer in mem.lid.layers] == [(1, 256, 2 * IDX)] * 2
    assert mem.mla.get_size() == mem.lid.get_size() == 256


def test_deepseek32_indexer_cache_keeps_every_trunk_layer():
    hp = mla("deepseek32", n_layer=3, indexer_full_layers=False)  # deepseek32 never reads the types
    mem = create_memory(hp, 256)
    assert layers(mem.mla) == layers(mem.lid) == [0, 1]


def test_without_nextn_the_mla_cache_keeps_every_layer():
    mem = create_memory(mla("deepseek32", n_layer=2, nextn=0), 256)
    assert layers(mem.mla) == layers(mem.lid) == [0, 1]


@pytest.mark.parametrize("arch", ["glm-dsa", "deepseek32"])
def test_mtp_context_is_a_plain_cache_of_the_nextn_blocks(arch: str):
    mem = create_memory(mla(arch, n_layer=3, indexer_full_layers=[True, True, False]), 256, ctx_type="mtp")
    assert type(mem) is KVCache and layers(mem) == [2]
    assert mem.layers[0].v is None  # dense MLA: K only
    # a model without NextN blocks: the MTP context builds the DSA memory of the default context
    mem = create_memory(mla(arch, n_layer=2, nextn=0, indexer_full_layers=True), 256, ctx_type="mtp")
    assert isinstance(mem, KVCacheDSA)


def test_hy_v4_without_indexer_is_a_plain_cache():
    mem = create_memory(mla("hy_v4", n_layer=2, nextn=0, indexer_top_k=0), 256)
    assert type(mem) is KVCache and layers(mem) == [0, 1]
    mem = create_memory(mla("hy_v4", n_layer=3, nextn=0, indexer_full_layers=[True, False, False]), 256)
    assert isinstance(mem, KVCacheDSA) and layers(mem.mla) == [0, 1, 2] and layers(mem.lid) == [0]


def test_hy_v4_with_nextn_blocks_aborts():
    # filter_lid asks is_indexer_full of every layer, which aborts past the trunk (GGML_ABORT)
    hp = mla("hy_v4", n_layer=3, nextn=1, indexer_full_layers=[True, False, False])
    with pytest.raises(HParamsError, match="out of bounds"):
        create_memory(hp, 256)


def dots(**kw: object) -> HParams:
    args: dict = dict(
        n_layer=4, nextn=0, swa_type=SWAType.STANDARD, n_swa=4, swa_layers=[True, False, True, False],
        n_embd_head_k_swa=32, indexer_full_layers=[False, True, False, True],
    )  # fmt: skip
    args.update(kw)
    return mla("dots3note", **args)


def test_dots3note_builds_the_dsa_iswa_pair():
    mem = create_memory(dots(), 1024, n_ubatch=128)
    assert isinstance(mem, KVCacheDSAISWA) and mem.kind == "dsa_iswa"
    assert layers(mem.dsa.mla) == [1, 3] and layers(mem.dsa.lid) == [1, 3] and layers(mem.swa) == [0, 2]
    assert mem.swa.get_size() == 256  # pad(min(1024, 4 + 128), 256), as llama_kv_cache_iswa
    assert mem.dsa.get_size() == 1024
    assert [layer.k.shape[-1] for layer in mem.swa.layers] == [64, 64]  # key_length_swa 32, f16
    assert mem.dsa.lid.n_swa == 0 and mem.swa.n_swa == 4
    assert create_memory(dots(), 1024, swa_full=True).swa.get_size() == 1024


def test_dots3note_without_window_or_with_an_mtp_context_aborts():
    with pytest.raises(KVRefError, match="swa_type"):
        create_memory(dots(swa_type=SWAType.NONE, n_swa=0, swa_layers=False), 256)
    hp = dots(n_layer=5, nextn=1, swa_layers=[True, False, True, False, False],
              indexer_full_layers=[False, True, False, True, False])  # fmt: skip
    # llama.cpp's create_memory builds a plain cache of the NextN block, then llama_init_from_model segfaults building
    # the trunk graph over it (checked with a dots3note tiny model with a NextN block: SIGSEGV in
    # llama_kv_cache_dsa_context::get_mla <- build_attn_inp_k_dsa_iswa <- graph_reserve)
    with pytest.raises(KVRefError, match="no MTP graph"):
        create_memory(hp, 256, ctx_type="mtp")
    mem = create_memory(hp, 256)
    assert layers(mem.dsa.mla) == [1, 3] and layers(mem.swa) == [0, 2]


def test_lid_hparams():
    hp = mla("glm-dsa", n_head_kv=[1, 1, 1], n_embd_head_k_swa=40)
    lid = lid_hparams(hp)
    assert [lid.n_head_kv_l(il) for il in range(3)] == [1, 1, 1]
    assert lid.n_embd_head_k == IDX and lid.n_embd_head_k_swa == 40  # only the full-attention head size changes
    assert lid.rope_type == RopeType.NEOX and hp.rope_type == RopeType.NORM
    assert lid.n_rot == ROPE and lid.n_lora_kv == KV_LORA


def test_indexer_keys_always_rotate():
    # llama_kv_cache's constructor: DeepSeek lightning-indexer caches rotate K whatever the type (here f16)
    mem = create_memory(mla("glm-dsa", indexer_full_layers=True), 256)
    assert mem.lid.attn_rot_k and not mem.mla.attn_rot_k
    # hy_v4 is not among those archs: f16 keys are not rotated
    hy = create_memory(mla("hy_v4", n_layer=2, nextn=0, indexer_full_layers=True), 256)
    assert not hy.lid.attn_rot_k


# ------------------------------------------------------------------ operations


def test_both_caches_get_the_same_cells_and_ops():
    mem = create_memory(mla("glm-dsa", indexer_full_layers=True), 256, n_seq_max=2)
    mem.decode(tokens(6))
    mem.decode(tokens(3, seq=1))
    for cache in (mem.mla, mem.lid):
        assert cache.cells(0).pos.tolist()[:9] == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert mem.seq_rm(0, 2, 4) is True
    mem.seq_cp(1, 0, -1, -1)
    mem.seq_add(0, 4, -1, 10)
    for cache in (mem.mla, mem.lid):
        assert cache.seq_pos_max(0) == 15 and cache.seq_pos_min(0) == 0
    assert mem.seq_pos_max(1) == 2
    mem.seq_keep(1)
    assert mem.seq_pos_max(0) == -1 and mem.lid.seq_pos_max(0) == -1
    assert mem.get_can_shift()


def test_a_batch_that_does_not_fit_raises():
    mem = create_memory(mla("glm-dsa", indexer_full_layers=True), 256)
    mem.decode(tokens(250))
    with pytest.raises(NoSlotError):
        mem.decode(tokens(10, start=250))
    assert mem.seq_pos_max(0) == 249


def test_dsa_iswa_positions_come_from_the_swa_cache():
    mem = create_memory(dots(), 1024, n_ubatch=8)
    for i in range(4):
        mem.decode(tokens(8, start=8 * i), n_ubatch=8)
    mem.dsa.seq_rm(0, 0, 2)  # the DSA pair alone: the memory's range is still the SWA cache's
    assert mem.dsa.seq_pos_min(0) == 2 and mem.seq_pos_min(0) == mem.swa.seq_pos_min(0) == 0
    mem.dsa.seq_rm(0, 30, -1)
    assert mem.seq_pos_max(0) == 31
    assert not mem.get_can_shift()  # 1024 MLA cells, 256 SWA cells
    assert create_memory(dots(), 256).get_can_shift()  # both 256


# ------------------------------------------------------------------ state


def filled(n_seq_max: int = 2) -> KVCacheDSA:
    mem = create_memory(mla("glm-dsa", indexer_full_layers=True), 256, n_seq_max=n_seq_max)
    mem.decode(tokens(5))
    mem.decode(tokens(3, seq=1))
    return mem


def test_state_is_the_mla_section_then_the_indexer_section():
    mem = filled()
    for seq in (-1, 0, 1):
        blob = mem.state_write(seq)
        assert blob == mem.mla.state_write(seq) + mem.lid.state_write(seq)
        assert mem.state_size(seq) == len(blob)
    other = filled()
    other.clear()
    other.state_read(mem.state_write())
    assert other.state_write() == mem.state_write()


def test_a_failed_indexer_section_undoes_the_mla_restore():
    src = filled()
    data = src.mla.state_write(1) + src.lid.state_write(1)[:-1]  # the indexer section cut short
    mem = filled()
    before = mem.state_write()
    with pytest.raises(FormatError):
        mem.state_read(data, 1)
    assert mem.state_write() == before  # kvref's default: atomic
    with pytest.raises(FormatError):
        mem.state_read(data, 1, atomic=False)
    # llama.cpp: the MLA cache restored seq 1, then state_clear(1) removed it; the indexer cache's failed read
    # removed seq 1 too; seq 0 is kept in both
    for cache in (mem.mla, mem.lid):
        assert cache.seq_pos_max(1) == -1 and cache.seq_pos_max(0) == 4


def test_a_failed_whole_restore_clears_both():
    src = filled()
    data = src.mla.state_write() + src.lid.state_write()[:-1]
    mem = filled()
    with pytest.raises(FormatError):
        mem.state_read(data, atomic=False)
    assert mem.mla.seq_pos_max(0) == mem.lid.seq_pos_max(0) == -1


def test_dsa_iswa_state_and_partial_only():
    mem = create_memory(dots(), 256, n_seq_max=2)
    mem.decode(tokens(9))
    blob = mem.state_write(0)
    assert blob == mem.dsa.mla.state_write(0) + mem.dsa.lid.state_write(0) + mem.swa.state_write(0)
    assert mem.state_write(0, LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) == mem.swa.state_write(0)
    # a failing SWA section keeps the DSA pair restored (llama_kv_cache_dsa_iswa undoes nothing)
    other = create_memory(dots(), 256, n_seq_max=2)
    with pytest.raises(FormatError):
        other.state_read(blob[:-1], 1, atomic=False)
    assert other.dsa.mla.seq_pos_max(1) == other.dsa.lid.seq_pos_max(1) == 8
    assert other.swa.seq_pos_max(1) == -1
    # a failing indexer section clears the MLA part again and leaves the SWA cache unread
    lid_cut = mem.dsa.mla.state_write(0) + mem.dsa.lid.state_write(0)[:-1]
    other = create_memory(dots(), 256, n_seq_max=2)
    other.decode(tokens(2, seq=1))
    with pytest.raises(FormatError):
        other.state_read(lid_cut, 1, atomic=False)
    assert other.dsa.mla.seq_pos_max(1) == other.dsa.lid.seq_pos_max(1) == -1
    assert other.swa.seq_pos_max(1) == 1


def test_graph_inputs_of_the_indexer_cache():
    mem = create_memory(mla("glm-dsa", indexer_full_layers=True), 256)
    [(ub, slot)] = mem.decode(tokens(4))
    mask = mem.graph_input("kq_mask_lid", ub, slot, swa=False, f16=True, causal=None)
    assert mask.dtype.name == "float16" and mask.shape == (1, 4, 256)
    assert mem.graph_input("k_idxs_lid", ub, slot, swa=False, f16=False, causal=None).tolist() == [0, 1, 2, 3]
    assert mem.graph_input("kq_mask", ub, slot, swa=False, f16=False, causal=None) is None


# ------------------------------------------------------------------ jobs on the goldens

GOLDEN = __import__("pathlib").Path(__file__).resolve().parent.parent / "conformance" / "golden"


def test_inspect_labels_the_dsa_sections(capsys: pytest.CaptureFixture[str]) -> None:
    from kvref.jobs.cli import main

    # a session file names its arch: glm-dsa's two KV sections are the MLA and the indexer cache, not an iSWA pair
    assert main(["inspect", str(GOLDEN / "glm-dsa-single-seq" / "01-session.ggsn")]) == 0
    out = capsys.readouterr().out
    assert "memory layout: dsa" in out
    assert "section 0: MLA KV (latent K)" in out and "section 1: lightning-indexer KV" in out
    assert main(["inspect", str(GOLDEN / "dots3note-dsa-iswa-overflow" / "01-session.ggsn")]) == 0
    out = capsys.readouterr().out
    assert "memory layout: dsa_iswa" in out and "section 2: SWA attention KV" in out
    # a sequence file names no arch: read as the same bytes of an iSWA pair unless told
    seq = GOLDEN / "glm-dsa-single-seq" / "03-seq-seq0.ggsq"
    assert kvref.state.load(seq).memory.layout == "iswa"
    assert kvref.state.load(seq, layout="dsa").memory.layout == "dsa"


def test_a_dsa_state_has_only_the_current_layout() -> None:
    from kvref.errors import ConversionError

    src = GOLDEN / "glm-dsa-single-seq" / "01-session.ggsn"
    assert kvref.state.load(src).to_bytes() == src.read_bytes()
    with pytest.raises(ConversionError, match="dsa memory exists only"):
        kvref.convert(src, era="2025-07")


def test_restore_a_dsa_session_into_the_memory_of_its_model() -> None:
    model = GOLDEN.parent / "models" / "glm-dsa-tiny.gguf"
    f = GOLDEN / "glm-dsa-single-seq" / "01-session.ggsn"
    mem, obj = kvref.restore(f, model=model)
    assert isinstance(mem, KVCacheDSA) and mem.seq_pos_max(0) == len(obj.tokens) - 1
    assert mem.state_write() == kvref.state.section_bytes(*obj.memory.sections)


def test_glm_5_2_default_indexer_types():
    # src/models/glm-dsa.cpp: {1, 1, then 1, 0, 0, 0 nineteen times}
    from kvref.hparams import _GLM_5_2_INDEXER_TYPES as T

    assert len(T) == 78 and T[:10] == (True, True, True, False, False, False, True, False, False, False)
    assert sum(T) == 2 + 19


@pytest.mark.parametrize(
    ("case_id", "model"),
    [("glm-dsa-multi-seq", "glm-dsa-tiny"), ("dots3note-dsa-iswa-overflow", "dots3note-tiny"),
     ("deepseek32-dsa-seq-div", "deepseek32-tiny"), ("hy_v4-dsa-single-seq", "hy_v4-tiny")],
)  # fmt: skip
def test_every_dsa_artefact_restores_with_its_model(case_id: str, model: str) -> None:
    """Sequence files carry no arch: the model says their two (three) KV sections are a DSA memory's."""
    import json
    import warnings

    case = json.loads((GOLDEN / case_id / "case.json").read_text())
    saves = [op for op in case["trace"] if op["op"] == "save" and op.get("ret") not in (0, False)]
    assert saves
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for op in saves:
            seq = op.get("seq_id") if op["kind"] in ("seq", "seq_data") else None
            flags = op.get("flags", 0) or 0
            r = kvref.restore(
                GOLDEN / case_id / op["file"], model=GOLDEN.parent / "models" / f"{model}.gguf", seq_id=seq
            )
            want = r.state.memory.layout
            assert want == ("kv" if flags else "dsa_iswa" if model.startswith("dots3note") else "dsa"), op["file"]
            got = r.memory.state_write(-1 if seq is None else seq, flags)
            assert got == kvref.state.section_bytes(*r.state.memory.sections), op["file"]


def test_an_indexer_head_smaller_than_n_rot_is_refused():
    # glm-dsa / deepseek32 / dots3note graphs GGML_ASSERT(n_rot <= indexer_head_size): no context is made
    with pytest.raises(KVRefError, match="indexer_head_size"):
        create_memory(mla("glm-dsa", indexer_head_size=8, indexer_full_layers=True), 256)
    # the MTP graph has no indexer: its context is made
    assert create_memory(mla("glm-dsa", indexer_head_size=8, indexer_full_layers=True), 256, ctx_type="mtp")


@pytest.mark.parametrize(
    "case_id", ["glm-dsa-context-shift", "hy_v4-dsa-context-shift", "dots3note-dsa-iswa-shift-swa-full"]
)
def test_k_shift_of_every_cache_matches_llama_cpp(case_id: str) -> None:
    """The goldens' context shift (seq_rm(0, 4, 12), seq_add(0, 12, -1, -8)): the state saved with the shift pending
    (02-state.bin), restored and given the pending shift of the moved cells, then update(): every cache's K rows equal
    those llama.cpp wrote after its K-shift (06-state.bin) -- the MLA cache, the indexer cache (NEOX over the last
    n_rot of its dims) and dots3note's SWA cache; the rows did change."""
    import json

    import numpy as np

    from kvref.jobs.conformance import create_memory_for, hparams_from_case

    case = json.loads((GOLDEN / case_id / "case.json").read_text())
    mem = create_memory_for(case, hparams_from_case(case))
    before = kvref.state.load(GOLDEN / case_id / "02-state.bin")
    mem.state_read(kvref.state.section_bytes(*before.memory.sections))
    caches = [mem.dsa.mla, mem.dsa.lid, mem.swa] if isinstance(mem, KVCacheDSAISWA) else [mem.mla, mem.lid]
    for cache in caches:
        cells = cache.cells(0)
        pos = np.asarray(cells.pos)
        for i in np.flatnonzero(pos >= 4).tolist():  # the cells seq_add moved: shift -8 pending
            p = int(pos[i])
            cells.rm(i)
            cells.pos_set_shifted(i, p, -8)
            cells.seq_add(i, 0)
    assert mem.update()
    after = kvref.state.load(GOLDEN / case_id / "06-state.bin")  # after the decode that applied the shift
    for mine, theirs, old in zip(mem.state_sections(), after.memory.sections, before.memory.sections, strict=True):
        pa, pb = list(mine.streams[0].cells.pos), list(theirs.streams[0].cells.pos)
        ia = [i for i, p in enumerate(pa) if p in pb]
        ib = [pb.index(pa[i]) for i in ia]
        for ka, kb, ko in zip(mine.streams[0].data.k, theirs.streams[0].data.k, old.streams[0].data.k, strict=True):
            assert np.array_equal(ka.data[ia], kb.data[ib])
            assert not np.array_equal(ko.data[ia], kb.data[ib])


def test_an_mla_model_refuses_different_k_and_v_types():
    # llama_init_from_model: "model does not support different K and V cache types" (is_mla, or deepseek4); the
    # glm-dsa-mixed-kv-types-refused golden records it
    with pytest.raises(KVRefError, match="different K"):
        create_memory(mla("glm-dsa", indexer_full_layers=True), 256, type_k="q8_0", type_v="f16")
    assert create_memory(mla("glm-dsa", indexer_full_layers=True), 256, type_k="bf16", type_v="bf16")


def test_export_undoes_the_forced_rotation_of_f16_indexer_keys():
    # llama.cpp rotates a DeepSeek lightning indexer's K whatever its type (f16 here): with the model, tensors /
    # export give the keys as computed; the MLA section's f16 latent K is never rotated
    import numpy as np

    from kvref import state
    from kvref.ggml import rotation
    from kvref.jobs.tensors import state_tensors

    path = GOLDEN / "glm-dsa-single-seq" / "01-session.ggsn"
    obj = state.load(path)
    got = state_tensors(obj, model=GOLDEN.parent / "models" / "glm-dsa-tiny.gguf")
    lid = [e for e in got.kv if e.section == 1]
    mla = [e for e in got.kv if e.section == 0]
    assert lid and all(e.unrotated_k for e in lid) and not any(e.unrotated_k for e in mla)
    for j, e in enumerate(lid):  # the section's layers, in order
        stored = obj.memory.sections[1].streams[0].data.k[j]
        rows = np.frombuffer(bytes(stored.data), np.float16).astype(np.float32).reshape(e.k.shape[0], -1)
        n = rows.shape[1]  # one indexer head: the rotation block is the head
        np.testing.assert_allclose(rotation.rotate(e.k.reshape(len(rows), n), n), rows, rtol=0, atol=2e-3)
    plain = state_tensors(obj, model=GOLDEN.parent / "models" / "glm-dsa-tiny.gguf", unrotate=False)
    assert not any(e.unrotated_k for e in plain.kv)
