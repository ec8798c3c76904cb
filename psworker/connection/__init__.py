"""The worker's connection to the job's shards: the one way the trainer and the pusher reach
the servers.

`Connection` registers (REGISTER and WELCOME, and the heartbeat that keeps the registration
alive: psworker.connection.registration), pulls the weights from the leader and every follower
shard at once, sends the messages of a push (whole slices and buckets, each to the shard that
owns it) under the leader's flow control, waits for their answers, and leaves. What goes wrong
is one of the errors of a request (psworker.connection.requests): RequestFailed (an ERROR
reply), NoReply (silence past the retries), Interrupted (a shutdown signal ended a wait), and
HandshakeRefused (the server refuses this worker's key).

Flow control is the push side of the connection. With job.push_credits the leader takes
pushes from only so many workers at once (psserver.serving.credits). Unless a credit came
with the weights, the connection asks with PUSH_READY before the leader's first message of a
step and does not wait for the answer there: the leader's units it is offered meanwhile are
held (their bytes stay in `flat.grads`, which nothing writes before the next backward), and
backward and the follower shards' slices go on. Waiting inside backward would hold up every
follower's bytes behind the leader's credit. `await_go` then reads the leader's go (a PUSH_ACK
with `go`) and hands back the units held, in order, for the pusher to send.

Behind it: requests (one server: a request, its wait, its failure, the socket), heartbeat
(the thread), registration (REGISTER and its checks), shards (the follower shards' slices,
moved in parallel) and streaming (updated buckets that arrive before the pull). What it is
not: cutting and compressing a gradient (psworker.pusher), nor the worker loop
(psworker.trainer).
"""

import logging
import threading
from typing import Literal

import torch

from common.errors import PSError, ServerError
from common.job import JobSpec
from common.model.flat import FlatModel
from common.wire.handshake import HandshakeRefused
from common.wire.protocol import (
    WHOLE,
    Leave,
    Message,
    Pull,
    Push,
    PushAck,
    PushReady,
    Stop,
    Weights,
    describe,
)
from common.wire.security import ClientSecurity
from psworker.connection.registration import (
    MAX_REREGISTRATIONS,
    Session,
    model_of,
    new_process_identity,
    pause_before_registering_again,
    register,
)
from psworker.connection.requests import (
    Interrupted,
    NoReply,
    RequestFailed,
    ServerConnection,
    server_words,
)
from psworker.connection.shards import ShardClients
from psworker.connection.streaming import WeightStream

__all__ = [
    "MAX_REREGISTRATIONS",
    "Connection",
    "HandshakeRefused",
    "Interrupted",
    "NoReply",
    "RequestFailed",
    "Session",
    "model_of",
    "new_process_identity",
    "server_words",
]

log = logging.getLogger("ps.worker")


class Connection:
    """The worker's connection to the job: the leader's (`leader`), and once a registration
    is attached (`attach`), the follower shards' and the leader's weight stream."""

    def __init__(self, leader: ServerConnection) -> None:
        self.leader = leader
        self.session: Session | None = None  # the registration, once registered
        self.stream: WeightStream | None = None  # buckets of the leader's slice streamed back
        self.shards: ShardClients | None = None  # the follower shards; None with one server
        self._flat: FlatModel | None = None
        # The oldest slice version worth pulling from the follower shards: a follower holds the
        # pull until it has that many updates. In sync mode the one the last PUSH_ACK named, so
        # that no follower answers with the slice from before the step this worker pushed.
        self.min_version = 0
        # Flow control. May the leader's messages of this push go? None: not asked yet;
        # "asked": PUSH_READY is out and its go not read yet; False: the ask or its answer
        # failed, nothing goes.
        self._ask: PushReady | None = None
        self._go: bool | Literal["asked"] | None = None
        self._held: list[int] = []  # the leader's units, in order; -1: its whole slice
        # Whether any of this push went to the leader: a reply, or streamed weights, may come.
        self._leader_sent = False

    @classmethod
    def open(
        cls, endpoint: str, timeout_s: float, retries: int,
        security: ClientSecurity | None = None, join_timeout_s: float | None = None,
    ) -> "Connection":  # fmt: skip
        """A connection to the leader at `endpoint` (see ServerConnection for the rest)."""
        leader = ServerConnection(
            endpoint, timeout_s, retries, security, join_timeout_s=join_timeout_s
        )
        return cls(leader)

    @property
    def interrupt(self) -> threading.Event | None:
        """Set by a signal handler: a wait the worker can leave without ends (Interrupted)."""
        return self.leader.interrupt

    @interrupt.setter
    def interrupt(self, event: threading.Event | None) -> None:
        self.leader.interrupt = event

    # ---- registration ------------------------------------------------------------------------

    @property
    def job(self) -> JobSpec:
        assert self.session is not None, "not registered"
        return self.session.job

    def register(
        self, name: str, device: torch.device, process: str, previous: JobSpec | None = None
    ) -> Session | Stop:
        """Register as process `process` (again, after the server forgot this worker, when
        `previous` is the job it trained); the new session, or the STOP of a job that is
        over. A new registration talks to nothing else until `attach`."""
        self.detach()
        session = register(self.leader, name, device, process, previous)
        if isinstance(session, Session):
            self.session = session
        return session

    def register_again(
        self, name: str, device: torch.device, process: str, forgotten: int,
        shutdown: threading.Event,
    ) -> Session | Stop:  # fmt: skip
        """Register again after the server forgot this worker `forgotten` times in a row,
        after a pause that grows with them (Interrupted if `shutdown` comes first)."""
        pause_before_registering_again(forgotten, shutdown)
        return self.register(name, device, process, previous=self.job)

    def attach(self, flat: FlatModel) -> None:
        """Connect what this registration talks to besides the leader: its weight stream and
        the follower shards (a restarted server may run another number of them). Weights
        pulled and streamed go into `flat`."""
        self.detach()
        job = self.job
        self._flat = flat
        self.stream = WeightStream(job, flat.load_params)
        self.leader.on_weights_part = self.stream.accept
        self.shards = self._connect_shards(job, flat)
        self.min_version = 0

    def _connect_shards(self, job: JobSpec, flat: FlatModel) -> ShardClients | None:
        if job.num_shards == 1:
            return None
        if len(job.shard_endpoints) != job.num_shards - 1:
            raise ServerError(
                f"the job has {job.num_shards} server shards but lists "
                f"{len(job.shard_endpoints)} follower endpoints; run the same release everywhere"
            )
        log.info("the parameters live on %d server shards", job.num_shards)
        leader = self.leader
        return ShardClients(
            job, flat.load_params, leader.timeout_s, leader.retries, leader.security,
            leader.last_heard, lambda: leader.verdict() or leader.stopped_early(),
            leader.interrupt,
        )  # fmt: skip

    def detach(self) -> None:
        """Close the follower shards' connections of the last registration."""
        if self.shards is not None:
            self.shards.close()
        self.shards, self.stream = None, None

    def leave(self, reason: str) -> None:
        """Tell the server this worker is gone, so that nobody waits for it; best effort."""
        session = self.session
        if session is None:
            return
        try:
            self.leader.request(Leave(session.worker_id, session.token, reason))
        except PSError as exc:
            log.warning("could not tell the server that this worker leaves: %s", exc)

    def close(self) -> None:
        self.detach()
        self.leader.close()

    # ---- pull --------------------------------------------------------------------------------

    def pull(self) -> Weights | Stop:
        """Bring the worker's weights and buffers to the server's current version, from the
        leader and every follower shard at once. What the leader streamed back whole after the
        last push is not sent again."""
        session, stream, flat = self.session, self.stream, self._flat
        assert session is not None and stream is not None and flat is not None, "not attached"
        worker_id, token, job = session.worker_id, session.token, session.job
        if self.shards is not None:  # on their way while the leader answers
            self.shards.request_slices(worker_id, token, self.min_version)
        reply = self.leader.request(Pull(worker_id, token, stream.whole_version()))
        if isinstance(reply, Stop):
            return reply
        if not isinstance(reply, Weights):
            raise ServerError(f"expected WEIGHTS, got {type(reply).__name__}")
        check_weights(job, reply)
        if not reply.streamed:  # the leader's slice; host to device on a GPU worker
            flat.load_params(job.shard_range(0)[0], reply.params)
        elif reply.version != stream.whole_version():
            raise ServerError(
                f"the server sent no weights for version {reply.version}, but this worker "
                f"holds {stream.whole_version()}; run the same release of ps-server and "
                "ps-worker"
            )
        flat.buffers.copy_(reply.buffers)
        if self.shards is not None:
            stop = self.shards.receive_slices(worker_id, token, reply.version)
            if stop is not None:  # the job's heartbeat heard it while a follower was silent
                return stop
        return reply

    # ---- push --------------------------------------------------------------------------------

    def begin_push(self, granted: bool) -> None:
        """A new push: `granted` says a credit came with the weights, so no ask is needed."""
        self._held, self._leader_sent = [], False
        if not self.job.push_credits or granted:
            self._ask, self._go = None, True
        else:
            assert self.session is not None
            self._ask, self._go = PushReady(self.session.worker_id, self.session.token), None

    def admit(self, bucket: int) -> bool:
        """Whether the leader's unit `bucket` (-1: its whole slice) may go now. Asks once per
        push, before the leader's first message; while the answer is not read, the unit is
        held instead. Raises what sending the ask raised: after that nothing of this push is
        admitted."""
        if self._go is None:
            assert self._ask is not None
            self._go = False  # unless the ask below goes out
            self.leader.send(self._ask)
            self._go = "asked"
        if self._go == "asked":
            self._held.append(bucket)
        return self._go is True

    @property
    def asked(self) -> bool:
        """Whether a PUSH_READY is out whose answer `await_go` has yet to read."""
        return self._go == "asked"

    def await_go(self) -> list[int] | Stop | Exception:
        """Wait for the go asked for: the leader's units held meanwhile, now free to go. A
        STOP, another reply, or a failure to receive instead is returned, and nothing more
        goes."""
        assert self._go == "asked"
        try:
            reply = self.leader.receive()
        except Exception as exc:
            self._go = False
            return exc
        if not (isinstance(reply, PushAck) and reply.go):
            self._go = False
            if isinstance(reply, Stop):
                return reply
            got = "a PUSH_ACK without go" if isinstance(reply, PushAck) else describe(reply)
            return ServerError(
                f"expected the leader's go (a PUSH_ACK with go) after PUSH_READY, got {got}; "
                "run the same release of ps-server and ps-worker"
            )
        self._go = True
        held, self._held = self._held, []
        return held

    def post(self, push: Push) -> None:
        """One bucket of a shard's slice, sent ahead of the PUSH that completes it; never
        answered, and not sent again if lost: that PUSH's answer says so."""
        assert push.bucket != WHOLE
        if push.shard == 0:
            self._leader_sent = True
            self.leader.post(push)
        else:
            assert self.shards is not None
            self.shards.post_bucket(push)

    def send(self, push: Push) -> None:
        """A shard's whole slice, or the PUSH that completes its buckets: answered, and
        `finish_push` waits for every answer."""
        assert push.bucket == WHOLE
        if push.shard == 0:
            self._leader_sent = True
            self.leader.send(push)
        else:
            assert self.shards is not None
            self.shards.send_push(push)

    def drop_push(self) -> None:
        """The push failed (or the job stopped) before it was all sent: the answers to what
        went are not wanted, and the followers' slices will never be committed."""
        if self.shards is not None:
            self.shards.cancel()
        if self._leader_sent:
            self.leader.reset()

    def finish_push(self) -> PushAck | Stop:
        """The leader's answer to the push, once every follower has staged its slice."""
        if self.shards is not None:
            try:
                stop = self.shards.finish_pushes()
            except (Interrupted, RequestFailed):
                # The worker leaves, or a follower refused its slice: the next request must
                # not read this push's answer. (The leader forgetting this worker is answered
                # inside: the leader's answer then says whether the push counted.)
                self.shards.cancel()
                self.leader.reset()
                raise
            if stop is not None:  # the leader's reply would say the same: it is not read
                self.leader.reset()
                return stop
        reply: Message = self.leader.receive()
        if isinstance(reply, Stop):
            return reply
        if not isinstance(reply, PushAck) or reply.go:
            got = "a go" if isinstance(reply, PushAck) else describe(reply)
            raise ServerError(
                f"expected the PUSH_ACK of a push, got {got}; run the same release of "
                "ps-server and ps-worker"
            )
        # Sync: the acknowledged version is the one the next pull gets.
        self.min_version = reply.version if self.job.mode == "sync" else 0
        return reply


def check_weights(job: JobSpec, weights: Weights) -> None:
    """WEIGHTS that fit the job: training on anything else would go on silently wrong (a
    short vector leaves part of the model as it was; int64 weights are cast)."""
    lo, hi = job.shard_range(0)
    expected = [("buffers", weights.buffers, job.num_buffers)]
    if not weights.streamed:
        expected.append(("parameters", weights.params, hi - lo))
    for what, tensor, numel in expected:
        if tensor.dtype != torch.float32 or tensor.numel() != numel:
            raise ServerError(
                f"the server sent {tensor.numel()} {what} of {tensor.dtype}, not the job's "
                f"{numel} of torch.float32; run the same release of ps-server and ps-worker"
            )
