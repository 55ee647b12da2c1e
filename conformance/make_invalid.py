#!/usr/bin/env python3
"""Derive conformance/invalid/ from the goldens by byte surgery.

    python conformance/make_invalid.py        (after generate.py)

Each invalid file is one golden artefact with a single fault: a field overwritten, the
file cut short inside a field, or bytes appended.  The field names are the vocabulary in
conformance/README.md ("Field vocabulary"); the manifest says which field a reader must
blame and with which error class.

The offsets come from ``walk()`` below, a deliberately small walker written for this
script only (independent of kvref), driven by the artefact description in case.json.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden"
INVALID = HERE / "invalid"

# ggml type id -> (block size, bytes per block), for the types the goldens use
TYPE_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 8: (32, 34), 30: (1, 2)}


class Cursor:
    def __init__(self, data: bytes, off: int = 0):
        self.b = data
        self.off = off
        self.fields: list[dict] = []

    def take(self, name: str, fmt: str, **where):
        size = struct.calcsize("<" + fmt)
        val = struct.unpack_from("<" + fmt, self.b, self.off)
        self.fields.append({"field": name, "offset": self.off, "size": size, "value": val[0], **where})
        self.off += size
        return val[0]

    def blob(self, name: str, size: int, **where):
        self.fields.append({"field": name, "offset": self.off, "size": size, "value": None, **where})
        self.off += size


def _kv_section(c: Cursor, section: str, cell_ext: int):
    n_stream = c.take("n_stream", "I", section=section)
    for s in range(n_stream):
        cc = c.take("cell_count", "I", section=section, stream=s)
        if cc == 0:
            continue
        for i in range(cc):
            c.take("pos", "i", section=section, stream=s, cell=i)
            n = c.take("n_seq_id", "I", section=section, stream=s, cell=i)
            if cell_ext:
                c.blob("cell_ext", cell_ext, section=section, stream=s, cell=i)
            for _ in range(n):
                c.take("seq_id", "i", section=section, stream=s, cell=i)
        v_trans = c.take("v_trans", "I", section=section, stream=s)
        n_layer = c.take("n_layer", "I", section=section, stream=s)
        for il in range(n_layer):
            c.take("k_type", "i", section=section, stream=s, layer=il)
            rs = c.take("k_row_size", "Q", section=section, stream=s, layer=il)
            c.blob("k_data", rs * cc, section=section, stream=s, layer=il)
        for il in range(n_layer):
            c.take("v_type", "i", section=section, stream=s, layer=il)
            if not v_trans:
                rs = c.take("v_row_size", "Q", section=section, stream=s, layer=il)
                c.blob("v_data", rs * cc, section=section, stream=s, layer=il)
            else:
                el = c.take("v_el_size", "I", section=section, stream=s, layer=il)
                ne = c.take("n_embd_v_gqa", "I", section=section, stream=s, layer=il)
                c.blob("v_data", el * ne * cc, section=section, stream=s, layer=il)


def _recurrent_section(c: Cursor, hp: dict):
    cc = c.take("cell_count", "I", section="recurrent")
    for i in range(cc):
        c.take("pos", "i", section="recurrent", cell=i)
        n = c.take("n_seq_id", "I", section="recurrent", cell=i)
        for _ in range(n):
            c.take("seq_id", "i", section="recurrent", cell=i)
    c.take("s_trans", "I", section="recurrent")
    n_layer = c.take("n_layer", "I", section="recurrent")
    rec = [il for il in range(n_layer) if hp["recurrent_layers"][il]]
    for il in rec:
        c.take("r_type", "i", section="recurrent", layer=il)
        rs = c.take("r_row_size", "Q", section="recurrent", layer=il)
        c.blob("r_data", rs * cc, section="recurrent", layer=il)
    for il in rec:
        c.take("s_type", "i", section="recurrent", layer=il)
        rs = c.take("s_row_size", "Q", section="recurrent", layer=il)
        c.blob("s_data", rs * cc, section="recurrent", layer=il)


def walk(data: bytes, op: dict, hp: dict, producer: dict) -> list[dict]:
    c = Cursor(data)
    kind = op["kind"]
    if kind in ("session", "seq"):
        c.take("magic", "I")
        c.take("version", "I")
        n = c.take("n_token_count", "I")
        c.blob("tokens", 4 * n)
    if kind == "seq_data" and op["header"]:
        c.take("io_magic", "I")
        c.take("io_seq_id", "i")
    if kind in ("session", "state_data"):
        n = c.take("arch_length", "I")
        c.blob("arch", n)
        if op.get("output_block"):
            n = c.take("n_outputs", "I")
            c.blob("output_pos", 4 * n)
            n = c.take("logits_size", "Q")
            c.blob("logits", 4 * n)
            n = c.take("embd_size", "Q")
            c.blob("embd", 4 * n)
    for sec in op["sections"]:
        if sec == "recurrent":
            _recurrent_section(c, hp)
        else:
            _kv_section(c, sec, producer["cell_ext_size"] if op["cell_ext"] else 0)
    if c.off != len(data):
        raise AssertionError(f"{op['file']}: walked {c.off} of {len(data)} bytes")
    return c.fields


# ------------------------------------------------------------------ faults


def _find(fields, name, nth=0, **where):
    hits = [f for f in fields if f["field"] == name and all(f.get(k) == v for k, v in where.items())]
    return hits[nth]


def _put(data: bytes, f: dict, fmt: str, value) -> bytes:
    b = bytearray(data)
    struct.pack_into("<" + fmt, b, f["offset"], value)
    return bytes(b)


def _cut(data: bytes, f: dict, inside: bool = True) -> bytes:
    """Cut the file inside the field (half its bytes kept) or right before it."""
    keep = f["offset"] + (max(1, f["size"] // 2) if inside and f["size"] > 1 else 0)
    return data[:keep]


FMT = {4: "I", 8: "Q"}


def faults() -> list[dict]:
    """(name, golden case, artefact, field, mutation) for every invalid file."""
    F = []

    def add(
        name,
        case,
        file,
        field,
        how,
        *,
        nth=0,
        where=None,
        value=None,
        needs_hparams=False,
        note=None,
        fmt=None,
        blame=None,
        also=(),
    ):
        F.append(
            dict(
                name=name,
                case=case,
                file=file,
                field=field,
                how=how,
                nth=nth,
                where=where or {},
                value=value,
                needs_hparams=needs_hparams,
                note=note,
                fmt=fmt,
                blame=blame,
                also=list(also),
            )
        )

    sess = ("llama-f16-single-seq", "01-session.ggsn")
    seqf = ("llama-f16-single-seq", "03-seq-seq0.ggsq")
    blob = ("llama-f16-single-seq", "04-seqdata-seq0.bin")
    fa = ("llama-f16-fa-single-seq", "01-session.ggsn")
    multi = ("llama-f32-multi-seq", "01-session.ggsn")
    rec = ("mamba-seq-cp-rm", "01-session.ggsn")
    recq = ("mamba-seq-cp-rm", "03-seq-seq0.ggsq")
    mrope = ("qwen2vl-mrope", "01-session.ggsn")
    q8 = ("llama-q8_0-fa-multistream", "01-session.ggsn")

    # headers
    add("session-bad-magic.ggsn", *sess, "magic", "set", value=0x6767736F)
    add(
        "session-magic-is-seq.ggsn",
        *sess,
        "magic",
        "set",
        value=0x67677371,
        note="a sequence-file magic at the start of a session file",
    )
    add("session-unknown-version.ggsn", *sess, "version", "set", value=11)
    add("session-version-zero.ggsn", *sess, "version", "set", value=0)
    add("session-truncated-in-version.ggsn", *sess, "version", "cut")
    add(
        "session-token-count-lie.ggsn",
        *sess,
        "n_token_count",
        "set",
        value=0x40000000,
        note="more tokens than the file holds",
    )
    add("session-truncated-in-tokens.ggsn", *sess, "tokens", "cut", blame="n_token_count", also=["tokens"])
    add("session-arch-length-lie.ggsn", *sess, "arch_length", "set", value=0x7FFFFFF0)
    add("session-truncated-in-arch.ggsn", *sess, "arch", "cut", blame="arch_length", also=["arch"])
    add("session-trailing-bytes.ggsn", *sess, "trailing", "append", value=b"\x00\x01\x02\x03")
    add(
        "seq-bad-magic.ggsq",
        *seqf,
        "magic",
        "set",
        value=0x6767736E,
        note="a session-file magic at the start of a sequence file",
    )
    add("seq-unknown-version.ggsq", *seqf, "version", "set", value=4)
    add("seq-token-count-lie.ggsq", *seqf, "n_token_count", "set", value=0x10000000)
    add(
        "seq-trailing-bytes.ggsq",
        *seqf,
        "trailing",
        "append",
        value=b"\xff" * 7,
        note="llama.cpp's llama_state_seq_load_file reads what it needs and ignores the rest",
    )
    add("seqdata-bad-io-magic.bin", *blob, "io_magic", "set", value=0xAF143CD9)
    add("seqdata-truncated-in-io-seq-id.bin", *blob, "io_seq_id", "cut")
    # KV section
    add(
        "session-n-stream-lie.ggsn", *sess, "n_stream", "set", value=0x01000000, note="more streams than the file holds"
    )
    add("session-cell-count-lie.ggsn", *sess, "cell_count", "set", value=0x00FFFFFF)
    add(
        "session-truncated-before-cells.ggsn",
        *sess,
        "pos",
        "cut_before",
        blame="cell_count",
        also=["pos"],
        note="the file ends right after cell_count",
    )
    add("session-n-seq-id-lie.ggsn", *sess, "n_seq_id", "set", value=0x7FFFFFFF)
    add("session-seq-id-256.ggsn", *multi, "seq_id", "set", value=256, nth=3)
    add("session-seq-id-negative.ggsn", *multi, "seq_id", "set", value=-1, fmt="i", nth=1)
    add(
        "session-seq-id-beyond-n-seq-max.ggsn",
        *sess,
        "seq_id",
        "set",
        value=5,
        needs_hparams=True,
        note="5 < 256 but the context that wrote it has n_seq_max 1; llama.cpp refuses the restore",
    )
    add(
        "seq-n-seq-id-two.ggsq",
        *seqf,
        "n_seq_id",
        "set",
        value=2,
        nth=0,
        note="a sequence file cell must belong to exactly one sequence",
    )
    add("session-v-trans-2.ggsn", *sess, "v_trans", "set", value=2)
    add(
        "session-v-trans-flipped.ggsn",
        *sess,
        "v_trans",
        "set",
        value=0,
        needs_hparams=True,
        note="the context that wrote it transposes V (flash attention off)",
    )
    add("session-n-layer-lie.ggsn", *sess, "n_layer", "set", value=3, needs_hparams=True)
    add("session-n-layer-zero.ggsn", *sess, "n_layer", "set", value=0, needs_hparams=True)
    add("session-k-type-unknown.ggsn", *sess, "k_type", "set", value=99, fmt="i")
    add(
        "session-k-type-mismatch.ggsn",
        *sess,
        "k_type",
        "set",
        value=0,
        fmt="i",
        needs_hparams=True,
        note="f32 instead of f16, row size left as written",
    )
    add(
        "session-k-row-size-fraction.ggsn",
        *sess,
        "k_row_size",
        "set",
        value=129,
        note="not a whole number of f16 elements",
    )
    add("session-k-row-size-mismatch.ggsn", *sess, "k_row_size", "set", value=256, needs_hparams=True)
    add(
        "session-k-row-size-q8_0-fraction.ggsn",
        *q8,
        "k_row_size",
        "set",
        value=35,
        note="not a whole number of q8_0 blocks (34 bytes)",
    )
    add("session-truncated-in-k-data.ggsn", *sess, "k_data", "cut", nth=1, also=["k_row_size", "cell_count"])
    add("session-v-type-unknown.ggsn", *sess, "v_type", "set", value=-7, fmt="i")
    add("session-v-el-size-lie.ggsn", *sess, "v_el_size", "set", value=4, note="f16 elements are 2 bytes")
    add("session-n-embd-v-gqa-lie.ggsn", *sess, "n_embd_v_gqa", "set", value=0x00100000, also=["v_data"])
    add(
        "session-truncated-in-v-data.ggsn",
        *sess,
        "v_data",
        "cut",
        nth=1,
        also=["v_el_size", "n_embd_v_gqa", "cell_count"],
    )
    add("session-fa-v-row-size-fraction.ggsn", *fa, "v_row_size", "set", value=63)
    add("session-fa-truncated-in-v-data.ggsn", *fa, "v_data", "cut", also=["v_row_size", "cell_count"])
    add("session-mrope-truncated-in-cell-ext.ggsn", *mrope, "cell_ext", "cut", nth=4, also=["cell_count"])
    # composite memories: the second section missing
    add(
        "iswa-missing-swa-section.ggsn",
        "gemma2-swa-overflow",
        "01-session.ggsn",
        "n_stream",
        "cut_before",
        where={"section": "kv_swa"},
        note="the file ends after the base cache section",
    )
    add(
        "hybrid-missing-recurrent-section.ggsn",
        "jamba-hybrid",
        "01-session.ggsn",
        "cell_count",
        "cut_before",
        where={"section": "recurrent"},
        note="the file ends after the attention section",
    )
    add(
        "hybrid-partial-seqdata-kv-layer-count.bin",
        "jamba-hybrid",
        "05-seqdata-seq0-flags1.bin",
        "n_layer",
        "set",
        value=1,
        where={"section": "recurrent"},
        needs_hparams=True,
        note="the recurrent section counts every model layer (3), not only the recurrent ones",
    )
    # legacy session v9 output block (llama-cpp-python 0.3.16)
    leg = ("legacy-0.3.16-llama-f16-single-seq", "01-session.ggsn")
    add("legacy-v9-n-outputs-lie.ggsn", *leg, "n_outputs", "set", value=0x20000000)
    add("legacy-v9-logits-size-lie.ggsn", *leg, "logits_size", "set", value=1 << 40)
    add("legacy-v9-truncated-in-logits.ggsn", *leg, "logits", "cut", blame="logits", also=["logits_size"])
    add("legacy-v9-embd-size-lie.ggsn", *leg, "embd_size", "set", value=0x0FFFFFFF)
    # recurrent section
    add("recurrent-cell-count-lie.ggsq", *recq, "cell_count", "set", value=0x00FFFFFF, where={"section": "recurrent"})
    add("recurrent-seq-id-256.ggsn", *rec, "seq_id", "set", value=256, where={"section": "recurrent"})
    add("recurrent-s-trans-2.ggsq", *recq, "s_trans", "set", value=2)
    add(
        "recurrent-n-layer-lie.ggsq",
        *recq,
        "n_layer",
        "set",
        value=7,
        needs_hparams=True,
        where={"section": "recurrent"},
    )
    add("recurrent-r-type-unknown.ggsq", *recq, "r_type", "set", value=123, fmt="i")
    add(
        "recurrent-r-row-size-fraction.ggsq",
        *recq,
        "r_row_size",
        "set",
        value=770,
        note="not a whole number of f32 elements",
    )
    add("recurrent-s-type-unknown.ggsq", *recq, "s_type", "set", value=77, fmt="i")
    add("recurrent-truncated-in-s-data.ggsn", *rec, "s_data", "cut", nth=1, also=["s_row_size", "cell_count"])
    add("recurrent-seq-truncated-in-r-data.ggsq", *recq, "r_data", "cut", also=["r_row_size", "cell_count"])
    return F


def build() -> list[dict]:
    if INVALID.exists():
        shutil.rmtree(INVALID)
    INVALID.mkdir()
    cache: dict = {}
    entries = []
    for f in faults():
        key = (f["case"], f["file"])
        if key not in cache:
            doc = json.loads((GOLDEN / f["case"] / "case.json").read_text())
            op = next(o for o in doc["trace"] if o["op"] == "save" and o["file"] == f["file"])
            data = (GOLDEN / f["case"] / f["file"]).read_bytes()
            cache[key] = (data, walk(data, op, doc["model"]["hparams"], doc["producer"]))
        data, fields = cache[key]
        field = f["field"]
        how = f["how"]
        blame = field
        if how == "append":
            out = data + f["value"]
            offset = len(data)
        else:
            fl = _find(fields, field, f["nth"], **f["where"])
            offset = fl["offset"]
            if how == "set":
                fmt = f.get("fmt") or FMT[fl["size"]]
                out = _put(data, fl, fmt, f["value"])
            elif how == "cut":
                out = _cut(data, fl, inside=True)
            elif how == "cut_before":
                out = _cut(data, fl, inside=False)
            else:
                raise ValueError(how)
        blame = f["blame"] or blame
        (INVALID / f["name"]).write_bytes(out)
        e = {
            "file": f["name"],
            "error": "FormatError",
            "field": blame,
            "also_accept": f["also"],
            "fault": how if how != "set" else f"{field} set to {f['value']}",
            "offset": offset,
            "source": {"case": f["case"], "file": f["file"]},
            "needs_hparams": f["needs_hparams"],
            "sha256": hashlib.sha256(out).hexdigest(),
        }
        if how in ("cut", "cut_before"):
            e["fault"] = f"truncated to {len(out)} bytes ({'inside' if how == 'cut' else 'before'} {field})"
        if how == "append":
            e["fault"] = f"{len(f['value'])} bytes appended"
        if f["note"]:
            e["note"] = f["note"]
        entries.append(e)
    write_manifest(entries)
    return entries


def write_manifest(entries: list[dict]) -> None:
    manifest = {
        "description": "Corrupt state files derived from the goldens by make_invalid.py; each has one fault. "
        "A reader must raise `error` naming `field` (or one of `also_accept`, where a truncation "
        "can be noticed either at a count or at the field being read). Entries with "
        "needs_hparams=true are only "
        "detectable against the model and context of the source case (as llama.cpp checks "
        "them against its own model); a reader given no hparams may accept them or blame a "
        "later field. `llama_cpp` (present after a --llama-check run) records what the producing "
        "llama.cpp did when the file was loaded into a fresh context like the source case's: "
        "llama.cpp is lenient in places (it accepts any non-zero v_trans and trailing bytes after a "
        "sequence file) and reads past the end of a truncated session file without noticing until "
        "its final size check. Files derived from a legacy golden are checked with the llama.cpp "
        "that wrote that golden (the source case's producer).",
        "files": entries,
    }
    (INVALID / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def check_goldens() -> int:
    """Walk every golden artefact: the walker must consume each file exactly."""
    n = 0
    for cj in sorted(GOLDEN.glob("*/case.json")):
        doc = json.loads(cj.read_text())
        for op in doc["trace"]:
            if op["op"] == "save" and op["ret"]:
                walk((cj.parent / op["file"]).read_bytes(), op, doc["model"]["hparams"], doc["producer"])
                n += 1
    return n


# ------------------------------------------------------------------ what llama.cpp does with them

_PROBE = r"""
import json, sys
sys.path.insert(0, {here!r})
import driver
doc = json.load(open({case_json!r}))
r = driver.Run(__import__("pathlib").Path({inv!r}), __import__("pathlib").Path({model!r}),
               doc["model"]["hparams"], doc["context"])
kind = {kind!r}
if kind == "session":
    r.load_session({file!r})
elif kind == "seq":
    r.load_seq({file!r}, 0)
elif kind == "state_data":
    r.set_state_data({file!r})
else:
    r.set_seq_data({file!r}, 0, {flags!r})
op = r.trace[-1]
print(json.dumps({{"ret": op["ret"], "errors": op.get("errors", [])}}))
"""


def llama_check(entries: list[dict], model_dir: Path, legacy_python: str | None = None) -> None:
    """Load every invalid file into a fresh llama.cpp context like the source case's and
    record what llama.cpp returned (each in its own process: some faults abort)."""
    import subprocess

    for e in entries:
        src = e["source"]
        case_json = GOLDEN / src["case"] / "case.json"
        doc = json.loads(case_json.read_text())
        op = next(o for o in doc["trace"] if o["op"] == "save" and o["file"] == src["file"])
        model = model_dir / doc["model"]["file"]
        python = sys.executable
        if doc["producer"]["llama_cpp_python"] != "0.3.36":
            if not legacy_python:
                continue
            python = legacy_python  # the producer that wrote the source golden
        code = _PROBE.format(
            here=str(HERE),
            case_json=str(case_json),
            inv=str(INVALID),
            model=str(model),
            kind=op["kind"],
            file=e["file"],
            flags=op.get("flags", 0),
        )
        p = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        if p.returncode == 0:
            res = json.loads(p.stdout.strip().splitlines()[-1])
            ok = bool(res["ret"])
            errors = res["errors"][:3]
            if e["fault"].startswith("truncated"):
                # llama.cpp's file reader goes on past the end of the file, so the values it
                # then complains about are whatever was in memory: keep the words, not the numbers
                errors = [re.sub(r"-?\d+", "<n>", x) for x in errors]
            e["llama_cpp"] = {"accepted": ok, "ret": res["ret"], "errors": errors}
        else:
            e["llama_cpp"] = {
                "accepted": False,
                "ret": None,
                "aborted": True,
                "exit_code": p.returncode,
                "errors": p.stderr.strip().splitlines()[-2:],
            }


if __name__ == "__main__":
    import argparse
    import os

    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--llama-check", action="store_true", help="also record what llama.cpp itself does with each invalid file"
    )
    ap.add_argument(
        "--legacy-python",
        default=os.environ.get("KVREF_LEGACY_PYTHON"),
        help="python of the venv with the older llama-cpp-python, to check legacy-derived files",
    )
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvref-conformance",
    )
    a = ap.parse_args()
    print(f"walked {check_goldens()} golden artefacts")
    es = build()
    if a.llama_check:
        llama_check(es, a.model_dir, a.legacy_python)
        write_manifest(es)
    print(f"wrote {len(es)} invalid files")
    sys.exit(0)
