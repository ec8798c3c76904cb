"""The leader's connection to one follower shard: connecting to it, reading what it sends, and
waiting for its slice.

The leader keeps one DEALER socket to each follower that joined. What a follower answers (the
slice the leader pulled, a ping's version, an ERROR) is read here, and every answer counts as
a sign of life; the follower's own traffic counts come with its slices. A follower that refuses the
leader's request, is out of step, or sends nothing in time is lost (`ShardLost`): the job
cannot go on without its slice.

What it is not: the group. Which followers may join, what they are sent and when one counts
as silent are psserver.shards.leader'; this is one link.
"""

import dataclasses
import logging
import time

import zmq

from common.errors import JobLost, PSError, RequestRejected
from common.wire.protocol import Error, Message, Register, Weights, decode
from common.wire.security import ServerSecurity, secure_peer_socket

log = logging.getLogger("ps.server")


class ShardLost(JobLost):
    """A follower shard stopped answering; the job cannot go on without its slice."""


@dataclasses.dataclass
class FollowerLink:
    shard: int
    endpoint: str
    socket: zmq.Socket
    last_heard: float
    pinged: float = 0.0
    # The follower's own counts, as of its latest answer: gradient bytes it applied and
    # updated-bucket bytes it streamed to workers (the leader sees neither go by).
    pushed_bytes: int = 0
    streamed_bytes: int = 0

    def heard(self, reply: Message) -> None:
        self.last_heard = time.monotonic()
        if isinstance(reply, Weights):
            self.pushed_bytes, self.streamed_bytes = reply.pushed_bytes, reply.streamed_bytes

    def drain(self) -> None:
        """Read every answer that has come, without waiting."""
        while self.socket.poll(0):
            try:
                self.heard(decode(self.socket.recv_multipart()))
            except PSError as exc:
                log.warning("shard %d sent a message the leader cannot read: %s", self.shard, exc)
                self.last_heard = time.monotonic()

    def await_slice(self, version: int, wait_s: float) -> Weights:
        """The follower's slice at `version`, the answer to a PULL; ShardLost if it refuses,
        is at another version, or sends nothing for `wait_s` seconds."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.socket.poll(int(left * 1000) + 1):
                break
            reply = decode(self.socket.recv_multipart())
            self.heard(reply)
            if isinstance(reply, Error):  # to this PULL, or to a plan or commit before it
                raise ShardLost(
                    f"shard {self.shard} refused the leader's request ({reply.code}): "
                    f"{reply.message}; restart every shard, with --resume to use the last "
                    "checkpoint"
                )
            if not isinstance(reply, Weights) or reply.params.numel() == 0:
                continue  # a ping's answer
            if reply.version != version:
                raise ShardLost(
                    f"shard {self.shard} is at step {reply.version}, the leader at {version}; "
                    "the shards are out of step: restart the job with --resume"
                )
            return reply
        raise ShardLost(
            f"shard {self.shard} at {self.endpoint} did not send its slice within "
            f"{wait_s:g} s; restart every shard, with --resume to use the last "
            "checkpoint"
        )


def connect_follower(
    context: zmq.Context, hello: Register, security: ServerSecurity | None, timeout_s: float
) -> FollowerLink:
    """A DEALER to the follower whose REGISTER is `hello`; a send blocks at most `timeout_s`."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    if security is not None:
        secure_peer_socket(socket, security)
    try:
        socket.connect(hello.endpoint)
    except zmq.ZMQError as exc:
        socket.close()
        raise RequestRejected(
            "bad-shard", f"shard {hello.shard}: cannot connect to {hello.endpoint!r}: {exc}"
        ) from None
    return FollowerLink(hello.shard, hello.endpoint, socket, time.monotonic())
