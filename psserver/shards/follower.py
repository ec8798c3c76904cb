"""A follower shard: owns one slice of the flat parameter vector and repeats the leader's updates.

With `--num-shards K`, shard 0 (the leader, psserver.server) runs the job: membership, the
sync/async policy, evaluation and checkpoints. Shards 1..K-1 each own the slice
`job.shard_range(i)` and answer workers directly, so K slices move in parallel:

    leader --ROSTER-----> shard i   the job's workers, whenever they change: the only ones
                                    whose pushes and pulls the shard takes (psserver.shards.roster)
    leader --STEP_PLAN--> shard i   sync: "step v waits for these workers": apply each bucket
                                    as soon as all of them sent it (psserver.shards.staging)
    worker --PUSH-------> shard i   the gradient's slice, or one bucket of it, is staged; a
                                    slice sent in buckets is completed by a PUSH that says how
                                    many, and that one is answered (PUSH_ACK), as on shard 0
    leader --COMMIT-----> shard i   "update v is these workers' gradients": apply the staged
                                    slices with exactly the leader's arithmetic, bucket by
                                    bucket as they are all in, and move to version v + 1
    shard i --WEIGHTS---> worker    sync: each applied bucket, to the workers that sent it in
                                    buckets, at once (psserver.serving.streaming)
    worker --PULL-------> shard i   the slice, once it has at least `min_version` updates;
                                    without the parameters if they were all streamed
    leader --PULL-------> shard i   the slice (and momentum) for evaluation and checkpoints,
                                    or (min_version -1) a ping that proves the shard is alive

A push or pull from anyone but the job's workers is refused ("unknown-worker") and staged
nowhere, so a flood of made-up ones cannot push a real worker's slice out of the staging
area before its commit names it. A slice is applied only when the leader names it (in a plan
or a commit), so a late gradient or one for the wrong batch never reaches a follower's
weights, and K shards compute bit for bit what one server would. In sync mode a bucket is
applied as soon as every worker of the step's plan sent it, as the leader applies its own
buckets, so weights flow back while other gradients still come in; a worker whose leader
slice is then refused (NaN) keeps that bucket's update, as it keeps the leader's buckets
applied before the refusal. A slice the leader commits but that never arrives (its worker
died between its pushes) is skipped after `slice_wait` seconds and the rest is renormalised,
as the leader does for a missing worker.

What this is not: a replica. A follower holds no checkpoint of its own; the leader gathers the
slices into one checkpoint, the same for any K, and hands them out again on --resume. Nor is
it the way the slice goes out: held pulls, the leader's and streamed buckets are
psserver.shards.slice_pulls'; this module joins the leader, checks who sent what, and stages.
A PUSH is checked with the same code as on shard 0 (psserver.serving.validation).
"""

import logging
import secrets
import time
from pathlib import Path

import torch
import zmq

from common.catalog import largest_state_numel
from common.cpu_share import CpuShare
from common.errors import ProtocolError, PSError, RequestRejected
from common.job import JobSpec
from common.wire.endpoint_file import write_endpoint_file
from common.wire.handshake import HandshakeLogger
from common.wire.protocol import (
    LEADER_ID,
    WHOLE,
    Commit,
    Message,
    Pull,
    Push,
    PushAck,
    Roster,
    StepPlan,
    Stop,
    encode,
)
from common.wire.security import (
    ServerSecurity,
    secure_server_socket,
    warn_if_public_without_curve,
)
from psserver.serving.requests import RefusalLog, serve_one
from psserver.serving.socket import send_tracked
from psserver.serving.streaming import WeightStreamer
from psserver.serving.validation import check_push
from psserver.shards.joining import FollowerConfig, advertised_endpoint, join_leader
from psserver.shards.roster import WorkerRoster
from psserver.shards.slice_pulls import SlicePullHandler
from psserver.shards.staging import SliceStaging
from psserver.store.optimizer import OptimizerSpec
from psserver.store.parameters import SliceStore

log = logging.getLogger("ps.shard")
POLL_MS = 100
NO_INDICES = torch.empty(0, dtype=torch.int32)  # a bucket is dense


class SliceServer:
    def __init__(
        self,
        config: FollowerConfig,
        security: ServerSecurity | None = None,
        shard_secret: bytes | None = None,  # proven to the leader when joining
    ) -> None:
        self.config, self.security = config, security
        self.cpu_share = CpuShare(config.threads)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.refusals = RefusalLog(log)
        self.authenticator = None
        warn_if_public_without_curve(config.bind, security is not None, log)  # as the leader
        if security is not None:
            self.authenticator = secure_server_socket(self.context, self.socket, security)
        self.handshakes: HandshakeLogger | None = HandshakeLogger.started(
            self.socket, security is not None, log
        )
        # As on the leader, ZeroMQ drops a frame bigger than any slice plus a header before
        # it is read into memory (per frame, not per message: see psserver.serving.socket). The job
        # (so the slice) is known only after joining, and the limit must be set before
        # binding: it is that of the largest model.
        self.socket.setsockopt(zmq.MAXMSGSIZE, 4 * largest_state_numel() + (1 << 20))
        try:
            self.socket.bind(config.bind)
        except zmq.ZMQError as exc:
            self.close()
            raise PSError(f"shard {config.shard}: cannot bind {config.bind}: {exc}") from None
        bound = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.endpoint = advertised_endpoint(bound, config.advertise_host)
        if config.endpoint_file:
            try:
                write_endpoint_file(Path(config.endpoint_file), bound)
            except PSError:
                self.close()
                raise
        try:
            welcome = join_leader(self.context, config, self.endpoint, self.security, shard_secret)
        except BaseException:
            self.close()
            raise
        self.job = JobSpec.from_dict(welcome.job)
        self.lo, self.hi = self.job.shard_range(config.shard)
        self.leader_token = welcome.leader_token
        self.max_staged = welcome.max_staged
        try:  # it refuses an empty key: workers' tokens would come from an empty secret
            self.roster = WorkerRoster(welcome.worker_key, config.shard)
            optimizer = OptimizerSpec.from_dict(welcome.optimizer)
        except ProtocolError as exc:
            self.close()
            raise PSError(f"shard {config.shard}: {exc}") from None
        if welcome.params.numel() != self.hi - self.lo:
            self.close()
            raise PSError(
                f"shard {config.shard}: the leader sent {welcome.params.numel()} parameters for "
                f"a slice of {self.hi - self.lo}; run the same release on every shard"
            )
        params = welcome.params.clone()  # (S,) our own memory: the frame is read-only
        self.store = SliceStore(
            params,
            torch.zeros_like(params),
            optimizer,
            sparse=self.job.sparse,
        )
        self.store.version = welcome.version
        self.store.set_momentum(welcome.momentum)
        # Sync: nothing changes the slice while a step is open, so pulls get it uncopied.
        self.store.publish_live = self.job.mode == "sync"
        buckets = self.job.shard_bucket_ranges(config.shard)
        self.staging = SliceStaging(
            self.store, buckets, welcome.max_staged, welcome.slice_wait, config.shard
        )
        # Sync: applied buckets go straight back to the workers that sent them in buckets.
        streamer: WeightStreamer | None = None
        if self.job.mode == "sync" and welcome.stream_weights:
            streamer = WeightStreamer(self.store, buckets, config.shard)
            self.staging.on_step_dropped = streamer.reset
        self.pulls = SlicePullHandler(
            config.shard, self.socket, self.store, self.staging, streamer, welcome.max_staged,
            self._send,
        )  # fmt: skip
        if streamer is not None:
            self.staging.on_bucket_applied = self.pulls.stream_bucket
        self.leader_identity: bytes | None = None
        self.last_from_leader = time.monotonic()
        self.stopped = False
        log.info(
            "shard %d of %d: parameters [%d, %d) of %s at step %d, reachable at %s",
            config.shard,
            config.num_shards,
            self.lo,
            self.hi,
            self.job.model,
            self.store.version,
            self.endpoint,
        )

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self.stopped:
                # Pulls waiting for a snapshot slot are looked at again in a moment.
                stalled_waits = self.store.stalled_waits
                if self.socket.poll(1 if self.pulls.starved else POLL_MS):
                    serve_one(self.socket, self._handle, self.refusals)
                self.staging.apply_ready()
                self.pulls.answer_held()
                self.cpu_share.recount()
                if self.store.stalled_waits != stalled_waits:
                    # It waited for a stalled worker's sends, reading nothing meanwhile: the
                    # leader's messages are in the queue, not missing.
                    self.last_from_leader = time.monotonic()
                silent = time.monotonic() - self.last_from_leader
                if silent > self.config.leader_timeout:
                    raise PSError(
                        f"shard {self.config.shard}: the leader has been silent for "
                        f"{silent:.0f} s; giving up (restart the job with --resume)"
                    )
            log.info(
                "shard %d stops at step %d; %.1f MB streamed",
                self.config.shard, self.store.version, self.pulls.streamed_bytes / 1e6,
            )  # fmt: skip
        finally:
            self.close()

    def close(self) -> None:
        if self.handshakes is not None:  # its monitor socket would keep term() waiting
            self.handshakes.close()
            self.handshakes = None
        self.refusals.flush()
        self.socket.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()
            self.authenticator = None
        self.context.term()

    def _send(
        self, identity: bytes, message: Message, track: bool = False, lo: int = 0,
        hi: int | None = None,
    ) -> None:  # fmt: skip
        """Send zero-copy; `track`: the store waits for it before it updates [lo, hi)."""
        if not track:
            self.socket.send_multipart([identity, *encode(message)], copy=False)
            return
        self.store.track_send(send_tracked(self.socket, [identity], message), lo, hi)

    def _handle(self, identity: bytes, message: Message, sender_key: str) -> None:
        # sender_key is not needed here: the leader proves itself by its token, and workers
        # by theirs.
        if isinstance(message, Pull) and message.worker_id == LEADER_ID:
            self._check_leader(identity, message.token)
            self._check_shard(message.shard, "PULL")
            if message.min_version < 0:  # a ping: the version (and traffic) is the answer
                self._send(identity, self.pulls.to_leader(with_params=False))
            else:
                self.pulls.hold(identity, message)
        elif isinstance(message, (Push, Pull)):
            # Before anything is staged or held: only the job's workers take up room here.
            self.roster.check(message.worker_id, message.token)
            if isinstance(message, Push):
                self._on_push(identity, message)
            else:
                self._check_shard(message.shard, "PULL")
                self.pulls.hold(identity, message)
        elif isinstance(message, (Commit, StepPlan, Roster)):
            self._check_leader(identity, message.leader_token)
            if isinstance(message, Roster):
                self.roster.update(message)
            elif isinstance(message, Commit):
                self.staging.add_commit(message)
            else:
                self.staging.set_plan(message)
        elif isinstance(message, Stop) and identity == self.leader_identity:
            self.stopped = True
        else:
            raise RequestRejected(
                "unexpected-message",
                f"this is shard {self.config.shard} of {self.config.num_shards}; it takes "
                f"pushes and pulls of its slice only, not {type(message).__name__}: send "
                "everything else to the leader",
            )

    def _check_shard(self, shard: int, kind: str) -> None:
        if shard != self.config.shard:
            raise RequestRejected(
                "wrong-shard",
                f"this is shard {self.config.shard}; a {kind} for shard {shard} goes to that "
                "shard (the job's shard_endpoints)",
            )

    def _check_leader(self, identity: bytes, token: str) -> None:
        if not secrets.compare_digest(token.encode("utf-8", "replace"), self.leader_token.encode()):
            raise RequestRejected(
                "not-leader",
                "COMMIT, STEP_PLAN, ROSTER and a PULL as worker 0 are for the leader only",
            )
        self.leader_identity = identity
        self.last_from_leader = time.monotonic()

    # ---- pushes and commits ----------------------------------------------------------------

    def _on_push(self, identity: bytes, push: Push) -> None:
        """Stage the slice, or one bucket of it. A bucket is never answered (a refused one is
        logged, and told in the reply to the PUSH that completes the slice); a whole slice
        and the completing PUSH are answered with PUSH_ACK or the refusal, as on shard 0."""
        key = (push.version, push.epoch, push.batch)
        stage = self.staging.stage
        try:
            check_push(self.job, self.config.shard, push)
        except RequestRejected as exc:
            if push.bucket == WHOLE and push.parts:
                raise  # the completing PUSH itself is malformed: its buckets stay as they are
            # The leader may still commit this gradient (its own slice was fine): remember the
            # refusal, so the commit skips it at once instead of waiting for it.
            stage(push.worker_id, push.token, key, identity, push.bucket, None, exc)
            if push.bucket < 0:  # not a bucket's PUSH: answered
                raise
            self.refusals.refused(
                exc.code, logging.WARNING, "refused bucket %d of worker %d (%s): %s",
                push.bucket, push.worker_id, exc.code, exc,
            )  # fmt: skip
            return
        if push.bucket == WHOLE and push.parts:
            self.staging.complete(push.worker_id, push.token, key, push.parts)
        elif push.bucket == WHOLE:
            stage(push.worker_id, push.token, key, identity, WHOLE, (push.grads, push.grad_indices))
        else:
            stage(push.worker_id, push.token, key, identity, push.bucket, (push.grads, NO_INDICES))
            return  # never answered
        # The loop applies what is now complete.
        self._send(identity, PushAck(self.store.version, 0, True, self.config.shard))
