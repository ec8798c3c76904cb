"""`ps-bench`: measure communication and end-to-end training on your own machines."""

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import click

from common.cli import ENV_PREFIX, explain_errors
from common.models import MODELS
from psserver.bench.comm import run_comm
from psserver.bench.link import (
    LINK_PHASES,
    LinkBench,
    describe_link,
    link_report,
    parse_phases,
    run_link_phase,
    summarize_link,
)
from psserver.bench.netns import LinkLab
from psserver.bench.report import bar_plot, markdown_table, write_json
from psserver.bench.straggler import run_straggler
from psserver.bench.train import LABELS, TrainBench, describe, run_phase, summarize
from psserver.bench.train import table_rows as train_rows

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
    default=8.0,
    show_default=True,
    help="The server's gradient buckets in the bucketed runs (a 'whole' run uses one).",
)


@click.group(context_settings={"show_default": True, "max_content_width": 100})
def command() -> None:
    """Benchmarks that print a markdown table and can write JSON and a PNG plot."""


@command.command()
@click.option("--workers", type=click.IntRange(min=1), default=2, help="Synthetic workers.")
@click.option(
    "--model",
    type=click.Choice(sorted(MODELS)),
    default="resnet18",
    help="Whose parameter count sets the message size.",
)
@click.option("--rounds", type=click.IntRange(min=3), default=30, help="Timed rounds per run.")
@click.option(
    "--num-shards",
    type=click.IntRange(min=1),
    default=1,
    help="Above 1, add a sync run on this many server shards (slices moved in parallel).",
)
@bucket_mb_option
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    help="Runs of each kind, taking turns; each row then holds all their rounds.",
)
@output_options("the round times")
@explain_errors
def comm(
    workers: int,
    model: str,
    rounds: int,
    num_shards: int,
    bucket_mb: float,
    repeat: int,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Sync round time (push + update + pull) against the bare ZeroMQ floor, and async rate."""
    click.echo(f"ps-bench comm: {workers} workers, {model}, {rounds} rounds per run...", err=True)
    result = run_comm(workers, model, rounds, num_shards, bucket_mb, repeat)
    cpu = result["cpu_ms_per_round"]
    runs = [  # label, the round's stats, its ratio to the floor, its CPU time
        ("zeromq floor", result["floor_round_ms"], 1.0, cpu["floor"]),
        ("ps sync round (buckets, streamed back)", result["sync_round_stats_ms"],
         result["sync_over_floor"], cpu["sync"]),
        ("ps sync round, whole (--bucket-mb 0)", result["sync_whole_round_stats_ms"],
         result["sync_whole_over_floor"], cpu["whole"]),
    ]  # fmt: skip
    if num_shards > 1:
        runs.append(
            (f"ps sync round, {num_shards} shards", result["sync_sharded_round_stats_ms"],
             result["sync_sharded_over_floor"], cpu["sharded"])
        )  # fmt: skip
    moved = result["bytes_per_round"]
    headers = ["run", "median ms", "min ms", "max ms", "GB/s", "vs floor"]
    headers += ["server CPU ms", "CPU ms per worker"]
    click.echo(
        markdown_table(
            headers,
            [
                [
                    label,
                    s["median_ms"],
                    s["min_ms"],
                    s["max_ms"],
                    moved / s["median_ms"] / 1e6,
                    over,
                    use["server"],
                    use["each_worker"],
                ]
                for label, s, over, use in runs
            ],
        )
    )
    click.echo(
        f"\n{result['model_bytes'] / 1e6:.1f} MB per model; "
        f"{result['bytes_per_round'] / 1e6:.1f} MB moved per sync round; "
        f"async: {result['async_updates_per_second']:.1f} updates/s; server peak RSS "
        f"{result['server_peak_rss_mb']['sync']:.0f} MB (sync), "
        f"{result['server_peak_rss_mb']['async']:.0f} MB (async)"
        + (
            f", {result['sync_sharded_peak_rss_mb']:.0f} MB ({num_shards} shards together)"
            if num_shards > 1
            else ""
        )
    )
    if json_path is not None:
        write_json(json_path, result)
    if plot is not None:
        bar_plot(
            plot,
            f"sync round, {workers} workers, {model}",
            [label.split(" (")[0] for label, *_ in runs],
            [stats["median_ms"] for _, stats, *_ in runs],
            "milliseconds (median)",
        )


@command.command()
@click.option("--workers", type=click.IntRange(min=1), default=2, help="ps-workers, and DDP ranks.")
@click.option(
    "--model", type=click.Choice(sorted(MODELS)), default="resnet18", help="The model to train."
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=64,
    help="Per worker and DDP rank; the single process trains on workers x this.",
)
@click.option(
    "--steps",
    type=click.IntRange(min=3),
    default=20,
    help="Steps per worker (the PyTorch runs time all but the first 2).",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=1,
    help="Torch threads per process; the single process gets workers x this.",
)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    help="auto: one GPU per worker and rank if there are enough, else the CPU.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=1800.0,
    help="Seconds each run may take.",
)
@click.option(
    "--num-shards",
    type=click.IntRange(min=1),
    default=1,
    help="Above 1, add two sync runs on this many server shards: with overlap (slices pushed "
    "during backward) and without, to measure what overlap gains.",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    help="Run every phase this many times, taking turns (all phases, then all again), and "
    "report each phase's median: the machine's drift then hits every phase alike.",
)
@bucket_mb_option
@output_options("images/s")
@explain_errors
def train(
    workers: int,
    model: str,
    batch_size: int,
    steps: int,
    threads: int,
    device: str,
    timeout: float,
    num_shards: int,
    repeat: int,
    bucket_mb: float,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Training images/s: ps sync and async against one process and PyTorch DDP."""
    bench = TrainBench(
        workers, model, batch_size, steps, threads, device, timeout, num_shards, bucket_mb
    )
    devices = bench.devices()
    phases = bench.phases()
    runs = run_in_turns(
        phases, repeat, lambda phase: describe(phase, bench, devices),
        lambda phase: run_phase(phase, bench, devices),
    )  # fmt: skip
    results = summarize(bench, devices, runs)
    rates = results["images_per_second"]
    click.echo(markdown_table(["run", "images/s", "vs DDP"], train_rows(results)))
    if json_path is not None:
        write_json(json_path, results)
    if plot is not None:
        bar_plot(
            plot,
            f"training, {workers} workers, {model}, batch {batch_size} per worker",
            [LABELS[phase] for phase in phases],
            [rates[phase] for phase in phases],
            "images per second",
        )


@command.command()
@click.option("--workers", type=click.IntRange(min=2), default=2, help="Workers; one is slow.")
@click.option("--model", type=click.Choice(sorted(MODELS)), default="lenet")
@click.option("--batch-size", type=click.IntRange(min=1), default=64, help="Per worker.")
@click.option("--epochs", type=click.IntRange(min=1), default=2)
@click.option("--train-limit", type=click.IntRange(min=1), default=6000)
@click.option(
    "--delay",
    type=click.FloatRange(min=0),
    default=0.03,
    help="Seconds the slow worker sleeps per step (about one step's compute: 2x).",
)
@click.option("--threads", type=click.IntRange(min=1), default=1, help="Torch threads each.")
@output_options("images/s")
@explain_errors
def straggler(
    workers: int,
    model: str,
    batch_size: int,
    epochs: int,
    train_limit: int,
    delay: float,
    threads: int,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Throughput and accuracy of sync, async and SSP with one worker slowed down."""
    click.echo(
        f"ps-bench straggler: {workers} workers, one sleeping {delay} s per step...", err=True
    )
    result = run_straggler(workers, model, batch_size, epochs, train_limit, delay, threads)
    click.echo(
        markdown_table(
            ["policy", "images/s", "test accuracy", "steps", "wall s", "staleness mean", "max"],
            [
                [
                    r["mode"],
                    r["images_per_second"],
                    r["test_accuracy"],
                    r["global_steps"],
                    r["wall_seconds"],
                    r["staleness_mean"],
                    r["staleness_max"],
                ]
                for r in result["runs"]
            ],
        )
    )
    if json_path is not None:
        write_json(json_path, result)
    if plot is not None:
        bar_plot(
            plot,
            f"one straggler of {workers}, {model}",
            [r["mode"] for r in result["runs"]],
            [r["images_per_second"] for r in result["runs"]],
            "images/s",
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


@command.command()
@click.option("--workers", type=click.IntRange(min=1), default=2, help="Worker hosts.")
@click.option("--model", type=click.Choice(sorted(MODELS)), default="resnet18")
@click.option("--batch-size", type=click.IntRange(min=1), default=64, help="Per worker.")
@click.option(
    "--steps",
    type=click.IntRange(min=3),
    default=10,
    help="Steps per worker (DDP times all but the first 2).",
)
@click.option("--threads", type=click.IntRange(min=1), default=1, help="Torch threads each.")
@click.option(
    "--mbit",
    type=click.FloatRange(min=1),
    default=1000.0,
    show_default=True,
    help="Every host's link speed, each way, in Mbit/s.",
)
@click.option(
    "--server-hosts",
    type=click.IntRange(min=2),
    default=2,
    help="Server shards in the sharded phase, each on a host of its own.",
)
@click.option(
    "--phases",
    default=",".join(LINK_PHASES),
    help="The phases to run, comma-separated (ddp must be one: rates are against it).",
)
@click.option(
    "--repeat", type=click.IntRange(min=1), default=1, help="Runs of each phase, taking turns."
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=1800.0,
    help="Seconds each run may take.",
)
@bucket_mb_option
@output_options("images/s")
@explain_errors
def link(
    workers: int,
    model: str,
    batch_size: int,
    steps: int,
    threads: int,
    mbit: float,
    server_hosts: int,
    phases: str,
    repeat: int,
    timeout: float,
    bucket_mb: float,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Overlap over a slow network: sync with and without overlap (and without streaming the
    updated weights back), on one server host and on --server-hosts, and DDP, with every host
    in its own network namespace on links of --mbit (needs root)."""
    bench = LinkBench(
        TrainBench(workers, model, batch_size, steps, threads, "cpu", timeout, 1, bucket_mb),
        mbit,
        server_hosts,
        parse_phases(phases),
    )
    with LinkLab(bench.hosts, mbit) as lab:
        runs = run_in_turns(
            bench.phases, repeat, lambda phase: describe_link(phase, bench),
            lambda phase: run_link_phase(phase, bench, lab),
        )  # fmt: skip
    results = summarize_link(bench, runs)
    click.echo(link_report(bench, results))
    if json_path is not None:
        write_json(json_path, results)
    if plot is not None:
        bar_plot(
            plot,
            f"{workers} workers, {model}, batch {batch_size}, {mbit:g} Mbit/s links",
            [bench.label(p) for p in bench.phases],
            [results["images_per_second"][p] for p in bench.phases],
            "images per second",
        )


def main() -> None:
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
