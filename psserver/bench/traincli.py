"""`ps-bench train`: its options and their checks, the phases taken in turns, and the table
and plot it makes of the record.

What this is not: the phases themselves (psserver.bench.train, .trainps, .baselines), the
record (psserver.bench.trainreport), nor the group the command belongs to
(psserver.bench.cli).
"""

import contextlib
from pathlib import Path

import click

from common.cli import EnvAwareCommand, explain_errors, timeout_seconds
from common.logs import counted
from common.model.builtin import MODELS
from psserver.bench.options import (
    PhasesError,
    agent_options,
    bucket_mb_option,
    check_phases,
    option_error,
    output_options,
    parse_phases,
    run_in_turns,
    shard_agent_option,
)
from psserver.bench.placement import announce_placement, check_agent_options
from psserver.bench.remote import RemoteClients
from psserver.bench.report import bar_plot, markdown_table, write_json
from psserver.bench.train import describe, run_phase
from psserver.bench.trainbench import LABELS, PHASES, SHARDED_PHASES, TrainBench
from psserver.bench.trainreport import summarize
from psserver.bench.trainreport import table_rows as train_rows


@click.command(cls=EnvAwareCommand)
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
    type=timeout_seconds(),
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
    help="Run every phase this many times, taking turns (all phases, then all again, each "
    "turn starting one phase later), and report each phase's median: the machine's drift "
    "then hits every phase alike.",
)
@click.option(
    "--phases",
    default=None,
    help=f"The phases to run, comma-separated, of {', '.join(PHASES)} (and with --num-shards, "
    f"{', '.join(SHARDED_PHASES)}); ddp must be one: rates are against it. Default: all.",
)
@bucket_mb_option
@agent_options("the ps-workers and DDP ranks (and the single process, on the first)")
@shard_agent_option
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
    phases: str | None,
    bucket_mb: float | None,
    agents: tuple[str, ...],
    host: str | None,
    port: int | None,
    shard_agents: tuple[str, ...],
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Training images/s: ps sync and async against one process and PyTorch DDP."""
    check_agent_options(agents, shard_agents, host, num_shards)
    if port is not None and not agents:  # comm takes it locally; train's local runs do not
        raise click.UsageError(
            "train uses --port only for runs with --agent (for a firewall between hosts); "
            "on one host every run takes a free port: leave --port out"
        )
    only = parse_phases(phases, PHASES + SHARDED_PHASES) if phases is not None else ()
    try:
        if phases is not None and not only:  # `--phases ""` is not "every phase"
            check_phases(only, PHASES + SHARDED_PHASES)
        bench = TrainBench(
            workers, model, batch_size, steps, threads, device, timeout, num_shards, bucket_mb,
            only,
        )  # fmt: skip
    except PhasesError as exc:  # a usage error, which may come from PS_TRAIN_PHASES
        raise option_error(click.get_current_context(), "phases", exc.reason) from None
    chosen = bench.phases()
    crossing = bench.epoch_end_inside()
    if crossing is not None:
        click.echo(f"ps-bench train: {crossing}", err=True)
    with contextlib.ExitStack() as stack:
        remote = None
        if agents:
            remote = stack.enter_context(
                RemoteClients(list(agents), host, port, list(shard_agents))
            )
            announce_placement(remote, workers, num_shards)
            devices = remote.devices(workers, device)
        else:
            devices = bench.devices()
        runs = run_in_turns(
            chosen, repeat, lambda phase: describe(phase, bench, devices),
            lambda phase: run_phase(phase, bench, devices, remote),
        )  # fmt: skip
        results = summarize(bench, devices, runs)
        if remote is not None:
            results["server_host"] = remote.server_host
            results["client_hosts"] = remote.describe(workers)
            if shard_agents:
                results["follower_hosts"] = remote.shards.describe(num_shards)
    rates = results["images_per_second"]
    click.echo(markdown_table(["run", "images/s", "vs DDP"], train_rows(results)))
    for note in results["notes"]:
        click.echo(f"note: {note}")
    if json_path is not None:
        write_json(json_path, results)
    if plot is not None:
        bar_plot(
            plot,
            f"training, {counted(workers, 'worker')}, {model}, batch {batch_size} per worker",
            [LABELS[phase] for phase in chosen],
            [rates[phase] for phase in chosen],
            "images per second"
            + (f" (median of {repeat}; whiskers: slowest and fastest run)" if repeat > 1 else ""),
            [(min(runs[phase]), max(runs[phase])) for phase in chosen] if repeat > 1 else None,
        )
