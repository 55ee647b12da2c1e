"""The job commands of the ``kvref`` CLI: ``convert``, ``diff``, ``check`` (argument parsers and runners), and the
extra facts ``kvref inspect`` shows (file size, matching eras, section labels, the full token list).

Each runner is a thin shell over one library call (`kvref.jobs.convert.convert`, `kvref.jobs.diff.diff`,
`kvref.jobs.check.check_file`); `kvref.jobs.cli.SUBCOMMANDS` registers them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, TextIO, cast

if TYPE_CHECKING:
    from ..state import KVSection, StateObject
    from ..state.summary_types import StateSummary

import numpy as np

from ..errors import ArgumentError

# the label of each section of a layout, in write order (kvref inspect's headings)
SECTION_LABELS: dict[str, tuple[str, ...]] = {
    "kv": ("attention KV",),
    "iswa": ("base attention KV (full attention layers)", "SWA attention KV (sliding-window layers)"),
    "recurrent": ("recurrent",),
    "hybrid": ("attention KV (attention layers)", "recurrent (recurrent layers)"),
    "hybrid_iswa": ("base attention KV", "SWA attention KV", "recurrent"),
    "hybrid_idx": ("attention KV", "recurrent", "indexer KV"),
    "dsa": ("MLA KV (latent K)", "lightning-indexer KV"),
    "dsa_iswa": ("MLA KV (latent K)", "lightning-indexer KV", "SWA attention KV"),
    "msa": ("attention KV (every layer)", "MSA indexer keys (sparse layers)"),
    "dsv4": (),  # its parts label themselves (kvref.state.summary)
    "none": (),
}


def read_source(name: str, taken: list[str] | None = None) -> str | bytes:
    """A state argument: a path, or ``-`` for the bytes of standard input (one argument may be ``-``)."""
    if name != "-":
        return name
    if taken is not None:
        if taken:
            raise ArgumentError(f"only one argument can be - (standard input), not {taken[0]} and {name}")
        taken.append(name)
    return sys.stdin.buffer.read()


def plural(n: int, word: str) -> str:
    """``1 cell``, ``2 cells``."""
    return f"{n} {word}{'' if n == 1 else 's'}"


# kvref inspect --json lists every token of a file up to this many; beyond, "tokens_omitted" (--all lists them)
TOKENS_IN_JSON = 1 << 16
# kvref inspect --model turns this many tokens into text (it prints 500 characters); --all every one
TOKENS_AS_TEXT = 1024


def enrich_summary(
    summary: StateSummary, obj: StateObject, size: int | None, *, all_tokens: bool = False
) -> StateSummary:
    """Add what ``kvref inspect`` shows beyond ``obj.summary()``: ``file_size``, ``eras`` (the eras whose layout
    the state has), every section's ``label``, and the ``tokens`` (an int32 array, as `dump_json` writes it): all
    of them when there are at most `TOKENS_IN_JSON` or ``all_tokens``, else ``tokens_omitted``, their count."""
    from ..state.eras import ERAS, matching_eras

    if size is not None:
        summary["file_size"] = size
    eras = matching_eras(obj)
    summary["eras"] = [{"era": e, "llama_cpp_python": ERAS[e].releases} for e in eras]
    labels = SECTION_LABELS.get(obj.memory.layout, ())
    for i, sec in enumerate(summary.get("sections", [])):
        if "label" in sec:  # a section that labels itself (the parts of a DSV4 section)
            continue
        sec["label"] = labels[i] if i < len(labels) else sec["kind"]
        if sec["kind"] == "kv":
            note = rotation_note(cast("KVSection", obj.memory.sections[i]), eras)  # the summary's kind
            if note:
                sec["rotation"] = note
    tokens = getattr(obj, "tokens", None)  # session and sequence files
    if tokens is not None:
        if all_tokens or len(tokens) <= TOKENS_IN_JSON:
            summary["tokens"] = tokens
        else:
            summary["tokens_omitted"] = len(tokens)
    return summary


def dump_json(doc: Mapping[str, object], out: TextIO) -> None:
    """``json.dump(doc, out, indent=2)``, with a NumPy integer array at the top level written as a JSON list a
    million values at a time (a 20M-token file's token list never becomes 20M Python objects at once)."""
    arrays = {k: v for k, v in doc.items() if isinstance(v, np.ndarray)}
    marks = {k: f"@@kvref-array-{k}@@" for k in arrays}
    text = json.dumps({k: marks.get(k, v) for k, v in doc.items()}, indent=2)
    for k, a in arrays.items():
        head, _, text = text.partition(json.dumps(marks[k]))
        out.write(head + "[")
        for i in range(0, len(a), 1 << 20):
            out.write((", " if i else "") + ", ".join(map(str, a[i : i + (1 << 20)].tolist())))
        out.write("]")
    out.write(text + "\n")


# ------------------------------------------------------------------------------------------- convert
def convert_args(p: argparse.ArgumentParser) -> None:
    """``kvref convert IN OUT [--to-era E] [--seq N | --merge B ...] [--map A:B,...] [--streams M]``."""
    from ..state.eras import ERAS

    p.add_argument("input", help="the state file to convert (with --merge: the first sequence file, sequence 0); "
                   "- for stdin")  # fmt: skip
    p.add_argument("output", help="where to write the result; - for stdout")
    p.add_argument("--to-era", default=None, metavar="ERA",
                   help=f"the layout to write: {', '.join(ERAS)}, a compat name or a llama-cpp-python release "
                   "(default: the current one)")  # fmt: skip
    p.add_argument(
        "--seq", type=int, default=None, metavar="N", help="cut sequence N out of a session into a sequence file"
    )
    p.add_argument("--merge", nargs="+", default=[], metavar="FILE",
                   help="more sequence files: INPUT is sequence 0, each FILE the next id, in one session")  # fmt: skip
    p.add_argument("--map", default=None, metavar="OLD:NEW,...", help="rename sequence ids, e.g. 0:3,1:2")
    p.add_argument("--streams", choices=["unified", "per-seq"], default=None,
                   help="one unified stream, or one stream per sequence")  # fmt: skip
    p.add_argument("--n-stream", type=int, default=None, help="streams for --streams per-seq (default: largest id + 1)")
    p.add_argument("--kind", choices=["session", "seq", "state", "seq_state"], default=None,
                   help="the container to write (default: the input's; --seq: seq; --merge: session)")  # fmt: skip
    p.add_argument("--arch", default=None, help="the arch string of a session made by --merge")
    p.add_argument("--model", default=None,
                   help="the GGUF model (its arch; its sha256 for --sidecar; the layer widths a session of "
                   "version 5 .. 7 needs)")  # fmt: skip
    p.add_argument("--type-k", default=None,
                   help="retype K (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1); --model gives the head size "
                   "llama.cpp's attention rotation depends on")  # fmt: skip
    p.add_argument("--type-v", default=None, help="retype V (the same types; quantized V needs flash attention)")
    p.add_argument("--sidecar", action="store_true", help="also write OUTPUT.kvref.json (see docs/recipes.md)")


def cmd_convert(args: argparse.Namespace) -> int:
    """Run ``kvref convert``; prints what was written."""
    from ..state.eras import describe_eras, matching_eras
    from .convert import convert

    taken: list[str] = []
    to_stdout = args.output == "-"
    if to_stdout and args.sidecar:
        raise ArgumentError("--sidecar needs an OUTPUT file, not - (standard output)")
    out = convert(
        read_source(args.input, taken), None if to_stdout else args.output, era=args.to_era, seq=args.seq,
        merge=[read_source(m, taken) for m in args.merge], seq_map=args.map, streams=args.streams,
        n_stream=args.n_stream, kind=args.kind, arch=args.arch, model=args.model, type_k=args.type_k,
        type_v=args.type_v, sidecar=args.sidecar,
    )  # fmt: skip
    if to_stdout:
        out.write_to(sys.stdout.buffer)
        sys.stdout.buffer.flush()
    version = f" version {out.version}" if hasattr(out, "version") else ""
    print(
        f"wrote {'standard output' if to_stdout else args.output}: {out.kind}{version}, {out.memory.layout} "
        f"memory, layout of {describe_eras(matching_eras(out))}",
        file=sys.stderr if to_stdout else sys.stdout,
    )
    return 0


# ------------------------------------------------------------------------------------------- diff
def diff_args(p: argparse.ArgumentParser) -> None:
    """``kvref diff A B [--json] [--model M.gguf]``."""
    p.add_argument("a", help="a state file (- for stdin)")
    p.add_argument("b", help="another state file (- for stdin)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--model", default=None, help="the GGUF model, which a session of version 5 .. 7 needs to be read")


def cmd_diff(args: argparse.Namespace) -> int:
    """Run ``kvref diff``: exit 0 when equal, 1 when different (2 on error, from kvref.jobs.cli.main)."""
    from .diff import diff

    taken: list[str] = []
    res = diff(read_source(args.a, taken), read_source(args.b, taken), model=args.model)
    if args.json:
        json.dump(res.to_json(), sys.stdout, indent=2)
        print()
    else:
        for line in res.lines():
            print(line)
    return 0 if res.equal else 1


# ------------------------------------------------------------------------------------------- check
def _on_off(text: str) -> bool | str:
    if text in ("on", "true", "1", "enabled"):
        return True
    if text in ("off", "false", "0", "disabled"):
        return False
    if text == "auto":
        return "auto"
    raise argparse.ArgumentTypeError(f"expected on, off or auto, not {text!r}")


# the context defaults that differ between llama.cpp (llama_context_default_params) and llama-cpp-python's Llama()
CHECK_DEFAULTS: dict[str, dict[str, bool | str]] = {
    "llama.cpp": {"flash_attn": "auto"},
    "llama-cpp-python": {"flash_attn": False},
}


def check_args(p: argparse.ArgumentParser) -> None:
    """``kvref check FILE --model M.gguf [context options]``."""
    p.add_argument("file", help="the state file (- for stdin)")
    p.add_argument("--model", required=True, help="the GGUF model llama.cpp will load")
    p.add_argument("--n-ctx", type=int, default=512, help="context size (default 512, llama.cpp's)")
    p.add_argument("--n-seq-max", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--defaults", choices=list(CHECK_DEFAULTS), default="llama.cpp",
                   help="whose context defaults: llama.cpp's (llama_context_default_params: flash attention auto) "
                   "or llama-cpp-python's Llama() (flash attention off), the one that saved the file")  # fmt: skip
    p.add_argument("--flash-attn", type=_on_off, default=None,
                   help="on, off or auto (default: auto with --defaults llama.cpp, V not transposed; off with "
                   "--defaults llama-cpp-python)")  # fmt: skip
    p.add_argument("--kv-unified", dest="kv_unified", action="store_true", default=False,
                   help="one stream for every sequence")  # fmt: skip
    p.add_argument("--no-kv-unified", dest="kv_unified", action="store_false", help="one stream per sequence (default)")
    p.add_argument(
        "--swa-full", dest="swa_full", action="store_true", default=True, help="full-size SWA cache (default)"
    )
    p.add_argument("--no-swa-full", dest="swa_full", action="store_false", help="SWA cache of the window only")
    p.add_argument("--type-k", default="f16", help="K cache type (default f16)")
    p.add_argument("--type-v", default="f16", help="V cache type (default f16)")
    p.add_argument("--seq-id", type=int, default=None, help="the sequence a sequence file is restored into (default 0)")
    p.add_argument(
        "--compat", default=None, help="the llama.cpp: compat name or llama-cpp-python release (default: newest)"
    )
    p.add_argument("--json", action="store_true", help="print the answer as JSON")


def cmd_check(args: argparse.Namespace) -> int:
    """Run ``kvref check``: exit 0 when llama.cpp would load the file, 1 when not (2 on error)."""
    from .check import check_file

    defaults = CHECK_DEFAULTS[args.defaults]
    flash_attn = args.flash_attn if args.flash_attn is not None else defaults["flash_attn"]
    res = check_file(
        read_source(args.file), args.model, n_ctx=args.n_ctx, n_seq_max=args.n_seq_max, kv_unified=args.kv_unified,
        flash_attn=flash_attn, type_k=args.type_k, type_v=args.type_v, swa_full=args.swa_full,
        seq_id=args.seq_id, compat=args.compat,
    )  # fmt: skip
    hint = None
    if res.option == "--flash-attn" and args.flash_attn is None and args.defaults == "llama.cpp" and res.fix == "off":
        hint = (
            "a file saved by llama-cpp-python's Llama() (flash attention off by default): --defaults llama-cpp-python"
        )
    if args.json:
        json.dump({**res.to_json(), **({"hint": hint} if hint else {})}, sys.stdout, indent=2)
        print()
    else:
        print(res.line() + (f"\n     {hint}" if hint else ""))
    return 0 if res.ok else 1


__all__ = [
    "CHECK_DEFAULTS",
    "SECTION_LABELS",
    "check_args",
    "cmd_check",
    "cmd_convert",
    "cmd_diff",
    "cmd_export",
    "cmd_plot",
    "convert_args",
    "diff_args",
    "dump_json",
    "enrich_summary",
    "export_args",
    "plot_args",
    "plural",
    "rotation_note",
]


# ------------------------------------------------------------------------------------------- export, plot
def export_args(p: argparse.ArgumentParser) -> None:
    """``kvref export IN OUT [--model M.gguf | --head-dim N] [--no-unrotate]``."""
    p.add_argument("input", help="the state file (- for stdin)")
    p.add_argument("output", help="OUT.npz or OUT.safetensors (kvref[export]); - writes npz to stdout")
    p.add_argument("--model", default=None, help="the GGUF model: head sizes, layer ids, R/S shapes")
    p.add_argument("--head-dim", type=int, default=None, help="the head size, when no --model is given")
    p.add_argument("--no-unrotate", dest="unrotate", action="store_false", default=True,
                   help="keep llama.cpp's attention rotation in quantized K/V (default: undo it)")  # fmt: skip


def cmd_export(args: argparse.Namespace) -> int:
    """Run ``kvref export``; prints what was written."""
    from .export import export

    source = read_source(args.input)
    if args.output == "-":
        arrays = export(source, "standard output", fmt="npz", model=args.model, head_dim=args.head_dim,
                        unrotate=args.unrotate, stream=sys.stdout.buffer)  # fmt: skip
        sys.stdout.buffer.flush()
        print(f"wrote standard output (npz): {plural(len(arrays), 'array')}", file=sys.stderr)
        return 0
    arrays = export(source, args.output, model=args.model, head_dim=args.head_dim, unrotate=args.unrotate)
    print(f"wrote {args.output}: {plural(len(arrays), 'array')}, {os.path.getsize(args.output)} bytes")
    return 0


def plot_args(p: argparse.ArgumentParser) -> None:
    """``kvref plot IN -o OUT.png [--model M.gguf]``."""
    p.add_argument("input", help="the state file (- for stdin)")
    p.add_argument("-o", "--output", required=True, help="the picture to write (.png, .svg, .pdf)")
    p.add_argument("--model", default=None, help="the GGUF model (marks the SWA window)")


def cmd_plot(args: argparse.Namespace) -> int:
    """Run ``kvref plot``."""
    from .plot import plot

    print(f"wrote {plot(read_source(args.input), args.output, model=args.model)}")
    return 0


def rotation_note(sec: KVSection, eras: list[str]) -> str | None:
    """``kvref inspect``'s line on llama.cpp's attention rotation for a KV section (None when it cannot apply)."""
    from ..ggml.types import traits
    from .tensors import era_rotates

    data = next((st.data for st in sec.streams if st.data is not None and st.data.k), None)
    if data is None or not any(era_rotates(e) for e in eras):
        return None
    parts = []
    for name, rows in (("K", data.k[0]), ("V", data.v[0] if data.v else None)):
        if rows is None or not traits(rows.type).is_quantized:
            continue
        n = rows.row_size // traits(rows.type).type_size * traits(rows.type).block_size
        if n % 64 == 0:
            parts.append(f"{name} ({rows.type_name})")
    if not parts:
        return None
    sure = "probably" if era_rotates(eras[0]) else "possibly"
    return (
        f"{' and '.join(parts)} {sure} written with llama.cpp's attention rotation (quantized, rows a multiple of "
        "64 values, era 0.3.36+; applies when the head size is a multiple of 64): kvref export undoes it"
    )
