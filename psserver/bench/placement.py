"""Where `ps-bench comm` and `train` place their processes across hosts: the checks of
--agent, --shard-agent and --host together, and the lines that say where everything runs."""

from typing import Any

import click

from common.errors import PSError
from psserver.bench.agentlink import agent_endpoint
from psserver.bench.remote import RemoteClients


def check_agent_options(
    agents: tuple[str, ...], shard_agents: tuple[str, ...], host: str | None, num_shards: int
) -> None:
    if host is not None and not agents:
        raise click.UsageError("--host is the address agents reach this host at: add --agent")
    if not shard_agents:
        return
    if not agents:
        raise click.UsageError("--shard-agent places follower shards for --agent runs: add --agent")
    if len(shard_agents) > num_shards - 1:
        raise click.UsageError(
            f"--num-shards {num_shards} has {num_shards - 1} follower shards, too few for "
            f"{len(shard_agents)} --shard-agent hosts"
        )
    try:
        shared = {agent_endpoint(a) for a in agents} & {agent_endpoint(a) for a in shard_agents}
    except PSError as exc:
        raise click.UsageError(str(exc)) from None
    if shared:
        raise click.UsageError(
            f"{', '.join(sorted(shared))} is both --agent and --shard-agent; an agent runs one "
            "job at a time: start a second agent on another port for the shards"
        )


def sharded_rss_note(result: dict[str, Any], num_shards: int, followers_elsewhere: bool) -> str:
    if num_shards == 1:
        return ""
    rss = result["sync_sharded_peak_rss_mb"]
    if followers_elsewhere:
        return f", {rss:.0f} MB (the {num_shards}-shard leader; its followers ran elsewhere)"
    return f", {rss:.0f} MB ({num_shards} shards together)"


def announce_placement(remote: RemoteClients, workers: int, num_shards: int) -> None:
    for where in remote.describe(workers):
        gpus = f", {where['gpus']} GPUs" if where["gpus"] else ""
        click.echo(
            f"  workers {where['clients']} on {where['host']} ({where['cores']} cores{gpus}, "
            f"agent {where['agent']}); servers on {remote.server_host}",
            err=True,
        )
    if num_shards > 1:
        for where in remote.shards.describe(num_shards):
            click.echo(
                f"  follower shards {where['shards']} on {where['host']} ({where['cores']} "
                f"cores, agent {where['agent']})",
                err=True,
            )
