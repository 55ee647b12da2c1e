"""``kvref store put|get|lookup|stats|gc``: the prefix store (`kvref.store`) from the command line.

A llama-server with ``--slot-save-path DIR`` writes slot files (``/slots/N?action=save``) and reads them back
(``action=restore``): ``put`` keeps a slot file's prefix chunks once, ``get`` writes the longest prefix of a
prompt that the store can serve as a slot file for ``action=restore``. ``get`` exits 0 when it wrote a file, 1
when nothing is servable (and writes nothing), 2 on an error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ..errors import ArgumentError

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def byte_size(text: str) -> int:
    """``8G``, ``512MiB``, ``1000000`` -> bytes (K, M, G, T are powers of 1024)."""
    m = _SIZE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use bytes or a K/M/G/T suffix (8G, 512MiB)")
    return int(m.group(1)) << (10 * " kmgt".index((m.group(2) or " ").lower()))


def read_tokens(name: str) -> list[int]:
    """Token ids from a state file with tokens (session or slot file), a JSON list (or llama-server's /tokenize
    answer, ``{"tokens": [...]}``), or ids separated by spaces or commas; ``-`` reads standard input."""
    from .. import state
    from ..errors import FormatError

    data = sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()
    if data[:4] in (b"nsgg", b"qsgg"):  # 'ggsn' / 'ggsq' little-endian: a state file
        try:
            obj = state.load(data)
        except FormatError as e:
            raise ArgumentError(f"--tokens-from {name}: {e}") from e
        tokens = getattr(obj, "tokens", None)
        if tokens is None:
            raise ArgumentError(f"--tokens-from {name}: a {obj.kind} holds no tokens")
        from ..state.server_tokens import read_prompt

        return [int(t) for t in read_prompt(tokens).tokens]  # a llama-server slot file may pack its prompt
    text = data.decode("utf-8", "replace").strip()
    try:
        ids = json.loads(text) if text[:1] in "[{" else [int(x) for x in re.split(r"[\s,]+", text) if x]
    except ValueError as e:
        raise ArgumentError(f"--tokens-from {name}: not a JSON list or whitespace-separated token ids ({e})") from e
    if isinstance(ids, dict) and isinstance(ids.get("tokens"), list):  # llama-server's /tokenize answer
        ids = ids["tokens"]
    if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
        raise ArgumentError(f"--tokens-from {name}: the JSON is not a list of token ids (or /tokenize's answer)")
    return ids


def store_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="store_command", metavar="ACTION", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "url", help="the store: a directory (embedded, no server), sqlite:///PATH or redis://HOST:PORT/DB"
        )
        sp.add_argument(
            "--capacity-bytes",
            type=byte_size,
            default=None,
            metavar="N",
            help="bound the store to N bytes, evicting least recently used chunks (8G, 512MiB)",
        )
        sp.add_argument(
            "--chunk-tokens",
            type=int,
            default=None,
            metavar="T",
            help="tokens per chunk when the store is made (default 256, then fixed)",
        )

    def context(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--model", required=True, help="the GGUF model the states come from (its weights are hashed once)"
        )
        sp.add_argument(
            "--tokens-from",
            required=True,
            metavar="F",
            help="the prompt's tokens: a session/slot file, a JSON list or whitespace-separated ids; - for stdin",
        )
        sp.add_argument("--type-k", default="f16", help="the context's K type (default f16)")
        sp.add_argument("--type-v", default="f16", help="the context's V type (default f16)")
        sp.add_argument(
            "--flash-attn", choices=["on", "off"], default=None, help="the context's flash attention (default: either)"
        )
        sp.add_argument(
            "--era", default=None, help="the writer's layout era or llama-cpp-python release (default: any)"
        )

    sp = sub.add_parser("put", help="store state files' prefixes (chunks already kept are not stored again)")
    common(sp)
    sp.add_argument("files", nargs="+", metavar="FILE", help="slot/sequence files, session files or state blobs")
    sp.add_argument("--model", required=True, help="the GGUF model that wrote them")
    sp.add_argument("--tokens-from", default=None, metavar="F", help="the tokens of a blob that holds none")
    sp.add_argument(
        "--seq-id", type=int, default=None, help="which sequence of a whole-context state (default: its only one)"
    )

    sp = sub.add_parser("get", help="write the longest servable prefix of a prompt as a state file")
    common(sp)
    context(sp)
    sp.add_argument("-o", "--output", required=True, help="the file to write (for llama-server: SLOT_DIR/NAME)")
    sp.add_argument(
        "--kind",
        choices=["seq", "seq_state", "state", "session"],
        default="seq",
        help="seq: a slot/sequence file (default); seq_state / state: raw blobs; session: a session file",
    )
    sp.add_argument("--seq-id", type=int, default=0, help="the sequence the prefix is for (default 0)")
    sp.add_argument("--n-stream", type=int, default=1, help="streams of the context (n_seq_max without kv_unified)")
    sp.add_argument("--json", action="store_true", help="print the result as JSON")

    sp = sub.add_parser("lookup", help="how many tokens of a prompt the store can serve, and why not more")
    common(sp)
    context(sp)
    sp.add_argument("--json", action="store_true", help="print the result as JSON")

    sp = sub.add_parser("stats", help="bytes, chunks, entries, hits and misses")
    common(sp)
    sp.add_argument("--json", action="store_true", help="print the counters as JSON")

    sp = sub.add_parser("gc", help="evict down to a size and drop chunks no prefix reaches")
    common(sp)
    sp.add_argument("--max-bytes", type=byte_size, default=None, metavar="N", help="evict down to N bytes (8G, ...)")


def _open(args: argparse.Namespace) -> object:
    from .. import store

    return store.open(args.url, capacity_bytes=args.capacity_bytes, chunk_tokens=args.chunk_tokens)


def _context(args: argparse.Namespace) -> dict[str, str | bool | None]:
    fa = None if args.flash_attn is None else args.flash_attn == "on"
    return {"type_k": args.type_k, "type_v": args.type_v, "flash_attn": fa, "era": args.era}


def cmd_store(args: argparse.Namespace) -> int:
    from ..store import Store

    st = _open(args)
    assert isinstance(st, Store)
    with st:
        action = args.store_command
        if action == "put":
            tokens = read_tokens(args.tokens_from) if args.tokens_from else None
            for f in args.files:
                r = st.put(f, model=args.model, tokens=tokens, seq_id=args.seq_id)
                print(
                    f"{f}: {r.n_tokens} tokens, {r.new_chunks} new chunks, {r.new_bytes} new bytes"
                    + (", a recurrent checkpoint" if r.checkpoint else "")
                )
            return 0
        if action in ("get", "lookup"):
            tokens = read_tokens(args.tokens_from)
            if action == "lookup":
                look = st.lookup(tokens, model=args.model, **_context(args))
                doc = {
                    "n_tokens": look.n_tokens,
                    "matched": look.matched,
                    "prompt_tokens": len(tokens),
                    "why": look.why,
                }
                print(json.dumps(doc, indent=2) if args.json else _lookup_text(doc))
                return 0 if look.n_tokens else 1
            fa = None if args.flash_attn is None else args.flash_attn == "on"
            hit = st.get(tokens, args.model, args.kind, args.seq_id, n_stream=args.n_stream, type_k=args.type_k,
                         type_v=args.type_v, flash_attn=fa, era=args.era)  # fmt: skip
            if hit is None:
                look = st.lookup(tokens, model=args.model, **_context(args))
                doc = {"n_tokens": 0, "matched": look.matched, "prompt_tokens": len(tokens), "why": look.why}
                print(json.dumps(doc, indent=2) if args.json else _lookup_text(doc))
                return 1
            n = hit.save(args.output)
            doc = {
                "n_tokens": hit.n_tokens,
                "matched": hit.matched,
                "prompt_tokens": len(tokens),
                "why": hit.why,
                "output": args.output,
                "bytes": n,
                "kind": hit.kind,
            }
            print(json.dumps(doc, indent=2) if args.json else _lookup_text(doc) + f"; wrote {args.output} ({n} bytes)")
            return 0
        if action == "stats":
            stats = st.stats()
            if args.json:
                print(json.dumps(stats, indent=2))
            else:
                for k, v in stats.items():
                    print(f"{k:>14}: {v}")
            return 0
        res = st.gc(args.max_bytes)
        print(
            f"evicted {res['evicted_bytes']} bytes, dropped {res['dropped']} unreachable values; "
            f"{st.stats()['bytes']} bytes held"
        )
        return 0


def _lookup_text(doc: dict[str, object]) -> str:
    why = doc["why"]
    text = f"servable: {doc['n_tokens']} of {doc['prompt_tokens']} tokens"
    if isinstance(why, list) and why:
        text += " (" + "; ".join(str(w) for w in why) + ")"
    return text


__all__ = ["byte_size", "cmd_store", "read_tokens", "store_args"]
