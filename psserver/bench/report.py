"""Benchmark output: a markdown table on stdout, JSON results, and an optional PNG plot."""

import json
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common.errors import PSError

# The title's characters per line: the figure is 7 inches wide, and a title set over the
# axes alone (right of the long bar labels) was cut off at the figure's edge.
TITLE_WIDTH = 70


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(value: Any) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: Path, results: dict[str, Any]) -> None:
    text = json.dumps(results, indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:  # checked at the start; the disk may have filled since
        raise PSError(
            f"could not write the results to {path} ({exc.strerror or exc}); they were:\n{text}"
        ) from None


def bar_plot(
    path: Path,
    title: str,
    labels: Sequence[str],
    values: Sequence[float],
    axis_label: str,
    spans: Sequence[tuple[float, float]] | None = None,
) -> None:
    """One horizontal bar per run, top to bottom in table order: long labels stay readable.
    `spans`, one (lowest, highest) per bar, are drawn as whiskers: how far repeated runs of
    the same kind moved, against which a difference between bars must be read."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    errors = None
    if spans is not None:
        errors = [
            [value - low for value, (low, _) in zip(values, spans, strict=True)],
            [high - value for value, (_, high) in zip(values, spans, strict=True)],
        ]  # (2, bars): below and above each bar's value
    figure, axes = plt.subplots(figsize=(7, 1.2 + 0.45 * len(labels)))
    axes.barh(labels, values, color="#4c72b0", xerr=errors, capsize=4, ecolor="#333333")
    axes.invert_yaxis()
    figure.suptitle(textwrap.fill(title, TITLE_WIDTH))  # centred on the figure, not the axes
    axes.set_xlabel(axis_label)
    highest = max([*values, *(high for _, high in spans or [])], default=1.0)
    axes.set_xlim(0, highest * 1.18)  # room for the numbers
    for i, value in enumerate(values):
        end = value if spans is None else spans[i][1]
        axes.annotate(f" {value:.1f}", (end, i), ha="left", va="center")
    figure.tight_layout()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, dpi=120)
    except OSError as exc:
        raise PSError(f"could not write the plot to {path} ({exc.strerror or exc})") from None
    finally:
        plt.close(figure)
