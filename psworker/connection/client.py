"""The worker's connection to the server: requests with timeouts and bounded retries.

A request waits for its reply until the server has been silent for `timeout_s`, or until
something ends the wait sooner (psworker.connection.waiting says what counts as silence, and what
does). After a silent wait the socket is replaced (a ZeroMQ request cannot be taken back) and the
request is sent again after an exponential backoff, at most `retries` times; or, for a first
registration (`within_s`), as often as fits before its deadline. The server
deduplicates retried pushes, so a retry never applies a gradient twice. A server that
answers "busy" is asked again the same way.

A server that refuses this worker's handshake (CURVE keys it does not accept, or none where it
wants them) is told apart from a silent one: the main socket's handshakes are watched
(common.wire.handshake), and a refusal ends the wait at once with HandshakeRefused, which says
which key to fix, instead of every retry's timeout and a "no reply".

When a request fails, psworker.connection.failures says so (RequestFailed, NoReply, Interrupted).

What it is not: the wait for one reply (psworker.connection.waiting, which ServerConnection builds
on: heartbeats as signs of life, a verdict or STOP that answers for the server, a shutdown
signal). Nor the heartbeat: that thread (psworker.connection.heartbeat) runs on a socket of its own;
this connection starts and stops it. Nor the sockets themselves (psworker.connection.socket).
"""

import itertools
import logging
import time
from collections.abc import Callable

import zmq

from common.wire.handshake import HandshakeRefused, send_when_connected
from common.wire.protocol import Error, Message, describe, encode
from common.wire.security import ClientSecurity
from psworker.connection.failures import (
    RequestFailed,
    no_reply,
    nobody_answered,
    server_words,
)
from psworker.connection.heartbeat import HeartbeatThread
from psworker.connection.socket import close_dealer, open_dealer
from psworker.connection.waiting import ReplyWaiter

log = logging.getLogger("ps.worker")
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0


class ServerConnection(ReplyWaiter):
    """Requests to one server (the leader, or a follower shard) on a DEALER that is replaced
    after each silent wait; ReplyWaiter does the waiting."""

    def __init__(
        self, endpoint: str, timeout_s: float, retries: int = 5,
        security: ClientSecurity | None = None, liveness: Callable[[], float] | None = None,
        verdict: Callable[[], Message | None] | None = None,
        join_timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        """`join_timeout_s`: how long a first registration waits for a server that has never
        answered (psworker.connection.registration; None: as long as its retries)."""
        super().__init__(timeout_s, liveness, verdict)
        self.join_timeout_s = join_timeout_s
        self.endpoint, self.retries = endpoint, retries
        self.request_retries = retries
        self.security = security
        self.context = zmq.Context()
        self._watch = None
        self._socket = self.open_socket(watched=True)
        self._pending = None  # the request `receive` is waiting for
        self._sent = False

    def open_socket(self, watched: bool = False) -> zmq.Socket:
        """A new DEALER to the server; `watched`: the main socket, whose handshakes tell
        whether the server refuses this worker (the heartbeat's socket leaves that to it)."""
        socket, watch = open_dealer(
            self.context, self.endpoint, self.timeout_s, self.security, watched
        )
        if watched:
            self._watch = watch
        return socket

    def request(
        self, message: Message, retries: int | None = None, within_s: float | None = None
    ) -> Message:
        """Send a message and return the reply; an ERROR reply becomes RequestFailed.
        `retries`: this request's, if not the connection's; `within_s`: instead of retries,
        ask again after each silent wait until this many seconds have passed.

        Tensors in the reply are read-only views of the received frames.
        """
        self._begin_wait(within_s)
        try:
            self.send(message)
            return self.receive(retries, within_s)
        finally:
            self._deadline = None

    def send(self, message: Message) -> None:
        """Start a request; `receive` waits for its reply. ZeroMQ moves the bytes on its own
        I/O thread, so requests sent to several servers travel in parallel."""
        # Logged before the send, which may wait for a connection: with --log-level debug,
        # the log says which request a worker waits on, and when each was answered.
        log.debug("asking %s: %s", self.endpoint, describe(message))
        self._pending = message
        try:
            # Not connected within the timeout: receive() retries.
            left = self._time_left()
            self._sent = send_when_connected(
                self._socket, encode(message), self._watch,
                self.timeout_s if left is None else min(self.timeout_s, left),
            )  # fmt: skip
        except HandshakeRefused:
            self._pending = None
            raise

    def post(self, message: Message) -> None:
        """Send a message that gets no reply (a bucket's PUSH), ahead of the request that answers
        for it. Not retried: if it is lost, that request says so."""
        try:
            self._socket.send_multipart(encode(message), copy=False)
        except zmq.Again:
            log.debug("could not send %s to %s", describe(message), self.endpoint)

    def receive(self, retries: int | None = None, within_s: float | None = None) -> Message:
        """The reply to the last `send`, retrying it after a timeout (see the module doc);
        `within_s` as for `request`."""
        message = self._pending
        assert message is not None, "receive() without send()"
        if self._deadline is None:  # not begun by `request`
            self._begin_wait(within_s)
        started = self._wait_started
        self._asked_again = False
        retries = self.retries if retries is None else retries
        self.request_retries = retries
        try:
            for attempt in itertools.count():
                reply = self._await_reply() if self._sent else None
                left = self._time_left()
                again = attempt < retries if left is None else left > 0
                busy = isinstance(reply, Error) and reply.code == "busy"
                if reply is not None and not (busy and again):
                    self._pending = None
                    log.debug(
                        "%s answered %s with %s",
                        self.endpoint, describe(message), describe(reply),
                    )  # fmt: skip
                    if isinstance(reply, Error):
                        raise RequestFailed(
                            reply.code,
                            f"the server refused {describe(message)} "
                            f"({server_words(reply.code)}): {server_words(reply.message)}",
                        )
                    return reply
                self._check_handshake()  # a refusal, not silence: retrying cannot help
                if not again or self._asked_again:  # see psworker.connection.waiting
                    break
                delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt, left or BACKOFF_MAX_S)
                # "busy": the server had too many requests waiting (others' floods, say) and
                # turned this one away for now; it is asked again like one that got no reply.
                # (A first registration says what it waits for itself: a notice, not a warning.)
                log.log(
                    logging.WARNING if left is None else logging.INFO,
                    "%s from %s (%s, attempt %d%s); retrying in %.1f s",
                    "busy" if busy else f"no reply for {self.timeout_s:.0f} s", self.endpoint,
                    describe(message), attempt + 1,
                    f" of {retries + 1}" if left is None else "", delay,
                )  # fmt: skip
                self._back_off(delay)
                self.reset()  # its late reply, if any, must not be read later
                self.send(message)
        finally:
            self._deadline = None
        self._pending = None
        waited = time.monotonic() - started
        if within_s is not None and not self.proven:
            raise nobody_answered(self.endpoint, message, waited, self.reach(), within_s)
        raise no_reply(
            self.endpoint, message, attempt + 1, self.timeout_s, self.proven, waited,
            forgotten=self._asked_again,
        )  # fmt: skip

    def reset(self) -> None:
        """Forget a request in flight: a new socket never reads the old one's reply."""
        self._close_socket(self._socket)
        self._socket = self.open_socket(watched=True)
        self._pending = self._early = None

    def _close_socket(self, socket: zmq.Socket) -> None:
        """Close the main socket and its handshake watch (which `context.term()` would
        otherwise wait for)."""
        close_dealer(socket, self._watch)
        self._watch = None

    def start_heartbeat(self, worker_id: int, token: str, interval: float) -> None:
        self.stop_heartbeat()
        self.heartbeat = HeartbeatThread(self, worker_id, token, interval)
        self.heartbeat.start()

    def stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def close(self) -> None:
        self.stop_heartbeat()
        self._close_socket(self._socket)
        self.context.term()
