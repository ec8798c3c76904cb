"""The worker's connection to the server: one DEALER socket, one request at a time.

Every request waits at most `timeout_s` for its reply, so a dead or unreachable server ends in
a clear error rather than a hang.
"""

import zmq

from common.errors import ServerError
from common.protocol import Error, Message, decode, encode


class ServerConnection:
    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ServerError(
                f"--server {endpoint!r} is not a valid endpoint ({exc}); use tcp://HOST:PORT"
            ) from None

    def request(self, message: Message) -> Message:
        """Send a message and return the reply; an ERROR reply becomes a ServerError.

        Tensors in the reply are read-only views of the received frames.
        """
        self._socket.send_multipart(encode(message), copy=False)
        if not self._socket.poll(int(self.timeout_s * 1000)):
            raise ServerError(
                f"no reply from the server at {self.endpoint} within {self.timeout_s:g} s; "
                "check that ps-server runs there and the port is reachable"
            )
        frames = self._socket.recv_multipart(copy=False)
        reply = decode([frame.buffer for frame in frames])
        if isinstance(reply, Error):
            raise ServerError(
                f"the server refused {type(message).__name__} ({reply.code}): {reply.message}"
            )
        return reply

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()
