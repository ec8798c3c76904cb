"""The worker's connection to one server (the leader, or a follower shard): a request, its
wait and how it fails, on a DEALER socket of its own.

REQUESTS. A request waits for its reply until the server has been silent for `timeout_s`, or
until something ends the wait sooner (below). After a silent wait the socket is replaced (a
ZeroMQ request cannot be taken back) and the request is sent again after an exponential
backoff, at most `retries` times; or, for a first registration (`within_s`), as often as fits
before its deadline. The server deduplicates retried pushes, so a retry never applies a
gradient twice. A server that answers "busy" is asked again the same way.

THE WAIT. Heartbeat replies count as signs of life, so a long sync step (waiting for a
straggler, an evaluation) is not mistaken for a dead server. A first registration waits for a
server that has never answered with a deadline instead (`join_timeout_s`, the worker's
--join-timeout): it says after a second that nothing answers yet and how far the connection
got (common.wire.handshake: refused, open, or a handshake done), then again every
JOIN_NOTICE_EVERY_S with how long it has waited, and it ends at the deadline. A server that
restarts under a worker that trained is still waited for with --timeout and --retries.

A follower shard's connection has no heartbeat of its own. Only a request the follower may
hold (a PULL of its slice) borrows the job's `liveness`, and only once the follower has
answered something on this connection: a follower this worker cannot reach (a firewall, say)
is told by its own silence, not hidden by the leader's heartbeats.

Besides replies, the main socket may carry streamed weights (a WEIGHTS with a bucket, see
psworker.connection.streaming); the wait hands each to `on_weights_part` as it reads past it.

A wait also ends early:
- when the server refuses this worker's handshake (CURVE keys it does not accept, or none
  where it wants them): the main socket's handshakes are watched (common.wire.handshake), and
  a refusal ends the wait at once with HandshakeRefused, which says which key to fix;
- when the heartbeat heard STOP or "unknown-worker" (the server drains, or restarted without
  this worker): every request would get that answer, so the one waiting gets it now. Not a
  PUSH after "unknown-worker": the server may have applied it before it forgot the worker,
  and a top-k worker takes back what it sent only if it was not applied. The push is sent
  once more at once, and the server's answer to it (applied or not, or "unknown-worker" from
  a server that never had it) is the push's. If that answer does not come within
  `timeout_s` either, the push ends at once with NoReply, without the retries: a server
  that forgot this worker and then fell silent has most likely died, and they would only
  wait it out;
- for a follower's answer to a slice of a push, when the leader already answered that push
  with STOP (`stopped_early`): the leader stops its followers as it exits, so that answer
  may never come, and nor would the heartbeat's STOP from a leader that is gone;
- on a shutdown signal (`interrupt`), while waiting for an answer the worker can leave without:
  a PULL (the server may hold it for long), REGISTER, STATUS, or a follower's answer to a
  slice of a push (it only says the slice is staged: the leader, which has the push, decides
  whether the step counts, and no heartbeat speaks for a silent follower). `Interrupted`, and
  the worker leaves; so does the pause before such a request is sent again (`_back_off`).
  Not the leader's answer to a PUSH: it ends the step a leaving worker finishes.

FAILURES. RequestFailed for an ERROR reply, NoReply when every attempt met silence,
Interrupted when a shutdown signal ended a wait. What a NoReply says depends on what the
connection knew of the server before it fell silent: one that answered this worker before has
stopped (it finished the job while this worker was paused or cut off, or it died), and one that
never answered may not run there at all, or not be reachable. The two call for different
fixes. A first registration that met only silence until its --join-timeout says how far its
connection got (`nobody_answered`).

THE SOCKET: no linger, a send timeout, CURVE when the job has keys, and, for the main socket,
a watch on its handshakes set up before it connects, so that no refusal goes unseen.

What it is not: the heartbeat thread (psworker.connection.heartbeat), which runs on a socket
of its own that this connection opens, and whose `last_heard` and `verdict` a wait only reads;
nor what the worker asks (psworker.connection, the job's connection).
"""

import itertools
import logging
import threading
import time
from collections.abc import Callable

import zmq

from common.errors import PSError, ServerError
from common.logs import counted, printable
from common.wire.handshake import HandshakeRefused, HandshakeWatch, send_when_connected
from common.wire.protocol import (
    Error,
    Message,
    Pull,
    Push,
    PushReady,
    Register,
    Status,
    Stop,
    Weights,
    decode,
    describe,
    encode,
)
from common.wire.security import ClientSecurity, secure_client_socket
from psworker.connection.heartbeat import HeartbeatThread

log = logging.getLogger("ps.worker")
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
POLL_SLICE_MS = 250
SILENCE_NOTICE_S = 5.0  # a server that is up answers a REGISTER in milliseconds
JOIN_NOTICE_FIRST_S = 1.0  # a first registration's wait, said this soon...
JOIN_NOTICE_EVERY_S = 15.0  # ...then this often in its first minute, and once a minute after


# ---- failures -----------------------------------------------------------------------------

SERVER_TEXT_LIMIT = 1000  # characters of a server's words a worker prints (as its errors are cut)


def server_words(text: str) -> str:
    """What a server said (an ERROR's code or message, a STOP's reason), fit for a log line or
    an error: another release's server, or something that is not ps-server at all, may send
    newlines that forge log lines or escapes that rewrite the terminal (see common.logs)."""
    return printable(text, SERVER_TEXT_LIMIT)


class RequestFailed(ServerError):
    """The server answered with an ERROR reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class NoReply(ServerError):
    """Every attempt of a request met `timeout_s` of silence."""

    def __init__(self, message: str, waited_s: float) -> None:
        super().__init__(message)
        self.waited_s = waited_s  # from the first attempt to giving up, backoff included


class Interrupted(PSError):
    """A shutdown signal ended a wait for the server (see `ServerConnection.interrupt`)."""


def no_reply(
    endpoint: str, asked: Message, attempts: int, timeout_s: float, answered_before: bool,
    waited_s: float, forgotten: bool = False,
) -> NoReply:  # fmt: skip
    """The NoReply for `asked`, sent `attempts` times; `answered_before`: whether this server
    answered anything on this connection before (see the module doc); `forgotten`: its
    heartbeat said "unknown-worker", and `asked` (a push) got no answer when sent again."""
    waited = f"after {counted(attempts, 'attempt')} ({timeout_s:g} s of silence each)"
    if forgotten:
        return NoReply(
            f"the server at {endpoint} said it no longer knew this worker (unknown-worker), "
            f"then did not answer whether it had applied its push in {timeout_s:g} s; it has "
            "probably finished the job or died: see its log, and if the job is not over, "
            "restart it with --resume and start this worker again",
            waited_s,
        )
    if answered_before:
        return NoReply(
            f"the server at {endpoint} stopped answering ({describe(asked)} got no reply "
            f"{waited}); it answered this worker before, so it has probably finished the job "
            "or died: see its log, and if the job is not over, restart it with --resume and "
            "start this worker again",
            waited_s,
        )
    return NoReply(
        f"no reply from the server at {endpoint} {waited}; check that ps-server runs there "
        "and that the port is reachable from this host (a refused key would have been said)",
        waited_s,
    )


def nobody_answered(
    endpoint: str, asked: Message, waited_s: float, reach: str, join_timeout_s: float
) -> NoReply:
    """The NoReply of a first registration that nothing answered within `join_timeout_s`;
    `reach`: how far its connection got (common.wire.handshake.HandshakeWatch.reach)."""
    return NoReply(
        f"nothing answered at {endpoint} in {waited_s:.0f} s ({reach}; {describe(asked)} "
        "got no reply); check --server (the host, and the port of ps-server's --bind) and "
        "that ps-server runs there; a server that takes longer to start needs a longer "
        f"--join-timeout (or PS_JOIN_TIMEOUT) than {join_timeout_s:g} s",
        waited_s,
    )


# ---- the socket ---------------------------------------------------------------------------


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


# ---- the request and its wait -------------------------------------------------------------


def interruptible(request: Message | None) -> bool:
    """Whether a shutdown signal may end the wait for this request's answer: one a leaving
    worker can do without (module doc). A follower's answer to a PUSH only says the slice is
    staged; the leader's (shard 0) ends the step."""
    if isinstance(request, Push):
        return request.shard != 0
    return isinstance(request, (Register, Status, Pull))


def held(request: Message | None) -> bool:
    """Whether a follower may rightly hold this request while the job goes on (last_heard)."""
    return isinstance(request, Pull) and request.shard != 0


def streamed_bucket(message: Message) -> bool:
    """An updated bucket the server sent unasked, not a reply (psworker.connection.streaming)."""
    return isinstance(message, Weights) and message.bucket >= 0


class ServerConnection:
    """Requests to one server (the leader, or a follower shard) on a DEALER that is replaced
    after each silent wait, and the wait for each reply (the module doc)."""

    def __init__(
        self, endpoint: str, timeout_s: float, retries: int = 5,
        security: ClientSecurity | None = None, liveness: Callable[[], float] | None = None,
        verdict: Callable[[], Message | None] | None = None,
        join_timeout_s: float | None = None,
    ) -> None:  # fmt: skip
        """`liveness`: when the job was last heard from, if not by this connection's heartbeat;
        `verdict`: what the job's heartbeat heard, if not ours; `join_timeout_s`: how long a
        first registration waits for a server that has never answered (None: as long as its
        retries)."""
        self.endpoint, self.timeout_s, self.retries = endpoint, timeout_s, retries
        self.request_retries = retries  # how many times the request in flight is sent again
        self.security, self.join_timeout_s = security, join_timeout_s
        self.liveness, self.leader_verdict = liveness, verdict
        # Set by a signal handler: an interruptible wait raises Interrupted (module doc).
        self.interrupt: threading.Event | None = None
        self.heartbeat: HeartbeatThread | None = None
        self.on_weights_part: Callable[[Weights], None] | None = None
        self.context = zmq.Context()
        self._watch: HandshakeWatch | None = None
        self._socket = self.open_socket(watched=True)
        self._pending: Message | None = None  # the request `receive` is waiting for
        self._sent = False  # whether a connection took it in
        self._early: Message | None = None  # the reply, read ahead by stopped_early
        self._asked_again = False  # a PUSH sent again after the heartbeat's "unknown-worker"
        # Whether the server answered anything on this connection (any socket of it): until
        # then only its own replies prove that this worker can reach it (see last_heard).
        self.proven = False
        # Whether a ZeroMQ handshake with the server succeeded on any socket of this
        # connection: something there speaks ZeroMQ, and may be asked for its STATUS.
        self.met = False
        self._silence_noticed = False  # see _notice_silence
        # A wait with a deadline (a first registration, see the module doc): when it began,
        # when it ends, and when to say next that nothing answers yet.
        self._wait_started, self._next_notice_s = 0.0, 0.0
        self._deadline: float | None = None

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
                if not again or self._asked_again:  # see the module doc
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

    def _check_handshake(self) -> None:
        """Raise HandshakeRefused if the server refuses this worker's handshakes."""
        if self._watch is not None:
            try:
                self._watch.check()
            except HandshakeRefused:
                self._pending = None
                raise
            self.met = self.met or self._watch.handshaken

    def reach(self) -> str:
        """How far the main socket got with the server (common.wire.handshake)."""
        return self._watch.reach() if self._watch is not None else "no connection yet"

    def _begin_wait(self, within_s: float | None) -> None:
        """Start the wait for a request's reply: until `within_s` from now if given (see the
        module doc), else by the request's retries."""
        self._wait_started = time.monotonic()
        self._deadline = None if within_s is None else self._wait_started + within_s
        self._next_notice_s = JOIN_NOTICE_FIRST_S

    def _time_left(self) -> float | None:
        """Seconds to the deadline of this wait, if it has one."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _await_reply(self) -> Message | None:
        sent = time.monotonic()
        while True:
            if self._early is not None:
                reply, self._early = self._early, None
                return reply
            if self._socket.poll(POLL_SLICE_MS):
                message = self._read()
                if not streamed_bucket(message):
                    return message
                sent = time.monotonic()  # the server is alive: wait on for the reply
                continue
            # Nothing came in this slice (a reply that did come is read first).
            self._check_handshake()
            verdict = self.verdict()
            if verdict is not None and self._ask_push_again(verdict):
                if not self._sent:  # no connection took it in timeout_s: nobody is there
                    return None
                sent = time.monotonic()
                continue
            if verdict is not None and not self._asked_again:
                # The real reply would say the same; it is not read.
                said = (
                    f"{server_words(verdict.code)}: {server_words(verdict.message)}"
                    if isinstance(verdict, Error)
                    else "STOP"
                )
                log.info("the job said %s; not waiting for the reply", said)
                self._replace_socket()
                return verdict
            if self._interrupted():
                raise self._interruption()
            self._notice_silence(sent)
            heard = max(sent, self.last_heard())
            if time.monotonic() - heard > self.timeout_s or self._time_left() == 0.0:
                return None

    def _notice_silence(self, sent: float) -> None:
        """Say once, after SILENCE_NOTICE_S, that a server never heard from on this
        connection has not answered yet: with the default --timeout, a worker started before
        its server (or pointed at the wrong one) said nothing for a minute."""
        if self.proven:
            return
        if self._deadline is not None:
            self._notice_joining()
            return
        if self._silence_noticed or time.monotonic() - sent < SILENCE_NOTICE_S:
            return
        self._silence_noticed = True
        asked = describe(self._pending) if self._pending is not None else "nothing"
        retries = self.request_retries
        again = f"asking again, at most {counted(retries, 'time')}"
        then = again if retries else "giving up"
        log.info(
            "no answer yet from the server at %s (%s); waiting up to %g s for it (--timeout), "
            "then %s (--retries %d)",
            self.endpoint, asked, self.timeout_s, then, retries,
        )  # fmt: skip

    def _notice_joining(self) -> None:
        """Say that nothing answers yet, how far the connection got and how long is left: a
        second into a wait with a deadline, then every JOIN_NOTICE_EVERY_S (a minute, after
        the first)."""
        waited = time.monotonic() - self._wait_started
        if waited < self._next_notice_s:
            return
        self._next_notice_s = waited + (JOIN_NOTICE_EVERY_S if waited < 60 else 60.0)
        log.info(
            "nothing answers at %s yet (%s): waited %.0f s, giving up in %.0f s "
            "(--join-timeout %g)",
            self.endpoint, self.reach(), waited, self._time_left(), self.join_timeout_s,
        )  # fmt: skip

    def _read(self) -> Message:
        frames = self._socket.recv_multipart(copy=False)
        self.proven = True  # even a reply that does not decode came from the server
        message = decode([frame.buffer for frame in frames])
        if streamed_bucket(message) and self.on_weights_part is not None:
            assert isinstance(message, Weights)
            self.on_weights_part(message)  # copied out before the frames go
        return message

    def stopped_early(self) -> Stop | None:
        """A STOP that already answers the push in flight, read without waiting (module
        doc); any other reply is kept for `receive`."""
        if self._early is None and self._sent and isinstance(self._pending, (Push, PushReady)):
            while self._early is None and self._socket.poll(0):
                message = self._read()
                self._early = None if streamed_bucket(message) else message
        return self._early if isinstance(self._early, Stop) else None

    def _ask_push_again(self, verdict: Message) -> bool:
        """After the heartbeat's "unknown-worker", send a waiting PUSH once more on a new
        socket: its answer says whether it was applied (see the module doc)."""
        pending = self._pending
        if self._asked_again or not isinstance(pending, Push) or pending.shard != 0:
            return False
        if not isinstance(verdict, Error) or verdict.code != "unknown-worker":
            return False
        log.info("the heartbeat heard unknown-worker; asking whether the push was applied")
        self._asked_again = True
        self.reset()
        self.send(pending)
        return True

    def _interrupted(self) -> bool:
        """A shutdown signal came, and nothing of this worker's waits on this reply."""
        interrupt = self.interrupt
        return interrupt is not None and interrupt.is_set() and interruptible(self._pending)

    def _back_off(self, delay_s: float) -> None:
        """Pause `delay_s` before asking again. A shutdown signal ends the pause before a
        request the worker can leave without, as it ends the wait for its answer: the pause
        grows to 8 s, and a SIGTERMed worker (and whoever stopped it) waited it out."""
        if self.interrupt is not None and interruptible(self._pending):
            self.interrupt.wait(delay_s)
        else:
            time.sleep(delay_s)
        if self._interrupted():
            raise self._interruption()

    def _interruption(self) -> Interrupted:
        """End the wait for the request in flight on a shutdown signal: its late reply must
        not be read as the answer to the LEAVE that comes next, so the socket is replaced."""
        self._replace_socket()
        asked = describe(self._pending) if self._pending is not None else "nothing"  # no token
        return Interrupted(f"stopped waiting for the answer to {asked}")

    def _replace_socket(self) -> None:
        """A new socket, keeping the request that `receive` answers for."""
        pending = self._pending
        self.reset()
        self._pending = pending

    def verdict(self) -> Message | None:
        """A STOP or "unknown-worker" that the heartbeat (this connection's, or the job's
        leader's) heard: the answer any request would get."""
        if self.heartbeat is not None:
            return self.heartbeat.verdict
        return self.leader_verdict() if self.leader_verdict is not None else None

    def last_heard(self) -> float:
        """When the server was last heard from, besides the replies `_await_reply` reads."""
        if self.heartbeat is not None:
            return self.heartbeat.last_heard
        # The job's heartbeat says the job goes on, not that this server is reachable: it
        # speaks only for a request this server may rightly hold, and only once this server
        # has answered here. Otherwise a follower that never gets our requests (a firewall)
        # would be waited for as long as the leader answers.
        if self.liveness is not None and self.proven and held(self._pending):
            return self.liveness()
        return 0.0
