"""`ps-server`: hold the weights, apply the updates, evaluate, checkpoint, summarise."""

import functools
import logging
import subprocess
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from common.cli import (
    ENV_PREFIX,
    EnvAwareCommand,
    chosen_options,
    explain_errors,
    unwinding_on_termination,
)
from common.errors import ConfigError, PSError
from common.logs import setup_logging
from common.memory import reuse_large_buffers
from common.options import FOLLOWER_READS, SERVER_OPTIONS, options, spec_of, with_params
from common.security_options import server_security_from_options
from common.startup import freeze_imported_objects
from psserver.config import ServerConfig
from psserver.shards.auth import new_shard_secret, read_shard_secret
from psserver.shards.launch import (
    FollowerLaunch,
    check_follower_ports,
    follower_configs,
    start_followers,
    stop_followers,
)

if TYPE_CHECKING:  # imported late at run time, once logging is set up
    from psserver.server import ParameterServer

FOLLOWER_GRACE_AFTER_FAILURE_S = 5.0  # see run_with_followers

# Options that some modes do not read: (the modes that do, what the option does there). They
# used to be accepted and ignored without a word; given to another mode, the server says so.
MODE_ONLY_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "staleness": (("ssp",), "bounds how far ahead a worker may run in --mode ssp only"),
    "staleness_lr": (
        ("async", "ssp"),
        "scales a stale gradient's step, and only --mode async and ssp apply stale gradients",
    ),
    "step_timeout": (
        ("sync",),
        "closes a --mode sync step that waits for a gradient (async and ssp apply each one "
        "as it comes, with no step to wait for)",
    ),
    "stream_weights": (
        ("sync",),
        "streams the buckets of a --mode sync step back as they are applied (async and ssp "
        "send weights only when a worker pulls)",
    ),
}


@click.command(
    cls=EnvAwareCommand, context_settings={"show_default": True, "max_content_width": 100}
)
@options(SERVER_OPTIONS)
@explain_errors
@with_params
def command(params: Mapping[str, Any]) -> None:
    """Run the parameter server for one training job."""
    shard, num_shards, log_level = params["shard"], params["num_shards"], params["log_level"]
    check_shard_options(shard, params["leader"], num_shards)
    keys = params["curve_secret_key"], params["curve_authorized_clients"]
    if shard:
        refuse_job_options(shard, params)
        setup_logging(log_level, f"shard{shard}")
        reuse_large_buffers()
        from psserver.shards.follower import SliceServer
        from psserver.shards.joining import FollowerConfig

        follower = spec_of(FollowerConfig, params)
        security = server_security_from_options(*keys)
        SliceServer(follower, security, shard_secret_from(params["shard_secret_file"])).run()
        return
    setup_logging(log_level, "server")
    reuse_large_buffers()  # 45 MB messages: no page faults on every receive
    security = server_security_from_options(*keys)
    config = spec_of(ServerConfig, params)
    warn_of_ignored_options(click.get_current_context(), config)
    shard_secret = None
    if params["shard_secret_file"] is not None and num_shards == 1:  # `-` would wait on stdin
        logging.getLogger("ps.server").warning(
            "--shard-secret-file is for a sharded job (--num-shards K); this one ignores it"
        )
    else:
        shard_secret = shard_secret_from(params["shard_secret_file"])
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
    told = FollowerLaunch(log_level, *keys)
    configs = follower_configs(
        config, server.endpoint, params["advertise_host"], params["leader_timeout"]
    )
    run_with_followers(server, functools.partial(start_followers, configs, told), shard_secret)


def check_shard_options(shard: int | None, leader: str | None, num_shards: int) -> None:
    """--shard, --leader and --num-shards together, before anything starts."""
    if shard is not None and shard >= num_shards:
        if num_shards == 1:  # --num-shards left out, most likely
            raise ConfigError(
                f"--shard {shard} needs --num-shards K, the job's number of shards (more than "
                f"{shard}), on every shard"
            )
        raise ConfigError(f"--shard {shard}: shards are numbered 0..{num_shards - 1}")
    if leader is not None and not shard:
        refuse_leader_without_shard(shard, num_shards)
    if shard and leader is None:
        raise ConfigError(f"--shard {shard} is a follower: give it --leader ENDPOINT")


def ignored_by_mode(given: list[str], mode: str) -> list[tuple[str, str]]:
    """(option, what it does) for each option in `given` (names as in the config) that a
    job of `mode` does not read."""
    ignored = []
    for name in given:
        modes, purpose = MODE_ONLY_OPTIONS.get(name, ((mode,), ""))
        if mode not in modes:
            ignored.append((name, purpose))
    return ignored


def warn_of_ignored_options(ctx: click.Context, config: ServerConfig) -> None:
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


def refuse_job_options(shard: int, params: Mapping[str, Any]) -> None:
    """A follower takes the job from its leader: options that describe the job were ignored
    without a word, and the follower trained the leader's job instead."""
    given = given_explicitly(click.get_current_context(), set(params) - FOLLOWER_READS)
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
    freeze_imported_objects()
    # kill, a pod's eviction, ps-local stopping its server: stop the followers as Ctrl-C
    # does, and say so (PR_SET_PDEATHSIG sends a follower SIGTERM too)
    with unwinding_on_termination():
        command(auto_envvar_prefix=ENV_PREFIX)


if __name__ == "__main__":
    main()
