"""The way a follower shard's weights go out: pulls (a worker's, and the leader's for
evaluation and checkpoints) held until their version is there, and (sync mode) applied buckets
streamed at once to the workers that sent them.

A worker's PULL is answered with the slice once this shard has at least `min_version` updates,
without the parameters if it says it holds that version whole (`have_version`) and every
bucket of it was streamed to its connection, the rule shard 0 follows too
(psserver.serving.streaming); slices are sent zero-copy from the store and tracked, so the
store waits for ZeroMQ before it changes that memory. The leader's PULL (worker id LEADER_ID)
is answered with the slice (and momentum, if asked) and this shard's traffic counts; one with
min_version -1 is a ping, answered at once by the follower's loop. Nothing is answered while a
commit is half applied: some buckets would be at the next version, some not yet.

What it is not: the follower's request handling (psserver.shards.follower checks who sent what
before anything is held here) or its staging of gradients (psserver.serving.parts), whose applied
buckets this only sends.
"""

from collections.abc import Callable

import torch
import zmq

from common.errors import RequestRejected
from common.wire.protocol import LEADER_ID, Error, Message, Pull, Weights
from psserver.serving.parts import AppliedBucket, SliceStaging
from psserver.serving.socket import send_tracked
from psserver.serving.streaming import WeightStreamer
from psserver.store.parameters import SliceStore

# Commits that may still be on their way from the leader (see hold): generous, since many
# async workers can move the leader far ahead of what this shard has read; it only has to
# refuse versions that will never come.
FUTURE_PULL_SLACK = 1024
EMPTY = torch.empty(0)


class SlicePullHandler:
    def __init__(
        self,
        shard: int,
        socket: zmq.Socket,
        store: SliceStore,
        staging: SliceStaging,
        streamer: WeightStreamer | None,
        max_staged: int,
        send: Callable[[bytes, Message, bool], None],  # True: tracked (psserver.serving.socket)
    ) -> None:
        self.shard, self.socket, self.store, self.staging = shard, socket, store, staging
        self.streamer = streamer  # sync with --stream-weights: applied buckets go out at once
        self.max_staged = max_staged
        self._send = send
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
                self._send(held_by, Error("busy", "too many pulls are waiting; ask again"), False)
                return
        raise RequestRejected("busy", "too many requests are waiting; try again later")

    def stream_bucket(self, applied: AppliedBucket) -> None:
        """Sync: an applied bucket goes at once to the workers whose parts were in it."""
        streamer = self.streamer
        assert streamer is not None
        streamer.forget_older(applied.version - 1)
        lo, hi = streamer.buckets[applied.bucket]
        part = streamer.part(applied.recipients, applied.bucket, applied.version)
        sent = send_tracked(self.socket, applied.recipients, part)
        self.store.track_send(sent, lo, hi)
        self.streamed_bytes += len(applied.recipients) * part.params.nbytes

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
                self._send(identity, self.to_leader(True, request.with_momentum), False)
            elif self._streamed_to(identity, request):
                version = self.store.version
                streamed = Weights(
                    version, -1, -1, -1, 0, False, EMPTY, EMPTY, True, shard=self.shard
                )
                self._send(identity, streamed, False)
            elif (snapshot := self.store.snapshot_params()) is not None:
                version, params = snapshot
                self._send(
                    identity,
                    Weights(version, -1, -1, -1, 0, False, params, EMPTY, shard=self.shard),
                    True,
                )
            else:  # every copy is still being sent
                self.starved = True
                waiting.append((identity, request))
        self.held = waiting

    def to_leader(self, with_params: bool, with_momentum: bool = False) -> Weights:
        """An answer to the leader's PULL, with this shard's traffic so far."""
        momentum = self.store.momentum() if with_momentum else None
        return Weights(
            self.store.version, -1, -1, -1, 0, False,
            self.store.params.clone() if with_params else EMPTY, EMPTY, shard=self.shard,
            momentum=momentum.clone() if momentum is not None else EMPTY,
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
