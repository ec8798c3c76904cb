"""`ps-plot`: turn the JSON Lines of a `--log-dir` into PNG charts.

It reads every `*.jsonl` file of the log dir (see common.metrics for the records) and writes
four charts: the train loss of each worker and the server's test loss over the steps, the
server's test accuracy and each worker's train accuracy over the steps, the staleness
histogram of the server's updates, and the time per step over the run. It is not a live
dashboard; for that, point TensorBoard at DIR/tb.
"""

import json
from pathlib import Path
from typing import Any

import click
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from common.cli import ENV_PREFIX, EnvAwareCommand, explain_errors
from common.errors import ConfigError, DataError
from common.logs import counted

Record = dict[str, Any]
SMOOTH_ABOVE = 50  # series longer than this also get a moving average


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


def events(records: list[Record], event: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of one key, from the records of one event that have it."""
    chosen = [r for r in records if r["event"] == event and is_number(r.get(key))]
    if event == "step":
        chosen = [r for r in chosen if r.get("applied", True)]
    return np.array([r["step"] for r in chosen]), np.array([r[key] for r in chosen], float)


def plot_series(axes: Axes, x: np.ndarray, y: np.ndarray, label: str, **style: Any) -> None:
    """A line; a long, noisy one is drawn faint, with its moving average on top."""
    if len(x) <= SMOOTH_ABOVE:
        axes.plot(x, y, label=label, **style)
        return
    width = max(2, len(x) // 25)
    smooth = np.convolve(y, np.ones(width) / width, mode="valid")  # (n - width + 1,)
    style["color"] = axes.plot(x, y, alpha=0.25, linewidth=0.8, **style)[0].get_color()
    axes.plot(x[width - 1 :], smooth, label=label, **style)


def workers(runs: dict[str, list[Record]]) -> list[str]:
    return [name for name in runs if name != "server"]


def plot_loss(runs: dict[str, list[Record]], axes: Axes) -> None:
    for name in workers(runs):
        plot_series(axes, *events(runs[name], "step", "train_loss"), f"{name} train")
    if "server" in runs:
        steps, loss = events(runs["server"], "eval", "test_loss")
        axes.plot(steps, loss, "ko-", label="server test")
    axes.set(xlabel="server step", ylabel="cross-entropy loss", title="Loss")


def plot_accuracy(runs: dict[str, list[Record]], axes: Axes) -> None:
    for name in workers(runs):
        plot_series(axes, *events(runs[name], "step", "train_accuracy"), f"{name} train")
    if "server" in runs:
        steps, accuracy = events(runs["server"], "eval", "test_accuracy")
        axes.plot(steps, accuracy, "ko-", label="server test")
    axes.set(xlabel="server step", ylabel="accuracy", ylim=(0, 1), title="Accuracy")


def plot_staleness(runs: dict[str, list[Record]], axes: Axes) -> None:
    # The server sees every applied update; without its file, the workers' acks tell the same.
    sources = ["server"] if "server" in runs else workers(runs)
    event = "update" if sources == ["server"] else "step"
    values = np.concatenate([events(runs[name], event, "staleness")[1] for name in sources])
    # Only the staleness values that occur: a bogus huge one must not size an array.
    stalenesses, counts = np.unique(values.astype(np.int64), return_counts=True)
    axes.bar(stalenesses, counts, width=0.8)
    axes.set(
        xlabel="staleness (updates between pull and apply)",
        ylabel="updates",
        title=f"Staleness ({len(values)} updates; always 0 in sync mode)",
    )


def plot_step_time(runs: dict[str, list[Record]], top: Axes, bottom: Axes) -> None:
    start = min(r["time"] for records in runs.values() for r in records)
    for index, (name, records) in enumerate(runs.items()):
        event = "update" if name == "server" else "step"
        keys = ("step_time_s",) if name == "server" else ("step_time_s", "compute_s", "comm_s")
        chosen = [
            r for r in records if r["event"] == event and all(is_number(r.get(k)) for k in keys)
        ]
        seconds = np.array([r["time"] - start for r in chosen])
        label, color = ("server: between updates" if name == "server" else name), f"C{index}"
        step_time = np.array([r["step_time_s"] for r in chosen])
        plot_series(top, seconds, step_time, label, color=color)
        if name != "server":  # communication includes waiting for the server to answer
            compute = np.array([r["compute_s"] for r in chosen])
            comm = np.array([r["comm_s"] for r in chosen])
            plot_series(bottom, seconds, compute, f"{name} compute", color=color)
            plot_series(bottom, seconds, comm, f"{name} pull + push", color=color, ls="--")
    top.set(ylabel="seconds per step", title="Step time")
    bottom.set(xlabel="seconds since the first record", ylabel="seconds per step")


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
    for name, draw in (
        ("loss", plot_loss),
        ("accuracy", plot_accuracy),
        ("staleness", plot_staleness),
    ):
        figure = Figure(figsize=(8, 5))
        draw(runs, figure.add_subplot())
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
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Folder for the PNG files (default: LOG_DIR/plots).",
)
@explain_errors
def command(log_dir: Path, out: Path | None) -> None:
    """Plot the metrics that ps-server, ps-worker or ps-local wrote with --log-dir."""
    for path in write_plots(log_dir, out or log_dir / "plots"):
        click.echo(str(path))


def main() -> None:
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
