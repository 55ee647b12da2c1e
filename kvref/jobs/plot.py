"""``kvref plot IN -o out.png``: a picture of a cache -- which cells each sequence holds, at which positions.

One panel per KV stream (and per recurrent section): cells along x, sequence ids along y, a square where the
cell holds the sequence, coloured by the cell's position (labelled when there are few cells). With the model
(``hparams=`` / ``--model``) an SWA section's cells outside the window of the sequence's newest position are
drawn hollow (``is_masked_swa``: the KQ mask hides them). A memory (`plot_memory`) also marks a pending K-shift
(cells with a non-zero shift, applied at the next ``update()``) with a red outline and its amount. Needs
matplotlib (``pip install 'kvref[plot]'``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, cast

import numpy as np
import numpy.typing as npt

from ..errors import KVRefError
from ..state.dsv4 import DSV4Section

if TYPE_CHECKING:
    from matplotlib.patches import Patch

    from ..hparams import HParams
    from ..state import Cells, KVSection, RecurrentSection, StateObject
    from ..state.load import Source
    from ._types import AnyMemory, StateSource

# each layout's sections in write order (kvref.jobs.cli_jobs.SECTION_LABELS says the same at length)
_LABELS = {
    "kv": ("attention KV",),
    "iswa": ("base attention KV", "SWA attention KV"),
    "recurrent": ("recurrent",),
    "hybrid": ("attention KV", "recurrent"),
    "hybrid_iswa": ("base attention KV", "SWA attention KV", "recurrent"),
    "hybrid_idx": ("attention KV", "recurrent", "indexer KV"),
    "dsa": ("MLA KV (latent K)", "lightning-indexer KV"),
    "dsa_iswa": ("MLA KV (latent K)", "lightning-indexer KV", "SWA attention KV"),
    "msa": ("attention KV", "MSA indexer keys"),
    "dsv4": ("DSV4 raw base attention KV", "DSV4 raw SWA attention KV"),
}
INSTALL = "kvref plot needs matplotlib: pip install 'kvref[plot]' (or pip install matplotlib)"


@dataclass
class Panel:
    """What one panel shows: a title, cell indices, positions, per-cell sequence ids, shifts, SWA info."""

    title: str
    cells: npt.NDArray[np.int64]
    pos: npt.NDArray[np.int32]
    seqs: list[tuple[int, ...]]
    shift: npt.NDArray[np.int32] | None = None
    n_swa: int = 0
    swa_type: int = 0


def _pyplot() -> ModuleType:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KVRefError(INSTALL) from None
    return plt


def _seqs(cells: Cells) -> list[tuple[int, ...]]:
    return [cells.seq_ids(i) for i in range(cells.n)]


def state_panels(obj: StateObject, hparams: HParams | None = None) -> list[Panel]:
    """The panels of a loaded state; ``hparams`` marks the SWA window of an SWA section."""
    labels = _LABELS.get(obj.memory.layout, ())
    out = []
    sections: list[KVSection | RecurrentSection] = []
    for sec in obj.memory.sections:  # a DSV4 section: the cells of its raw iSWA sections (the rest has none)
        if isinstance(sec, DSV4Section):
            sections.extend(sec.raw)
            labels = labels[1:] if sec.partial else labels  # partial: the SWA section only
        else:
            sections.append(sec)
    for si, sec in enumerate(sections):
        label = labels[si] if si < len(labels) else sec.kind
        swa = hparams if hparams is not None and "SWA" in label and hparams.n_swa > 0 else None
        n_swa = int(swa.n_swa) if swa is not None else 0
        swa_type = int(swa.swa_type) if swa is not None else 0
        if sec.kind == "kv":
            for s, st in enumerate(cast("KVSection", sec).streams):
                c = st.cells
                if c is None:
                    out.append(Panel(f"section {si} ({label}), stream {s}: empty", np.zeros(0, np.int64),
                                     np.zeros(0, np.int32), []))  # fmt: skip
                    continue
                out.append(Panel(f"section {si} ({label}), stream {s}", np.arange(c.n), np.asarray(c.pos),
                                 _seqs(c), None, n_swa, swa_type))  # fmt: skip
        else:
            c = cast("RecurrentSection", sec).cells
            out.append(Panel(f"section {si} ({label})", np.arange(c.n), np.asarray(c.pos), _seqs(c)))
    return out


def memory_panels(mem: AnyMemory) -> list[Panel]:
    """The panels of a memory: every stream of every cache, with its cell indices and pending K-shift."""
    from ..memory.kv_cache import KVCache
    from ..memory.kv_state import written_cells
    from .restore import leaf_caches

    out = []
    for si, leaf in enumerate(leaf_caches(mem)):
        if not isinstance(leaf, KVCache):
            (sec,) = leaf.state_sections(-1)
            c = sec.cells
            out.append(Panel(f"section {si} (recurrent)", np.arange(c.n), np.asarray(c.pos), _seqs(c)))
            continue
        for s in range(leaf.n_stream):
            cells = leaf.cells(s)
            idx = written_cells(leaf, s, -1)
            seqs = [tuple(int(x) for x in cells.seq_get_all(int(i))) for i in idx]
            shift = np.asarray(cells.shift)[idx] if cells.get_has_shift() else None
            out.append(Panel(f"section {si} (KV{', SWA' if leaf.n_swa else ''}), stream {s}", idx.astype(np.int64),
                             np.asarray(cells.pos)[idx], seqs, shift, leaf.n_swa, int(leaf.swa_type)))  # fmt: skip
    return out


PICTURE_SUFFIXES = (".png", ".svg", ".pdf")


def draw(panels: list[Panel], out: str | os.PathLike[str], title: str = "") -> str:
    """Render ``panels`` to ``out`` (PNG, SVG, PDF: by suffix); returns the path."""
    from ..hparams import is_masked_swa

    suffix = os.path.splitext(os.fspath(out))[1].lower()
    if suffix not in PICTURE_SUFFIXES:
        raise KVRefError(f"{os.fspath(out)}: kvref plot draws {', '.join(PICTURE_SUFFIXES)} pictures (by the output's "
                         f"suffix), not {suffix or 'a file without a suffix'}")  # fmt: skip
    plt = _pyplot()
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.ticker import MaxNLocator

    n = max(len(panels), 1)
    heights = [max(1.2, 0.35 * (len({x for t in p.seqs for x in t}) or 1) + 0.9) for p in panels] or [1.5]
    fig, axes = plt.subplots(n, 1, figsize=(11, sum(heights) + 1.4), squeeze=False, layout="constrained",
                             gridspec_kw={"height_ratios": heights})  # fmt: skip
    all_pos = np.concatenate([p.pos for p in panels if len(p.pos)]) if any(len(p.pos) for p in panels) else None
    vmin, vmax = (int(all_pos.min()), int(max(all_pos.max(), all_pos.min() + 1))) if all_pos is not None else (0, 1)
    cmap = plt.get_cmap("viridis")
    norm = plt.Normalize(vmin, vmax)
    legend: dict[str, Patch] = {}
    for ax, p in zip(axes[:, 0], panels, strict=False):
        ids = sorted({x for t in p.seqs for x in t})
        row = {sid: k for k, sid in enumerate(ids)}
        last = {sid: max(int(p.pos[i]) for i, t in enumerate(p.seqs) if sid in t) for sid in ids}
        few = len(p.cells) <= 48
        for i, t in enumerate(p.seqs):
            x = int(p.cells[i])
            for sid in t:
                masked = p.n_swa > 0 and bool(is_masked_swa(p.n_swa, p.swa_type, int(p.pos[i]), last[sid]))
                color = cmap(norm(int(p.pos[i])))
                ax.add_patch(Rectangle((x - 0.45, row[sid] - 0.4), 0.9, 0.8, facecolor="white" if masked else color,
                                       edgecolor=color if masked else "none", hatch="///" if masked else None,
                                       linewidth=1.0))  # fmt: skip
                if masked:
                    legend["outside the SWA window (masked)"] = Patch(facecolor="white", edgecolor="gray", hatch="///")
                if p.shift is not None and int(p.shift[i]) != 0:
                    ax.add_patch(Rectangle((x - 0.5, row[sid] - 0.48), 1.0, 0.96, fill=False, edgecolor="red",
                                           linewidth=1.6))  # fmt: skip
                    legend["pending K-shift (applied at update)"] = Patch(facecolor="white", edgecolor="red")
                if few:
                    lum = 1.0 if masked else float(np.dot(color[:3], (0.299, 0.587, 0.114)))
                    txt = f"{int(p.pos[i])}" + (f"\n{int(p.shift[i]):+d}" if p.shift is not None and p.shift[i] else "")
                    ax.text(x, row[sid], txt, ha="center", va="center", fontsize=7,
                            color="black" if lum > 0.5 else "white")  # fmt: skip
        lo = int(p.cells.min()) if len(p.cells) else 0
        hi = int(p.cells.max()) if len(p.cells) else 1
        ax.set_xlim(lo - 0.8, hi + 0.8)
        ax.set_ylim(-0.7, max(len(ids), 1) - 0.3)
        ax.set_yticks(range(len(ids)))
        ax.set_yticklabels([f"seq {s}" for s in ids])
        ax.invert_yaxis()
        extra = f", SWA window {p.n_swa}" if p.n_swa else ""
        ax.set_title(f"{p.title}: {len(p.cells)} cells{extra}", fontsize=10, loc="left")
        ax.set_xlabel("cell", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # cells are whole: no tick at 0.5
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", alpha=0.2)
    sm = plt.cm.ScalarMappable(norm=norm, cmap=cmap)
    fig.colorbar(sm, ax=axes[:, 0].tolist(), label="position", fraction=0.025, pad=0.01, aspect=max(10, 8 * n))
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="outside lower left", fontsize=8, frameon=False, ncols=2)
    if title:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    path = os.fspath(out)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(
    source: StateSource | AnyMemory,
    out: str | os.PathLike[str],
    *,
    hparams: HParams | None = None,
    model: str | os.PathLike[str] | None = None,
) -> str:
    """Draw a state (path, bytes or loaded state) or a memory to ``out``; returns the path."""
    from .. import state

    if model is not None and hparams is None:
        from ..hparams import HParams

        hparams = HParams.from_gguf(os.fspath(model))
    if hasattr(source, "state_sections") and hasattr(source, "profile"):
        mem = cast("AnyMemory", source)
        return draw(memory_panels(mem), out, f"{type(mem).__name__} ({mem.profile.name})")
    obj = (
        source if isinstance(source, state.StateObject) else state.load(cast("Source", source), model=hparams)
    )  # (versions 5 .. 7)
    name = os.path.basename(os.fspath(source)) if isinstance(source, str | os.PathLike) else obj.kind
    return draw(state_panels(obj, hparams), out, f"{name}: {obj.kind}, {obj.memory.layout} memory")


__all__ = ["INSTALL", "Panel", "draw", "memory_panels", "plot", "state_panels"]
