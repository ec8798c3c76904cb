"""Pieces every `ps-bench` command shares: the --json and --plot options, --bucket-mb, and
running phases in turns with progress on stderr."""

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def output_options(plotted: str) -> Callable[[F], F]:
    """--json PATH and --plot PNG, which every benchmark takes."""

    def decorate(func: F) -> F:
        func = click.option(
            "--plot",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help=f"Write a PNG bar chart of {plotted} here.",
        )(func)
        return click.option(
            "--json",
            "json_path",
            type=click.Path(dir_okay=False, path_type=Path),
            default=None,
            help="Write the results here.",
        )(func)

    return decorate


# The server's --bucket-mb in the runs that send buckets: like DDP's bucket_cap_mb.
bucket_mb_option = click.option(
    "--bucket-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    show_default="the server's: 2 over its shards, at least 0.5",
    help="The server's gradient buckets in the bucketed runs (a 'whole' run uses one).",
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
    except BaseException:
        click.echo(" failed", err=True)
        raise
    click.echo(f" {outcome(result)} ({time.perf_counter() - started:.0f} s)", err=True)
    return result


def _rate(images_per_second: float) -> str:
    return f"{images_per_second:.1f} img/s"


def run_in_turns(
    phases: Sequence[str],
    repeat: int,
    describe_phase: Callable[[str], str],
    run: Callable[[str], float],
) -> dict[str, list[float]]:
    """Every phase `repeat` times, taking turns; each run's images/s, by phase."""
    runs: dict[str, list[float]] = {phase: [] for phase in phases}
    total = len(phases) * repeat
    for i, phase in enumerate(list(phases) * repeat, start=1):
        rate = announced(i, total, describe_phase(phase), functools.partial(run, phase), _rate)
        runs[phase].append(rate)
    return runs
