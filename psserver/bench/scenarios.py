"""`ps-bench straggler` and `ps-bench link`: training in a harder world, one slow worker or
slow links between hosts. The group is in psserver.bench.cli, `comm` and `train` in
psserver.bench.commcli and .traincli."""

from collections.abc import Mapping
from typing import Any

import click

from common.cli import EnvAwareCommand, FiniteFloatRange, explain_errors
from common.errors import ConfigError
from common.logs import counted
from common.options import Option, options, spec_of, with_params
from psserver.bench import options as bench
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
from psserver.bench.options import PhasesError, option_error, parse_phases, run_in_turns
from psserver.bench.report import bar_plot, markdown_table, write_json
from psserver.bench.straggler import check_train_limit, run_straggler
from psserver.bench.trainbench import TrainBench

STRAGGLER_OPTIONS = (
    bench.workers("Workers; one is slow.", least=2),
    bench.model("lenet", "The model every run trains (each run trains it from the same start)."),
    bench.batch_size("Per worker."),
    bench.STRAGGLER_EPOCHS,
    bench.STRAGGLER_TRAIN_LIMIT,
    bench.SLOWDOWN,
    bench.DELAY,
    bench.threads("Torch threads each."),
    *bench.output_options("images/s"),
)
LINK_OPTIONS = (
    bench.workers("Worker hosts."),
    bench.model("resnet18", "The model to train."),
    bench.batch_size("Per worker."),
    bench.steps(10, "Steps per worker (DDP times all but the first 2)."),
    bench.threads("Torch threads each."),
    Option(
        "--mbit",
        type=FiniteFloatRange(min=1),
        default=1000.0,
        show_default=True,
        help="Every host's link speed, each way, in Mbit/s.",
    ),
    Option(
        "--server-hosts",
        type=click.IntRange(min=2),
        default=2,
        help="Server shards in the sharded phase, each on a host of its own.",
    ),
    Option(
        "--phases",
        default=",".join(LINK_PHASES),
        help="The phases to run, comma-separated (ddp must be one: rates are against it).",
    ),
    bench.repeat("Runs of each phase, taking turns."),
    bench.RUN_TIMEOUT,
    Option(
        "--congestion-control",
        type=click.Choice(CONGESTION_CONTROLS),
        default="cubic",
        show_default=True,
        help="TCP congestion control on every host: cubic is Linux's default (reno where the "
        "kernel allows no cubic); host keeps this machine's.",
    ),
    bench.BENCH_BUCKET_MB,
    *bench.output_options("images/s"),
)


@click.command(cls=EnvAwareCommand)
@options(STRAGGLER_OPTIONS)
@explain_errors
@with_params
def straggler(params: Mapping[str, Any]) -> None:
    """Throughput and accuracy of sync, async and SSP with one worker slowed down.

    Each policy trains the same job (--model, --epochs of --train-limit images) with
    --workers ps-workers, worker 0 sleeping before every push: --delay seconds, or (by
    default) enough to take --slowdown times as long as the others, timed by a short run
    first."""
    workers, model, delay = params["workers"], params["model"], params["delay"]
    batch_size, train_limit, epochs = params["batch_size"], params["train_limit"], params["epochs"]
    try:
        check_train_limit(train_limit, workers, batch_size)
    except ConfigError as exc:
        raise option_error(click.get_current_context(), "train_limit", str(exc)) from None
    slowdown = params["slowdown"]
    slow = f"sleeping {delay} s per step" if delay is not None else f"{slowdown:g}x slower"
    click.echo(f"ps-bench straggler: {counted(workers, 'worker')}, one {slow}...", err=True)
    result = run_straggler(
        workers, model, batch_size, epochs, train_limit, delay, params["threads"], slowdown
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
    if params["json_path"] is not None:
        write_json(params["json_path"], result)
    if params["plot"] is not None:
        bar_plot(
            params["plot"],
            f"one straggler of {workers}, {model}",
            [r["mode"] for r in result["runs"]],
            [r["images_per_second"] for r in result["runs"]],
            "images/s",
        )


@click.command(cls=EnvAwareCommand)
@options(LINK_OPTIONS)
@explain_errors
@with_params
def link(params: Mapping[str, Any]) -> None:
    """Overlap over a slow network: sync with and without overlap (and without streaming the
    updated weights back), on one server host and on --server-hosts, and DDP, with every host
    in its own network namespace on links of --mbit (needs root)."""
    mbit = params["mbit"]
    try:
        train = spec_of(TrainBench, {**params, "device": "cpu", "num_shards": 1})
        bench = LinkBench(
            train, mbit, params["server_hosts"], parse_phases(params["phases"], LINK_PHASES)
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

    with LinkLab(bench.hosts, mbit, params["congestion_control"]) as lab:
        click.echo(f"TCP congestion control on every host: {lab.congestion_control}", err=True)
        runs = run_in_turns(
            bench.phases, params["repeat"], lambda p: describe_link(p, bench), run_metered
        )
    results = summarize_link(bench, runs, uses, lab.congestion_control)
    click.echo(link_report(bench, results))
    if params["json_path"] is not None:
        write_json(params["json_path"], results)
    if params["plot"] is not None:
        bar_plot(
            params["plot"],
            f"{counted(train.workers, 'worker')}, {train.model}, batch {train.batch_size}, "
            f"{mbit:g} Mbit/s links "
            f"({lab.congestion_control})",
            [bench.label(p) for p in bench.phases],
            [results["images_per_second"][p] for p in bench.phases],
            "images per second",
        )
