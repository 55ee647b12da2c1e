"""The token field of a llama-server slot file: a plain token list, or llama-server's packed prompt.

llama-server saves a slot with ``llama_state_seq_save_file(ctx, path, slot, tokens, n)`` where ``tokens`` is what
``server_tokens::serialize`` packs (tools/server/server-common.cpp, llama.cpp as vendored by llama-cpp-python
0.3.36): so that prompts with images survive a save, the field starts with LLAMA_TOKEN_NULL (-1), then
``u32 version`` (1), ``u32 n`` and ``n`` i32 tokens (LLAMA_TOKEN_NULL where a media chunk sits), ``u32 m`` and
``m`` u32 media start indices, then each media chunk as ``u32 size`` + its ``mtmd_input_chunk_save`` bytes,
zero-padded to whole tokens. Older servers (and every other writer) store the plain token list;
``server_tokens::deserialize`` tells the two apart by the leading -1, as `read_prompt` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..constants import TOKEN_NULL
from ..errors import FormatError

SERVER_TOKENS_STATE_VERSION = 1


@dataclass(frozen=True)
class Prompt:
    """What a file's token field holds: ``form`` is "plain" or "llama-server packed v<version>"."""

    form: str
    tokens: npt.NDArray[np.int32]  # the prompt's tokens (-1 where a media chunk sits)
    media: list[tuple[int, int]] = field(default_factory=list)  # (start index, bytes of the saved chunk)


def read_prompt(field_tokens: npt.NDArray[np.int32]) -> Prompt:
    """The prompt a token field holds (FormatError, naming the part, for a packed field that does not parse)."""
    toks = np.asarray(field_tokens, dtype="<i4")
    if len(toks) == 0 or int(toks[0]) != TOKEN_NULL:
        return Prompt("plain", toks)
    raw = toks.tobytes()
    at = 4

    def u32(what: str) -> int:
        nonlocal at
        if at + 4 > len(raw):
            raise FormatError(f"llama-server packed prompt: {what} past the end of the token field", field="tokens")
        v = int.from_bytes(raw[at : at + 4], "little")
        at += 4
        return v

    version = u32("version")
    if version != SERVER_TOKENS_STATE_VERSION:
        raise FormatError(
            f"llama-server packed prompt version {version}, kvref reads {SERVER_TOKENS_STATE_VERSION}", field="tokens"
        )
    n = u32("token count")
    if at + 4 * n > len(raw):  # bounded by the bytes there before anything is read
        raise FormatError(f"llama-server packed prompt: {n} tokens do not fit the token field", field="tokens")
    tokens = np.frombuffer(raw, "<i4", n, at).copy()
    at += 4 * n
    m = u32("media count")
    if at + 4 * m > len(raw):
        raise FormatError(f"llama-server packed prompt: {m} media indices do not fit the token field", field="tokens")
    starts = np.frombuffer(raw, "<u4", m, at).tolist()
    at += 4 * m
    media = []
    for start in starts:
        size = u32("media chunk size")
        if at + size > len(raw):
            raise FormatError(f"llama-server packed prompt: a {size}-byte media chunk is cut short", field="tokens")
        media.append((int(start), size))
        at += size
    return Prompt(f"llama-server packed v{version}", tokens, media)


__all__ = ["SERVER_TOKENS_STATE_VERSION", "Prompt", "read_prompt"]
