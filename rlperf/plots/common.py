"""What every rlperf picture shares: a headless figure, an atomic PNG write, an HTML page embedding it."""
from __future__ import annotations

import base64
import html
import os
from pathlib import Path

DPI = 100


class PlotInputError(ValueError):
    """A file or directory to plot is missing or malformed; the message names the path (and line)."""


def new_figure(width: float, height: float):
    """A matplotlib ``Figure`` (inches) on the Agg canvas: no pyplot, no display, no global backend switch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | Path) -> Path:
    """Write ``fig`` to ``path`` as PNG through a temporary file and a rename, so a viewer (or a page that
    reloads) never reads half a picture while a run redraws it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=DPI)
    os.replace(tmp, path)
    return path


def write_html(png: Path, title: str, lines: list[str] = ()) -> Path:
    """``png`` with ``.html``: a self-contained page (the picture embedded as a data URI), the title and
    ``lines`` (what was plotted) under it."""
    png = Path(png)
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    items = "".join(f"<li>{html.escape(x)}</li>" for x in lines)
    page = (f"<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title></head>\n"
            f"<body style=\"font-family: sans-serif\">\n<h3>{html.escape(title)}</h3>\n"
            f"<img alt=\"{html.escape(png.name)}\" style=\"max-width: 100%\" src=\"data:image/png;base64,{data}\">\n"
            f"<ul>{items}</ul>\n</body></html>\n")
    out = png.with_suffix(".html")
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(page)
    os.replace(tmp, out)
    return out
