"""The worker's connection to the server: requests with timeouts and bounded retries.

A request waits until the server has been silent for `timeout_s`: heartbeat replies count as
signs of life, so a long sync step (waiting for a straggler, an evaluation) is not mistaken
for a dead server. After a timeout the socket is replaced (a ZeroMQ request cannot be taken
back) and the request is sent again after an exponential backoff, at most `retries` times.
The server deduplicates retried pushes, so a retry never applies a gradient twice.

A follower shard's connection has no heartbeat of its own. Only a request the follower may
hold (SLICE_PULL) borrows the job's `liveness`, and only once the follower has answered
something on this connection: a follower this worker cannot reach (a firewall, say) is told
by its own silence, not hidden by the leader's heartbeats.

A server that refuses this worker's handshake (CURVE keys it does not accept, or none where it
wants them) is told apart from a silent one: the main socket's handshakes are watched
(common.handshake), and a refusal ends the wait at once with HandshakeRefused, which says
which key to fix, instead of every retry's timeout and a "no reply".

Besides replies, the main socket may carry streamed weights (WEIGHTS_PART, see
psworker.streaming); `receive` hands each to `on_weights_part` as it reads past it.

A wait also ends early:
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
  the worker leaves. Not the leader's answer to a PUSH: it ends the step a leaving worker
  finishes.

When a request fails, psworker.failures says so (RequestFailed, NoReply, Interrupted).

What it is not: the heartbeat. That thread (psworker.heartbeat) runs on a socket of its own;
this connection starts and stops it, and reads what it heard. Nor the sockets themselves
(psworker.dealer).
"""

import logging
import threading
import time
from collections.abc import Callable

import zmq

from common.handshake import HandshakeRefused, HandshakeWatch, send_when_connected
from common.protocol import (
    Error,
    Message,
    Pull,
    Push,
    PushReady,
    Register,
    SlicePull,
    SlicePush,
    Status,
    Stop,
    WeightsPart,
    decode,
    encode,
)
from common.security import ClientSecurity
from psworker.dealer import close_dealer, open_dealer
from psworker.failures import Interrupted, RequestFailed, no_reply
from psworker.heartbeat import HeartbeatThread

log = logging.getLogger("ps.worker")
BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 8.0
POLL_SLICE_MS = 250


# Waits a shutdown signal may end: answers a leaving worker can do without (module doc).
INTERRUPTIBLE = (Register, Status, Pull, SlicePull, SlicePush)
HELD = (SlicePull,)  # what a follower may hold while the job goes on (see last_heard)


class ServerConnection:
    def __init__(
        self, endpoint: str, timeout_s: float, retries: int = 5,
        security: ClientSecurity | None = None, liveness: Callable[[], float] | None = None,
        verdict: Callable[[], Message | None] | None = None,
    ) -> None:  # fmt: skip
        self.endpoint, self.timeout_s, self.retries = endpoint, timeout_s, retries
        self.security = security
        self.liveness = liveness  # when the job was last heard from, if not by our heartbeat
        self.leader_verdict = verdict  # what the job's heartbeat heard, if not ours
        # Set by a signal handler: an interruptible wait raises Interrupted (module doc).
        self.interrupt: threading.Event | None = None
        self.context = zmq.Context()
        self.heartbeat: HeartbeatThread | None = None
        self._watch: HandshakeWatch | None = None
        self._socket = self.open_socket(watched=True)
        self._pending: Message | None = None  # the request `receive` is waiting for
        self._sent = False
        self._early: Message | None = None  # the reply, read ahead by stopped_early
        self._asked_again = False  # a PUSH sent again after the heartbeat's "unknown-worker"
        # Whether the server answered anything on this connection (any socket of it): until
        # then only its own replies prove that this worker can reach it (see last_heard).
        self.proven = False
        self.on_weights_part: Callable[[WeightsPart], None] | None = None

    def open_socket(self, watched: bool = False) -> zmq.Socket:
        """A new DEALER to the server; `watched`: the main socket, whose handshakes tell
        whether the server refuses this worker (the heartbeat's socket leaves that to it)."""
        socket, watch = open_dealer(
            self.context, self.endpoint, self.timeout_s, self.security, watched
        )
        if watched:
            self._watch = watch
        return socket

    def request(self, message: Message, retries: int | None = None) -> Message:
        """Send a message and return the reply; an ERROR reply becomes RequestFailed.
        `retries`: this request's, if not the connection's.

        Tensors in the reply are read-only views of the received frames.
        """
        self.send(message)
        return self.receive(retries)

    def send(self, message: Message) -> None:
        """Start a request; `receive` waits for its reply. ZeroMQ moves the bytes on its own
        I/O thread, so requests sent to several servers travel in parallel."""
        self._pending = message
        try:
            # Not connected within the timeout: receive() retries.
            self._sent = send_when_connected(
                self._socket, encode(message), self._watch, self.timeout_s
            )
        except HandshakeRefused:
            self._pending = None
            raise

    def post(self, message: Message) -> None:
        """Send a message that gets no reply (PUSH_PART), ahead of the request that answers
        for it. Not retried: if it is lost, that request says so."""
        try:
            self._socket.send_multipart(encode(message), copy=False)
        except zmq.Again:
            log.debug("could not send %s to %s", type(message).__name__, self.endpoint)

    def receive(self, retries: int | None = None) -> Message:
        """The reply to the last `send`, retrying it after a timeout (see the module doc)."""
        message = self._pending
        assert message is not None, "receive() without send()"
        started = time.monotonic()
        self._asked_again = False
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            reply = self._await_reply() if self._sent else None
            busy = isinstance(reply, Error) and reply.code == "busy"
            if reply is not None and not (busy and attempt < retries):
                self._pending = None
                if isinstance(reply, Error):
                    raise RequestFailed(
                        reply.code,
                        f"the server refused {type(message).__name__} ({reply.code}): "
                        f"{reply.message}",
                    )
                return reply
            self._check_handshake()  # a refusal, not silence: retrying cannot help
            if attempt == retries or self._asked_again:  # see the module doc
                break
            delay = min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**attempt)
            # "busy": the server had too many requests waiting (others' floods, say) and
            # turned this one away for now; it is asked again like one that got no reply.
            log.warning(
                "%s from %s (%s, attempt %d of %d); retrying in %.1f s",
                "busy" if busy else f"no reply for {self.timeout_s:.0f} s", self.endpoint,
                type(message).__name__, attempt + 1, retries + 1, delay,
            )  # fmt: skip
            time.sleep(delay)
            self.reset()  # its late reply, if any, must not be read later
            self.send(message)
        self._pending = None
        raise no_reply(
            self.endpoint, message, attempt + 1, self.timeout_s, self.proven,
            time.monotonic() - started, forgotten=self._asked_again,
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

    def _check_handshake(self) -> None:
        """Raise HandshakeRefused if the server refuses this worker's handshakes."""
        if self._watch is not None:
            try:
                self._watch.check()
            except HandshakeRefused:
                self._pending = None
                raise

    def _await_reply(self) -> Message | None:
        sent = time.monotonic()
        while True:
            if self._early is not None:
                reply, self._early = self._early, None
                return reply
            if self._socket.poll(POLL_SLICE_MS):
                message = self._read()
                if not isinstance(message, WeightsPart):
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
                    f"{verdict.code}: {verdict.message}" if isinstance(verdict, Error) else "STOP"
                )
                log.info("the job said %s; not waiting for the reply", said)
                self._replace_socket()
                return verdict
            if self._interrupted():
                self._replace_socket()
                asked = type(self._pending).__name__  # not the request: it holds the token
                raise Interrupted(f"stopped waiting for the answer to {asked}")
            heard = max(sent, self.last_heard())
            if time.monotonic() - heard > self.timeout_s:
                return None

    def _read(self) -> Message:
        frames = self._socket.recv_multipart(copy=False)
        self.proven = True  # even a reply that does not decode came from the server
        message = decode([frame.buffer for frame in frames])
        if isinstance(message, WeightsPart) and self.on_weights_part is not None:
            self.on_weights_part(message)  # copied out before the frames go
        return message

    def stopped_early(self) -> Stop | None:
        """A STOP that already answers the push in flight, read without waiting (module
        doc); any other reply is kept for `receive`."""
        if self._early is None and self._sent and isinstance(self._pending, (Push, PushReady)):
            while self._early is None and self._socket.poll(0):
                message = self._read()
                self._early = None if isinstance(message, WeightsPart) else message
        return self._early if isinstance(self._early, Stop) else None

    def _ask_push_again(self, verdict: Message) -> bool:
        """After the heartbeat's "unknown-worker", send a waiting PUSH once more on a new
        socket: its answer says whether it was applied (see the module doc)."""
        pending = self._pending
        if self._asked_again or not isinstance(pending, Push):
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
        return (
            interrupt is not None
            and interrupt.is_set()
            and isinstance(self._pending, INTERRUPTIBLE)
        )

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
        if self.liveness is not None and self.proven and isinstance(self._pending, HELD):
            return self.liveness()
        return 0.0

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
