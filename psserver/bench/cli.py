"""`ps-bench`: measure communication and end-to-end training on your own machines.

The group and `agent` (comm's and train's workers on other hosts) are here; `comm` in
psserver.bench.commcli, `train` in psserver.bench.traincli, `straggler` and `link` in
psserver.bench.scenarios."""

from pathlib import Path

import click

from common.cli import (
    ENV_PREFIX,
    EnvAwareGroup,
    explain_errors,
    unwinding_on_termination,
)
from common.logs import LEVELS, setup_logging
from psserver.bench.agent import run_agent
from psserver.bench.agentwire import DEFAULT_AGENT_PORT
from psserver.bench.commcli import comm
from psserver.bench.options import agent_bind
from psserver.bench.scenarios import link, straggler
from psserver.bench.traincli import train


@click.group(cls=EnvAwareGroup, context_settings={"show_default": True, "max_content_width": 100})
def command() -> None:
    """Benchmarks that print a markdown table and can write JSON and a PNG plot."""


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


command.add_command(comm)
command.add_command(train)
command.add_command(straggler)
command.add_command(link)


def main() -> None:
    with unwinding_on_termination():
        command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
