"""`ps-bench comm`: its options, and the table, notes and plot it makes of the record.

What this is not: the runs and the record (psserver.bench.comm), nor the group the command
belongs to (psserver.bench.cli).
"""

import contextlib
from pathlib import Path

import click

from common.cli import EnvAwareCommand, explain_errors
from common.models import MODELS
from psserver.bench.clients import Clients, LocalClients
from psserver.bench.comm import run_comm
from psserver.bench.options import (
    agent_options,
    bucket_mb_option,
    output_options,
    shard_agent_option,
)
from psserver.bench.placement import announce_placement, check_agent_options, sharded_rss_note
from psserver.bench.remote import RemoteClients
from psserver.bench.report import bar_plot, markdown_table, write_json

# How `over_floor_by_turn`'s rows are named in the line under the comm table.
TURN_LABELS = {"sync": "streamed", "whole": "whole", "sharded": "shards"}


@click.command(cls=EnvAwareCommand)
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
            result["follower_hosts"] = remote.shards.describe(num_shards)
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
