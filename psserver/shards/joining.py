"""How a follower shard joins its leader: where workers can reach it, and the one REGISTER ->
WELCOME exchange (each in a follower's form, with `shard`) that hands it the job and its
slice's starting state.

What it is not: the follower's work. That is psserver.shards.follower, which starts from the
welcome this returns.
"""

import dataclasses
import logging
import socket
import time
from pathlib import Path

import zmq

from common.catalog import all_fingerprints
from common.errors import PSError
from common.wire.endpoints import check_endpoint
from common.wire.handshake import HandshakeRefused, HandshakeWatch, await_answer
from common.wire.protocol import Error, Register, Welcome, decode, describe, encode
from common.wire.security import ServerSecurity, secure_peer_socket
from psserver.shards.auth import shard_proof

log = logging.getLogger("ps.shard")
FIRST_WAIT_NOTICE_S = 5.0  # a leader that starts its followers answers long before this
WAIT_NOTICE_S = 30.0


@dataclasses.dataclass(frozen=True)
class FollowerConfig:
    shard: int
    num_shards: int
    leader: str  # the leader's endpoint
    bind: str = "tcp://127.0.0.1:*"
    advertise_host: str | None = None  # the host workers use to reach this shard
    leader_timeout: float = 600.0  # seconds of leader silence before this shard gives up
    threads: int | None = None
    endpoint_file: Path | None = None

    def __post_init__(self) -> None:
        check_endpoint(self.leader, "--leader")
        check_endpoint(self.bind, "--bind", bind=True)


def advertised_endpoint(bound: str, advertise_host: str | None) -> str:
    """The endpoint others should dial: the bound one, with a wildcard host replaced."""
    transport, _, rest = bound.partition("://")
    host, _, port = rest.rpartition(":")
    if advertise_host:
        host = advertise_host
    elif host in ("0.0.0.0", "*", "[::]", "::"):
        host = socket.gethostname()
    return f"{transport}://{host}:{port}"


def await_leader(link: zmq.Socket, watch: HandshakeWatch, config: FollowerConfig) -> bool:
    """Whether the leader answered within --leader-timeout. A follower started by hand before
    its leader said nothing for up to that long (10 minutes by default): it now says whom it
    waits for after a few seconds, and again now and then. One its leader started hears at
    once and says nothing."""
    deadline = time.monotonic() + config.leader_timeout
    notice_s = FIRST_WAIT_NOTICE_S
    while True:
        left_s = deadline - time.monotonic()
        if await_answer(link, watch, max(0.0, min(notice_s, left_s))):
            return True
        if left_s <= notice_s:
            return False
        log.info(
            "shard %d: waiting for its leader at %s to answer (%.0f s left of --leader-timeout)",
            config.shard, config.leader, deadline - time.monotonic(),
        )  # fmt: skip
        notice_s = WAIT_NOTICE_S


def join_leader(
    context: zmq.Context,
    config: FollowerConfig,
    endpoint: str,
    security: ServerSecurity | None,
    shard_secret: bytes | None = None,
) -> Welcome:
    """Register with the leader as this shard (reachable at `endpoint`), proving the job's
    shard secret if it has one, and wait for the job and this slice's starting state."""
    shard, num_shards = config.shard, config.num_shards
    proof = "" if shard_secret is None else shard_proof(shard_secret, shard, num_shards, endpoint)
    register = Register(
        shard=shard, num_shards=num_shards, endpoint=endpoint, fingerprints=all_fingerprints(),
        proof=proof,
    )  # fmt: skip
    link = context.socket(zmq.DEALER)
    link.setsockopt(zmq.LINGER, 0)
    if security is not None:
        secure_peer_socket(link, security)
    # Keys that do not match the leader's are told at once, not after --leader-timeout.
    watch = HandshakeWatch(link, config.leader, security is not None, peer=True)
    try:
        link.connect(config.leader)
        link.send_multipart(encode(register))
        if not await_leader(link, watch, config):
            raise PSError(
                f"shard {config.shard}: no answer from the leader at {config.leader} in "
                f"{config.leader_timeout:g} s; start ps-server --shard 0 there first, or check "
                "--leader"
            )
        reply = decode(link.recv_multipart())
    except HandshakeRefused as exc:
        raise PSError(f"shard {config.shard}: {exc}") from None
    except zmq.ZMQError as exc:
        raise PSError(f"shard {config.shard}: --leader {config.leader}: {exc}") from None
    finally:
        watch.close()  # before its socket: the context cannot end while it is open
        link.close(linger=0)
    if isinstance(reply, Error):
        raise PSError(f"shard {config.shard}: the leader refused it: {reply.message}")
    if not isinstance(reply, Welcome) or reply.shard != shard:
        raise PSError(
            f"shard {config.shard}: expected the leader's WELCOME for shard {shard}, got "
            f"{describe(reply)}; is --leader the endpoint of this job's shard 0?"
        )
    return reply
