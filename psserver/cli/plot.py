"""`ps-plot`: turn the JSON Lines of a `--log-dir` into PNG charts.

It reads every `*.jsonl` file of the log dir (see common.metrics for the records) and writes
four charts: the train loss of each worker and the server's test loss over the steps, the
server's test accuracy and each worker's train accuracy over the steps, the staleness
histogram of the server's updates (titled with the run's mode, from its `job` record), and
the time per step over the run. It is not a live dashboard; for that, point TensorBoard at
DIR/tb.

The charts over steps count every step once, as the server's summary does: a server that
resumed from a checkpoint trains the steps after it again, and their first records, in every
file, are left out (`standing`). The chart over time keeps them, since that time was spent,
and breaks its lines where no record came for a while (a server down, a worker paused)
rather than drawing a straight line across. A panel with nothing to draw says why.
"""

import itertools
import json
import textwrap
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import click
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from common.cli import ENV_PREFIX, EnvAwareCommand, explain_errors
from common.errors import ConfigError, DataError
from common.job import MODES
from common.logs import counted
from common.options import Option, options
from common.startup import freeze_imported_objects

Record = dict[str, Any]
SMOOTH_ABOVE = 50  # series longer than this also get a moving average
# A line breaks where the time between two records is this many times their usual spacing,
# and at least GAP_MIN_S (an evaluation or a checkpoint between two updates is no outage).
GAP_FACTOR, GAP_MIN_S = 10.0, 2.0
NOTE_WIDTH = 60  # characters a line of an empty panel's note
LOG_SCALE_ABOVE = 10.0  # series whose typical values differ this much share a log scale


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_metrics(log_dir: Path) -> dict[str, list[Record]]:
    """Records by file name (`server`, `worker-1`, ...). What is not a record is skipped: a
    torn last line, a file that cannot be read as text, a record without a numeric time and
    step. (Fields that are not numbers are left out where they are plotted: `events`.)"""
    runs: dict[str, list[Record]] = {}
    files = sorted(log_dir.glob("*.jsonl"))
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            click.echo(f"skipped {path}: cannot be read as text ({exc})", err=True)
            continue
        records, foreign = [], 0
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                click.echo(f"skipped line {number} of {path}: not JSON", err=True)
                continue
            if (
                isinstance(record, dict)
                and isinstance(record.get("event"), str)
                and is_number(record.get("time"))
                and is_number(record.get("step"))
            ):
                records.append(record)
            else:
                foreign += 1
        if foreign:  # once a file: another program's .jsonl may hold thousands
            click.echo(
                f"skipped {counted(foreign, 'line')} of {path}: JSON, but not a record with an "
                "event, a numeric time and a numeric step",
                err=True,
            )
        if records:
            runs[path.stem] = records
        elif not text.strip():  # a writer that gave up at its first line (a full disk) left it
            click.echo(f"skipped {path}: empty", err=True)
    if not runs and files:
        raise DataError(
            f"no metrics in {log_dir}: none of its {len(files)} .jsonl files holds a record "
            "of ps-server or ps-worker --log-dir (see the lines skipped above)"
        )
    if not runs:
        raise DataError(
            f"no metrics in {log_dir}: expected server.jsonl or worker-ID.jsonl files; "
            "train with --log-dir DIR first"
        )
    return runs


def standing(runs: dict[str, list[Record]]) -> dict[str, list[Record]]:
    """The records whose steps still stand (see the module doc): a server that resumed from
    its checkpoint at step s wrote a `resume` record; what any file recorded before it past
    step s was trained again, and is left out. (Times compare across files written on one
    host, or on hosts whose clocks agree.)"""
    resumes = [(r["time"], r["step"]) for r in runs.get("server", []) if r["event"] == "resume"]
    return {
        name: [r for r in records if not any(r["time"] < t and r["step"] > s for t, s in resumes)]
        for name, records in runs.items()
    }


def events(records: list[Record], event: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one key, from the records of one event that have it."""
    chosen = [r for r in records if r["event"] == event and is_number(r.get(key))]
    if event == "step":
        chosen = [r for r in chosen if r.get("applied", True)]
    return np.array([r["step"] for r in chosen]), np.array([r[key] for r in chosen], float)


def runs_of_gaps(x: np.ndarray) -> list[slice]:
    """The runs of `x` (times, ascending) with no gap inside: a gap is GAP_FACTOR times the
    usual spacing of the records, and at least GAP_MIN_S."""
    if len(x) < 2:
        return [slice(0, len(x))]
    spacing = np.diff(x)  # (n - 1,)
    gap = max(GAP_MIN_S, GAP_FACTOR * float(np.median(spacing)))
    bounds = [0, *(np.flatnonzero(spacing > gap) + 1).tolist(), len(x)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def joined(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One line of several pieces, with NaN between them: matplotlib leaves a gap there."""
    xs, ys = [], []
    for x, y in pieces:
        xs += [x, np.array([np.nan])]
        ys += [y, np.array([np.nan])]
    if not xs:
        return np.array([]), np.array([])
    return np.concatenate(xs[:-1]), np.concatenate(ys[:-1])


def plot_series(
    axes: Axes, x: np.ndarray, y: np.ndarray, label: str, gaps: bool = False, **style: Any
) -> None:
    """A line; a long, noisy one is drawn faint, with its moving average on top. `gaps`:
    break it where no record came for a while (runs_of_gaps), the average too."""
    runs = runs_of_gaps(x) if gaps else [slice(0, len(x))]
    if len(x) <= SMOOTH_ABOVE:
        axes.plot(*joined([(x[r], y[r]) for r in runs]), label=label, **style)
        return
    width = max(2, len(x) // 25)
    faint = {**style, "alpha": 0.25, "linewidth": 0.8}
    style["color"] = axes.plot(*joined([(x[r], y[r]) for r in runs]), **faint)[0].get_color()
    smooth = []
    for run in runs:
        w = min(width, len(x[run]))
        average = np.convolve(y[run], np.ones(w) / w, mode="valid")  # (len - w + 1,)
        smooth.append((x[run][w - 1 :], average))
    axes.plot(*joined(smooth), label=label, **style)


def workers(runs: dict[str, list[Record]]) -> list[str]:
    return [name for name in runs if name != "server"]


def run_mode(runs: dict[str, list[Record]]) -> str | None:
    """The run's mode, from the last `job` record of the server (or else of a worker)."""
    for name in (["server"] if "server" in runs else []) + workers(runs):
        modes = [r.get("mode") for r in runs[name] if r["event"] == "job"]
        known = [mode for mode in modes if mode in MODES]
        if known:
            return known[-1]
    return None


def say_if_empty(axes: Axes, why: str) -> None:
    """A panel with nothing drawn says so, and why, instead of showing empty axes."""
    if axes.patches or any(np.size(line.get_xdata()) for line in axes.lines):
        return
    note = textwrap.fill(f"no data: {why}", NOTE_WIDTH)  # matplotlib's wrap overflows axes
    axes.text(0.5, 0.5, note, transform=axes.transAxes, ha="center", va="center", color="0.3")


def no_worker_files(runs: dict[str, list[Record]]) -> str:
    """Why worker records are missing, when they are: no worker wrote a file here."""
    return "" if workers(runs) else "no worker-*.jsonl here (ps-worker --log-dir writes one); "


@dataclass(frozen=True)
class Measure:
    """A quantity drawn over the steps: each worker's `train_KEY` of its steps, and the
    server's `test_KEY` of its evaluations."""

    key: str  # "loss": the records' train_loss and test_loss
    ylabel: str
    title: str
    ylim: tuple[float, float] | None = None


LOSS = Measure("loss", "cross-entropy loss", "Loss")
ACCURACY = Measure("accuracy", "accuracy", "Accuracy", ylim=(0, 1))


def plot_train_and_test(runs: dict[str, list[Record]], axes: Axes, measure: Measure) -> None:
    for name in workers(runs):
        plot_series(axes, *events(runs[name], "step", f"train_{measure.key}"), f"{name} train")
    if "server" in runs:
        steps, values = events(runs["server"], "eval", f"test_{measure.key}")
        if len(steps):
            axes.plot(steps, values, "ko-", label="server test")
    axes.set(xlabel="server step", ylabel=measure.ylabel, title=measure.title)
    if measure.ylim is not None:
        axes.set_ylim(*measure.ylim)
    why = f"{no_worker_files(runs)}no train {measure.key}, and no server evaluation"
    say_if_empty(axes, why)


def plot_staleness(runs: dict[str, list[Record]], axes: Axes) -> None:
    # The server sees every applied update; without its file, the workers' acks tell the same.
    sources = ["server"] if "server" in runs else workers(runs)
    event = "update" if sources == ["server"] else "step"
    values = np.concatenate([events(runs[name], event, "staleness")[1] for name in sources])
    # Only the staleness values that occur: a bogus huge one must not size an array.
    stalenesses, counts = np.unique(values.astype(np.int64), return_counts=True)
    if len(values):
        axes.bar(stalenesses, counts, width=0.8)
    mode = run_mode(runs)
    how = {None: "", "sync": "; sync mode: always 0"}.get(mode, f"; {mode} mode")
    axes.set(
        xlabel="staleness (updates between pull and apply)",
        ylabel="updates",
        title=f"Staleness ({counted(len(values), 'update')}{how})",
    )
    where = "server.jsonl records" if "server" in runs else "the workers' files record"
    say_if_empty(axes, f"{where} no applied update yet")


def plot_step_time(runs: dict[str, list[Record]], top: Axes, bottom: Axes) -> None:
    """Workers first, the server last and on top, in black: in sync mode its time between
    updates is the workers' step time, and a line drawn under theirs was hidden."""
    start = min(r["time"] for records in runs.values() for r in records)
    order = [*workers(runs), *(["server"] if "server" in runs else [])]
    for index, name in enumerate(order):
        server = name == "server"
        event = "update" if server else "step"
        keys = ("step_time_s",) if server else ("step_time_s", "compute_s", "comm_s")
        chosen = [
            r for r in runs[name] if r["event"] == event and all(is_number(r.get(k)) for k in keys)
        ]
        chosen.sort(key=lambda r: r["time"])
        seconds = np.array([r["time"] - start for r in chosen])
        if not len(seconds):
            continue
        step_time = np.array([r["step_time_s"] for r in chosen])
        if server:
            style = {"color": "black", "linewidth": 1.6, "zorder": 3}
            plot_series(top, seconds, step_time, "server: between updates", True, **style)
            continue
        plot_series(top, seconds, step_time, name, True, color=f"C{index}")
        # Communication includes waiting for the server to answer.
        compute = np.array([r["compute_s"] for r in chosen])
        comm = np.array([r["comm_s"] for r in chosen])
        plot_series(bottom, seconds, compute, f"{name} compute", True, color=f"C{index}")
        plot_series(bottom, seconds, comm, f"{name} pull + push", True, color=f"C{index}", ls="--")
    for axes in (top, bottom):
        log_scale_if_apart(axes)
    top.set(ylabel="seconds per step", title="Step time")
    bottom.set(xlabel="seconds since the first record", ylabel="seconds per step")
    say_if_empty(top, "no update or step records with a step time")
    say_if_empty(bottom, f"{no_worker_files(runs)}no worker step with compute and comm times")


def log_scale_if_apart(axes: Axes) -> None:
    """A log scale for lines whose typical values (medians) differ by LOG_SCALE_ABOVE or
    more: on a linear one, a server that updates every few milliseconds for workers that
    each take a second drew a flat line along the axis."""
    medians = []
    for line in axes.lines:
        values = np.asarray(line.get_ydata(), float)
        values = values[np.isfinite(values) & (values > 0)]
        if len(values):
            medians.append(float(np.median(values)))
    if medians and max(medians) >= LOG_SCALE_ABOVE * min(medians):
        axes.set_yscale("log")


def save(figure: Figure, path: Path) -> Path:
    for axes in figure.axes:
        if axes.get_legend_handles_labels()[0]:
            axes.legend(fontsize="small")
        axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def write_plots(log_dir: Path, out: Path) -> list[Path]:
    runs = read_metrics(log_dir)
    try:
        return _draw_all(runs, out)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the plots to {out} ({exc.strerror or exc}); pick another --out"
        ) from None


def _draw_all(runs: dict[str, list[Record]], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    by_step = standing(runs)
    for name, draw in (
        ("loss", partial(plot_train_and_test, measure=LOSS)),
        ("accuracy", partial(plot_train_and_test, measure=ACCURACY)),
        ("staleness", plot_staleness),
    ):
        figure = Figure(figsize=(8, 5))
        draw(by_step, figure.add_subplot())
        written.append(save(figure, out / f"{name}.png"))
    figure = Figure(figsize=(8, 7))
    top, bottom = figure.subplots(2, 1, sharex=True)
    plot_step_time(runs, top, bottom)
    written.append(save(figure, out / "step_time.png"))
    return written


@click.command(
    cls=EnvAwareCommand, context_settings={"show_default": True, "max_content_width": 100}
)
@click.argument("log_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@options(
    Option(
        "--out",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Folder for the PNG files (default: LOG_DIR/plots).",
    )
)
@explain_errors
def command(log_dir: Path, out: Path | None) -> None:
    """Plot the metrics that ps-server, ps-worker or ps-local wrote with --log-dir."""
    for path in write_plots(log_dir, out or log_dir / "plots"):
        click.echo(str(path))


def main() -> None:
    freeze_imported_objects()
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
