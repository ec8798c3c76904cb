"""`ps-server`: hold the weights, apply the updates, evaluate, checkpoint, summarise."""

import functools
import logging
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from common.cli import (
    ENV_PREFIX,
    EnvAwareCommand,
    FiniteFloatRange,
    chosen_options,
    explain_errors,
    timeout_seconds,
    unwinding_on_termination,
)
from common.errors import ConfigError, PSError
from common.logs import LEVELS, setup_logging
from common.memory import reuse_large_buffers
from common.security_options import server_security_from_options, server_security_options
from psserver.cli.options import (
    MODE_ONLY_OPTIONS,
    config_from_options,
    ignored_by_mode,
    training_options,
)
from psserver.shards.auth import new_shard_secret, read_shard_secret
from psserver.shards.launch import (
    check_follower_ports,
    security_args,
    start_followers,
    stop_followers,
)

if TYPE_CHECKING:  # imported late at run time, once logging is set up
    from psserver.config import ServerConfig
    from psserver.server import ParameterServer

# The options of ps-server's that a follower shard uses; every other one describes the job,
# which a follower takes from its leader.
FOLLOWER_OPTIONS = frozenset({"bind", "num_shards", "threads", "endpoint_file"})
FOLLOWER_GRACE_AFTER_FAILURE_S = 5.0  # see run_with_followers


@click.command(
    cls=EnvAwareCommand, context_settings={"show_default": True, "max_content_width": 100}
)
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
    "--linger",
    type=FiniteFloatRange(min=0),
    default=0.0,
    help="After the summary, go on answering every worker that comes with STOP (and "
    "ps-status with the status) for this many seconds, or until SIGTERM: a worker that a "
    "supervisor restarts after the end (Kubernetes) then hears the job is over and exits 0.",
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
@click.option(
    "--shard-secret-file",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    default=None,
    help="A file holding the secret the shards of a job share: the leader admits only the "
    "followers that prove it. Give every shard started with --shard the same file (or `-` to "
    "read it from standard input); a leader makes one for the followers it starts. Make one "
    "with `(umask 077; openssl rand -hex 32 > FILE)`.",
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
    shard_secret_file: Path | None,
    **options: Any,
) -> None:
    """Run the parameter server for one training job."""
    num_shards = options["num_shards"]
    if shard is not None and shard >= num_shards:
        if num_shards == 1:  # --num-shards left out, most likely
            raise ConfigError(
                f"--shard {shard} needs --num-shards K, the job's number of shards (more than "
                f"{shard}), on every shard"
            )
        raise ConfigError(f"--shard {shard}: shards are numbered 0..{num_shards - 1}")
    if leader is not None and not shard:
        refuse_leader_without_shard(shard, num_shards)
    if shard:
        if leader is None:
            raise ConfigError(f"--shard {shard} is a follower: give it --leader ENDPOINT")
        refuse_job_options(shard, options)
        setup_logging(log_level, f"shard{shard}")
        reuse_large_buffers()
        from psserver.shards.follower import SliceServer
        from psserver.shards.joining import FollowerConfig

        follower = FollowerConfig(
            shard, num_shards, leader, options["bind"], advertise_host, leader_timeout,
            options["threads"],
            str(options["endpoint_file"]) if options["endpoint_file"] else None,
        )  # fmt: skip
        security = server_security_from_options(curve_secret_key, curve_authorized_clients)
        SliceServer(follower, security, shard_secret_from(shard_secret_file)).run()
        return
    setup_logging(log_level, "server")
    reuse_large_buffers()  # 45 MB messages: no page faults on every receive
    security = server_security_from_options(curve_secret_key, curve_authorized_clients)
    config = config_from_options(**options)
    warn_of_ignored_options(click.get_current_context(), config)
    shard_secret = None
    if shard_secret_file is not None and num_shards == 1:  # not read: `-` would wait on stdin
        logging.getLogger("ps.server").warning(
            "--shard-secret-file is for a sharded job (--num-shards K); this one ignores it"
        )
    else:
        shard_secret = shard_secret_from(shard_secret_file)
    launching = num_shards > 1 and shard is None
    if launching:
        check_follower_ports(config.bind, num_shards)
        if shard_secret is None:  # the followers this command starts prove a new one
            shard_secret = new_shard_secret()
    from psserver.server import ParameterServer  # after logging, so import-time work is logged

    server = ParameterServer(config, security, shard_secret)
    if not launching:
        server.run()
        return
    assert shard_secret is not None
    start = functools.partial(
        start_followers, num_shards, config.bind, server.endpoint, advertise_host,
        security_args(curve_secret_key, curve_authorized_clients), config.threads, log_level,
        leader_timeout,
    )  # fmt: skip
    run_with_followers(server, start, shard_secret)


def warn_of_ignored_options(ctx: click.Context, config: "ServerConfig") -> None:
    """Warn of each option the person set (not a default) that a job of this mode does not
    read: --no-staleness-lr in sync mode trained as if it were not there."""
    given = chosen_options(ctx, MODE_ONLY_OPTIONS)
    for name, purpose in ignored_by_mode(given, config.mode):
        (shown,) = given_explicitly(ctx, [name])
        if shown.startswith("--") and getattr(config, name) is False:
            shown = "--no-" + shown.removeprefix("--")  # as it was typed
        logging.getLogger("ps.server").warning(
            "%s %s; this %s job ignores it", shown, purpose, config.mode
        )


def shard_secret_from(path: Path | None) -> bytes | None:
    """The --shard-secret-file's secret (read once logging is set up: it may warn)."""
    return read_shard_secret(path) if path is not None else None


def run_with_followers(
    server: "ParameterServer",
    start: Callable[[bytes], list[subprocess.Popen[bytes]]],
    secret: bytes,
) -> None:
    """Start the followers (`start` takes the secret they prove), run the job, stop them."""
    followers = start(secret)
    server.launched_followers = dict(enumerate(followers, start=1))
    try:
        server.run()
    except BaseException:
        # The run told them to stop as it ended (psserver.server): a moment to end on that,
        # rather than on a SIGTERM that comes while they do. Not the full grace: a leader
        # stopped by a signal should end soon after it.
        told = server.followers_told_to_stop()
        stop_followers(followers, FOLLOWER_GRACE_AFTER_FAILURE_S, told)
        raise
    if stop_followers(followers, told=server.followers_told_to_stop()):
        raise PSError("a follower shard failed while stopping; see its log above")


def refuse_leader_without_shard(shard: int | None, num_shards: int) -> None:
    """--leader on the leader itself used to be ignored: a second leader started, and
    waited for followers that joined the first."""
    role = "--shard 0 makes this server" if shard == 0 else "without --shard this server is"
    if num_shards == 1:
        wanted = "--shard I --num-shards K (I in 1..K-1)"
    else:
        wanted = "--shard 1" if num_shards == 2 else f"--shard I (I in 1..{num_shards - 1})"
    raise ConfigError(
        f"--leader is for a follower shard, and {role} the leader; did you mean {wanted}? "
        "Leave out --leader to run the leader"
    )


def refuse_job_options(shard: int, options: dict[str, Any]) -> None:
    """A follower takes the job from its leader: options that describe the job were ignored
    without a word, and the follower trained the leader's job instead."""
    given = given_explicitly(click.get_current_context(), set(options) - FOLLOWER_OPTIONS)
    if given:
        raise ConfigError(
            f"shard {shard} is a follower: it takes the job (model, mode, lr, ...) from the "
            f"leader, so {', '.join(given)} would be ignored; give these options to the leader "
            "(shard 0) only"
        )


def given_explicitly(ctx: click.Context, names: Iterable[str]) -> list[str]:
    """Those of `names` set on the command line (as --x) or in the environment (as PS_X)."""
    return [
        "--" + name.replace("_", "-")
        if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE
        else f"{ENV_PREFIX}_{name.upper()}"
        for name in chosen_options(ctx, names)
    ]


def main() -> None:
    # kill, a pod's eviction, ps-local stopping its server: stop the followers as Ctrl-C
    # does, and say so (PR_SET_PDEATHSIG sends a follower SIGTERM too)
    with unwinding_on_termination():
        command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
