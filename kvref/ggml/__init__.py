"""ggml's number formats, as every wing reads them: the type table (`types`), quantization (`quant`), the
Hadamard rotation of quantized K/V (`rotation`) and typed row views (`rows`).

``kvref.ggml.GGMLType`` and the other names of the type table stay reachable here."""

from __future__ import annotations

from .types import TYPE_TRAITS, GGMLType, GGMLTypeError, TypeTraits, ggml_type, row_size, traits, type_name

__all__ = ["TYPE_TRAITS", "GGMLType", "GGMLTypeError", "TypeTraits", "ggml_type", "row_size", "traits", "type_name"]
