"""`ps-server --num-shards K` in one command: the leader starts its K-1 follower shards.

The followers run on this host, each in its own process (a slice update is a pass over
memory; separate processes use separate cores and separate sockets). They bind next to the
leader: ports PORT+1 .. PORT+K-1 when the leader has a fixed PORT, free ports otherwise.
Linux kills them if the leader dies (PR_SET_PDEATHSIG), so no shard outlives its job. They
start as the `ps-server` console script does (a Ctrl-C while they import torch is one line
each), in the leader's process group: a Ctrl-C stops the whole job.
To spread shards over several hosts, start each with `ps-server --shard I --leader ...`.
The followers prove the job's shard secret when they join (psserver.shards.auth): the leader
writes it to their standard input.
"""

import dataclasses
import logging
import os
import subprocess
import time
from collections.abc import Collection, Sequence
from pathlib import Path

from common.cli import without_option_variables
from common.errors import ConfigError, JobLost
from common.logs import counted
from common.processes import how_it_ended, start_child, stopped_by
from common.roles import SERVER, command_args
from common.startup import command_line
from common.wire.endpoints import MAX_PORT
from psserver.config import ServerConfig
from psserver.shards.joining import FollowerConfig

log = logging.getLogger("ps.server")
# How long a leader whose follower a Ctrl-C or a SIGTERM stopped waits for the same signal
# to stop it too, before it reports the follower (see check_launched).
OWN_SIGNAL_WAIT_S = 1.0


class FollowerExited(JobLost):
    """A follower shard this command started exited before it joined: the leader would
    otherwise wait for it for ever."""


def check_follower_ports(leader_bind: str, num_shards: int) -> None:
    """The followers can bind beside the leader (see `follower_bind`): checked before the
    leader loads anything, not found out when a follower fails to bind."""
    transport, _, rest = leader_bind.partition("://")
    if transport != "tcp":
        raise ConfigError(
            f"--bind {leader_bind} with --num-shards {num_shards}: the leader starts its "
            "followers on TCP ports beside its own, so bind it to tcp://HOST:PORT (or "
            "tcp://HOST:* for free ports), or start each shard with --shard I"
        )
    port = rest.rpartition(":")[2]
    if not port.isdigit() or int(port) == 0:  # a free port, or one that bind will refuse
        return
    last = int(port) + num_shards - 1
    if last > MAX_PORT:
        raise ConfigError(
            f"--bind {leader_bind} with --num-shards {num_shards}: the followers would "
            f"listen on ports up to {last}, past {MAX_PORT}; bind the leader to port "
            f"{MAX_PORT - num_shards + 1} or lower, or to port * for free ports"
        )


def check_launched(children: dict[int, subprocess.Popen[bytes]], waiting: list[int]) -> None:
    """Raise FollowerExited if a shard the leader waits for was started here and has exited
    (it could not bind, say): it will never join.

    One that a Ctrl-C or a SIGTERM stopped most likely got it with the leader (a terminal's
    Ctrl-C, ps-local stopping its server reach the whole process group): the leader is
    stopping too, and must say that, not that its follower failed. Its own handler may not
    have run yet (another thread took the signal): a moment for it first."""
    for shard in waiting:
        child = children.get(shard)
        code = None if child is None else child.poll()
        if code is None:
            continue
        ended = f"shard {shard} (started by this command) {how_it_ended(code)} before joining"
        if stopped_by(code) is not None:
            time.sleep(OWN_SIGNAL_WAIT_S)  # the leader's own handler raises in here, if due
            raise FollowerExited(f"{ended}, by a signal this leader did not get")
        raise FollowerExited(f"{ended}; see its error above" if code > 0 else ended)


def follower_bind(leader_bind: str, leader_endpoint: str, shard: int) -> str:
    """Where shard `shard` listens: beside the leader, on PORT+shard or a free port."""
    transport, _, rest = leader_endpoint.partition("://")
    host = rest.rpartition(":")[0]
    wanted_host = leader_bind.partition("://")[2].rpartition(":")[0]
    bind_host = wanted_host if wanted_host in ("*", "0.0.0.0") else host
    fixed = not leader_bind.endswith(":*") and not leader_bind.endswith(":0")
    port = int(rest.rpartition(":")[2]) + shard if fixed else "*"
    return f"{transport}://{bind_host}:{port}"


def dialable(endpoint: str) -> str:
    """The leader's endpoint as its own host dials it (a wildcard host is not dialable)."""
    transport, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host in ("0.0.0.0", "*"):
        host = "127.0.0.1"
    return f"{transport}://{host}:{port}"


@dataclasses.dataclass(frozen=True)
class FollowerLaunch:
    """What each follower a leader starts is told besides its FollowerConfig: the leader's
    log level and CURVE keys, and where the shard secret comes from."""

    log_level: str
    curve_secret_key: Path | None = None
    curve_authorized_clients: Path | None = None
    shard_secret_file: Path = Path("-")  # its standard input: see hand_over_secret


def follower_configs(
    leader: ServerConfig, leader_endpoint: str, advertise_host: str | None, leader_timeout: float
) -> list[FollowerConfig]:
    """Shards 1..K-1 of the leader's job, each bound beside the leader (`follower_bind`)."""
    leader_dialled = dialable(leader_endpoint)
    return [
        FollowerConfig(
            shard,
            leader.num_shards,
            leader_dialled,
            bind=follower_bind(leader.bind, leader_endpoint, shard),
            advertise_host=advertise_host or None,
            leader_timeout=leader_timeout,
            threads=leader.threads,
        )
        for shard in range(1, leader.num_shards)
    ]


def start_followers(
    configs: Sequence[FollowerConfig], told: FollowerLaunch, shard_secret: bytes
) -> list[subprocess.Popen[bytes]]:
    # Everything a follower needs is on its command line; the leader's own PS_ variables
    # (PS_ENDPOINT_FILE, say) must not reach it, and a follower refuses training options
    # (PS_MODEL, PS_LR, ...): it takes the job from the leader.
    env = without_option_variables(os.environ)
    children: list[subprocess.Popen[bytes]] = []
    for config in configs:
        argv = [*command_line(SERVER.module, "ps-server"), *command_args(SERVER, config, told)]
        try:
            child = start_child(argv, hold_interrupt=True, env=env, stdin=subprocess.PIPE)
        except BaseException:  # a stop signal came: the caller never gets these to stop
            stop_followers(children, grace_s=0)
            raise
        hand_over_secret(child, shard_secret)
        children.append(child)
    log.info("started %s", counted(len(children), "follower shard"))
    return children


def hand_over_secret(child: subprocess.Popen[bytes], secret: bytes) -> None:
    """Write the shard secret to a follower's standard input and close it.

    A pipe, not a file: nothing is left on disk when the leader is killed (a file in $TMPDIR
    outlived every SIGKILLed leader), and only this user can read another process's pipe; not
    an argument or a variable either, which `ps` and every grandchild would see. The secret is
    far smaller than a pipe's buffer, so this never waits for the follower to read it."""
    assert child.stdin is not None
    try:
        child.stdin.write(secret + b"\n")
        child.stdin.close()
    except BrokenPipeError:  # it died at once; the leader's watch reports how
        pass


def stop_followers(
    children: list[subprocess.Popen[bytes]], grace_s: float = 10.0,
    told: Collection[int] | None = None,
) -> int:  # fmt: skip
    """Wait for the followers (the leader told them to stop), all of them within `grace_s`
    together, not each (a leader of 8 shards waited 35 s, past a Kubernetes pod's grace);
    SIGTERM any that linger, then SIGKILL.

    `told`: the shards (numbered from 1, as `children` are) the leader sent its STOP, when not
    all of them. The others had not joined and hear none: they get SIGTERM at once, where
    they waited out the grace for nothing, and ending on it is no failure of theirs.

    Returns the first non-zero exit code, or 0."""
    unheard = set() if told is None else set(range(1, len(children) + 1)) - set(told)
    for shard in unheard:
        if children[shard - 1].poll() is None:
            children[shard - 1].terminate()
    worst = 0
    deadline = time.monotonic() + grace_s
    for shard, child in enumerate(children, 1):
        try:
            code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.terminate()
            try:
                code = child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                code = child.wait()
        if shard in unheard and stopped_by(code) == "SIGTERM":
            continue  # our own SIGTERM
        if code and not worst:
            worst = code
    return worst
