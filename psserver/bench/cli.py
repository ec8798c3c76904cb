"""`ps-bench`: measure communication and end-to-end training on your own machines.

`comm`, `agent` (comm's workers on other hosts) and `train` are here; `straggler` and `link`
in psserver.bench.scenarios."""

import contextlib
from pathlib import Path

import click

from common.cli import (
    ENV_PREFIX,
    EnvAwareGroup,
    explain_errors,
    timeout_seconds,
    unwind_on_termination,
)
from common.logs import LEVELS, setup_logging
from common.models import MODELS
from psserver.bench.agent import DEFAULT_AGENT_PORT, run_agent
from psserver.bench.clients import Clients, LocalClients
from psserver.bench.comm import run_comm
from psserver.bench.options import (
    PhasesError,
    agent_bind,
    agent_options,
    bucket_mb_option,
    check_phases,
    option_error,
    output_options,
    parse_phases,
    run_in_turns,
    shard_agent_option,
)
from psserver.bench.placement import announce_placement, check_agent_options, sharded_rss_note
from psserver.bench.remote import RemoteClients
from psserver.bench.report import bar_plot, markdown_table, write_json
from psserver.bench.scenarios import link, straggler
from psserver.bench.train import (
    LABELS,
    PHASES,
    SHARDED_PHASES,
    TrainBench,
    describe,
    run_phase,
    summarize,
)
from psserver.bench.train import table_rows as train_rows

# How `over_floor_by_turn`'s rows are named in the line under the comm table.
TURN_LABELS = {"sync": "streamed", "whole": "whole", "sharded": "shards"}


@click.group(cls=EnvAwareGroup, context_settings={"show_default": True, "max_content_width": 100})
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
@agent_options("the workers (and the floor's clients)")
@shard_agent_option
@output_options("the round times")
@explain_errors
def comm(
    workers: int,
    model: str,
    rounds: int,
    num_shards: int,
    bucket_mb: float | None,
    repeat: int,
    agents: tuple[str, ...],
    host: str | None,
    port: int | None,
    shard_agents: tuple[str, ...],
    json_path: Path | None,
    plot: Path | None,
) -> None:
    """Sync round time (push + update + pull) against the bare ZeroMQ floor, and async rate."""
    check_agent_options(agents, shard_agents, host, num_shards)
    click.echo(f"ps-bench comm: {workers} workers, {model}, {rounds} rounds per run...", err=True)
    with contextlib.ExitStack() as stack:
        clients: Clients = LocalClients(port)
        if agents:
            remote = RemoteClients(list(agents), host, port, list(shard_agents))
            clients = stack.enter_context(remote)
            announce_placement(remote, workers, num_shards)
        result = run_comm(workers, model, rounds, num_shards, bucket_mb, repeat, clients)
        if shard_agents:
            result["follower_hosts"] = remote.describe_shards(num_shards)
    cpu, bound = result["cpu_ms_per_round"], result["cpu_bound_round_ms"]
    streamed = "buckets, streamed back" if result["sync_buckets"] > 1 else "1 bucket: not streamed"
    runs = [  # label, the round's stats, its ratio to the floor, its CPU time, its CPU bound
        ("zeromq floor", result["floor_round_ms"], 1.0, cpu["floor"], bound["floor"]),
        (f"ps sync round ({streamed})", result["sync_round_stats_ms"],
         result["sync_over_floor"], cpu["sync"], bound["sync"]),
        ("ps sync round, whole (--bucket-mb 0)", result["sync_whole_round_stats_ms"],
         result["sync_whole_over_floor"], cpu["whole"], bound["whole"]),
    ]  # fmt: skip
    if num_shards > 1:
        runs.append(
            (f"ps sync round, {num_shards} shards", result["sync_sharded_round_stats_ms"],
             result["sync_sharded_over_floor"], cpu["sharded"], bound["sharded"])
        )  # fmt: skip
    moved = result["bytes_per_round"]
    headers = ["run", "median ms", "min ms", "max ms", "GB/s", "vs floor"]
    headers += ["server CPU ms", "CPU ms per worker", "CPU-bound ms"]
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
                    "" if least is None else least,
                ]
                for label, s, over, use, least in runs
            ],
        )
    )
    click.echo(
        f"\n{result['model_bytes'] / 1e6:.1f} MB per model; "
        f"{result['bytes_per_round'] / 1e6:.1f} MB moved per sync round; "
        f"async: {result['async_updates_per_second']:.1f} updates/s; server peak RSS "
        f"{result['server_peak_rss_mb']['sync']:.0f} MB (sync), "
        f"{result['server_peak_rss_mb']['async']:.0f} MB (async)"
        + sharded_rss_note(result, num_shards, bool(shard_agents))
    )
    for note in result["notes"]:
        click.echo(f"note: {note}")
    if repeat > 1:
        click.echo(
            "turn by turn, over that turn's floor: "
            + "; ".join(
                f"{TURN_LABELS[kind]} {', '.join(f'{r:.2f}' for r in ratios)}"
                for kind, ratios in result["over_floor_by_turn"].items()
            )
        )
    shards_note = "; server CPU ms is the shards' leader alone" if num_shards > 1 else ""
    if shard_agents:
        shards_note += " (blank CPU-bound ms: its followers' CPU on other hosts is not counted)"
    if agents:
        click.echo(
            "CPU-bound ms: on each host, the CPU time a round of what ran there over its cores; "
            f"the busiest host's. No round can be shorter on these hosts{shards_note}"
        )
    else:
        click.echo(
            "CPU-bound ms: the CPU time a round of the server, its follower shards and all the "
            f"workers, over the {result['cores']} cores they share; no round can be shorter "
            f"here{shards_note}"
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
                results["follower_hosts"] = remote.describe_shards(num_shards)
    rates = results["images_per_second"]
    click.echo(markdown_table(["run", "images/s", "vs DDP"], train_rows(results)))
    for note in results["notes"]:
        click.echo(f"note: {note}")
    if json_path is not None:
        write_json(json_path, results)
    if plot is not None:
        bar_plot(
            plot,
            f"training, {workers} workers, {model}, batch {batch_size} per worker",
            [LABELS[phase] for phase in chosen],
            [rates[phase] for phase in chosen],
            "images per second"
            + (f" (median of {repeat}; whiskers: slowest and fastest run)" if repeat > 1 else ""),
            [(min(runs[phase]), max(runs[phase])) for phase in chosen] if repeat > 1 else None,
        )


@command.command()
@click.option(
    "--bind",
    default=f"tcp://0.0.0.0:{DEFAULT_AGENT_PORT}",
    callback=agent_bind,
    help="Where to listen for `ps-bench comm/train --agent` (or --shard-agent); "
    "tcp://127.0.0.1:* for a test.",
)
@click.option(
    "--endpoint-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the endpoint it listens on here (useful with a * port).",
)
@click.option(
    "--log-level", type=click.Choice(LEVELS), default="info", help="Log verbosity (stderr)."
)
@explain_errors
def agent(bind: str, endpoint_file: Path | None, log_level: str) -> None:
    """Run a benchmark's workers (or shards) here for a coordinator elsewhere (iperf -s).

    Start one on every worker host, then `ps-bench comm --agent HOST ...` or `ps-bench train
    --agent HOST ...` on the server host (and, for either's `--num-shards K --shard-agent
    HOST`, one on every other server host: it runs follower shards). It runs one benchmark
    at a time, only its own kinds of process, and only against the address that asked; stop
    it with Ctrl-C."""
    setup_logging(log_level, "agent")
    run_agent(bind, endpoint_file)


command.add_command(straggler)
command.add_command(link)


def main() -> None:
    unwind_on_termination()
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
