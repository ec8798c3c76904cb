"""`ps-server`: hold the weights, apply the updates, evaluate, checkpoint, summarise."""

from pathlib import Path
from typing import Any

import click

from common.cli import ENV_PREFIX, FiniteFloatRange, explain_errors, timeout_seconds
from common.errors import ConfigError, PSError
from common.logs import LEVELS, setup_logging
from common.memory import reuse_large_buffers
from common.security_options import server_security_from_options, server_security_options
from psserver.launch import security_args, start_followers, stop_followers
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
    type=FiniteFloatRange(min=0),
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
@click.option(
    "--shard",
    type=click.IntRange(min=0),
    default=None,
    help="With --num-shards K, run only shard I: 0 is the leader (it waits for the others), "
    "1..K-1 are followers that join --leader. Without it the leader starts the followers.",
)
@click.option(
    "--leader",
    default=None,
    help="A follower shard's leader endpoint (shard 0), e.g. tcp://ps-0:5555.",
)
@click.option(
    "--advertise-host",
    default=None,
    help="The host name workers use to reach a follower shard (default: the --bind host, "
    "or this machine's name when --bind is a wildcard).",
)
@click.option(
    "--leader-timeout",
    type=timeout_seconds(),
    default=600.0,
    help="A follower gives up after this many seconds without word from the leader.",
)
@server_security_options
@click.option("--log-level", type=click.Choice(LEVELS), default="info", help="Log verbosity.")
@explain_errors
def command(
    log_level: str,
    curve_secret_key: Path | None,
    curve_authorized_clients: Path | None,
    shard: int | None,
    leader: str | None,
    advertise_host: str | None,
    leader_timeout: float,
    **options: Any,
) -> None:
    """Run the parameter server for one training job."""
    num_shards = options["num_shards"]
    if shard is not None and shard >= num_shards:
        raise ConfigError(f"--shard {shard}: shards are numbered 0..{num_shards - 1}")
    if shard:
        if leader is None:
            raise ConfigError(f"--shard {shard} is a follower: give it --leader ENDPOINT")
        setup_logging(log_level, f"shard{shard}")
        reuse_large_buffers()
        from psserver.follower import SliceServer
        from psserver.joining import FollowerConfig

        follower = FollowerConfig(
            shard, num_shards, leader, options["bind"], advertise_host, leader_timeout,
            options["threads"],
            str(options["endpoint_file"]) if options["endpoint_file"] else None,
        )  # fmt: skip
        SliceServer(
            follower, server_security_from_options(curve_secret_key, curve_authorized_clients)
        ).run()
        return
    setup_logging(log_level, "server")
    reuse_large_buffers()  # 45 MB messages: no page faults on every receive
    security = server_security_from_options(curve_secret_key, curve_authorized_clients)
    config = config_from_options(**options)
    from psserver.server import ParameterServer  # after logging, so import-time work is logged

    server = ParameterServer(config, security)
    if num_shards == 1 or shard == 0:
        server.run()
        return
    followers = start_followers(
        num_shards,
        config.bind,
        server.endpoint,
        advertise_host,
        security_args(curve_secret_key, curve_authorized_clients),
        config.threads,
        log_level,
        leader_timeout,
    )
    server.local_followers = [child.pid for child in followers]
    try:
        server.run()
    except BaseException:
        stop_followers(followers, grace_s=0)
        raise
    if stop_followers(followers):
        raise PSError("a follower shard failed while stopping; see its log above")


def main() -> None:
    command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
