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
    """The token pieces of a GGUF model (``tokenizer.ggml.tokens``)."""
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise HParamsError(f"reading a vocabulary needs the 'gguf' package: {e}") from e
    field = GGUFReader(os.fspath(model), "r").fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise HParamsError(f"{model} has no tokenizer.ggml.tokens: no vocabulary to read tokens with")
    return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]


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
