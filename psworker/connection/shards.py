"""The worker's side of server sharding: the follower shards' slices, moved in parallel.

With K shards the worker talks to the leader (shard 0) as before, for its slice, and to each
follower for the others. Every connection has its own ZeroMQ context and I/O thread, which
moves the bytes while Python waits elsewhere, so all K transfers overlap: pulls are requested
before the leader's pull, and gradient slices sent before the leader's push.

A follower answers a PULL once its slice has at least `min_version` updates. In sync mode the
worker asks for the version of its last acknowledgement, which is the version the leader will
send next; if the leader's weights turn out newer, the slices are asked for again.

In sync mode with overlap the follower streams each applied bucket back (a WEIGHTS with a
bucket), as the leader does; each connection hands them to a WeightStream of its own slice. They
come before the reply to the pull on the same connection, so the pull claims the version it
asks for as held (`have_version`): if the follower streamed every bucket of it there, its reply
leaves the parameters out.

A follower this worker cannot reach while the leader can would leave the whole job waiting on
this worker: its silence past the retries (a firewall), or its refusal of this worker's
handshake (a CURVE key only the leader accepts), ends the worker with an error that names the
shard, and the leader then goes on without it. A follower that answered before and falls
silent together with the leader (a worker paused until its job had ended, a crashed leader,
whose followers end with it) is not a port to open: the error says the job is gone.
"""

import logging
import threading
import time
from collections.abc import Callable

from common.errors import ServerError
from common.job import JobSpec
from common.sharding import shard_range
from common.wire.handshake import HandshakeRefused
from common.wire.protocol import WHOLE, Message, Pull, Push, PushAck, Stop, Weights
from common.wire.security import ClientSecurity
from psworker.connection.requests import NoReply, RequestFailed, ServerConnection
from psworker.connection.streaming import ParamLoader, WeightStream

log = logging.getLogger("ps.worker")


class ShardClients:
    def __init__(
        self,
        job: JobSpec,
        load: ParamLoader,
        timeout_s: float,
        retries: int,
        security: ClientSecurity | None,
        liveness: Callable[[], float],
        verdict: Callable[[], Message | None] | None = None,
        interrupt: threading.Event | None = None,
    ) -> None:
        self.endpoints, self.bounds = job.shard_endpoints, job.bounds
        self.liveness = liveness  # when the leader was last heard from
        # A follower holds a pull until its slice is updated, which may take as long as a
        # sync step: once the follower has answered, the leader's heartbeats, not the
        # follower's silence, say it is alive (ServerConnection.last_heard).
        self.connections = [
            ServerConnection(endpoint, timeout_s, retries, security, liveness, verdict)
            for endpoint in self.endpoints
        ]
        for connection in self.connections:
            connection.interrupt = interrupt  # a held pull ends on a signal, as the leader's
        # Streamed buckets and pulled slices go into the worker's parameters through `load`.
        self.load = load
        self.streams = [WeightStream(job, load, shard) for shard in range(1, job.num_shards)]
        for connection, stream in zip(self.connections, self.streams, strict=True):
            connection.on_weights_part = stream.accept

    def request_slices(self, worker_id: int, token: str, min_version: int) -> None:
        for shard in range(1, len(self.connections) + 1):
            self._send(shard, Pull(worker_id, token, min_version, shard, min_version))

    def receive_slices(self, worker_id: int, token: str, version: int) -> Stop | None:
        """Load every follower's slice into the parameters (unless it was streamed there),
        asking again for any older than `version` (the leader's). A STOP the job's heartbeat
        heard instead ends the pull: the caller hands it on."""
        for shard in range(1, len(self.connections) + 1):
            reply = self._receive(shard)
            if isinstance(reply, Stop):
                self.cancel()
                return reply
            reply = self._slice(shard, reply)
            if reply.version < version:
                pull = Pull(worker_id, token, version, shard, version)
                reply = self._slice(shard, self._receive(shard, pull))
            held = self.streams[shard - 1].whole_version()
            if reply.streamed and held != reply.version:
                log.warning(
                    "shard %d streamed version %d, but this worker holds %d whole; asking for "
                    "the slice", shard, reply.version, held,
                )  # fmt: skip
                pull = Pull(worker_id, token, -1, shard, reply.version)
                reply = self._slice(shard, self._receive(shard, pull))
            if not reply.streamed:
                self.load(shard_range(self.bounds, shard)[0], reply.params)
        return None

    def _receive(self, shard: int, request: Message | None = None) -> Message:
        """The follower's reply to `request`, sent now, or else to the one sent last."""
        connection = self.connections[shard - 1]
        if request is not None:
            self._send(shard, request)
        try:
            return connection.receive()
        except HandshakeRefused as exc:
            raise ServerError(f"shard {shard}: {exc}") from None
        except NoReply as exc:
            leader_silent_s = time.monotonic() - self.liveness()
            if connection.proven and leader_silent_s >= exc.waited_s:
                raise ServerError(
                    f"shard {shard} at {connection.endpoint} stopped answering (no reply in "
                    f"{exc.waited_s:.0f} s), and the leader has been silent for "
                    f"{leader_silent_s:.0f} s; both answered this worker before, so the job "
                    "has probably finished or the server died: see the leader's log, and if "
                    "the job is not over, restart every shard with --resume and start this "
                    "worker again"
                ) from None
            # The leader answers, so the job goes on: the one likely cause is this host's path
            # to that shard, and waiting longer would hold up every other worker's step.
            raise ServerError(
                f"no reply from shard {shard} at {connection.endpoint} in "
                f"{exc.waited_s:.0f} s; check that its port is reachable from this host"
            ) from None

    def _slice(self, shard: int, reply: Message) -> Weights:
        lo, hi = shard_range(self.bounds, shard)
        if (
            not isinstance(reply, Weights)
            or reply.shard != shard
            or reply.bucket != WHOLE
            or reply.params.numel() != (0 if reply.streamed else hi - lo)
        ):
            raise ServerError(
                f"shard {shard} at {self.endpoints[shard - 1]} sent {type(reply).__name__} "
                f"instead of its {hi - lo} parameters; run the same release everywhere"
            )
        return reply

    def send_push(self, push: Push) -> None:
        """A whole slice, or the PUSH that completes one sent in buckets: the request whose
        answer `finish_pushes` waits for."""
        self._send(push.shard, push)

    def post_bucket(self, push: Push) -> None:
        """One bucket of a slice, sent ahead of the PUSH that completes it; never answered."""
        self.connections[push.shard - 1].post(push)

    def _send(self, shard: int, request: Message) -> None:
        """Start a request to a follower; a refused handshake is said with the shard's name."""
        try:
            self.connections[shard - 1].send(request)
        except HandshakeRefused as exc:
            raise ServerError(f"shard {shard}: {exc}") from None

    def finish_pushes(self) -> Stop | None:
        """Wait for every follower to stage its slice. A STOP instead (the job's heartbeat
        heard the drain while a follower, which the leader stopped, never answered) ends the
        wait: the caller hands it on, and the other followers' answers are dropped. So does a
        shutdown signal, with Interrupted (psworker.connection.requests): the worker leaves."""
        for shard in range(1, len(self.connections) + 1):
            try:
                reply = self._receive(shard)
            except RequestFailed as exc:
                if exc.code != "unknown-worker":
                    raise
                # The leader forgot this worker (a follower only learns it from the leader),
                # but may have applied its push first: the leader's answer says which, and
                # top-k takes back what it sent only if it was not (psworker.connection.requests).
                log.info("shard %d: %s; asking the leader whether the push counted", shard, exc)
                self.cancel()
                return None
            if isinstance(reply, Stop):
                self.cancel()
                return reply
            if not isinstance(reply, PushAck):
                raise ServerError(
                    f"shard {shard} answered a slice push with {type(reply).__name__}; "
                    "run the same release on every server and worker"
                )
        return None

    def cancel(self) -> None:
        """Drop requests in flight (the leader said STOP, or the worker registers again)."""
        for connection, stream in zip(self.connections, self.streams, strict=True):
            connection.reset()
            stream.forget()  # a new connection gets the whole slice

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
