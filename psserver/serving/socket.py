"""A shard's ROUTER socket, the leader's and every follower's: bound with its limits (and
CURVE), and the ways to send on it.

Replies go out zero-copy. Tensors the server keeps changing (the live weights in sync mode, a
snapshot slot in async mode) are sent tracked, so that the store knows when ZeroMQ is done
with their memory (ParameterStore.track_send) before it writes there again.

What it is not: the request loop. The server polls, and `serve` hands each request to it.
"""

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import zmq

from common.errors import ProtocolError, PSError
from common.wire.endpoint_file import write_endpoint_file
from common.wire.handshake import HandshakeLogger
from common.wire.protocol import Message, decode, encode
from common.wire.security import (
    ClientKeyAuthenticator,
    ServerSecurity,
    secure_server_socket,
    warn_if_public_without_curve,
)
from psserver.serving.requests import Handler, RefusalLog, serve_one

log = logging.getLogger("ps.server")


def send_tracked(
    socket: zmq.Socket, identities: Sequence[bytes], message: Message
) -> list[zmq.MessageTracker]:
    """Send one message zero-copy to each of these ROUTER peers; what comes back tells when
    ZeroMQ is done with the tensors, for every peer at once.

    The message is encoded once and its tensor frames are shared: each send takes a reference
    to the same ZeroMQ message, and a frame's tracker fires only once every send of it is
    done. A bucket streamed to N workers costs one encoding and one tracker, not N."""
    header, *tensors = encode(message)
    # Only frames with bytes in them are tracked: an empty one reads no tensor's memory.
    frames = [zmq.Frame(t, track=memoryview(t).nbytes > 0) for t in tensors]
    for identity in identities:
        socket.send_multipart([identity, header, *frames], copy=False)
    return [f.tracker for f in frames if f.tracker is not None]


class ServerSocket:
    def __init__(
        self,
        context: zmq.Context,
        bind: str,
        security: ServerSecurity | None,
        max_message_bytes: int,
        endpoint_file: Path | None = None,
        logger: logging.Logger = log,
        who: str = "",  # what a bind error names first: "shard 1: " on a follower
    ) -> None:
        self.socket = context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        # How long closing waits for queued replies to leave: none, unless the last ones
        # matter (see linger_for_last_replies).
        self.linger_ms = 0
        self.refusals = RefusalLog(logger)
        warn_if_public_without_curve(bind, security is not None, logger)
        self.curve = security is not None  # its requests carry the sender's CURVE key
        self.authenticator: ClientKeyAuthenticator | None = None
        if security is not None:
            self.authenticator = secure_server_socket(context, self.socket, security)
        # Clients with the wrong keys (or none) never get a message through: say so.
        self.handshakes: HandshakeLogger | None = HandshakeLogger.started(
            self.socket, security is not None, logger
        )
        # ZeroMQ drops a frame bigger than this before it is read into memory. The limit is
        # per frame: a message of many frames, each under it, is still taken in whole (and
        # then refused for its frame count). Only CURVE keeps strangers from sending those.
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        try:
            self.socket.bind(bind)
        except zmq.ZMQError as exc:
            self.close()
            raise PSError(
                f"{who}cannot bind {bind}: {exc}; pick a free port or another address"
            ) from None
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if endpoint_file is not None:
            try:
                write_endpoint_file(endpoint_file, self.endpoint)
            except PSError:
                self.close()
                raise

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms))

    def serve(self, handle: Handler, on_error: Callable[[], None]) -> None:
        """One request (the caller has polled), handled or answered with an ERROR."""
        serve_one(self.socket, handle, self.refusals, on_error, curve=self.curve)

    def receive(self) -> tuple[bytes, Message | None]:
        """One request as it is, or None for one that does not decode (while shutting down)."""
        identity, *payload = self.socket.recv_multipart()
        try:
            return identity, decode(payload)
        except ProtocolError:
            return identity, None

    def send(self, identity: bytes, message: Message) -> None:
        self.socket.send_multipart([identity, *encode(message)], copy=False)

    def send_watched(self, identity: bytes, message: Message) -> zmq.MessageTracker:
        """Send a message built for this reply alone; what comes back tells when ZeroMQ has
        handed it to the kernel (psserver.status.backlog counts the ones that have not left)."""
        # copy=False even for small frames: a copied frame's tracker is done at once.
        frames = [zmq.Frame(frame, copy=False, track=True) for frame in encode(message)]
        self.socket.send_multipart([identity, *frames], copy=False)
        tracker = frames[0].tracker
        assert tracker is not None  # track=True
        return tracker

    def send_tracked(
        self, identities: Sequence[bytes], message: Message
    ) -> list[zmq.MessageTracker]:
        """Send zero-copy to each peer; what comes back tells when ZeroMQ is done with the
        tensors (see `send_tracked`)."""
        return send_tracked(self.socket, identities, message)

    def linger_for_last_replies(self, linger_ms: int) -> None:
        """Let replies sent just before closing leave: the context's end waits for them, up
        to `linger_ms`, and not at all once they are gone."""
        self.linger_ms = linger_ms

    def close(self) -> None:
        """Close the socket, then CURVE's authenticator: its thread holds a socket too, and
        the context cannot end before it does (so can the handshake log's monitor)."""
        if self.handshakes is not None:
            self.handshakes.close()
            self.handshakes = None
        self.refusals.flush()
        self.socket.close(linger=self.linger_ms)
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
