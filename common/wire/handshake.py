"""Telling a failed ZeroMQ handshake from a silent server.

A ZeroMQ connection whose handshake fails never delivers a message, so without help a client
with the wrong keys waits out its timeout and every retry (minutes), and then blames the
network. Mechanism mismatches and bad server keys never reach the server's ZAP handler either,
so its log says nothing. libzmq reports every failed handshake as a socket monitor event; this
module reads them:

- `HandshakeWatch` on a client socket says, within a second or so, that the server refused
  this client, and why in the person's terms (`HandshakeRefused`); and, while nothing
  answers, how far its connection got (`reach`): refused, open, or a handshake done;
- `HandshakeLogger` on a server socket logs clients that fail its handshake, at most once a
  minute per reason.

A monitor is an inproc PAIR socket of the watched socket's context: it must be closed before
that context is terminated, or `term()` waits for ever. Both classes close theirs in `close()`.
"""

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from common.errors import ServerError
from common.wire.security import KEYS_HINT

FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
DECISIVE = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
# A connection cut in the middle of a handshake (a server killed at that moment) also ends in
# NO_DETAIL, once; a refusal repeats at every reconnect (every 0.1 s), so that many in a row
# without a success is a refusal.
REFUSALS_IN_A_ROW = 3
REACH = zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_HANDSHAKE_SUCCEEDED
LOG_EVERY_S = 60.0
STOP_POLL_MS = 200
SEND_POLL_MS = 100
ANSWER_POLL_MS = 250  # how often a wait for an answer looks at the handshakes


class HandshakeRefused(ServerError):
    """The server ended every handshake of this connection: no request can get through."""


_monitor_numbers = itertools.count()


def _monitor(socket: zmq.Socket, events: int) -> zmq.Socket:
    """A monitor socket for `socket`, at an inproc address of its own: pyzmq's default names
    it after the socket's file descriptor, which a socket opened after a close gets again
    while the old monitor's address is still being torn down, and the new monitor then hears
    nothing."""
    return socket.get_monitor_socket(events, f"inproc://handshakes-{next(_monitor_numbers)}")


def _mechanism_mismatch(event: int, value: int) -> bool:
    """One end speaks CURVE and the other does not."""
    return (
        event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    )


def _pending_events(monitor: zmq.Socket) -> list[tuple[int, int]]:
    """The (event, value) pairs waiting on a monitor socket, without blocking."""
    events = []
    while monitor.poll(0):
        message = recv_monitor_message(monitor)
        events.append((int(message["event"]), int(message["value"])))
    return events


class HandshakeWatch:
    """Watches the handshakes of one client socket (used by the thread that owns it)."""

    def __init__(
        self, socket: zmq.Socket, endpoint: str, secured: bool, peer: bool = False
    ) -> None:
        """`peer`: this is a follower shard's link to its leader, whose keys are the job's
        own pair, not a worker's client keys."""
        self.endpoint, self.secured, self.peer = endpoint, secured, peer
        self._socket = socket
        self._monitor: zmq.Socket | None = _monitor(socket, FAILED | REACH)
        self._refusals = 0  # failed handshakes since the last one that succeeded
        # What `check` has read of the connection so far (see `reach`).
        self.handshaken = False  # a ZeroMQ handshake succeeded: something speaks ZeroMQ there
        self._connected = False  # the last attempt to connect made a TCP connection
        self._connect_failed = False  # an attempt to connect failed (refused, timed out)

    def check(self) -> None:
        """Raise HandshakeRefused if the server refused this client (see REFUSALS_IN_A_ROW)."""
        if self._monitor is None:
            return
        for event, value in _pending_events(self._monitor):
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
                continue
            if event == zmq.EVENT_CONNECT_RETRIED:  # libzmq tries again every 100 ms
                self._connected, self._connect_failed = False, True
                continue
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._refusals = 0
                self.handshaken = True
                continue
            self._refusals += 1
            # AUTH: the server's ZAP handler said no, and never changes its mind for a key.
            # PROTOCOL: the two ends speak different mechanisms (after which libzmq stops
            # reconnecting), or CURVE failed its cryptography: both for good.
            if event in DECISIVE or self._refusals >= REFUSALS_IN_A_ROW:
                raise HandshakeRefused(self._explain(event, value))

    def reach(self) -> str:
        """How far this socket got with the server, for a person waiting for an answer (what
        `check` has read so far)."""
        if self.handshaken:
            return "it accepted the connection, but has not answered"
        if self._connected:
            return "a connection opens, but no ZeroMQ handshake completes"
        if self._connect_failed:
            return "the connection is refused: nothing listens on that port, or a firewall says no"
        return "no connection yet: the host does not answer"

    def _explain(self, event: int, value: int) -> str:
        if self.peer:
            return self._explain_to_shard(event, value)
        where = f"the server at {self.endpoint}"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"{where} refused this client's CURVE key (status {value}): its public key is "
                "not in the server's --curve-authorized-clients folder; copy the *.key file "
                "that belongs to --curve-secret-key there and restart the server (its log "
                "names the refused key), or use a key pair from that folder"
            )
        if _mechanism_mismatch(event, value) and self.secured:
            return (
                f"{where} does not use CURVE, but this client was given --curve-* keys; "
                "start ps-server with --curve-secret-key and --curve-authorized-clients, or "
                "leave the --curve-* options out here too"
            )
        if not self.secured:
            return (
                f"{where} refused every handshake: it uses CURVE (or it is not a ps-server "
                f"port); pass --curve-secret-key and --curve-server-key, {KEYS_HINT}"
            )
        # Closed connections alone: a server that does not use CURVE may close first too.
        return (
            f"{where} refused every CURVE handshake: --curve-server-key is not that server's "
            "public key (pass the *.key file that belongs to the server's --curve-secret-key), "
            "or that server does not use CURVE, or it is not a ps-server port"
        )

    def _explain_to_shard(self, event: int, value: int) -> str:
        where = f"the leader at {self.endpoint}"
        same = "the shards of one job share the leader's --curve-secret-key"
        if _mechanism_mismatch(event, value) and self.secured:
            return (
                f"{where} does not use CURVE, but this shard was given --curve-* options; "
                "give every shard the same ones as the leader"
            )
        if not self.secured:
            return (
                f"{where} refused every handshake: it uses CURVE; start this shard with the "
                f"leader's --curve-secret-key and --curve-authorized-clients ({same})"
            )
        return (
            f"{where} refused this shard's CURVE key: {same}; pass the leader's key file (or "
            "the leader does not use CURVE: then leave the --curve-* options out here too)"
        )

    def close(self) -> None:
        """Stop monitoring; call before the socket and its context are closed."""
        if self._monitor is None:
            return
        with contextlib.suppress(zmq.ZMQError):  # a closed socket's monitor ended with it
            self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._monitor = None


def send_when_connected(
    socket: zmq.Socket, frames: list[Any], watch: HandshakeWatch | None, timeout_s: float
) -> bool:
    """Send a message on a client socket; False if no connection took it within `timeout_s`.

    A DEALER holds a message until a connection exists, and after a refused handshake none
    ever does (libzmq stops reconnecting): a blocking send would sit out the whole timeout
    before anyone looked at the handshakes. This one looks between short waits and raises
    HandshakeRefused as soon as the server refuses. Once the first frame is taken, ZeroMQ
    takes the rest of the message."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            pass
        if watch is not None:
            watch.check()
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            return False
        socket.poll(min(SEND_POLL_MS, left_ms), zmq.POLLOUT)


def await_answer(socket: zmq.Socket, watch: HandshakeWatch, timeout_s: float) -> bool:
    """Whether something came to read within `timeout_s`; HandshakeRefused as soon as the
    server refuses this client's handshake."""
    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if socket.poll(max(0, min(ANSWER_POLL_MS, left_ms))):
            return True
        watch.check()
        if left_ms <= 0:
            return False


def _server_reason(event: int, value: int) -> str | None:
    """What a server's failed handshake says about the client; None for what it does not log.

    NO_DETAIL is a connection closed mid-handshake: port scanners and TCP health probes do
    that all day. AUTH is logged, with the key, by the ZAP handler (common.wire.security)."""
    if _mechanism_mismatch(event, value):
        return "mechanism"
    cryptographic = value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and cryptographic:
        return "server-key"
    return None


class HandshakeLogger(threading.Thread):
    """Logs the clients that fail a server socket's handshake, on a thread of its own.

    Create it before the socket binds (so no failure is missed) and `close()` it before the
    socket is closed."""

    def __init__(
        self, socket: zmq.Socket, secured: bool, log: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        super().__init__(name="handshake-log", daemon=True)
        self.secured, self.log, self.clock = secured, log, clock
        self._socket = socket
        self._monitor = _monitor(socket, FAILED)
        self._stopping = threading.Event()
        self._last_logged: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}  # failures since that reason was last logged

    def run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._monitor.poll(STOP_POLL_MS):
                    continue
                message = recv_monitor_message(self._monitor)
                reason = _server_reason(int(message["event"]), int(message["value"]))
                if reason is not None:
                    self.record(reason)
        except zmq.ZMQError:
            return  # the context is going away

    def record(self, reason: str) -> None:
        """Count one failure, and log it unless that reason was logged within LOG_EVERY_S."""
        now = self.clock()
        self._unlogged[reason] = self._unlogged.get(reason, 0) + 1
        last = self._last_logged.get(reason)
        if last is not None and now - last < LOG_EVERY_S:
            return
        count = self._unlogged.pop(reason)
        self._last_logged[reason] = now
        times = "" if count == 1 else f" ({count} times since this was last logged)"
        self.log.warning("%s%s", self._describe(reason), times)

    def _describe(self, reason: str) -> str:
        if reason == "server-key":
            return (
                "a client failed the CURVE handshake: its --curve-server-key is not this "
                "server's public key; give it the *.key file that belongs to this server's "
                "--curve-secret-key"
            )
        if self.secured:
            return (
                "a client without CURVE keys tried to connect; pass --curve-secret-key and "
                f"--curve-server-key to every worker, {KEYS_HINT}"
            )
        return (
            "a client with CURVE keys tried to connect, but this server runs without CURVE; "
            "start it with --curve-secret-key and --curve-authorized-clients, or run the "
            "clients without the --curve-* options"
        )

    @classmethod
    def started(cls, socket: zmq.Socket, secured: bool, log: logging.Logger) -> "HandshakeLogger":
        logger = cls(socket, secured, log)
        logger.start()
        return logger

    def close(self) -> None:
        """End the thread and its monitor; the socket stays open."""
        self._stopping.set()
        with contextlib.suppress(zmq.ZMQError):  # a closed socket's monitor ended with it
            self._socket.disable_monitor()
        if self.is_alive():
            self.join(timeout=5)
        self._monitor.close(linger=0)
