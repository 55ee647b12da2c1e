"""The ``kvref`` command line: one function per subcommand, registered on argparse subparsers.

Each subcommand is a ``(name, help, add_arguments, run)`` entry of `SUBCOMMANDS`; the work itself lives in the
library (``kvref.state``, ``kvref.jobs.conformance``), so every command is also one call.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from ..errors import KVRefError
from . import cli_jobs, cli_store

if TYPE_CHECKING:
    from ..state import StateObject
    from ..state.summary_types import CellsSummary, RowsSummary, StateSummary

Subcommand = tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]


def _inspect_args(p: argparse.ArgumentParser) -> None:
    from ..state.constants import LAYOUTS

    p.add_argument("file", help="session (.ggsn), sequence (.ggsq) file, or raw state / sequence blob; - for stdin")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--all", action="store_true",
                   help="every token in --json (by default up to 65536; a longer list is 'tokens_omitted') and "
                   "every token as --model text (by default the first 1024)")  # fmt: skip
    p.add_argument(
        "--kind",
        default="auto",
        choices=["auto", "session", "seq", "state", "seq_state"],
        help="what the file is: session file, sequence file, llama_state_get_data blob, "
        "llama_state_seq_get_data blob (default: detect)",
    )
    p.add_argument(
        "--layout",
        default="auto",
        choices=["auto", *LAYOUTS],
        help="the memory layout of the state (default: detect)",
    )
    p.add_argument("--ext-size", type=int, choices=[0, 8, 12], default=None, help="cell ext bytes (default: infer)")
    p.add_argument(
        "--verbose", action="store_true", help="when no reading parses, list why each one kvref tried failed"
    )
    p.add_argument("--model", default=None,
                   help="a GGUF model: its vocabulary turns the tokens back into text; a session of version 5 .. 7 "
                   "needs it to be read")  # fmt: skip


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _rows_line(name: str, d: RowsSummary) -> str:
    extra = f" (transposed, el {d['el_size']} x {d['n_embd']})" if d.get("transposed") else ""
    return f"{name} {d['type']:>6} row {d['row_size']:>6} B  {_fmt_bytes(d['bytes']):>10}{extra}"


def _print_cells(d: CellsSummary, indent: str) -> None:
    from .cli_jobs import plural

    print(f"{indent}cells: {d['cell_count']}" + (f", ext {d['ext_size']} B" if d.get("ext_size") else ""))
    for s, r in sorted(d["sequences"].items(), key=lambda kv: int(kv[0])):
        print(f"{indent}  seq {s:>3}: pos {r['pos_min']}..{r['pos_max']}  ({plural(r['n_cells'], 'cell')})")


def _print_summary(s: StateSummary) -> None:
    head = f"{s['format']}"
    if "version" in s:
        head += f" '{s['magic']}' version {s['version']}"
    if s.get("file_size") is not None:
        head += f", {_fmt_bytes(s['file_size'])}" + (f" ({s['file_size']} bytes)" if s["file_size"] >= 1024 else "")
    print(head)
    if "eras" in s:
        eras = ", ".join(f"{e['era']} (llama-cpp-python {e['llama_cpp_python']})" for e in s["eras"]) or "none"
        print(f"layout of era: {eras}")
    if "n_tokens" in s:
        more = " ..." if s["n_tokens"] > len(s["first_tokens"]) else ""
        print(f"tokens: {s['n_tokens']}  [{', '.join(map(str, s['first_tokens']))}{more}]")
        tf = s.get("token_field")
        if tf is not None and tf.get("form", "plain") != "plain":
            media = tf.get("media", [])
            print(
                f"token field: {tf['form']}"
                + (f": {tf['n_prompt_tokens']} prompt tokens, {len(media)} media chunk(s)" if "media" in tf else "")
                + (f" ({tf['error']})" if "error" in tf else "")
            )
    if "text" in s:
        print(f"text: {s['text'][:500]!r}" + (" ..." if len(s["text"]) > 500 else ""))
    if "arch" in s:
        print(f"arch: {s['arch']}")
    if s.get("note"):
        print(f"note: {s['note']}")
    if s.get("seq_id") is not None:
        print(f"saved from seq_id: {s['seq_id']}")
    if "outputs" in s:
        o = s["outputs"]
        print(f"outputs (v7 .. v9): {o['n_outputs']} ids, {o['logits']} logits, {o['embeddings']} embeddings")
    if "rng" in s:
        print(f"rng: the sampler's std::mt19937 state, {s['rng']['bytes']} bytes of text (session v7, v8)")
    print(f"memory layout: {s['layout']}")
    for i, sec in enumerate(s["sections"]):
        if sec["kind"] == "kv":
            n = "no n_stream field" if sec["n_stream"] is None else cli_jobs.plural(sec["n_stream"], "stream")
            print(f"section {i}: {sec.get('label', 'attention KV')}, {n}")
            if sec.get("rotation"):
                print(f"  note: {sec['rotation']}")
            for st in sec["streams"]:
                print(f"  stream {st['stream']}:")
                _print_cells(st, "    ")
                for layer in st.get("layers", []):
                    line = _rows_line("K", layer["k"]) + ("   " + _rows_line("V", layer["v"]) if "v" in layer else "")
                    model = f" (model layer {layer['il']})" if "il" in layer else ""
                    print(f"    layer {layer['layer']:>3}{model}: {line}")
        elif sec["kind"] == "dsv4_k":
            n = cli_jobs.plural(sec["n_stream"], "stream")
            print(f"section {i}: {sec['label']}, {sec['n_rows']} rows per stream, {n}")
            for layer in sec["layers"]:
                print(f"  model layer {layer['il']:>3}: K {layer['type']:>6} row {layer['row_size']:>6} B")
        elif sec["kind"] == "dsv4_state":
            n = cli_jobs.plural(sec["n_stream"], "stream")
            print(f"section {i}: {sec['label']}, {sec['state_size']} x {sec['n_embd_state']} f32 kv + score, {n}, "
                  f"model layers {sec['layers']}")  # fmt: skip
        else:
            print(
                f"section {i}: {sec.get('label', 'recurrent')}, s_trans {sec['s_trans']}, "
                f"{sec['n_state_layers']} of {sec['n_layer']} layers with state"
            )
            _print_cells(sec, "  ")
            for rl in sec["layers"]:
                r = rl["r"]
                line = f"R {r['type']:>6} row {r['row_size']:>6} B  {_fmt_bytes(r['bytes']):>10}   " + _rows_line(
                    "S", rl["s"]
                )
                model = f" (model layer {rl['il']})" if "il" in rl else ""
                print(f"  state layer {rl['index']:>3}{model}: {line}")


def _label_model_layers(summary: StateSummary, obj: StateObject, model: str) -> None:
    """Each layer's model layer (``il``) from the memory the model builds, or a note when the model does not fit."""
    from ..hparams import HParams
    from .tensors import section_layer_ids

    try:
        ids = section_layer_ids(obj, HParams.from_gguf(model))
    except KVRefError as e:
        summary["note"] = str(e)
        return
    for sec, il in zip(summary["sections"], ids, strict=True):
        if sec["kind"] == "kv":
            for st in sec["streams"]:
                for layer in st.get("layers", []):
                    layer["il"] = il[layer["layer"]]
        elif sec["kind"] == "recurrent":  # a DSV4 section's compressed parts record their layers themselves
            for rl in sec["layers"]:
                rl["il"] = il[rl["index"]]


def cmd_inspect(args: argparse.Namespace) -> int:
    from .. import state

    source = sys.stdin.buffer.read() if args.file == "-" else args.file
    from .cli_jobs import TOKENS_AS_TEXT, dump_json, enrich_summary

    obj = state.load(source, kind=args.kind, layout=args.layout, ext_size=args.ext_size, model=args.model)
    size = len(source) if isinstance(source, bytes) else os.path.getsize(source)
    summary = enrich_summary(cast("StateSummary", obj.summary()), obj, size, all_tokens=args.all)
    if args.model is not None:
        _label_model_layers(summary, obj, args.model)
    if args.model is not None and getattr(obj, "tokens", None) is not None:
        from ..state.server_tokens import read_prompt
        from ..vocab import detokenize, vocabulary

        prompt = read_prompt(obj.tokens).tokens
        shown = prompt if args.all else prompt[:TOKENS_AS_TEXT]
        summary["text"] = detokenize(shown.tolist(), vocabulary(args.model))
        if len(shown) < len(prompt):
            summary["text_of_tokens"] = len(shown)
    if args.json:
        dump_json(summary, sys.stdout)
    else:
        _print_summary(summary)
    return 0


def _conformance_args(p: argparse.ArgumentParser) -> None:
    from .conformance import add_arguments

    add_arguments(p)


def cmd_conformance(args: argparse.Namespace) -> int:
    from .conformance import main as run_conformance

    return run_conformance(args)


SUBCOMMANDS: list[Subcommand] = [
    ("inspect", "summarize a llama.cpp state file or blob", _inspect_args, cmd_inspect),
    ("conformance", "check kvref against the goldens written by llama.cpp", _conformance_args, cmd_conformance),
    ("convert", "upgrade, cut, merge, remap or restream a state file", cli_jobs.convert_args, cli_jobs.cmd_convert),
    ("diff", "where two state files differ (exit 0 same, 1 different, 2 error)", cli_jobs.diff_args, cli_jobs.cmd_diff),
    ("check", "will llama.cpp with this model and context load this file?", cli_jobs.check_args, cli_jobs.cmd_check),
    ("export", "K/V/R/S tensors of a state file as .npz / .safetensors", cli_jobs.export_args, cli_jobs.cmd_export),
    ("plot", "draw which cells each sequence holds (kvref[plot])", cli_jobs.plot_args, cli_jobs.cmd_plot),
    ("store", "prompt prefixes kept once, served back (put, get, ...)", cli_store.store_args, cli_store.cmd_store),
]


def build_parser() -> argparse.ArgumentParser:
    from ..about import about_line

    p = argparse.ArgumentParser(prog="kvref", description="llama.cpp memory modules and state files, in Python")
    p.add_argument("--version", action="version", version=about_line(), help="print kvref's version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_, add_args, run in SUBCOMMANDS:
        sp = sub.add_parser(name, help=help_, description=help_)
        add_args(sp)
        sp.set_defaults(run=run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "run", None):
        parser.error("a command is required")  # usage on stderr, exit 2 (argparse's convention)
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except KVRefError as e:
        print(f"kvref {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        readings = getattr(e, "readings", [])
        if readings and getattr(args, "verbose", False):
            print(f"the {len(readings)} readings tried:", file=sys.stderr)
            for reading, why in readings:
                print(f"  {reading}: {why}", file=sys.stderr)
        elif readings:
            print(f"({len(readings)} readings tried; --verbose lists them)", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvref inspect ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as e:
        print(f"kvref {args.command}: {os_error_text(e)}", file=sys.stderr)
        return 2


def os_error_text(e: OSError) -> str:
    """``PATH: what is wrong`` for an OSError, also one raised with only a path (``FileNotFoundError(path)``)."""
    what = e.strerror or {FileNotFoundError: "No such file or directory", IsADirectoryError: "Is a directory",
                          PermissionError: "Permission denied"}.get(type(e))  # fmt: skip
    name = e.filename if e.filename is not None else (e.args[0] if len(e.args) == 1 else None)
    if what and name is not None:
        return f"{os.fsdecode(name)}: {what}"
    return str(e) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
