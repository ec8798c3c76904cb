"""`ps-bench comm`: its options, where its clients run, and the record printed, written and
plotted.

What this is not: the runs and the record (psserver.bench.comm), nor what is printed of it
(psserver.bench.commreport), nor the group the command belongs to (psserver.bench.cli).
"""

import contextlib
from pathlib import Path

import click

from common.cli import EnvAwareCommand, explain_errors
from common.logs import counted
from common.model.builtin import MODELS
from psserver.bench.clients import Clients, LocalClients
from psserver.bench.comm import run_comm
from psserver.bench.commreport import HEADERS, lines_under_table, table_rows, table_runs
from psserver.bench.options import (
    agent_options,
    bucket_mb_option,
    output_options,
    shard_agent_option,
)
from psserver.bench.placement import announce_placement, check_agent_options
from psserver.bench.remote import RemoteClients
from psserver.bench.report import bar_plot, markdown_table, write_json


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
    click.echo(
        f"ps-bench comm: {counted(workers, 'worker')}, {model}, {rounds} rounds per run...",
        err=True,
    )
    with contextlib.ExitStack() as stack:
        clients: Clients = LocalClients(port)
        if agents:
            remote = RemoteClients(list(agents), host, port, list(shard_agents))
            clients = stack.enter_context(remote)
            announce_placement(remote, workers, num_shards)
        result = run_comm(workers, model, rounds, num_shards, bucket_mb, repeat, clients)
        if shard_agents:
            result["follower_hosts"] = remote.shards.describe(num_shards)
    runs = table_runs(result, num_shards)
    click.echo(markdown_table(HEADERS, table_rows(result, runs)))
    for line in lines_under_table(result, num_shards, repeat, bool(agents), bool(shard_agents)):
        click.echo(line)
    if json_path is not None:
        write_json(json_path, result)
    if plot is not None:
        bar_plot(
            plot,
            f"sync round, {counted(workers, 'worker')}, {model}",
            [run.label.split(" (")[0] for run in runs],
            [run.stats["median_ms"] for run in runs],
            "milliseconds (median)",
        )
