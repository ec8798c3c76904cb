"""`ps-bench train`: its options and their checks, the phases taken in turns, and the table
and plot it makes of the record.

What this is not: the phases themselves (psserver.bench.train, .trainps, .baselines), the
record (psserver.bench.trainreport), nor the group the command belongs to
(psserver.bench.cli).
"""

from collections.abc import Mapping
from typing import Any

import click

from common.cli import EnvAwareCommand, explain_errors
from common.logs import counted
from common.options import Option, options, spec_of, with_params
from psserver.bench import options as bench
from psserver.bench.options import (
    PhasesError,
    check_phases,
    option_error,
    parse_phases,
    run_in_turns,
)
from psserver.bench.report import bar_plot, markdown_table, write_json
from psserver.bench.train import describe, run_phase
from psserver.bench.trainbench import LABELS, PHASES, SHARDED_PHASES, TrainBench
from psserver.bench.trainreport import summarize
from psserver.bench.trainreport import table_rows as train_rows

TRAIN_OPTIONS = (
    bench.workers("ps-workers, and DDP ranks."),
    bench.model("resnet18", "The model to train."),
    bench.batch_size("Per worker and DDP rank; the single process trains on workers x this."),
    bench.steps(20, "Steps per worker (the PyTorch runs time all but the first 2)."),
    bench.threads("Torch threads per process; the single process gets workers x this."),
    bench.TRAIN_DEVICE,
    bench.RUN_TIMEOUT,
    bench.num_shards(
        "Above 1, add two sync runs on this many server shards: with overlap (slices pushed "
        "during backward) and without, to measure what overlap gains."
    ),
    bench.repeat(
        "Run every phase this many times, taking turns (all phases, then all again, each "
        "turn starting one phase later), and report each phase's median: the machine's "
        "drift then hits every phase alike."
    ),
    Option(
        "--phases",
        default=None,
        help=f"The phases to run, comma-separated, of {', '.join(PHASES)} (and with "
        f"--num-shards, {', '.join(SHARDED_PHASES)}); ddp must be one: rates are against it. "
        "Default: all.",
    ),
    bench.BENCH_BUCKET_MB,
    *bench.output_options("images/s"),
)


@click.command(cls=EnvAwareCommand)
@options(TRAIN_OPTIONS)
@explain_errors
@with_params
def train(params: Mapping[str, Any]) -> None:
    """Training images/s: ps sync and async against one process and PyTorch DDP."""
    phases = params["phases"]
    only = parse_phases(phases, PHASES + SHARDED_PHASES) if phases is not None else ()
    try:
        if phases is not None and not only:  # `--phases ""` is not "every phase"
            check_phases(only, PHASES + SHARDED_PHASES)
        bench = spec_of(TrainBench, {**params, "only": only})
    except PhasesError as exc:  # a usage error, which may come from PS_TRAIN_PHASES
        raise option_error(click.get_current_context(), "phases", exc.reason) from None
    chosen = bench.phases()
    crossing = bench.epoch_end_inside()
    if crossing is not None:
        click.echo(f"ps-bench train: {crossing}", err=True)
    devices = bench.devices()
    runs = run_in_turns(
        chosen, params["repeat"], lambda phase: describe(phase, bench, devices),
        lambda phase: run_phase(phase, bench, devices),
    )  # fmt: skip
    results = summarize(bench, devices, runs)
    rates = results["images_per_second"]
    click.echo(markdown_table(["run", "images/s", "vs DDP"], train_rows(results)))
    for note in results["notes"]:
        click.echo(f"note: {note}")
    if params["json_path"] is not None:
        write_json(params["json_path"], results)
    if params["plot"] is not None:
        repeat = params["repeat"]
        bar_plot(
            params["plot"],
            f"training, {counted(bench.workers, 'worker')}, {bench.model}, batch "
            f"{bench.batch_size} per worker",
            [LABELS[phase] for phase in chosen],
            [rates[phase] for phase in chosen],
            "images per second"
            + (f" (median of {repeat}; whiskers: slowest and fastest run)" if repeat > 1 else ""),
            [(min(runs[phase]), max(runs[phase])) for phase in chosen] if repeat > 1 else None,
        )
