"""A tiny progress bar for long jobs (multi-GiB conversions, exports): drawn on stderr when it is a terminal,
silent otherwise (pipes, logs, CI). No dependencies::

    with Progress(total_bytes, "export") as bar:
        for chunk in work:
            ...
            bar.update(len(chunk))
"""

from __future__ import annotations

import sys
import time
from typing import IO


class Progress:
    """``[#####.....]  42%  1.2/2.9 GiB  export``, redrawn at most every 0.1 s; ``enabled=None``: when ``stream``
    (default stderr) is a terminal."""

    def __init__(self, total: int, label: str = "", *, stream: IO[str] | None = None, enabled: bool | None = None,
                 width: int = 30) -> None:  # fmt: skip
        self.total = max(int(total), 0)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.width = width
        self.done = 0
        self._last = 0.0
        self._drawn = False

    def _fmt(self, n: float) -> str:
        for unit in ("B", "KiB", "MiB", "GiB"):
            if n < 1024 or unit == "GiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024
        return str(n)

    def line(self) -> str:
        """The bar as it is drawn now."""
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        fill = round(frac * self.width)
        return (f"[{'#' * fill}{'.' * (self.width - fill)}] {frac * 100:3.0f}%  "
                f"{self._fmt(self.done)}/{self._fmt(self.total)}  {self.label}")  # fmt: skip

    def update(self, n: int) -> None:
        """Add ``n`` units of work done."""
        self.done += int(n)
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last >= 0.1 or self.done >= self.total:
            self._last = now
            self.stream.write("\r" + self.line())
            self.stream.flush()
            self._drawn = True

    def close(self) -> None:
        """End the bar's line (only when one was drawn)."""
        if self.enabled and self._drawn:
            self.stream.write("\r" + self.line() + "\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["Progress"]
