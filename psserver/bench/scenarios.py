"""`ps-bench straggler` and `ps-bench link`: training in a harder world, one slow worker or
slow links between hosts. The group and `agent` are in psserver.bench.cli, `comm` and `train`
in psserver.bench.commcli and .traincli."""

from pathlib import Path
from typing import Any

import click

from common.cli import EnvAwareCommand, FiniteFloatRange, explain_errors, timeout_seconds
from common.errors import ConfigError
from common.logs import counted
from common.model.builtin import MODELS
from psserver.bench.link import (
    LINK_PHASES,
    LinkBench,
    describe_link,
    link_report,
    run_link_phase,
    summarize_link,
)
from psserver.bench.linkuse import LinkMeter, link_use
from psserver.bench.netns import CONGESTION_CONTROLS, LinkLab
from psserver.bench.options import (
    PhasesError,
    bucket_mb_option,
    option_error,
    output_options,
    parse_phases,
    run_in_turns,
)
from psserver.bench.report import bar_plot, markdown_table, write_json
from psserver.bench.straggler import check_train_limit, run_straggler
from psserver.bench.trainbench import TrainBench


@click.command(cls=EnvAwareCommand)
@click.option("--workers", type=click.IntRange(min=2), default=2, help="Workers; one is slow.")
@click.option(
    "--model",
    type=click.Choice(sorted(MODELS)),
    default="lenet",
    help="The model every run trains (each run trains it from the same start).",
)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, help="Per worker.")
@click.option(
    "--epochs",
    type=click.IntRange(min=1),
    default=2,
    help="Epochs of --train-limit images each policy's run trains; the test accuracy is "
    "taken at the end.",
)
@click.option(
    "--train-limit",
    type=click.IntRange(min=1),
    default=6000,
    help="Train on the first this many images of the embedded training set (the default is "
    "all of it); at least --workers x --batch-size, one step's worth.",
)
@click.option(
    "--slowdown",
    type=FiniteFloatRange(min=1),
    default=2.0,
    show_default=True,
    help="How many times as long the slow worker takes per step: it sleeps (slowdown - 1) "
    "times one worker step, timed on this machine by a short sync run first.",
)
@click.option(
    "--delay",
    type=FiniteFloatRange(min=0),
    default=None,
    help="Seconds the slow worker sleeps per step, instead of --slowdown: skips the "
    "calibration run (and the report's slowdown).",
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
    slowdown: float,
    delay: float | None,
    threads: int,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Throughput and accuracy of sync, async and SSP with one worker slowed down.

    Each policy trains the same job (--model, --epochs of --train-limit images) with
    --workers ps-workers, worker 0 sleeping before every push: --delay seconds, or (by
    default) enough to take --slowdown times as long as the others, timed by a short run
    first."""
    try:
        check_train_limit(train_limit, workers, batch_size)
    except ConfigError as exc:
        raise option_error(click.get_current_context(), "train_limit", str(exc)) from None
    slow = f"sleeping {delay} s per step" if delay is not None else f"{slowdown:g}x slower"
    click.echo(f"ps-bench straggler: {workers} workers, one {slow}...", err=True)
    result = run_straggler(
        workers, model, batch_size, epochs, train_limit, delay, threads, slowdown
    )
    slept = f"worker 0 slept {result['slow_worker_delay_s'] * 1000:.1f} ms a step"
    if result["step_s"] is None:
        slept += " (--delay: no calibration run, so how much slower that made it is not known)"
    else:
        slept += (
            f"; a step takes {result['step_s'] * 1000:.1f} ms here: "
            f"{result['slowdown']:.2f}x as long"
        )
    click.echo(slept, err=True)  # stdout has the table alone
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


@click.command(cls=EnvAwareCommand)
@click.option("--workers", type=click.IntRange(min=1), default=2, help="Worker hosts.")
@click.option(
    "--model", type=click.Choice(sorted(MODELS)), default="resnet18", help="The model to train."
)
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
    type=FiniteFloatRange(min=1),
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
    type=timeout_seconds(),
    default=1800.0,
    help="Seconds each run may take.",
)
@click.option(
    "--congestion-control",
    type=click.Choice(CONGESTION_CONTROLS),
    default="cubic",
    show_default=True,
    help="TCP congestion control on every host: cubic is Linux's default (reno where the "
    "kernel allows no cubic); host keeps this machine's.",
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
    congestion_control: str,
    bucket_mb: float | None,
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Overlap over a slow network: sync with and without overlap (and without streaming the
    updated weights back), on one server host and on --server-hosts, and DDP, with every host
    in its own network namespace on links of --mbit (needs root)."""
    try:
        bench = LinkBench(
            TrainBench(workers, model, batch_size, steps, threads, "cpu", timeout, 1, bucket_mb),
            mbit,
            server_hosts,
            parse_phases(phases, LINK_PHASES),
        )
    except PhasesError as exc:  # a usage error, which may come from PS_LINK_PHASES
        raise option_error(click.get_current_context(), "phases", exc.reason) from None
    uses: dict[str, list[dict[str, Any]]] = {phase: [] for phase in bench.phases}

    def run_metered(phase: str) -> float:
        with LinkMeter(lab) as meter:
            rate = run_link_phase(phase, bench, lab)
        if meter.failure is not None:
            click.echo(f" (link use is partial: {meter.failure})", err=True, nl=False)
        uses[phase].append(link_use(meter.samples, mbit))
        return rate

    with LinkLab(bench.hosts, mbit, congestion_control) as lab:
        click.echo(f"TCP congestion control on every host: {lab.congestion_control}", err=True)
        runs = run_in_turns(bench.phases, repeat, lambda p: describe_link(p, bench), run_metered)
    results = summarize_link(bench, runs, uses, lab.congestion_control)
    click.echo(link_report(bench, results))
    if json_path is not None:
        write_json(json_path, results)
    if plot is not None:
        bar_plot(
            plot,
            f"{counted(workers, 'worker')}, {model}, batch {batch_size}, {mbit:g} Mbit/s links "
            f"({lab.congestion_control})",
            [bench.label(p) for p in bench.phases],
            [results["images_per_second"][p] for p in bench.phases],
            "images per second",
        )
