"""Pieces every `ps-bench` command shares: their options (the product's, with the defaults
and help of a benchmark, and their own), --phases' checks, and running phases in turns with
progress on stderr."""

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from common.cli import BucketMegabytes, FiniteFloatRange, name_the_variable, timeout_seconds
from common.errors import ConfigError
from common.options import (
    BATCH_SIZE,
    BUCKET_MB,
    EPOCHS,
    LOCAL_DEVICE,
    MODEL,
    NUM_SHARDS,
    THREADS,
    TRAIN_LIMIT,
    WORKERS,
    Option,
)
from psserver.config import check_writable_file

T = TypeVar("T")


class OutputFile(click.Path):
    """A file to write: `--json ''` became the current folder, and `--json /tmp` was
    refused as "/ is not a writable folder"; both now say what is wrong."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False, path_type=Path)

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("is empty: name the file to write, e.g. results.json", param, ctx)
        if Path(value).is_dir():
            example = Path(value) / "results.json"
            self.fail(f"{value} is a folder: name a file in it, e.g. {example}", param, ctx)
        return super().convert(value, param, ctx)


# The option each output option must not share its file with.
OTHER_OUTPUT = {"json_path": ("plot", "--plot"), "plot": ("json_path", "--json")}


def _writable(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """Checked before the runs: a path that cannot be written used to fail after all of them,
    with a traceback, and the results were lost. --json and --plot on one file: the plot
    overwrote the results."""
    if value is None:
        return None
    try:
        check_writable_file(value, param.opts[0])  # --json or --plot
    except ConfigError as exc:
        raise click.BadParameter(str(exc)) from None
    other, flag = OTHER_OUTPUT[str(param.name)]
    given = ctx.params.get(other)  # set already if its option was read first
    if given is not None and given.resolve() == value.resolve():
        raise click.BadParameter(
            f"{value} is {flag}'s file too: the plot would overwrite the results; give "
            "them different files, e.g. --json results.json --plot results.png"
        )
    return value


def _plot_path(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """Writable, and in a format matplotlib writes: `plot.out` failed after all the runs, with
    a traceback, and `plot` became plot.png unasked."""
    if value is None:
        return None
    _writable(ctx, param, value)
    from matplotlib.backend_bases import FigureCanvasBase  # slow to import: only when asked

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if value.suffix.lstrip(".").lower() not in formats:
        raise click.BadParameter(
            f"{value} does not end in a picture format; name a .png file (or one of "
            f".{', .'.join(formats)})"
        )
    return value


def output_options(plotted: str) -> tuple[Option, Option]:
    """--json PATH and --plot PNG, which every benchmark takes."""
    return (
        Option(
            "--json",
            name="json_path",
            type=OutputFile(),
            default=None,
            callback=_writable,
            help="Write the results here.",
        ),
        Option(
            "--plot",
            type=OutputFile(),
            default=None,
            callback=_plot_path,
            help=f"Write a PNG bar chart of {plotted} here.",
        ),
    )


# The product's options, as each benchmark takes them: shown defaults are the group's.
def workers(help: str, least: int = 1) -> Option:
    return WORKERS.but(type=click.IntRange(min=least), help=help, show_default=None)


def model(default: str, help: str) -> Option:
    return MODEL.but(default=default, help=help, show_default=None)


def batch_size(help: str) -> Option:
    return BATCH_SIZE.but(type=click.IntRange(min=1), default=64, help=help, show_default=None)


def steps(default: int, help: str) -> Option:
    return Option("--steps", type=click.IntRange(min=3), default=default, help=help)


def threads(help: str) -> Option:
    return THREADS.but(default=1, help=help)


def num_shards(help: str) -> Option:
    return NUM_SHARDS.but(help=help, show_default=None)


def repeat(help: str) -> Option:
    return Option("--repeat", type=click.IntRange(min=1), default=1, help=help)


STRAGGLER_EPOCHS = EPOCHS.but(
    default=2,
    help="Epochs of --train-limit images each policy's run trains; the test accuracy is "
    "taken at the end.",
    show_default=None,
)
STRAGGLER_TRAIN_LIMIT = TRAIN_LIMIT.but(
    type=click.IntRange(min=1),
    default=6000,
    help="Train on the first this many images of the embedded training set (the default is "
    "all of it); at least --workers x --batch-size, one step's worth.",
)
TRAIN_DEVICE = LOCAL_DEVICE.but(
    help="auto: one GPU per worker and rank if there are enough, else the CPU."
)
RUN_TIMEOUT = Option(
    "--timeout", type=timeout_seconds(), default=1800.0, help="Seconds each run may take."
)
# The server's --bucket-mb in the runs that send buckets: like DDP's bucket_cap_mb.
BENCH_BUCKET_MB = BUCKET_MB.but(
    type=BucketMegabytes(min=0, min_open=True),
    show_default="the server's: 2 over its shards, at least 0.5",
    help="The server's gradient buckets in the bucketed runs (a 'whole' run uses one); at "
    "least one float32 value (4 bytes, 3.82e-06 MB).",
)
SLOWDOWN = Option(
    "--slowdown",
    type=FiniteFloatRange(min=1),
    default=2.0,
    show_default=True,
    help="How many times as long the slow worker takes per step: it sleeps (slowdown - 1) "
    "times one worker step, timed on this machine by a short sync run first.",
)
DELAY = Option(
    "--delay",
    type=FiniteFloatRange(min=0),
    default=None,
    help="Seconds the slow worker sleeps per step, instead of --slowdown: skips the "
    "calibration run (and the report's slowdown).",
)


def announced(
    index: int, total: int, description: str, run: Callable[[], T], outcome: Callable[[T], str]
) -> T:
    """One run of a benchmark, with a progress line on stderr: what runs, then its outcome
    and how long it took (or that it failed)."""
    click.echo(f"[{index}/{total}] {description} ...", err=True, nl=False)
    started = time.perf_counter()
    try:
        result = run()
    except KeyboardInterrupt:
        click.echo(" interrupted", err=True)
        raise
    except BaseException:
        click.echo(" failed", err=True)
        raise
    click.echo(f" {outcome(result)} ({time.perf_counter() - started:.0f} s)", err=True)
    return result


def _rate(images_per_second: float) -> str:
    return f"{images_per_second:.1f} img/s"


def in_turns(phases: Sequence[str], repeat: int) -> list[str]:
    """Every phase `repeat` times, taking turns, each turn starting one phase later than the
    one before: no phase always runs first (on a machine still settling), or always right
    after the same other one."""
    order = list(phases)
    return [order[(turn + i) % len(order)] for turn in range(repeat) for i in range(len(order))]


def run_in_turns(
    phases: Sequence[str],
    repeat: int,
    describe_phase: Callable[[str], str],
    run: Callable[[str], float],
) -> dict[str, list[float]]:
    """Every phase `repeat` times, taking turns (`in_turns`); each run's images/s, by phase."""
    runs: dict[str, list[float]] = {phase: [] for phase in phases}
    total = len(phases) * repeat
    for i, phase in enumerate(in_turns(phases, repeat), start=1):
        rate = announced(i, total, describe_phase(phase), functools.partial(run, phase), _rate)
        runs[phase].append(rate)
    return runs


def parse_phases(text: str, order: Sequence[str]) -> tuple[str, ...]:
    """`--phases sync,ddp` -> ("sync", "ddp"), in `order`; names not in it come last, for
    `check_phases` to refuse."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    known = [phase for phase in order if phase in names]
    return (*known, *sorted(names - set(known)))


class PhasesError(ConfigError):
    """--phases names phases that cannot run; `reason` says why, to follow the option's name."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"--phases {reason}")
        self.reason = reason


def check_phases(phases: Sequence[str], available: Sequence[str]) -> None:
    """A PhasesError unless `phases` are some of `available`, DDP among them."""
    unknown = [phase for phase in phases if phase not in available]
    if unknown or not phases:
        raise PhasesError(
            f"must be a comma-separated list of {', '.join(available)}; "
            f"got {','.join(phases) or 'nothing'}"
        )
    if "ddp" not in phases:
        raise PhasesError("must include ddp: every rate is reported against it")


def option_error(ctx: click.Context, name: str, message: str) -> click.BadParameter:
    """A usage error (exit 2) about option `name`, found after the options were read: it
    names the PS_ variable the value came from, if it did, as click does for the options it
    checks itself."""
    param = next(p for p in ctx.command.params if p.name == name)
    error = click.BadParameter(message, ctx=ctx, param=param)
    name_the_variable(error, ctx)
    return error
