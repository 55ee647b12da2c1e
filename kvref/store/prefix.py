"""The prefix store: llama.cpp states cut into chunks kept once, and the longest prefix a prompt shares with them
served back token-exactly, as the state file a llama.cpp context loads.

Keys (`kvref.store.backend` holds them):

- ``c:<key>``: a chunk's meta (`ChunkMeta`); ``key = BLAKE2b(parent key, the chunk's tokens)`` where the first
  chunk's parent is the namespace's root key, so a key names a whole token prefix (LMCache's and vLLM's chained
  block hashes).
- ``x:<BLAKE2b(parent, first l tokens)>``: link sets naming the chunks after ``parent`` that start with those l
  tokens, for l = 1 .. 16 and every multiple of 16 (`levels`): the index a prompt that leaves a stored chunk
  mid-way is looked up in (SGLang's radix tree, by hash). A binary search over the levels finds the longest
  stored prefix in a few lookups, and at most the siblings sharing its last 16 tokens are read to cut it at the
  exact token, however many chunks follow the same parent.
- ``s<i>.<start>:<key>``: section ``i``'s rows of the chunk's cells from offset ``start`` on.
- ``r:<key>``: a recurrent checkpoint after the prefix that ends the chunk (full or partial) ``key``; the link
  set ``ck:<parent>`` lists the lengths past ``parent`` that have one.
- ``m:ns:<id>``: a namespace record (`kvref.store.namespace`); the link set ``m:model:<model id>`` lists a
  model's namespaces. ``m:`` keys are never evicted.

Writes go deepest chunk first and each value is written whole, so a killed ``put`` leaves only chunks that
nothing reaches yet (``gc`` drops them). Lookups only peek; a ``put`` or a served ``get`` then marks the values of
its chain used in one call, deepest chunk first, so the least recently used values are the ends of chains, which
eviction removes before the prefixes many prompts share.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from ..errors import ArgumentError, ArgumentTypeError, DamagedValue, FormatError
from .backend import META, Backend
from .chunks import (
    PART,
    RECORD,
    Checkpoint,
    ChunkMeta,
    SeqRows,
    checkpoint_of,
    concat,
    decode,
    decode_checkpoint,
    encode,
    encode_checkpoint,
    kv_rows,
    kv_section,
    part_payload,
    recurrent_section,
    sequence_of,
    split_part,
)
from .namespace import KVGeometry, Namespace, namespace_of

if TYPE_CHECKING:
    from ..hparams import HParams
    from ..state import KVSection, RecurrentSection, StateObject
    from ..state.load import Source

KINDS = ("seq_state", "seq", "state", "session")
DEFAULT_CHUNK_TOKENS = 256
DENSE = 16  # prefix index levels: every length up to DENSE, then every multiple of it
CONFIG = META + "config"
Tokens = Sequence[int] | npt.NDArray[np.int32] | npt.NDArray[np.int64]


def _h(*parts: bytes) -> str:
    return hashlib.blake2b(b"".join(parts), digest_size=16).hexdigest()


def chain_key(parent: str, tokens: npt.NDArray[np.int32]) -> str:
    """The key of the chunk holding ``tokens`` after the prefix ``parent`` names."""
    return _h(bytes.fromhex(parent), tokens.astype("<i4").tobytes())


def root_key(ns: Namespace) -> str:
    """The parent key of a namespace's first chunks."""
    return _h(b"kvref-store-root", bytes.fromhex(ns.id))


def levels(n: int) -> list[int]:
    """The prefix lengths indexed for a chunk of ``n`` tokens."""
    return [*range(1, min(n, DENSE) + 1), *range(2 * DENSE, n + 1, DENSE)] + ([n] if n > DENSE and n % DENSE else [])


def _level_key(parent: str, tokens: npt.NDArray[np.int32]) -> str:
    return "x:" + chain_key(parent, tokens)


def _checkpoint_key(prefix_key: str) -> str:
    return "r:" + _h(b"checkpoint", bytes.fromhex(prefix_key))


def _tokens(tokens: Tokens, what: str) -> npt.NDArray[np.int32]:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ArgumentTypeError(f"{what} must be a sequence of token ids, not an array of {arr.dtype} {arr.shape}")
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ArgumentError(f"{what} holds ids outside int32 (llama_token)")
    return arr.astype(np.int32)


@dataclass
class Stored:
    """What a ``put`` did: tokens stored, chunks it wrote (the others were kept already) and their bytes."""

    n_tokens: int
    new_chunks: int
    new_bytes: int
    namespace: str
    checkpoint: bool = False


@dataclass
class Lookup:
    """How much of a prompt the store can serve: ``n_tokens`` (0: nothing), ``matched`` tokens shared with stored
    prefixes, and ``why`` when ``n_tokens < len(prompt)`` (each reason that cut it shorter)."""

    n_tokens: int
    matched: int
    why: list[str] = field(default_factory=list)
    namespace: str | None = None


@dataclass
class Hit:
    """A served prefix: ``data`` is the ``kind`` of state holding the first ``n_tokens`` of the prompt (``tokens``),
    for sequence ``seq_id`` of the caller's context; ``why`` says what kept it from being longer."""

    n_tokens: int
    data: bytes
    kind: str
    tokens: npt.NDArray[np.int32]
    seq_id: int
    matched: int
    why: list[str]
    namespace: str

    def save(self, path: str | os.PathLike[str], *, durable: bool = True) -> int:
        """Write ``data`` to ``path`` (through a temporary file: a crash never leaves half a file)."""
        from ..state.atomic import atomic_write

        data = self.data
        return atomic_write(path, lambda f: f.write(data), durable=durable)


@dataclass
class _Link:
    key: str
    meta: ChunkMeta
    start: int  # position of the chunk's first token
    used: int  # tokens of it the prompt shares


class Store:
    """A prefix store over a `Backend` (``kvref.store.open`` makes one from a URL or directory)."""

    def __init__(self, backend: Backend, *, capacity_bytes: int | None = None, chunk_tokens: int | None = None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ArgumentError(f"capacity_bytes must be >= 0 (or None: no limit), not {capacity_bytes}")
        self.backend = backend
        self.capacity_bytes = capacity_bytes
        self.chunk_tokens = self._chunk_tokens(chunk_tokens)
        self._namespaces: dict[str, Namespace] = {}
        self._hparams: dict[str, HParams] = {}  # per model id: a GGUF header is parsed once per store

    def _chunk_tokens(self, asked: int | None) -> int:
        if asked is not None and not (isinstance(asked, int) and 1 <= asked <= 1 << 20):
            raise ArgumentError(f"chunk_tokens must be an int in [1, 2**20], not {asked!r}")
        raw = self.backend.peek_many([CONFIG])[0]  # META: never evicted, nothing to mark
        if raw is not None:
            try:
                have = int(json.loads(bytes(decode(raw, RECORD)))["chunk_tokens"])
            except (DamagedValue, ValueError, KeyError, TypeError) as e:
                raise FormatError(f"{self.backend.url}: the store's config record is damaged ({e})") from e
            if asked is not None and asked != have:
                raise ArgumentError(
                    f"{self.backend.url} cuts states into chunks of {have} tokens; open it with chunk_tokens={have} "
                    "(or None), or use another store for another chunk size"
                )
            return have
        n = asked or DEFAULT_CHUNK_TOKENS
        self.backend.put(CONFIG, encode(RECORD, [json.dumps({"chunk_tokens": n}).encode()]))
        return self._chunk_tokens(None) if asked is None else n

    # --- namespaces -----------------------------------------------------------------------------------------

    def _remember(self, ns: Namespace) -> None:
        if ns.id not in self._namespaces:
            self.backend.put(META + "ns:" + ns.id, encode(RECORD, [ns.to_json().encode()]))
            self.backend.add_link(META + "model:" + ns.model, ns.id)
            self.backend.add_link(META + "models", ns.model)
            self._namespaces[ns.id] = ns

    def namespaces(self, model: str | os.PathLike[str]) -> list[Namespace]:
        """The namespaces stored for ``model`` (a GGUF path or its ``sha256:`` id)."""
        from .model_id import model_id

        mid = model_id(model)
        out = []
        for nid in sorted(self.backend.links(META + "model:" + mid)):
            ns = self._namespaces.get(nid)
            if ns is None:
                raw = self.backend.peek_many([META + "ns:" + nid])[0]
                if raw is None:
                    continue
                try:
                    ns = Namespace.from_json(bytes(decode(raw, RECORD)))
                except (DamagedValue, ValueError, KeyError, TypeError):
                    continue
                self._namespaces[nid] = ns
            out.append(ns)
        return out

    # --- put ------------------------------------------------------------------------------------------------

    def put(
        self, state: Source | StateObject, model: str | os.PathLike[str], tokens: Tokens | None = None, *,
        seq_id: int | None = None, hparams: HParams | None = None, extra: dict[str, object] | None = None,
    ) -> Stored:  # fmt: skip
        """Store one sequence of ``state`` (a path, bytes, a llama-cpp-python ``LlamaState`` or a loaded state)
        written by ``model`` (the GGUF path, or its ``sha256:`` id with ``hparams=``). ``tokens``: the tokens its
        cells hold (default: the file's, or a ``LlamaState``'s ``input_ids``); ``seq_id``: which sequence of a
        whole-context state (default: its only one); ``extra``: context settings the state cannot show (RoPE
        overrides, ...), which ``get`` must then give too."""
        from .. import state as state_mod
        from ..state import StateObject
        from .model_id import model_id

        obj = state if isinstance(state, StateObject) else state_mod.load(cast("Source", state))
        toks = self._put_tokens(obj, state, tokens)
        mid = model_id(model)
        hp = hparams
        if hp is None and not str(model).startswith("sha256:"):
            hp = self._hparams.get(mid) or self._hparams.setdefault(mid, _hparams(model))
        ns = namespace_of(obj, mid, hp, extra=extra)
        seq = sequence_of(obj, seq_id)
        rows: list[SeqRows | Checkpoint | None] = []
        for sec in obj.memory.sections:
            if sec.kind == "kv":
                rows.append(kv_rows(cast("KVSection", sec), seq))
            else:
                rows.append(checkpoint_of(cast("RecurrentSection", sec), seq))
        n = self._n_stored(ns, rows, len(toks))
        self._remember(ns)
        return self._write(ns, toks[:n], rows)

    @staticmethod
    def _put_tokens(obj: StateObject, state: object, tokens: Tokens | None) -> npt.NDArray[np.int32]:
        if tokens is not None:
            return _tokens(tokens, "tokens")
        own = getattr(obj, "tokens", None)
        if own is not None:  # a llama-server slot file may hold its packed prompt (kvref.state.server_tokens)
            from ..state.server_tokens import read_prompt

            prompt = read_prompt(np.asarray(own, np.int32))
            if prompt.media:
                raise ArgumentError(f"the file's prompt holds {len(prompt.media)} media chunk(s): the store keeps text "
                                    "prompts, whose token i sits at position i")  # fmt: skip
            return prompt.tokens
        ids = getattr(state, "input_ids", None)
        if ids is not None:  # a llama-cpp-python LlamaState
            return _tokens(np.asarray(ids)[: int(getattr(state, "n_tokens", len(ids)))], "LlamaState.input_ids")
        raise ArgumentError(f"a {obj.kind} blob does not hold its tokens: pass tokens= (the ids its cells hold)")

    @staticmethod
    def _n_stored(ns: Namespace, rows: list[SeqRows | Checkpoint | None], n_tokens: int) -> int:
        """How many tokens the state holds, checked against its cells: the full-attention sections must hold
        positions 0 .. n-1, the SWA sections a run ending at n-1, a recurrent state must have consumed n."""
        n: int | None = None
        for (_, geo), r in zip(ns.kv, [r for r in rows if isinstance(r, SeqRows)], strict=True):
            if geo.swa or not len(r.pos):
                continue
            m = len(r.pos)
            if r.pos[0] != 0 or r.pos[-1] != m - 1:
                raise FormatError(
                    f"the sequence's cells hold positions {r.pos[0]} .. {r.pos[-1]} in {m} cells, not 0 .. {m - 1}: "
                    "the store keeps prefixes whose token i sits at position i (no context shift, no M-RoPE images)"
                )
            if m > n_tokens:
                raise ArgumentError(f"the cells hold {m} positions but only {n_tokens} tokens were given")
            n = m if n is None else min(n, m)
        for cp in rows:
            if isinstance(cp, Checkpoint):
                if cp.pos + 1 > n_tokens:
                    raise ArgumentError(f"the recurrent state consumed {cp.pos + 1} positions, {n_tokens} tokens given")
                if n is not None and n != cp.pos + 1:
                    raise FormatError(f"the recurrent state consumed {cp.pos + 1} positions, the attention cells "
                                      f"hold {n}: a hybrid state's two parts must be at one length")  # fmt: skip
                n = cp.pos + 1
        if n is None:
            n = max((int(r.pos[-1]) + 1 for r in rows if isinstance(r, SeqRows) and len(r.pos)), default=0)
        for (_, geo), r in zip(ns.kv, [r for r in rows if isinstance(r, SeqRows)], strict=True):
            if geo.swa and len(r.pos):
                run = r.pos[r.pos < n]
                if len(run) and (run[-1] != n - 1 or run[-1] - run[0] != len(run) - 1):
                    raise FormatError(f"the SWA cache holds positions {run[0]} .. {run[-1]} in {len(run)} cells, "
                                      f"not a run ending at {n - 1}")  # fmt: skip
        return n

    def _write(self, ns: Namespace, toks: npt.NDArray[np.int32], rows: list[SeqRows | Checkpoint | None]) -> Stored:
        T, n, be = self.chunk_tokens, len(toks), self.backend
        keys, parents, starts = [], [], []
        parent = root_key(ns)
        for c0 in range(0, n, T):
            key = chain_key(parent, toks[c0 : c0 + T])
            keys.append(key)
            parents.append(parent)
            starts.append(c0)
            parent = key
        old = be.peek_many(["c:" + k for k in keys])  # the touch at the end marks them
        new_chunks = new_bytes = 0
        covers: list[list[int]] = []  # deepest chunk first
        ext_src = next((r for r, (_, g) in zip([x for x in rows if isinstance(x, SeqRows)], ns.kv, strict=True)
                        if not g.swa), None)  # fmt: skip
        for key, parent, c0, raw in reversed(list(zip(keys, parents, starts, old, strict=True))):
            chunk = toks[c0 : c0 + T]
            have: ChunkMeta | None = None
            if raw is not None:
                try:
                    have = ChunkMeta.decode(raw)
                    if have.parent != parent or not np.array_equal(have.tokens, chunk):
                        have = None
                except DamagedValue:
                    be.incr("corrupt")
            cover: list[int] = []
            wrote = False
            for i, r in enumerate(rows):
                best = have.cover[i] if have is not None and i < len(have.cover) else len(chunk)
                if not isinstance(r, SeqRows):
                    cover.append(best)
                    continue
                lo, hi = np.searchsorted(r.pos, [c0, c0 + len(chunk)])
                if hi <= lo:
                    cover.append(best)
                    continue
                start = int(r.pos[lo]) - c0
                if start < best:
                    value = encode(PART, part_payload(r.take(int(lo), int(hi))))
                    if be.put(f"s{i}.{start}:{key}", value):
                        new_bytes += len(value)
                    best, wrote = start, True
                cover.append(best)
            covers.append(cover)
            if have is None or wrote:
                ext = np.zeros((len(chunk), 0), np.int32)
                if ext_src is not None and len(ext_src.pos):
                    lo, hi = np.searchsorted(ext_src.pos, [c0, c0 + len(chunk)])
                    ext = ext_src.ext[lo:hi]
                if ext.shape[0] != len(chunk):
                    ext = np.zeros((len(chunk), ext.shape[1]), np.int32)
                value = ChunkMeta(parent, chunk, ext, cover).encode()
                be.put("c:" + key, value, replace=True)
                new_chunks += have is None
                new_bytes += len(value) if have is None else 0
        be.add_links([(_level_key(parent, toks[c0 : c0 + lv]), key)
                      for key, parent, c0 in zip(keys, parents, starts, strict=True)
                      for lv in levels(len(toks[c0 : c0 + T]))])  # fmt: skip
        # a put is a use of every chunk it holds, kept ones too: deepest first, so shared heads stay the newest
        be.touch([v for key, c0, c in zip(keys[::-1], starts[::-1], covers, strict=True)
                  for v in _chunk_values(key, c, len(toks[c0 : c0 + T]))])  # fmt: skip
        checkpoint = False
        cps = [r for r in rows if isinstance(r, Checkpoint)]
        if cps and n:
            cp = cps[0]
            q = (n - 1) // T
            value = encode_checkpoint(parents[q], cp)
            if be.put(_checkpoint_key(keys[q]), value):
                new_bytes += len(value)
                checkpoint = True
            be.add_link("ck:" + parents[q], str(n - q * T))
        be.incr("puts")
        if new_chunks or checkpoint:
            be.incr("entries")
        if self.capacity_bytes is not None:
            freed = be.evict(self.capacity_bytes)
            if freed:
                be.incr("evicted_bytes", freed)
        return Stored(n, new_chunks, new_bytes, ns.id, checkpoint)

    # --- lookup ---------------------------------------------------------------------------------------------

    def _walk(self, ns: Namespace, prompt: npt.NDArray[np.int32]) -> list[_Link]:
        """The stored chunks the prompt runs through, the last one possibly only in part."""
        T, be = self.chunk_tokens, self.backend
        keys, parent = [], root_key(ns)
        for c0 in range(0, len(prompt) - T + 1, T):
            parent = chain_key(parent, prompt[c0 : c0 + T])
            keys.append(parent)
        raws = be.peek_many(["c:" + k for k in keys])  # a get marks what it serves once it is served
        chain: list[_Link] = []
        parent = root_key(ns)
        for c, (key, raw) in enumerate(zip(keys, raws, strict=True)):
            meta = self._meta(key, raw, parent, prompt[c * T : (c + 1) * T])
            if meta is None:
                break
            chain.append(_Link(key, meta, c * T, T))
            parent = key
        at = len(chain) * T
        if at < len(prompt):
            best = self._partial(parent, prompt[at : at + T], at)
            if best is not None:
                chain.append(best)
        return chain

    def _partial(self, parent: str, rest: npt.NDArray[np.int32], at: int) -> _Link | None:
        """The stored chunk after ``parent`` sharing the most leading tokens with ``rest`` (fewer than all)."""
        be = self.backend
        lv = levels(len(rest))
        lo, hi = -1, len(lv)  # lv[lo] is held by some chunk, lv[hi] by none (binary search: the levels nest)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if be.link_sample(_level_key(parent, rest[: lv[mid]]), 1):
                lo = mid
            else:
                hi = mid
        if lo < 0:
            return None
        level = _level_key(parent, rest[: lv[lo]])
        # any one candidate will do when none can share more than lv[lo] tokens: all of ``rest`` is shared, or the
        # next length is indexed for every chunk long enough (the dense levels) and none holds it
        exact = lv[lo] == len(rest) or (lv[lo] < DENSE and lv[hi] == lv[lo] + 1)
        kids = sorted(be.link_sample(level, 8) if exact else be.links(level))  # a few: a link may outlive its chunk
        best: _Link | None = None
        for key, raw in zip(kids, be.peek_many(["c:" + k for k in kids]), strict=True):
            meta = self._meta(key, raw, parent, None)
            if meta is None:
                continue
            m = min(len(meta.tokens), len(rest))
            diff = np.flatnonzero(meta.tokens[:m] != rest[:m])
            used = int(diff[0]) if diff.size else m
            if used and (best is None or used > best.used):
                best = _Link(key, meta, at, used)
        return best

    def _meta(self, key: str, raw: bytes | None, parent: str, want: npt.NDArray[np.int32] | None) -> ChunkMeta | None:
        if raw is None:
            return None
        try:
            meta = ChunkMeta.decode(raw)
        except DamagedValue:
            self._drop(["c:" + key])
            return None
        if meta.parent != parent or (want is not None and not np.array_equal(meta.tokens, want)):
            return None  # a hash collision, or a record that is not what its key says
        return meta

    def _drop(self, keys: list[str]) -> None:
        self.backend.incr("corrupt", len(keys))
        self.backend.delete(keys)

    def _limit(self, ns: Namespace, chain: list[_Link], cover: dict[tuple[str, int], int]) -> tuple[int, list[str]]:
        """The longest servable length along ``chain`` (recurrent checkpoints aside), with the reasons it stops."""
        M = sum(link.used for link in chain)
        L, why = M, []
        for i, geo in ns.kv:
            covered = np.zeros(M, bool)
            for link in chain:
                start = cover.get((link.key, i), link.meta.cover[i] if i < len(link.meta.cover) else link.used)
                covered[link.start + min(start, link.used) : link.start + link.used] = True
            if not geo.swa:
                gaps = np.flatnonzero(~covered)
                if gaps.size and gaps[0] < L:
                    L = int(gaps[0])
                    why.append(f"section {i} (attention) holds rows only up to position {L}")
                continue
            n_l = self._swa_limit(ns, covered, L)
            if n_l < L:
                held = np.flatnonzero(covered[:L])
                why.append(f"section {i} (SWA, window {ns.n_swa}) holds positions {held[0] if held.size else L} .. "
                           f"{L - 1} of this prefix, not the window a cut at {L} needs (a sequence save keeps only "
                           f"the last window of its SWA cache): the longest servable cut is {n_l}")  # fmt: skip
                L = n_l
        return L, why

    @staticmethod
    def _swa_limit(ns: Namespace, covered: npt.NDArray[np.bool_], L: int) -> int:
        """The longest cut <= L whose SWA window the covered positions hold (0: none)."""
        from ..hparams import is_masked_swa

        gaps = np.flatnonzero(~covered[:L])
        while L > 0:
            g = gaps[gaps < L]
            if not g.size:
                return L
            last = int(g[-1])
            need = int(np.count_nonzero(is_masked_swa(ns.n_swa, ns.swa_type, np.arange(L), L)))
            if last < need:
                return L
            L = last  # every cut past the gap needs it: try the cuts before it
        return 0

    def lookup(self, tokens: Tokens, model: str | os.PathLike[str], **context: object) -> Lookup:
        """How many tokens of ``tokens`` the store can serve for ``model`` in the context ``context`` (the keys
        `get` takes: type_k, type_v, flash_attn, era, extra), and why not more. Reads metadata only."""
        context.setdefault("type_k", "f16")
        context.setdefault("type_v", "f16")
        context["extra"] = context.get("extra") or {}  # a namespace put with extra= is met only by the same extra
        return self._plan(_tokens(tokens, "tokens"), model, context, _Damage()).look

    def _plan(self, prompt: npt.NDArray[np.int32], model: str | os.PathLike[str], context: dict[str, object],
              damage: _Damage) -> _Plan:  # fmt: skip
        found = [ns for ns in self.namespaces(model) if ns.matches(context)]
        why = "no stored prefix of this prompt" if found else "nothing is stored for this model and context"
        best = _Plan(Lookup(0, 0, [why]), None, [], None)
        for ns in found:
            chain = self._walk(ns, prompt)
            L, reasons, cp = self._servable(ns, chain, damage, len(prompt))
            if chain and (best.ns is None or best.look.n_tokens < L):
                best = _Plan(Lookup(L, sum(x.used for x in chain), reasons, ns.id), ns, chain, cp)
        return best

    def _servable(self, ns: Namespace, chain: list[_Link], damage: _Damage, n_prompt: int
                  ) -> tuple[int, list[str], int | None]:  # fmt: skip
        M = sum(link.used for link in chain)
        why = [] if n_prompt == M else [f"the store shares the first {M} of the prompt's {n_prompt} tokens"]
        L, limits = self._limit(ns, chain, damage.cover)
        why += limits
        cp_at: int | None = None
        if ns.recurrent is not None:
            stops = self._checkpoints(ns, chain, L, damage.checkpoints)
            cp_at = max(stops, default=None)
            if cp_at is None:
                why.append(f"no recurrent state is stored at a length <= {L} (a recurrent memory is served only "
                           "where a state was saved)")  # fmt: skip
                L = 0
            elif cp_at < L:
                why.append(f"recurrent states are stored at lengths {sorted(stops)} up to {L}: serving {cp_at}")
                L = cp_at
        return L, why, cp_at

    def _checkpoints(self, ns: Namespace, chain: list[_Link], L: int, gone: set[int]) -> list[int]:
        T = self.chunk_tokens
        parents = [root_key(ns)] + [link.key for link in chain if link.used == T]
        out = []
        for c, parent in enumerate(parents):
            for off in self.backend.links("ck:" + parent):
                if off.isdigit() and 0 < int(off) <= T and c * T + int(off) <= L and c * T + int(off) not in gone:
                    out.append(c * T + int(off))
        return out

    # --- get ------------------------------------------------------------------------------------------------

    def get(
        self, tokens: Tokens, model: str | os.PathLike[str], kind: str = "seq_state", seq_id: int = 0, *,
        n_stream: int = 1, type_k: object = "f16", type_v: object = "f16", flash_attn: object = None,
        era: str | None = None, extra: dict[str, object] | None = None,
    ) -> Hit | None:  # fmt: skip
        """The longest prefix of ``tokens`` the store can serve for ``model``, as a ``kind`` of state (``seq_state``:
        llama_state_seq_set_data's blob; ``seq``: a sequence file, llama-server's slot file; ``state``: a
        llama_state_set_data blob; ``session``: a session file) holding it in sequence ``seq_id`` of a context of
        ``n_stream`` streams (1 unless the context has ``kv_unified=False`` and several sequences); None when
        nothing is servable. The context keys pick the namespace: K/V types (llama.cpp's defaults f16), flash
        attention (None: either), ``era`` (the writer's layout era; None: any) and ``extra`` (what ``put`` was
        given)."""
        if kind not in KINDS:
            raise ArgumentError(f"kind must be one of {KINDS}, not {kind!r}")
        if not isinstance(n_stream, int) or n_stream < 1:
            raise ArgumentError(f"n_stream must be an int >= 1, not {n_stream!r}")
        if not isinstance(seq_id, int) or not 0 <= seq_id < 256 or (n_stream > 1 and seq_id >= n_stream):
            raise ArgumentError(f"seq_id={seq_id!r} does not fit a context of {n_stream} stream(s) and 256 sequences")
        prompt = _tokens(tokens, "tokens")
        context = {"type_k": type_k, "type_v": type_v, "flash_attn": flash_attn, "era": era, "extra": extra or {}}
        damage = _Damage()
        while True:  # each round that fails has dropped a value from the plan, so this ends
            plan = self._plan(prompt, model, context, damage)
            look, ns = plan.look, plan.ns
            if ns is None or look.n_tokens == 0:
                self.backend.incr("misses")
                return None
            try:
                sections = self._sections(ns, plan.chain, damage, look.n_tokens, plan.checkpoint, seq_id, n_stream,
                                          kind)  # fmt: skip
            except DamagedValue:
                continue  # the plan counted on a value that is gone or damaged: ``damage`` says which
            obj = self._container(ns, sections, kind, prompt[: look.n_tokens], seq_id)
            also = [] if plan.checkpoint is None else [self._checkpoint_at(ns, plan.chain, plan.checkpoint)[1]]
            self._touch(plan.chain, damage, also)
            self.backend.incr("hits")
            self.backend.incr("served_tokens", look.n_tokens)
            return Hit(look.n_tokens, obj.to_bytes(), kind, prompt[: look.n_tokens].copy(), seq_id, look.matched,
                       look.why, ns.id)  # fmt: skip

    def _touch(self, chain: list[_Link], damage: _Damage, also: list[str]) -> None:
        """Mark what a get served as used, once: ``also`` (a checkpoint), then the chunks deepest first, so a
        chain's shared head stays the most recently used (the reads before it only peeked)."""
        keys = list(also)
        for link in reversed(chain):
            cover = [damage.cover.get((link.key, i), c) for i, c in enumerate(link.meta.cover)]
            keys += _chunk_values(link.key, cover, len(link.meta.tokens))
        self.backend.touch(keys)

    def _sections(
        self, ns: Namespace, chain: list[_Link], damage: _Damage, L: int, cp_at: int | None,
        seq_id: int, n_stream: int, kind: str,
    ) -> list[KVSection | RecurrentSection]:  # fmt: skip
        """The sections holding the first ``L`` tokens (raises `DamagedValue` after dropping a value it could not
        use, with ``damage`` updated so the next plan leaves it out)."""
        from ..state.eras import era as era_of

        scoped = kind in ("seq", "seq_state")
        has_n_stream = era_of(ns.era).n_stream_field
        stream = seq_id if n_stream > 1 else 0
        out: list[KVSection | RecurrentSection] = []
        for i, geo in enumerate(ns.sections):
            if isinstance(geo, KVGeometry):
                rows = self._rows(ns, i, geo, chain, damage.cover, L)
                out.append(kv_section(geo, rows, seq_id, n_stream, stream, ns.ext_size, has_n_stream))
            else:
                assert cp_at is not None
                cp = self._checkpoint(ns, chain, cp_at, geo, damage)
                out.append(recurrent_section(geo, cp, None if scoped else seq_id))
        return out

    def _rows(self, ns: Namespace, i: int, geo: KVGeometry, chain: list[_Link], cover: dict[tuple[str, int], int],
              L: int) -> SeqRows:  # fmt: skip
        # the covered run that ends at L (all of [0, L) for full attention)
        spans = []
        for link in chain:
            if link.start >= L:
                break
            spans.append((link, cover.get((link.key, i), link.meta.cover[i])))
        first = 0
        for link, start in spans:
            if start > 0 and link.start + start < L:
                first = max(first, link.start + start)
        want = [(link, start) for link, start in spans if link.start + len(link.meta.tokens) > first]
        keys = [f"s{i}.{start}:{link.key}" for link, start in want]
        raws = self.backend.peek_many(keys)
        parts = []
        for (link, start), key, raw in zip(want, keys, raws, strict=True):
            n_cells = len(link.meta.tokens) - start
            try:
                if raw is None:
                    raise DamagedValue("evicted")
                k, v = split_part(decode(raw, PART), geo, n_cells)
            except DamagedValue:
                if raw is not None:
                    self._drop([key])
                cover[(link.key, i)] = len(link.meta.tokens)
                self._uncover(link, i)
                raise
            p0 = link.start + start
            lo, hi = max(first, p0) - p0, min(L, link.start + len(link.meta.tokens)) - p0
            pos = np.arange(p0, p0 + n_cells, dtype=np.int32)
            ext = link.meta.ext[start:] if link.meta.ext.shape[1] else np.zeros((n_cells, ns.ext_size // 4), np.int32)
            parts.append(SeqRows(pos, ext, k, v).take(lo, hi))
        return concat(parts)

    def _uncover(self, link: _Link, i: int) -> None:
        """Record in the chunk's meta that section ``i``'s rows are gone (evicted or damaged), so the next put of
        a state holding them stores them again."""
        meta = link.meta
        cover = list(meta.cover)
        cover[i] = len(meta.tokens)
        self.backend.put("c:" + link.key, ChunkMeta(meta.parent, meta.tokens, meta.ext, cover).encode(), replace=True)

    def _checkpoint_at(self, ns: Namespace, chain: list[_Link], L: int) -> tuple[str, str]:
        """(parent key, checkpoint key) of a recurrent state after the first ``L`` tokens along ``chain``: the
        checkpoint is keyed by the (possibly partial) chunk that ends at L."""
        T = self.chunk_tokens
        q = (L - 1) // T
        parent = root_key(ns) if q == 0 else chain[q - 1].key
        end = chain[q].meta.tokens[: L - q * T] if q < len(chain) else np.zeros(0, np.int32)
        return parent, _checkpoint_key(chain_key(parent, end))

    def _checkpoint(self, ns: Namespace, chain: list[_Link], L: int, geo: object, damage: _Damage) -> Checkpoint:
        from .namespace import RecurrentGeometry

        parent, key = self._checkpoint_at(ns, chain, L)
        raw = self.backend.peek_many([key])[0]
        try:
            if raw is None:
                raise DamagedValue("evicted")
            got_parent, cp = decode_checkpoint(raw, cast("RecurrentGeometry", geo))
            if got_parent != parent or cp.pos != L - 1:
                raise DamagedValue("checkpoint for another prefix")
        except DamagedValue:
            if raw is not None:
                self._drop([key])
            damage.checkpoints.add(L)
            raise
        return cp

    def _container(self, ns: Namespace, sections: list[KVSection | RecurrentSection], kind: str,
                   tokens: npt.NDArray[np.int32], seq_id: int) -> StateObject:  # fmt: skip
        from .. import state
        from ..state.eras import CURRENT, era, to_era

        cur = era(CURRENT)
        memory = state.MemorySections(ns.layout, sections)
        obj: StateObject
        if kind == "session":
            obj = state.SessionFile(version=cur.session_version, tokens=tokens, arch=ns.arch, outputs=None,
                                    memory=memory)  # fmt: skip
        elif kind == "seq":
            obj = state.SeqFile(version=cur.seq_version, tokens=tokens, memory=memory)
        elif kind == "state":
            obj = state.StateBlob(arch=ns.arch, outputs=None, memory=memory)
        else:
            obj = state.SeqStateBlob(memory=memory, seq_id=seq_id, has_header=True)
        return to_era(obj, ns.era, has_ext=ns.ext_size > 0, seq_id=seq_id)

    # --- upkeep ---------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """Bytes and values held, capacity, chunk size, namespaces, and the counters (hits, misses, puts, entries,
        served tokens, corrupt values dropped, bytes evicted)."""
        held, n = self.backend.usage()
        counters = self.backend.counters()
        models = self.backend.links(META + "models")
        out: dict[str, object] = {
            "url": self.backend.url, "bytes": held, "chunks": n, "entries": counters.get("entries", 0),
            "hits": counters.get("hits", 0), "misses": counters.get("misses", 0),
            "puts": counters.get("puts", 0), "served_tokens": counters.get("served_tokens", 0),
            "corrupt": counters.get("corrupt", 0), "evicted_bytes": counters.get("evicted_bytes", 0),
            "capacity_bytes": self.capacity_bytes, "chunk_tokens": self.chunk_tokens,
            "models": len(models),
            "namespaces": sum(len(self.backend.links(META + "model:" + m)) for m in models),
        }  # fmt: skip
        return out

    def gc(self, max_bytes: int | None = None) -> dict[str, int]:
        """Evict least recently used values down to ``max_bytes`` (default: the capacity, if any), then drop what
        no prefix reaches any more (chunks whose parent is gone, parts and checkpoints of missing chunks,
        values that fail their checksum). Returns bytes evicted and values dropped."""
        be = self.backend
        freed = 0
        limit = max_bytes if max_bytes is not None else self.capacity_bytes
        if limit is not None:
            if limit < 0:
                raise ArgumentError(f"max_bytes must be >= 0, not {limit}")
            freed = be.evict(limit)
            if freed:
                be.incr("evicted_bytes", freed)
        roots = {root_key(ns) for m in be.links(META + "models") for ns in self.namespaces(m)}
        keys = be.keys()
        metas = sorted(k[2:] for k in keys if k.startswith("c:"))
        parent_of: dict[str, str] = {}
        for k, raw in zip(metas, be.peek_many(["c:" + k for k in metas]), strict=True):
            try:
                if raw is not None:
                    parent_of[k] = ChunkMeta.decode(raw).parent
            except DamagedValue:
                pass  # no parent: unreachable, dropped below
        alive: dict[str, bool] = {}

        def reachable(key: str) -> bool:
            """Does the chain of parents from ``key`` reach a namespace's root?"""
            path: list[str] = []
            k = key
            while k not in roots and k not in alive and k in parent_of and len(path) <= len(parent_of):
                path.append(k)
                k = parent_of[k]
            ok = k in roots or alive.get(k, False)
            alive.update(dict.fromkeys(path, ok))
            return ok

        dead = [f"c:{k}" for k in metas if not reachable(k)]
        # section parts ("s<i>.<start>:<key>") of chunks that are gone or unreachable
        dead += [k for k in keys if k[:1] == "s" and ":" in k and not alive.get(k.split(":", 1)[1], False)]
        dropped = be.delete(dead)
        # the prefix index names chunks that eviction removed: keep only the entries of reachable chunks
        pruned = be.prune_links("x:", [k for k, ok in alive.items() if ok])
        return {"evicted_bytes": freed, "dropped": dropped, "index_entries_dropped": pruned}

    def close(self) -> None:
        """Close the backend."""
        self.backend.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Damage:
    """What one `Store.get` found gone or damaged, so its next plan leaves it out."""

    cover: dict[tuple[str, int], int] = field(default_factory=dict)  # (chunk key, section) -> no rows
    checkpoints: set[int] = field(default_factory=set)  # lengths whose checkpoint is gone


@dataclass
class _Plan:
    look: Lookup
    ns: Namespace | None
    chain: list[_Link]
    checkpoint: int | None


def _chunk_values(key: str, cover: list[int], n: int) -> list[str]:
    """The keys of a chunk of ``n`` tokens: its section parts (``cover``), then its meta."""
    return [f"s{i}.{start}:{key}" for i, start in enumerate(cover) if start < n] + ["c:" + key]


def _hparams(model: str | os.PathLike[str]) -> HParams:
    from ..hparams import HParams

    return HParams.from_gguf(model)


__all__ = ["DEFAULT_CHUNK_TOKENS", "KINDS", "Hit", "Lookup", "Store", "Stored", "chain_key", "root_key"]
