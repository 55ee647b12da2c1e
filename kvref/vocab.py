"""Token ids back to text with a GGUF model's vocabulary (for ``kvref inspect --model``).

The pieces of ``tokenizer.ggml.tokens`` are joined as the two common vocabularies spell spaces and newlines:
SentencePiece's ``▁`` and GPT-2 byte-level BPE's ``Ġ`` / ``Ċ``; ``<0xNN>`` byte pieces become their byte. That is
enough to read a prompt back; it is not llama.cpp's full detokenizer (no special-token rules, no normalisation).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from .errors import HParamsError

_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def vocabulary(model: str | os.PathLike[str]) -> list[str]:
    """The token pieces of a GGUF model (``tokenizer.ggml.tokens``), read by kvref's GGUF metadata reader (the one
    ``HParams.from_gguf`` uses): a file that is not a GGUF model, or whose token list is not an array of strings, is
    an HParamsError naming the file or the key; a piece that is not UTF-8 reads with replacement characters."""
    from .hparams import _GGUFMeta

    key = "tokenizer.ggml.tokens"
    field = _GGUFMeta(model).fields.get(key)
    if field is None:
        raise HParamsError(f"{os.fspath(model)} has no {key}: no vocabulary to read tokens with")
    if field.n_elements and field.types != [9, 8]:  # GGUFValueType ARRAY of STRING
        raise HParamsError(f"key {key} is not an array of strings")
    return [raw.decode("utf-8", "replace") for raw in field.raw_strings()] if field.n_elements else []


def detokenize(tokens: Iterable[int], vocab: list[str]) -> str:
    """The text of ``tokens``: ids outside the vocabulary (a media placeholder -1, say) show as ``[id]``."""
    out = bytearray()
    for t in tokens:
        if not 0 <= t < len(vocab):
            out += f"[{t}]".encode()
            continue
        piece = vocab[t]
        m = _BYTE.fullmatch(piece)
        if m:
            out.append(int(m.group(1), 16))
        else:
            out += piece.replace("▁", " ").replace("Ġ", " ").replace("Ċ", "\n").encode()
    return out.decode("utf-8", "replace")


__all__ = ["detokenize", "vocabulary"]
