"""The worker's heartbeat: a thread that sends HEARTBEAT every `interval` and records when the
server last answered, and what it answered if that ends the registration (STOP, or ERROR
"unknown-worker").

The server's silence is judged by the connection's waits (psworker.connection.requests), which read
`last_heard` and `verdict`; this thread only writes them (a float and a reference: atomic
writes, no lock).

What it is not: a request. It runs on a socket of its own (sockets are not thread-safe),
made by the connection it serves, and nothing it sends is retried: the next beat is the retry.
"""

import contextlib
import threading
import time
from typing import TYPE_CHECKING

import zmq

from common.errors import PSError
from common.wire.protocol import Error, Heartbeat, HeartbeatAck, Message, Stop, decode, encode

if TYPE_CHECKING:  # the connection imports this module to start the thread
    from psworker.connection.requests import ServerConnection

STOP_POLL_MS = 50


class HeartbeatThread(threading.Thread):
    """Sends HEARTBEAT every `interval` on its own socket (sockets are not thread-safe) and
    records when the server last answered."""

    def __init__(
        self, connection: "ServerConnection", worker_id: int, token: str, interval: float
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.connection, self.worker_id, self.token = connection, worker_id, token
        self.interval = interval
        self.last_heard = time.monotonic()  # a float write is atomic; read by the main thread
        # STOP, or ERROR "unknown-worker": the end of this registration (a reference write,
        # atomic too). Other errors only stop the heartbeat: the silence then tells.
        self.verdict: Message | None = None
        self._stopping = threading.Event()

    def run(self) -> None:
        try:
            socket = self.connection.open_socket()
        except (PSError, zmq.ZMQError):
            return  # the main thread is shutting the connection down
        socket.setsockopt(zmq.SNDHWM, 4)  # a dead server must not pile up heartbeats
        try:
            while not self._stopping.is_set():
                with contextlib.suppress(zmq.Again):
                    socket.send_multipart(
                        encode(Heartbeat(self.worker_id, self.token)), zmq.NOBLOCK
                    )
                deadline = time.monotonic() + self.interval
                while time.monotonic() < deadline and not self._stopping.is_set():
                    # Short polls keep stop() prompt.
                    if socket.poll(STOP_POLL_MS):
                        self._on_reply(socket.recv_multipart())
        except zmq.ContextTerminated:
            pass
        finally:
            socket.close(linger=0)

    def _on_reply(self, frames: list[bytes]) -> None:
        try:
            reply = decode(frames)
        except PSError:  # a garbled heartbeat reply is not worth dying for
            return
        if isinstance(reply, (HeartbeatAck, Stop)):
            self.last_heard = time.monotonic()
        if isinstance(reply, Stop) or (isinstance(reply, Error) and reply.code == "unknown-worker"):
            self.verdict = (
                reply  # a request waiting now ends with it (see psworker.connection.requests)
            )
        if isinstance(reply, (Stop, Error)):
            self._stopping.set()

    def stop(self) -> None:
        self._stopping.set()
        self.join(timeout=5)
