"""`ps-server`: hold the weights, apply the updates, evaluate, checkpoint, summarise."""

from pathlib import Path
from typing import Any

import click

from common.cli import ENV_PREFIX, explain_errors
from common.logs import LEVELS, setup_logging
from common.memory import reuse_large_buffers
from common.security import server_security_from_options, server_security_options
from psserver.options import config_from_options, training_options


@click.command(context_settings={"show_default": True, "max_content_width": 100})
@click.option(
    "--bind",
    default="tcp://127.0.0.1:5555",
    help="ZeroMQ endpoint to listen on; tcp://0.0.0.0:5555 for other hosts, "
    "tcp://127.0.0.1:* for a free port.",
)
@training_options
@click.option(
    "--summary",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write a JSON summary of the run here.",
)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=None,
    help="Torch CPU threads for updates and evaluation (default: torch's choice).",
)
@click.option(
    "--stop-grace",
    type=click.FloatRange(min=0),
    default=10.0,
    help="Seconds to wait at the end for every worker to hear STOP.",
)
@click.option(
    "--endpoint-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the bound endpoint (with the real port) to this file.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (plain HTTP, no auth); HOST is "
    "127.0.0.1, or every interface when --bind is not loopback.",
)
@server_security_options
@click.option("--log-level", type=click.Choice(LEVELS), default="info", help="Log verbosity.")
@explain_errors
def command(
    log_level: str,
    curve_secret_key: Path | None,
    curve_authorized_clients: Path | None,
    **options: Any,
) -> None:
    """Run the parameter server for one training job."""
    setup_logging(log_level, "server")
    reuse_large_buffers()  # 45 MB messages: no page faults on every receive
    security = server_security_from_options(curve_secret_key, curve_authorized_clients)
    config = config_from_options(**options)
    from psserver.server import ParameterServer  # after logging, so import-time work is logged

    ParameterServer(config, security).run()


def main() -> None:
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
