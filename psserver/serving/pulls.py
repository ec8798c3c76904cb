"""Weights out, on every shard: pulls held until they can be answered, answered with the
shard's slice, and (sync mode) updated buckets streamed to the workers before they ask.

One handler serves the leader and the follower shards (`PullHandler`). It keeps the held
pulls, answers each as soon as it can, leaves the parameters out of a WEIGHTS if the puller
holds them already as streamed buckets (psserver.serving.streaming), sends an applied bucket at
once to the workers whose parts were in it (`stream_bucket`), and answers every pull with STOP
at the end of the job. Weights go out zero-copy from the store and tracked, so the store waits
for ZeroMQ before it changes that memory. What differs is a parameter of it:

- who is asking, and what goes with the weights (`PullTerms`): on the leader
  (`AssignmentTerms`) a membership record, whose pull waits until the policy has a batch for it
  (a sync step still open, an epoch boundary, the job not started yet), and whose WEIGHTS
  carry that batch, the flow-control offer and the buffers; on a follower (`SliceTerms`) a
  roster worker id, whose pull waits until the slice has at least `min_version` updates and
  is never answered while a commit is half applied (some buckets would be at the next
  version, some not yet), and whose WEIGHTS carry nothing else. The follower's terms answer
  the leader's PULL too (worker id LEADER_ID): with the slice (and momentum, if asked) and the
  shard's traffic counts, for evaluation and checkpoints.
- the key of a held pull, which is also the streaming books' key: the leader's worker id (one
  pull per worker), a follower's connection (one pull per connection: a newer one replaces
  the one before; the leader's pulls are each their own).
- the cap on held pulls (`max_held`): none on the leader, whose membership bounds them; on a
  follower the oldest worker's pull is answered "busy" to make room for a new one.

What it is not: a decision maker. The policy (or, on a follower, the leader's commits) says
what each worker computes next and when a bucket is applied; this module only sends.
"""

import dataclasses
import itertools
import logging
from collections.abc import Hashable, Sequence
from typing import Generic, Literal, NamedTuple, Protocol, TypeVar

import torch

from common.assignment import Assignment
from common.errors import RequestRejected
from common.wire.protocol import LEADER_ID, Error, Pull, Stop, Weights
from psserver.coordinator.membership import Membership, WorkerRecord, WorkerState
from psserver.policies import HOLD, UpdatePolicy
from psserver.serving.credits import PushCredits
from psserver.serving.socket import ServerSocket, asked_on
from psserver.serving.staging import SliceStaging
from psserver.serving.streaming import WeightStreamer
from psserver.status.report import TrainingMeter
from psserver.store.parameters import ParameterStore, SliceStore

log = logging.getLogger("ps.server")
NO_PARAMS = torch.empty(0)  # WEIGHTS for a worker that holds them already
UNASSIGNED = Assignment(-1, -1, -1, 0)  # a follower's WEIGHTS: no batch goes with them
# Commits that may still be on their way from the leader to a follower (see
# SliceTerms.admit): generous, since many async workers can move the leader far ahead of what
# the follower has read; it only has to refuse versions that will never come.
FUTURE_PULL_SLACK = 1024
Asker = TypeVar("Asker")  # who is asking: the leader's WorkerRecord, a follower's worker id
Asker_contra = TypeVar("Asker_contra", contravariant=True)
# What a held pull gets now: HOLD (not yet), None (STOP: the job is over), or an assignment.
Decision = Assignment | Literal["hold"] | None


class Snapshot(NamedTuple):
    """What a WEIGHTS is made of; `zero_copy`: the store's memory, so the send is tracked."""

    version: int
    params: torch.Tensor
    buffers: torch.Tensor
    zero_copy: bool


class PullTerms(Protocol[Asker_contra]):
    """Who is asking and what goes with the weights: the part of pulls that differs by shard."""

    def admit(self, asker: Asker_contra, pull: Pull) -> None:
        """Raise RequestRejected if this pull may not be held."""

    def decide(self, asker: Asker_contra, pull: Pull) -> Decision: ...

    def snapshot(self, asker: Asker_contra, streamed: bool) -> Snapshot | None:
        """The weights to answer with; None when every copy is still being sent."""

    def weights(
        self,
        asker: Asker_contra,
        pull: Pull,
        assignment: Assignment,
        snapshot: Snapshot,
        streamed: bool,
    ) -> Weights: ...

    def reply_to(self, asker: Asker_contra, identities: list[bytes]) -> list[bytes]:
        """Where the answer goes: the connections the pull came on (`HeldPull.identities`),
        and a newer one."""

    def stopped(self, asker: Asker_contra) -> None:
        """The asker was answered STOP."""

    def recipients(self, keys: Sequence[Hashable]) -> list[tuple[Hashable, bytes]]:
        """Of these streaming keys, those to stream an applied bucket to, with their
        connections."""


@dataclasses.dataclass
class HeldPull(Generic[Asker]):
    asker: Asker
    identities: list[bytes]  # the connections it came on, each answered (socket.asked_on)
    pull: Pull
    evictable: bool  # may be answered "busy" to make room (not the leader's, on a follower)


class PullHandler(Generic[Asker]):
    def __init__(
        self,
        router: ServerSocket,
        store: SliceStore,
        buckets: list[tuple[int, int]],
        terms: PullTerms[Asker],
        meter: TrainingMeter,  # counts streamed_bytes and streamed_pulls
        shard: int = 0,
        max_held: int | None = None,
    ) -> None:
        self.router, self.store, self.terms, self.meter = router, store, terms, meter
        self.max_held = max_held
        self.streamer = WeightStreamer(store, buckets, shard)
        self.held: dict[Hashable, HeldPull[Asker]] = {}  # in the order they came
        self.starved = False  # held pulls wait for a snapshot slot, not for work

    def hold(
        self, key: Hashable, asker: Asker, identity: bytes, pull: Pull, evictable: bool = True
    ) -> None:
        """Keep a pull until it can be answered; one held under the same key is replaced,
        and answered with it on its connections."""
        self.terms.admit(asker, pull)
        before = self.held.pop(key, None)
        if evictable and self.max_held is not None and len(self.held) >= self.max_held:
            self._evict_oldest()
        self.streamer.claim(key, pull.have_version)
        identities = asked_on([] if before is None else before.identities, identity)
        self.held[key] = HeldPull(asker, identities, pull, evictable)

    def _evict_oldest(self) -> None:
        """Make room for a new pull by answering the oldest held one "busy". Its sender, if it
        is still there, asks again after a pause; refusing the newest instead let anyone who
        filled the list from throw-away connections turn away every real worker's next pull,
        and end the job (only the job's workers get this far, but a token works on any number
        of connections)."""
        oldest = next((key for key, held in self.held.items() if held.evictable), None)
        if oldest is None:
            raise RequestRejected("busy", "too many requests are waiting; try again later")
        identities = self.held[oldest].identities
        self.forget(oldest)
        for identity in identities:
            self.router.send(identity, Error("busy", "too many pulls are waiting; ask again"))

    def forget(self, key: Hashable) -> None:
        """A worker left or died (or its pull was evicted): its pull is void, and what it was
        sent proves nothing."""
        self.held.pop(key, None)
        self.streamer.forget(key)

    def answer(self) -> None:
        """Answer every held pull that can be (with its weights, or STOP); keep the rest."""
        self.starved = False
        for key, held in list(self.held.items()):
            decision = self.terms.decide(held.asker, held.pull)
            if decision == HOLD:
                continue
            identities = self.terms.reply_to(held.asker, held.identities)
            if decision is None:
                del self.held[key]
                self.stop(held.asker, identities, "training is over")
                continue
            assert not isinstance(decision, str)
            streamed = self.streamer.covers(key)  # the puller has these params
            snapshot = self.terms.snapshot(held.asker, streamed)
            if snapshot is None:  # every copy of the weights is still being sent
                self.starved = True  # look again in a moment, not after a whole poll
                self.streamer.claim(key, held.pull.have_version)
                continue
            del self.held[key]
            self.meter.streamed_pulls += streamed
            weights = self.terms.weights(held.asker, held.pull, decision, snapshot, streamed)
            if snapshot.zero_copy:
                self.store.track_send(self.router.send_tracked(identities, weights))
            else:
                for identity in identities:
                    self.router.send(identity, weights)

    def stream_bucket(self, bucket: int, version: int, keys: Sequence[Hashable]) -> None:
        """A bucket was applied in sync mode: its new values go to these workers now, one
        encoding for all, tracked so that only an update of that bucket waits for the send."""
        self.streamer.forget_older(version - 1)  # they prove nothing any more
        recipients = self.terms.recipients(keys)
        if not recipients:
            return
        part = self.streamer.part([key for key, _ in recipients], bucket, version)
        lo, hi = self.streamer.buckets[bucket]
        identities = [identity for _, identity in recipients]
        self.store.track_send(self.router.send_tracked(identities, part), lo, hi)
        self.meter.streamed_bytes += len(identities) * part.params.nbytes

    def stop(self, asker: Asker, identities: list[bytes], reason: str) -> None:
        for identity in identities:
            self.router.send(identity, Stop(reason))
        self.terms.stopped(asker)

    def stop_all(self, reason: str) -> None:
        """Answer every held pull with STOP (the job is over)."""
        for held in self.held.values():
            self.stop(held.asker, self.terms.reply_to(held.asker, held.identities), reason)
        self.held.clear()


class AssignmentTerms:
    """The leader's: a registered worker's pull waits for the policy's next batch for it,
    which goes with the weights, with the flow-control offer and the buffers."""

    def __init__(
        self,
        store: ParameterStore,
        policy: UpdatePolicy,
        credits: PushCredits,
        membership: Membership,
    ) -> None:
        self.store, self.policy, self.credits, self.membership = store, policy, credits, membership

    def admit(self, asker: WorkerRecord, pull: Pull) -> None:
        if asker.state is WorkerState.REGISTERED:
            asker.move_to(WorkerState.WAITING)

    def decide(self, asker: WorkerRecord, pull: Pull) -> Decision:
        return self.policy.next_assignment(asker.worker_id)

    def snapshot(self, asker: WorkerRecord, streamed: bool) -> Snapshot | None:
        taken = self.store.snapshot()  # the buffers go even when the params are streamed
        return None if taken is None else Snapshot(*taken, zero_copy=True)

    def weights(
        self,
        asker: WorkerRecord,
        pull: Pull,
        assignment: Assignment,
        snapshot: Snapshot,
        streamed: bool,
    ) -> Weights:
        asker.assignment = assignment.key
        return Weights(
            snapshot.version, assignment.epoch, assignment.batch, assignment.rank,
            assignment.world_size, self.credits.offer(asker.worker_id),
            NO_PARAMS if streamed else snapshot.params, snapshot.buffers, streamed,
        )  # fmt: skip

    def reply_to(self, asker: WorkerRecord, identities: list[bytes]) -> list[bytes]:
        # And the socket of its last request, if it sent one on a newer socket since.
        return identities if asker.identity in identities else [*identities, asker.identity]

    def stopped(self, asker: WorkerRecord) -> None:
        asker.move_to(WorkerState.STOPPED)

    def recipients(self, keys: Sequence[Hashable]) -> list[tuple[Hashable, bytes]]:
        workers = [self.membership.workers.get(key) for key in keys if isinstance(key, int)]
        return [
            (w.worker_id, w.identity)
            for w in workers
            if w is not None and w.state is WorkerState.TRAINING
        ]


class SliceTerms:
    """A follower's: a roster worker's pull (or the leader's, as worker 0) waits until the slice
    has the version it asks for; nothing goes with a worker's weights, the shard's traffic with
    the leader's."""

    def __init__(
        self, shard: int, store: SliceStore, staging: SliceStaging, meter: TrainingMeter
    ) -> None:
        self.shard, self.store, self.staging, self.meter = shard, store, staging, meter
        self._leader_pulls = itertools.count()

    def leader_key(self) -> Hashable:
        """A key of its own for each of the leader's pulls: none replaces another."""
        return (LEADER_ID, next(self._leader_pulls))

    def admit(self, asker: int, pull: Pull) -> None:
        if asker == LEADER_ID:  # its token was checked: never refused
            return
        # A worker asks for the leader's version, which is ahead of this slice by the commits
        # queued here and those still on their way: a pull far beyond that would wait for ever.
        reachable = self.store.version + len(self.staging.commits) + FUTURE_PULL_SLACK
        if pull.min_version > reachable:
            raise RequestRejected(
                "bad-version",
                f"shard {self.shard} is at step {self.store.version}; step "
                f"{pull.min_version} is not coming soon: pull the version the leader gave you",
            )

    def decide(self, asker: int, pull: Pull) -> Decision:
        if self.staging.mid_commit or self.store.version < pull.min_version:
            return HOLD
        return UNASSIGNED

    def snapshot(self, asker: int, streamed: bool) -> Snapshot | None:
        if asker == LEADER_ID or streamed:  # nothing of the store's memory goes out
            return Snapshot(self.store.version, NO_PARAMS, NO_PARAMS, zero_copy=False)
        taken = self.store.snapshot_params()
        return None if taken is None else Snapshot(*taken, NO_PARAMS, zero_copy=True)

    def weights(
        self, asker: int, pull: Pull, assignment: Assignment, snapshot: Snapshot, streamed: bool
    ) -> Weights:
        if asker == LEADER_ID:
            return self.to_leader(True, pull.with_momentum)
        return Weights(
            snapshot.version, assignment.epoch, assignment.batch, assignment.rank,
            assignment.world_size, False, snapshot.params, NO_PARAMS, streamed, shard=self.shard,
        )  # fmt: skip

    def reply_to(self, asker: int, identities: list[bytes]) -> list[bytes]:
        return identities

    def stopped(self, asker: int) -> None:
        pass

    def recipients(self, keys: Sequence[Hashable]) -> list[tuple[Hashable, bytes]]:
        return [(key, key) for key in keys if isinstance(key, bytes)]  # keyed by connection

    def to_leader(self, with_params: bool, with_momentum: bool = False) -> Weights:
        """An answer to the leader's PULL, with this shard's traffic so far."""
        momentum = self.store.momentum() if with_momentum else None
        return Weights(
            self.store.version, -1, -1, -1, 0, False,
            self.store.params.clone() if with_params else NO_PARAMS, NO_PARAMS, shard=self.shard,
            momentum=momentum.clone() if momentum is not None else NO_PARAMS,
            pushed_bytes=self.staging.applied_bytes, streamed_bytes=self.meter.streamed_bytes,
        )  # fmt: skip
