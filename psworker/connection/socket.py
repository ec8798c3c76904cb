"""A worker's DEALER socket to a server: no linger, a send timeout, CURVE when the job has
keys, and, for a connection's main socket, a watch on its handshakes (common.wire.handshake) set
up before it connects, so that no refusal goes unseen.

What this is not: requests and their retries (psworker.connection.client), the wait for a reply
(psworker.connection.waiting), nor the heartbeat (psworker.connection.heartbeat); the connection and
the heartbeat open their sockets here.
"""

import zmq

from common.errors import ServerError
from common.wire.handshake import HandshakeWatch
from common.wire.security import ClientSecurity, secure_client_socket


def open_dealer(
    context: zmq.Context,
    endpoint: str,
    timeout_s: float,
    security: ClientSecurity | None,
    watched: bool,
) -> tuple[zmq.Socket, HandshakeWatch | None]:
    """A new DEALER connected to `endpoint`, and its handshake watch if `watched`."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    # A DEALER blocks on send until a connection exists, and one refused by CURVE never
    # does: requests go out by send_when_connected, a post gives up after the timeout.
    socket.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    if security is not None:
        secure_client_socket(socket, security)
    watch = None
    if watched:  # before connect, so that no handshake goes unseen
        watch = HandshakeWatch(socket, endpoint, security is not None)
    try:
        socket.connect(endpoint)
    except zmq.ZMQError as exc:
        if watch is not None:
            close_dealer(socket, watch)
        else:  # the heartbeat's: the main socket's watch stays
            socket.close()
        raise ServerError(
            f"--server {endpoint!r} is not a valid endpoint ({exc}); use tcp://HOST:PORT"
        ) from None
    return socket, watch


def close_dealer(socket: zmq.Socket, watch: HandshakeWatch | None) -> None:
    """Close a socket and its handshake watch (which `context.term()` would otherwise wait
    for)."""
    if watch is not None:
        watch.close()
    socket.close(linger=0)
