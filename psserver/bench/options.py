"""Pieces every `ps-bench` command shares: the --json and --plot options, --bucket-mb, and
running phases in turns with progress on stderr."""

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


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
        click.echo(f"[{i}/{total}] {describe_phase(phase)} ...", err=True, nl=False)
        started = time.perf_counter()
        try:
            runs[phase].append(run(phase))
        except BaseException:
            click.echo(" failed", err=True)
            raise
        seconds = time.perf_counter() - started
        click.echo(f" {runs[phase][-1]:.1f} img/s ({seconds:.0f} s)", err=True)
    return runs
