"""The wait for one reply on the worker's connection to a server, and what ends it sooner.

A wait lasts until the server has been silent for `timeout_s`: heartbeat replies count as
signs of life, so a long sync step (waiting for a straggler, an evaluation) is not mistaken
for a dead server.

A first registration waits for a server that has never answered with a deadline instead
(`join_timeout_s`, the worker's --join-timeout): it says after a second that nothing answers
yet and how far the connection got (common.wire.handshake: refused, open, or a handshake
done), then again every JOIN_NOTICE_EVERY_S with how long it has waited, and it ends at the
deadline. With the defaults, a wrong --server was silent for a minute and failed after six
(six tries of 60 s); a server that restarts under a worker that trained is still waited for
with --timeout and --retries.

A follower shard's connection has no heartbeat of its own. Only a request the follower may
hold (a PULL of its slice) borrows the job's `liveness`, and only once the follower has answered
something on this connection: a follower this worker cannot reach (a firewall, say) is told
by its own silence, not hidden by the leader's heartbeats.

Besides replies, the main socket may carry streamed weights (a WEIGHTS with a bucket, see
psworker.connection.streaming); the wait hands each to `on_weights_part` as it reads past it.

A wait also ends early:
- when the server refuses this worker's handshake (HandshakeRefused, see
  psworker.connection.client): retrying cannot help;
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

What it is not: sending a request, retrying it after a silent wait, or owning the sockets
(psworker.connection.client, whose ServerConnection builds on ReplyWaiter); nor the heartbeat thread
(psworker.connection.heartbeat), whose `last_heard` and `verdict` a wait only reads.
"""

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import zmq

from common.logs import counted
from common.wire.handshake import HandshakeRefused, HandshakeWatch
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
)
from psworker.connection.failures import Interrupted, server_words
from psworker.connection.heartbeat import HeartbeatThread

log = logging.getLogger("ps.worker")
POLL_SLICE_MS = 250
SILENCE_NOTICE_S = 5.0  # a server that is up answers a REGISTER in milliseconds
JOIN_NOTICE_FIRST_S = 1.0  # a first registration's wait, said this soon...
JOIN_NOTICE_EVERY_S = 15.0  # ...then this often in its first minute, and once a minute after


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


class ReplyWaiter(ABC):
    """Waits for the reply to the request in flight (the module doc says how long, and what
    ends it sooner). The connection that sends requests (psworker.connection.client) owns the socket
    and the request; this class reads them."""

    # The connection's, set by it: the main socket, its handshake watch, the request
    # `receive` waits for, whether a connection took it in, and the server's endpoint.
    _socket: zmq.Socket
    _watch: HandshakeWatch | None
    _pending: Message | None
    _sent: bool
    endpoint: str
    request_retries: int  # how many times the request `receive` waits for is sent again

    def __init__(
        self, timeout_s: float, liveness: Callable[[], float] | None,
        verdict: Callable[[], Message | None] | None,
    ) -> None:  # fmt: skip
        self.timeout_s = timeout_s
        self.liveness = liveness  # when the job was last heard from, if not by our heartbeat
        self.leader_verdict = verdict  # what the job's heartbeat heard, if not ours
        # Set by a signal handler: an interruptible wait raises Interrupted (module doc).
        self.interrupt: threading.Event | None = None
        self.heartbeat: HeartbeatThread | None = None
        self._early: Message | None = None  # the reply, read ahead by stopped_early
        self._asked_again = False  # a PUSH sent again after the heartbeat's "unknown-worker"
        # Whether the server answered anything on this connection (any socket of it): until
        # then only its own replies prove that this worker can reach it (see last_heard).
        self.proven = False
        self._silence_noticed = False  # see _notice_silence
        # A wait with a deadline (a first registration, see the module doc): when it began,
        # when it ends, and when to say next that nothing answers yet.
        self.join_timeout_s: float | None = None
        self._wait_started, self._next_notice_s = 0.0, 0.0
        self._deadline: float | None = None
        # Whether a ZeroMQ handshake with the server succeeded on any socket of this
        # connection: something there speaks ZeroMQ, and may be asked for its STATUS.
        self.met = False
        self.on_weights_part: Callable[[Weights], None] | None = None

    @abstractmethod
    def send(self, message: Message) -> None:
        """Start a request on the main socket (a PUSH asked again goes this way)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the request in flight and open a new main socket."""

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
