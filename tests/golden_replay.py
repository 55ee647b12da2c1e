"""Replay a conformance case's trace on a kvref memory and compare with what llama.cpp recorded.

Compared after every operation: the return values (decode 0/1, seq_rm true/false) and the observed
``seq_pos_min`` / ``seq_pos_max`` of every sequence. At every save: the memory section kvref writes has the
same length, the same sections and the same cell tables (positions and sequence ids, cell by cell) as the
golden file; when every state row came from a restore (no decode since), the bytes are identical.
Restores feed the golden files' memory sections to ``state_read``.

kvref does not run the model, so state rows written by a decode differ from llama.cpp's: those are the only
bytes not compared.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kvref.state as kst
from kvref.batch import Batch
from kvref.errors import NoSlotError

GOLDEN = Path(__file__).resolve().parent.parent / "conformance" / "golden"

LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY = 1


def load_case(case_id: str) -> dict:
    return json.loads((GOLDEN / case_id / "case.json").read_text())


def golden_sections(case_id: str, op: dict) -> list[Any]:
    layout = op["layout"]
    if op.get("flags", 0) & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
        layout = {"hybrid": "recurrent", "iswa": "kv"}.get(layout, layout)
    obj = kst.load(GOLDEN / case_id / op["file"], layout=layout)
    return obj.memory.sections


def cell_table(sec: Any) -> list[list[tuple[int, tuple[int, ...]]]]:
    """Per stream (one for recurrent sections): [(pos, seq ids)] of every cell written."""
    streams = [st.cells for st in sec.streams] if isinstance(sec, kst.KVSection) else [sec.cells]
    out = []
    for c in streams:
        if c is None:
            out.append([])
            continue
        out.append([(int(c.pos[i]), c.seq_ids(i)) for i in range(c.n)])
    return out


def observe(mem: Any, n_seq: int) -> dict:
    return {
        "seq_pos_min": [mem.seq_pos_min(s) for s in range(n_seq)],
        "seq_pos_max": [mem.seq_pos_max(s) for s in range(n_seq)],
    }


def has_state_api(mem: Any) -> bool:
    """Can the memory (all its parts) write and restore sections? (KVCache may not offer it yet.)"""
    from kvref.hybrid import HybridMemory
    from kvref.kv_cache_iswa import KVCacheISWA

    if isinstance(mem, HybridMemory):
        return has_state_api(mem.attn) and has_state_api(mem.recr)
    if isinstance(mem, KVCacheISWA):
        return has_state_api(mem.base) and has_state_api(mem.swa)
    return hasattr(mem, "state_sections") and hasattr(mem, "stage_state")


def replay(case_id: str, mem: Any) -> dict:
    """Run the trace; returns a report ``{"ops": n, "saves": n, "exact_saves": n, "stopped_at": k | None}``.

    Asserts on any mismatch. A memory without the state API is replayed up to its first save or restore.
    """
    case = load_case(case_id)
    n_seq = case["observed_context"]["n_seq_max"]
    n_ubatch = case["observed_context"]["n_ubatch"]
    exact = False  # every state row came from a restore
    exact_seqs: set[int] = set()  # sequences whose rows came from a restore
    report: dict[str, Any] = {"ops": 0, "saves": 0, "exact_saves": 0, "skipped_saves": 0, "stopped_at": None}
    states = has_state_api(mem)
    for k, op in enumerate(case["trace"]):
        where = f"{case_id} op {k} ({op['op']})"
        kind = op["op"]
        if not states and kind in ("seq_restore", "state_load"):
            report["stopped_at"] = k
            break
        if not states and kind == "save" and not _recurrent_only(mem, op):
            report["skipped_saves"] += 1
            continue
        if kind == "decode":
            batch = Batch(tokens=op["tokens"], pos=op.get("pos"), seq_ids=op["seq_ids"], logits=op.get("logits"))
            try:
                mem.decode(batch, n_ubatch)
                ret = 0
            except NoSlotError:
                ret = 1
            assert ret == op["ret"], f"{where}: decode returned {ret}, llama.cpp {op['ret']}"
            exact = False
            exact_seqs.clear()
        elif kind == "seq_rm":
            ret = mem.seq_rm(op["seq_id"], op["p0"], op["p1"])
            assert ret == op["ret"], f"{where}: seq_rm returned {ret}, llama.cpp {op['ret']}"
        elif kind == "seq_cp":
            mem.seq_cp(op["seq_id_src"], op["seq_id_dst"], op["p0"], op["p1"])
        elif kind == "seq_keep":
            mem.seq_keep(op["seq_id"])
        elif kind == "seq_add":
            mem.seq_add(op["seq_id"], op["p0"], op["p1"], op["delta"])
        elif kind == "seq_div":
            mem.seq_div(op["seq_id"], op["p0"], op["p1"], op["d"])
        elif kind == "clear":
            mem.clear(op.get("data", True))
            exact = False
            exact_seqs.clear()
        elif kind == "save":
            flags = op.get("flags", 0)
            seq_id = op.get("seq_id", -1)
            want = golden_sections(case_id, op)
            got = mem.state_sections(seq_id, flags)
            assert [type(s).__name__ for s in got] == [type(s).__name__ for s in want], f"{where}: sections"
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert cell_table(g) == cell_table(w), f"{where}: section {i} cells {cell_table(g)} != {cell_table(w)}"
            mine, theirs = kst.section_bytes(*got), kst.section_bytes(*want)
            assert len(mine) == len(theirs), f"{where}: {len(mine)} bytes, llama.cpp {len(theirs)}"
            report["saves"] += 1
            if exact or (seq_id >= 0 and seq_id in exact_seqs):
                assert mine == theirs, f"{where}: bytes differ after a restore"
                report["exact_saves"] += 1
        elif kind in ("seq_restore", "state_load"):
            if op["ret"] in (0, False):
                continue  # refused by the file layer (token capacity): the memory is not touched
            sections = golden_sections(case_id, {**op, "layout": _layout_of(case, op["file"])})
            seq_id = op.get("dest_seq_id", -1) if kind == "seq_restore" else -1
            mem.state_read(kst.section_bytes(*sections), seq_id, op.get("flags", 0))
            exact = kind == "state_load"
            if kind == "seq_restore":
                exact_seqs.add(seq_id)
        elif kind == "init":
            pass
        else:
            raise AssertionError(f"{where}: unknown op")
        if "observed" in op:
            assert observe(mem, n_seq) == op["observed"], f"{where}: {observe(mem, n_seq)} != {op['observed']}"
        report["ops"] += 1
    return report


def _recurrent_only(mem: Any, op: dict) -> bool:
    """A hybrid PARTIAL_ONLY save: only the recurrent section, comparable without the KV state API."""
    from kvref.hybrid import HybridMemory

    return isinstance(mem, HybridMemory) and mem.kind == "hybrid" and bool(op.get("flags", 0) & 1)


def _layout_of(case: dict, file: str) -> str:
    for op in case["trace"]:
        if op["op"] == "save" and op.get("file") == file:
            if op.get("flags", 0) & LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY:
                return {"hybrid": "recurrent", "iswa": "kv"}.get(op["layout"], op["layout"])
            return op["layout"]
    raise KeyError(file)


def hparams_from_case(case: dict) -> Any:
    """kvref.HParams from a case's recorded model hyper-parameters."""
    import kvref

    h = case["model"]["hparams"]
    ssm = h.get("ssm") or {}
    kw: dict[str, Any] = dict(
        arch=h["arch"],
        n_layer=h["n_layer"],
        n_embd=h["n_embd"],
        n_head=h["n_head"],
        n_head_kv=h["n_head_kv"],
        n_embd_head_k=h["n_embd_head_k"],
        n_embd_head_v=h["n_embd_head_v"],
        swa_layers=h["swa_layers"],
        recurrent_layers=h["recurrent_layers"],
        n_swa=h["n_swa"],
        swa_type=kvref.SWAType[h["swa_type"].upper()],
        rope_type=kvref.RopeType[h["rope_type"].upper()],
        n_ctx_train=h["n_ctx_train"],
        n_ff=h.get("n_ff", 0),
        ssm_d_conv=ssm.get("d_conv", 0),
        ssm_d_inner=ssm.get("d_inner", 0),
        ssm_d_state=ssm.get("d_state", 0),
        ssm_n_group=ssm.get("n_group", 0),
        ssm_dt_rank=ssm.get("dt_rank", 0),
    )
    if h.get("n_rot"):
        kw["n_rot"] = h["n_rot"]
    if h.get("rope_sections"):
        kw["rope_sections"] = tuple(h["rope_sections"])
    return kvref.HParams(**kw)


ALL_CASES = sorted(p.parent.name for p in GOLDEN.glob("*/case.json"))
