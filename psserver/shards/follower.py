"""A follower shard: owns one slice of the flat parameter vector and repeats the leader's updates.

With `--num-shards K`, shard 0 (the leader, psserver.server) runs the job: membership, the
sync/async policy, evaluation and checkpoints. Shards 1..K-1 each own the slice
`job.shard_range(i)` and answer workers directly, so K slices move in parallel:

    leader --ROSTER-----> shard i   the job's workers, whenever they change: the only ones
                                    whose pushes and pulls the shard takes (psserver.shards.roster)
    leader --COMMIT-----> shard i   sync, with a plan: "step v waits for these workers":
                                    apply each bucket as soon as all of them sent it
                                    (psserver.serving.staging)
    worker --PUSH-------> shard i   the gradient's slice, or one bucket of it, is staged; a
                                    slice sent in buckets is completed by a PUSH that says how
                                    many, and that one is answered (PUSH_ACK), as on shard 0
    leader --COMMIT-----> shard i   with entries: "update v is these workers' gradients":
                                    apply the staged slices with exactly the leader's
                                    arithmetic, bucket by bucket as they are all in, and move
                                    to version v + 1
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
it a second server: it runs the leader's serving code (psserver.serving: the socket, the
requests and their dispatch, the push handler with the roster as who may push and the staging
as where a push goes, the pulls). This module is what is a follower's own: joining the leader,
the leader's commits, roster and stop, and the loop's wiring.
"""

import logging
import secrets
import time

import torch
import zmq

from common.catalog import largest_state_numel
from common.cpu_share import CpuShare
from common.errors import ProtocolError, PSError, RequestRejected
from common.job import JobSpec
from common.wire.protocol import (
    LEADER_ID,
    Commit,
    Pull,
    Push,
    Roster,
    Stop,
)
from common.wire.security import (
    ServerSecurity,
)
from psserver.serving.pulls import PullHandler, SliceTerms
from psserver.serving.pushes import PushHandler
from psserver.serving.socket import Dispatch, ServerSocket, route
from psserver.serving.staging import SliceStaging
from psserver.shards.joining import FollowerConfig, advertised_endpoint, join_leader
from psserver.shards.roster import WorkerRoster
from psserver.status.report import TrainingMeter
from psserver.store.optimizer import OptimizerSpec
from psserver.store.parameters import SliceStore

log = logging.getLogger("ps.shard")
POLL_MS = 100


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
        # The leader's socket, limits and all (psserver.serving.socket). The job (so the slice)
        # is known only after joining, and the frame limit must be set before binding: it is
        # that of the largest model.
        try:
            self.router = ServerSocket(
                self.context,
                config.bind,
                security,
                max_message_bytes=4 * largest_state_numel() + (1 << 20),
                endpoint_file=config.endpoint_file,
                logger=log,
                who=f"shard {config.shard}: ",
            )
        except BaseException:
            self.context.term()
            raise
        self.endpoint = advertised_endpoint(self.router.endpoint, config.advertise_host)
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
        # The leader's pull handler, with a follower's terms: a roster worker (or the leader)
        # asks for a version, and nothing goes with the slice. Held pulls are keyed by
        # connection, and capped: the oldest is answered "busy" to make room.
        self.meter = TrainingMeter()  # the bytes streamed, reported to the leader
        self.terms = SliceTerms(config.shard, self.store, self.staging, self.meter)
        self.pulls: PullHandler[int] = PullHandler(
            self.router, self.store, buckets, self.terms, self.meter, config.shard,
            max_held=4 * welcome.max_staged + 16,
        )  # fmt: skip
        if self.job.mode == "sync" and welcome.stream_weights:
            # Applied buckets go straight back to the workers that sent them in buckets.
            self.staging.on_step_dropped = self.pulls.streamer.reset
            self.staging.on_bucket_applied = lambda applied: self.pulls.stream_bucket(
                applied.bucket, applied.version, applied.recipients
            )
        # The leader's push handler, with the roster for its membership and the staging for
        # its policy: a slice waits here for the leader's COMMIT.
        self.pushes = PushHandler(self.router, self.job, config.shard, self.roster, self.staging)
        # The leader proves itself by its token, and workers by theirs (the pushes' Senders).
        self.dispatch = Dispatch(
            [
                route(Push, self.pushes.handle),
                route(Pull, self._on_pull),
                route(Commit, self._on_commit),
                route(Roster, self._on_roster),
                route(Stop, self._on_stop),
            ],
            f"this is shard {config.shard} of {config.num_shards}; it takes pushes and pulls "
            "of its slice only, not {kind}: send everything else to the leader",
        )
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
                if self.router.poll(1 if self.pulls.starved else POLL_MS):
                    self.router.serve(self.dispatch, lambda: None)
                self.staging.apply_ready()
                self.pulls.answer()
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
                self.config.shard, self.store.version, self.meter.streamed_bytes / 1e6,
            )  # fmt: skip
        finally:
            self.close()

    def close(self) -> None:
        self.router.close()
        self.context.term()

    # ---- its requests: a worker's pushes and pulls, the leader's commits, roster and stop ----

    def _on_pull(self, identity: bytes, pull: Pull, sender_key: str) -> None:
        if pull.worker_id == LEADER_ID:
            self._check_leader(identity, pull.token)
            self._check_shard(pull.shard, "PULL")
            if pull.min_version < 0:  # a ping: the version (and traffic) is the answer
                self.router.send(identity, self.terms.to_leader(with_params=False))
            else:
                self.pulls.hold(self.terms.leader_key(), LEADER_ID, identity, pull, evictable=False)
            return
        # Before anything is held: only the job's workers take up room here.
        self.roster.authenticate(pull.worker_id, pull.token)
        self._check_shard(pull.shard, "PULL")
        self.pulls.hold(identity, pull.worker_id, identity, pull)  # one per connection

    def _on_commit(self, identity: bytes, commit: Commit, sender_key: str) -> None:
        self._check_leader(identity, commit.leader_token)
        self.staging.receive(commit)

    def _on_roster(self, identity: bytes, roster: Roster, sender_key: str) -> None:
        self._check_leader(identity, roster.leader_token)
        self.roster.update(roster)

    def _on_stop(self, identity: bytes, stop: Stop, sender_key: str) -> None:
        if identity != self.leader_identity:
            raise self.dispatch.refusal(stop)
        self.stopped = True

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
                "COMMIT, ROSTER and a PULL as worker 0 are for the leader only",
            )
        self.leader_identity = identity
        self.last_from_leader = time.monotonic()
