"""The way weights go out, on every shard: pulls held until they can be answered, answered
with the shard's slice, and (sync mode) updated buckets streamed to the workers before they ask.

Both kinds of shard send the same way: WEIGHTS with the store's version and slice, zero-copy
from the store and tracked, so the store waits for ZeroMQ before it changes that memory; the
parameters left out if the worker received them all as streamed buckets already
(psserver.serving.streaming); an applied bucket sent at once to the workers whose parts were
in it (`stream_bucket`). What differs is what a pull waits for:

- on the leader (`PullHandler`), until the policy has a batch for the worker (a sync step
  still open, an epoch boundary, the job not started yet); its WEIGHTS also carry the batch
  to compute, the flow-control offer and the buffers.
- on a follower (`SlicePullHandler`), until the slice has at least `min_version` updates, and
  never while a commit is half applied (some buckets would be at the next version, some not
  yet). The leader's PULL (worker id LEADER_ID) is answered with the slice (and momentum, if
  asked) and the shard's traffic counts, for evaluation and checkpoints; one with
  min_version -1 is a ping, answered at once.

What it is not: a decision maker. The policy (or, on a follower, the leader's commits) says
what each worker computes next and when a bucket is applied; this module only sends.
"""

import logging
from collections.abc import Hashable, Sequence

import torch

from common.errors import RequestRejected
from common.wire.protocol import LEADER_ID, Error, Pull, Stop, Weights
from psserver.coordinator.membership import Membership, WorkerRecord, WorkerState
from psserver.policies import HOLD, UpdatePolicy
from psserver.serving.credits import PushCredits
from psserver.serving.socket import ServerSocket
from psserver.serving.staging import AppliedBucket, SliceStaging
from psserver.serving.streaming import WeightStreamer
from psserver.status.report import TrainingMeter
from psserver.store.parameters import ParameterStore, SliceStore

log = logging.getLogger("ps.server")
NO_PARAMS = torch.empty(0)  # WEIGHTS for a worker that holds them already
# Commits that may still be on their way from the leader to a follower (see
# SlicePullHandler.hold): generous, since many async workers can move the leader far ahead of
# what the follower has read; it only has to refuse versions that will never come.
FUTURE_PULL_SLACK = 1024


def stream_bucket(
    router: ServerSocket,
    streamer: WeightStreamer,
    books: Sequence[Hashable],  # the streamer's keys of the recipients: worker ids or connections
    identities: Sequence[bytes],
    bucket: int,
    version: int,
) -> int:
    """Send an applied bucket's new values to these workers, one encoding for all, tracked so
    that only an update of that bucket waits for the send; returns the bytes sent."""
    part = streamer.part(books, bucket, version)
    lo, hi = streamer.buckets[bucket]
    streamer.store.track_send(router.send_tracked(identities, part), lo, hi)
    return len(identities) * part.params.nbytes


class PullHandler:
    def __init__(
        self,
        router: ServerSocket,
        store: ParameterStore,
        policy: UpdatePolicy,
        credits: PushCredits,
        membership: Membership,
        meter: TrainingMeter,
        buckets: list[tuple[int, int]],
    ) -> None:
        self.router, self.store, self.policy = router, store, policy
        self.credits, self.membership, self.meter = credits, membership, meter
        self.streamer = WeightStreamer(store, buckets)
        self.held: dict[int, WorkerRecord] = {}  # worker id -> a pull to answer
        self.starved = False  # held pulls wait for a snapshot slot, not for work

    def hold(self, worker: WorkerRecord, pull: Pull) -> None:
        self.streamer.claim(worker.worker_id, pull.have_version)
        if worker.state is WorkerState.REGISTERED:
            worker.move_to(WorkerState.WAITING)
        self.held[worker.worker_id] = worker

    def forget(self, worker_id: int) -> None:
        """A worker left or died: its pull is void, and what it was sent proves nothing."""
        self.held.pop(worker_id, None)
        self.streamer.forget(worker_id)

    def answer(self) -> None:
        """Answer every held pull the policy has work (or STOP) for."""
        self.starved = False
        for worker_id, worker in list(self.held.items()):
            decision = self.policy.next_assignment(worker_id)
            if decision == HOLD:
                continue
            if decision is None:
                del self.held[worker_id]
                self.stop(worker, "training is over")
                continue
            assert not isinstance(decision, str)
            snapshot = self.store.snapshot()
            if snapshot is None:  # every copy of the weights is still being sent
                self.starved = True  # look again in a moment, not after a whole poll
                return
            del self.held[worker_id]
            worker.assignment = (decision.epoch, decision.batch)
            version, params, buffers = snapshot
            streamed = self.streamer.covers(worker_id)  # the worker has these params
            self.meter.streamed_pulls += streamed
            weights = Weights(
                version, decision.epoch, decision.batch, decision.rank, decision.world_size,
                self.credits.offer(worker_id), NO_PARAMS if streamed else params, buffers,
                streamed,
            )  # fmt: skip
            self.store.track_send(self.router.send_tracked([worker.identity], weights))

    def stream_bucket(self, bucket: int, version: int, worker_ids: list[int]) -> None:
        """A bucket was applied in sync mode: its new values go to these workers now."""
        workers = [self.membership.workers.get(worker_id) for worker_id in worker_ids]
        training = [w for w in workers if w is not None and w.state is WorkerState.TRAINING]
        if not training:
            return
        self.meter.streamed_bytes += stream_bucket(
            self.router, self.streamer, [w.worker_id for w in training],
            [w.identity for w in training], bucket, version,
        )  # fmt: skip

    def stop(self, worker: WorkerRecord, reason: str) -> None:
        self.router.send(worker.identity, Stop(reason))
        worker.move_to(WorkerState.STOPPED)

    def stop_all(self, reason: str) -> None:
        """Answer every held pull with STOP (the job is over)."""
        for worker in self.held.values():
            self.stop(worker, reason)
        self.held.clear()


class SlicePullHandler:
    def __init__(
        self,
        shard: int,
        router: ServerSocket,
        store: SliceStore,
        staging: SliceStaging,
        streamer: WeightStreamer | None,
        max_staged: int,
    ) -> None:
        self.shard, self.router, self.store, self.staging = shard, router, store, staging
        self.streamer = streamer  # sync with --stream-weights: applied buckets go out at once
        self.max_staged = max_staged
        self.held: list[tuple[bytes, Pull]] = []  # pulls waiting for a version
        self.starved = False  # a pull waits for a snapshot slot, not for a version
        self.streamed_bytes = 0

    def hold(self, identity: bytes, request: Pull) -> None:
        """Keep a worker's PULL or the leader's until its version is there."""
        # One pull per connection at a time is all a real worker sends: a newer one replaces
        # the one before. The cap keeps a flood of pulls for far-future versions from many
        # connections from growing the list without end; the leader's pull is never refused
        # (its token was checked), or a flood could stop an evaluation.
        if request.worker_id != LEADER_ID:
            # A worker asks for the leader's version, which is ahead of this slice by the
            # commits queued here and those still on their way: a pull far beyond that would
            # wait for ever.
            reachable = self.store.version + len(self.staging.commits) + FUTURE_PULL_SLACK
            if request.min_version > reachable:
                raise RequestRejected(
                    "bad-version",
                    f"shard {self.shard} is at step {self.store.version}; step "
                    f"{request.min_version} is not coming soon: pull the version the leader "
                    "gave you",
                )
            self.held = [
                (held_by, held)
                for held_by, held in self.held
                if held_by != identity or held.worker_id == LEADER_ID
            ]
            if len(self.held) >= 4 * self.max_staged + 16:
                self._evict_oldest_pull()
        self.held.append((identity, request))

    def _evict_oldest_pull(self) -> None:
        """Make room for a new pull by answering the oldest held one "busy". Its sender, if it
        is still there, asks again after a pause; refusing the newest instead let anyone who
        filled the list from throw-away connections turn away every real worker's next pull,
        and end the job (only the job's workers get this far, but a token works on any number
        of connections)."""
        for index, (held_by, held) in enumerate(self.held):
            if held.worker_id != LEADER_ID:
                del self.held[index]
                self.router.send(held_by, Error("busy", "too many pulls are waiting; ask again"))
                return
        raise RequestRejected("busy", "too many requests are waiting; try again later")

    def stream_bucket(self, applied: AppliedBucket) -> None:
        """Sync: an applied bucket goes at once to the workers whose parts were in it."""
        streamer = self.streamer
        assert streamer is not None
        streamer.forget_older(applied.version - 1)
        self.streamed_bytes += stream_bucket(
            self.router, streamer, applied.recipients, applied.recipients, applied.bucket,
            applied.version,
        )  # fmt: skip

    def answer_held(self) -> None:
        """Answer every held request whose version is there (and, for a worker's pull, a
        snapshot slot is free); keep the rest."""
        waiting, self.starved = [], False
        if self.staging.mid_commit:  # some buckets are at the next version, some not yet
            return
        for identity, request in self.held:
            if self.store.version < request.min_version:
                waiting.append((identity, request))
            elif request.worker_id == LEADER_ID:
                self.router.send(identity, self.to_leader(True, request.with_momentum))
            elif self._streamed_to(identity, request):
                version = self.store.version
                streamed = Weights(
                    version, -1, -1, -1, 0, False, NO_PARAMS, NO_PARAMS, True, shard=self.shard
                )
                self.router.send(identity, streamed)
            elif (snapshot := self.store.snapshot_params()) is not None:
                version, params = snapshot
                weights = Weights(
                    version, -1, -1, -1, 0, False, params, NO_PARAMS, shard=self.shard
                )
                self.store.track_send(self.router.send_tracked([identity], weights))
            else:  # every copy is still being sent
                self.starved = True
                waiting.append((identity, request))
        self.held = waiting

    def to_leader(self, with_params: bool, with_momentum: bool = False) -> Weights:
        """An answer to the leader's PULL, with this shard's traffic so far."""
        momentum = self.store.momentum() if with_momentum else None
        return Weights(
            self.store.version, -1, -1, -1, 0, False,
            self.store.params.clone() if with_params else NO_PARAMS, NO_PARAMS, shard=self.shard,
            momentum=momentum.clone() if momentum is not None else NO_PARAMS,
            pushed_bytes=self.staging.applied_bytes, streamed_bytes=self.streamed_bytes,
        )  # fmt: skip

    def _streamed_to(self, identity: bytes, pull: Pull) -> bool:
        """Whether the puller holds the current version whole: it says so, and every bucket
        of it was streamed to this connection."""
        streamer = self.streamer
        return (
            streamer is not None
            and pull.have_version == self.store.version
            and streamer.sent_whole(identity)
        )
