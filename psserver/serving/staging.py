"""A follower shard's staging: the slices workers pushed to it, kept until the leader names them
in a COMMIT, then applied through the same store call the leader uses (SliceStore.apply_range),
with the leader's sum (psserver.store.parameters.add_weighted), so every shard computes bit for
bit what one server would. It is a follower's intake (psserver.serving.pushes.Intake): the
push handler authenticates and checks each push and hands it here.

A worker's PUSH is staged under (worker id, token, the
step it is for), zero-copy (the tensors are views of the received frames): either the whole
slice, or bucket by bucket (JobSpec.shard_buckets). A worker may have several slices staged:
in async mode its next push can come before the commit of its last one is applied (commits
apply in order, and one may wait for a straggler's slice). The leader names slices in its
COMMITs:

- the plan of a sync step (a COMMIT with `plan` set): the step now open, and the workers it
  waits for. Each bucket that every one of them has sent in parts, and the shard accepted, is
  applied at once, so it streams back while the other buckets' gradients are still on their
  way, as the leader's own buckets do. A slice pushed whole streams nothing, so it waits for
  the update: the leader may yet drop its worker's push as late, and then no shard may apply
  it.
- the update itself, with the gradients the leader took, in the order it added them. Updates
  queue in order; each bucket the plan did not cover is applied as soon as the slices it names
  have that bucket, and once every bucket is applied the slice moves to the next version.

A bucket that does not come within `slice_wait` seconds of the update (its worker died between
its pushes) is left out and the rest renormalised, as the leader does for a missing worker.
Slices no update ever names (a late sync gradient, which the leader dropped) stay until more
than `capacity` slices are staged; then those that nothing queued names go, the oldest of the
worker with the most first. A step abandoned after some buckets were applied by its plan keeps
them, as the leader does.

What this is not: the checks a part must pass (psserver.serving.validation), the books of which
buckets of a push are in (psserver.serving.pushes.PartialPush), nor the leader's arithmetic,
which its policy does as parts come (psserver.policies).
"""

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from common.compression import wire_bytes
from common.errors import PSError, RequestRejected
from common.wire.protocol import WHOLE, Commit, Push, PushAck
from psserver.serving.pushes import PartialPush, Piece, StepKey, check_complete, step_key
from psserver.store.parameters import SliceStore, add_weighted

log = logging.getLogger("ps.shard")
SliceKey = tuple[int, str, StepKey]  # (worker id, token, step): one staged slice
NO_INDICES = torch.empty(0, dtype=torch.int32)  # a bucket is dense


def slice_key(entry: list[Any]) -> SliceKey:
    """The staged slice a COMMIT entry or plan entry [worker id, token, version, epoch, batch,
    ...] names."""
    worker_id, token, version, epoch, batch = entry[:5]
    return worker_id, token, (version, epoch, batch)


@dataclasses.dataclass(frozen=True)
class AppliedBucket:
    bucket: int
    version: int  # the slice's version once the commit is complete
    recipients: list[bytes]  # connections whose parts were in it


class SliceStaging:
    """A follower's books: the slices staged, and the leader's commits that name them."""

    def __init__(
        self,
        store: SliceStore,
        buckets: list[tuple[int, int]],
        capacity: int,
        slice_wait: float,
        shard: int,
    ) -> None:
        self.store, self.buckets = store, buckets
        self.capacity, self.slice_wait, self.shard = capacity, slice_wait, shard
        # Oldest first. The token is part of the key, so a push under a stolen worker id
        # cannot replace the real worker's slice.
        self.staged: dict[SliceKey, PartialPush] = {}
        # Slices a commit has applied and let go, and why one was refused (None: it was not):
        # the PUSH that completes a slice sent in buckets may come after its commit applied
        # the buckets, and is answered from here. The latest `capacity` of them.
        self.finished: collections.OrderedDict[SliceKey, RequestRejected | None] = (
            collections.OrderedDict()
        )
        self.commits: collections.deque[tuple[float, Commit]] = collections.deque()
        self.plan: Commit | None = None  # the plan of the sync step the leader said is open
        self._applied: set[int] = set()  # buckets of the step below already applied
        self._applied_step: StepKey | None = None
        self.applied_bytes = 0  # gradient bytes applied, as they came on the wire
        self.on_bucket_applied: Callable[[AppliedBucket], None] | None = None
        # Called when buckets applied early belong to a step that ended without a commit:
        # what was streamed of it proves nothing any more.
        self.on_step_dropped: Callable[[], None] | None = None

    def stage(
        self,
        worker_id: int,
        token: str,
        key: tuple[int, int, int],
        identity: bytes,
        bucket: int,
        piece: Piece | None,
        refusal: RequestRejected | None = None,
    ) -> PartialPush:
        """Stage a worker's slice (bucket -1) or one bucket of it; piece None: refused, for
        `refusal`. Returns what is staged for it now."""
        staged = self.staged.pop((worker_id, token, key), None)
        if staged is None or bucket < 0:
            staged = PartialPush(key, identity=identity)
        staged.identity = identity  # a worker that reconnected gets its buckets on the new one
        if piece is None:
            refusal = refusal or RequestRejected("refused", "a push of it was refused")
            staged.refusal = staged.refusal or refusal
        elif bucket >= 0:
            staged.pieces[bucket] = piece
            staged.received.add(bucket)
        else:
            values, indices = piece
            if indices.numel() or len(self.buckets) == 1:  # top-k: one bucket, indices span it
                staged.pieces = {0: piece}
            else:
                staged.pieces = {
                    b: (values[lo:hi], indices) for b, (lo, hi) in enumerate(self.buckets)
                }
        self.staged[worker_id, token, key] = staged  # latest last: eviction drops the oldest
        self._evict()
        return staged

    def _evict(self) -> None:
        """Past `capacity`, drop slices that nothing queued names: the oldest of the worker
        that has the most staged. A named one is kept whatever the count: its commit is
        coming, and dropping it would lose a gradient that the leader's own slice has taken.

        By the worker with the most, not the oldest of all: a worker pushing slices for steps
        that never come (a bug, or a hostile client with a real token) would otherwise evict
        every other worker's slice before its commit, and the follower would apply those
        steps without them."""
        if len(self.staged) <= self.capacity:
            return
        named: set[SliceKey] = set()
        for _, commit in self.commits:
            named.update(slice_key(entry) for entry in commit.entries)
        if self.plan is not None:
            step = (self.plan.version, self.plan.epoch, self.plan.batch)
            named.update((worker_id, token, step) for worker_id, token, _ in self.plan.plan)
        held = collections.Counter(worker_id for worker_id, _, _ in self.staged)
        unnamed = [slot for slot in self.staged if slot not in named]  # oldest first
        while len(self.staged) > self.capacity and unnamed:
            most = max(held[worker_id] for worker_id, _, _ in unnamed)
            slot = next(slot for slot in unnamed if held[slot[0]] == most)  # ties: the oldest
            unnamed.remove(slot)
            del self.staged[slot]
            held[slot[0]] -= 1

    def complete(self, worker_id: int, token: str, key: StepKey, parts: int) -> None:
        """The PUSH that completes a slice sent in `parts` buckets: raise the refusal of one
        of them, or "incomplete-push" if some did not come (the worker computes the step
        again; those that did come are kept, and count once). A slice its commit applied
        already (the commit can come first: the leader's step may close while this PUSH is
        on its way) is complete."""
        slot = (worker_id, token, key)
        staged = self.staged.get(slot)
        if staged is None and slot in self.finished:  # applied by its commit already
            refusal = self.finished[slot]
            if refusal is not None:
                raise refusal
            return
        check_complete(staged, parts, len(self.buckets), f" of shard {self.shard}'s slice")

    # ---- the Intake of a follower's pushes (psserver.serving.pushes) -----------------------

    def admit_part(self, worker_id: int, part: Push) -> bool:
        return True  # a bucket sent again replaces the one staged

    def take_part(self, worker_id: int, identity: bytes, part: Push) -> None:
        self.stage(worker_id, part.token, step_key(part), identity, part.bucket,
                   (part.grads, NO_INDICES))  # fmt: skip

    def take_push(self, worker_id: int, identity: bytes, push: Push) -> PushAck:
        """Stage a whole slice, or complete one sent in buckets; either is answered at once
        (the loop applies what is now complete)."""
        if push.parts:
            self.complete(worker_id, push.token, step_key(push), push.parts)
        else:
            self.stage(worker_id, push.token, step_key(push), identity, WHOLE,
                       (push.grads, push.grad_indices))  # fmt: skip
        return PushAck(self.store.version, 0, True, self.shard)

    def refuse(self, worker_id: int, identity: bytes, push: Push, refusal: RequestRejected) -> None:
        """Remember the refusal: the leader may still commit this gradient (its own slice was
        fine), and the commit then skips it at once instead of waiting for it. A refused
        PUSH that completes buckets leaves them as they are."""
        if push.bucket == WHOLE and push.parts:
            return
        self.stage(worker_id, push.token, step_key(push), identity, push.bucket, None, refusal)

    @property
    def mid_commit(self) -> bool:
        """Some buckets of the next version are applied and some not: the slice is torn."""
        return bool(self._applied)

    def receive(self, commit: Commit) -> None:
        """A COMMIT from the leader: an update to queue, or the plan of a sync step."""
        if commit.entries and commit.plan:
            raise RequestRejected(
                "bad-message", "a COMMIT carries an update (entries) or a plan, never both"
            )
        if commit.entries:
            self.add_commit(commit)
        else:
            self.set_plan(commit)

    def add_commit(self, commit: Commit) -> None:
        self.commits.append((time.monotonic(), commit))

    def set_plan(self, plan: Commit) -> None:
        """The step the leader opened (a COMMIT with a plan and no entries), or the end of one
        without an update (neither)."""
        for entry in plan.plan:
            if not (
                isinstance(entry, list)
                and len(entry) == 3
                and type(entry[0]) is int
                and isinstance(entry[1], str)
                and type(entry[2]) is int
                and entry[2] > 0
            ):
                raise RequestRejected(
                    "bad-message",
                    f"a COMMIT's plan entry is [worker_id, token, samples], got {entry!r}",
                )
        self.plan = plan if plan.plan else None
        if not plan.plan and not self.commits:
            self._settle(None)

    def apply_ready(self) -> None:
        """Apply what the queued commits allow: every bucket whose slices are all here (or
        waited for long enough); a commit whose buckets are all applied completes."""
        while self.commits:
            arrived, commit = self.commits[0]
            if commit.version != self.store.version:
                raise PSError(
                    f"shard {self.shard} is at step {self.store.version} but the leader "
                    f"committed step {commit.version}; the shards are out of step: restart the "
                    "job with --resume"
                )
            if commit.entries:  # sync: every entry is for the same step
                self._settle((commit.version, int(commit.entries[0][3]), int(commit.entries[0][4])))
            waited_enough = time.monotonic() - arrived >= self.slice_wait
            found = [self._find(entry) for entry in commit.entries]
            for bucket in range(len(self.buckets)):
                if bucket in self._applied:
                    continue
                missing = [
                    entry[0]
                    for entry, staged in zip(commit.entries, found, strict=True)
                    if staged is None or not (staged.refused or bucket in staged.pieces)
                ]
                if missing and not waited_enough:
                    continue  # the slices may still be on their way
                if missing:
                    log.warning(
                        "step %d: no bucket %d from workers %s after %.1f s; applied without "
                        "them", commit.version, bucket, missing, self.slice_wait,
                    )  # fmt: skip
                usable = [
                    (int(entry[5]), staged)
                    for entry, staged in zip(commit.entries, found, strict=True)
                    if staged is not None and not staged.refused and bucket in staged.pieces
                ]
                self._apply_bucket(bucket, usable, commit.version, commit.expected,
                                   commit.lr_scale)  # fmt: skip
            if len(self._applied) < len(self.buckets):
                return
            for entry in commit.entries:
                self._drop(entry)
            self._applied, self._applied_step = set(), None
            self.store.count_update()
            self.commits.popleft()
        self._apply_planned()

    def _apply_planned(self) -> None:
        """Apply each bucket of the open sync step that every planned worker has sent."""
        plan = self.plan
        if plan is None or plan.version != self.store.version:
            return  # no step open, or the commit of the one before is not in yet
        step = (plan.version, plan.epoch, plan.batch)
        self._settle(step)
        usable: list[tuple[int, PartialPush]] = []  # (samples, slice) by rank
        for worker_id, token, samples in plan.plan:
            staged = self._find([worker_id, token, *step])
            if staged is None or staged.refused:
                return  # the commit decides (a refused slice is left out, a missing one waited for)
            if not staged.in_parts:
                # A whole slice (no overlap, or top-k) is nothing to stream back, so nothing
                # is gained by applying it before the leader says its push counted: its leader
                # push may yet be late (--step-timeout) or its worker forgotten, and applied
                # here it would reach this shard alone (top-k would then put it back into its
                # residual and send it again). The COMMIT applies it.
                return
            usable.append((samples, staged))
        for bucket in range(len(self.buckets)):
            if bucket not in self._applied and all(bucket in s.pieces for _, s in usable):
                self._apply_bucket(bucket, usable, plan.version, plan.expected, 1.0)

    def _settle(self, step: StepKey | None) -> None:
        """Make `step` the one buckets are applied for. Buckets applied for another step:
        that step ended without a commit (its epoch was abandoned). They keep their update,
        as the leader's buckets do."""
        if self._applied and self._applied_step != step:
            log.warning(
                "step %s ended without a commit after buckets %s of it were applied; they "
                "keep that update", self._applied_step, sorted(self._applied),
            )  # fmt: skip
            self._applied = set()
            if self.on_step_dropped is not None:
                self.on_step_dropped()
        self._applied_step = step

    def _find(self, entry: list[Any]) -> PartialPush | None:
        return self.staged.get(slice_key(entry))

    def _drop(self, entry: list[Any]) -> None:
        key = slice_key(entry)
        staged = self.staged.pop(key, None)
        if staged is not None:
            self.finished[key] = staged.refusal
            while len(self.finished) > self.capacity:
                self.finished.popitem(last=False)

    def _apply_bucket(
        self,
        bucket: int,
        usable: list[tuple[int, PartialPush]],  # (samples, slice), in the order to add them
        version: int,
        expected: int,
        lr_scale: float,
    ) -> None:
        """Step one bucket of the slice with these gradients, as the leader stepped its own:
        their sum weighted by samples / `expected` (`add_weighted`, in the leader's order),
        renormalised to the samples that came, then the store's `apply_range`. `expected` 0:
        async, one gradient (or none, its worker having died) applied as it is. Buckets are
        independent: the optimizer is elementwise."""
        lo, hi = self.buckets[bucket]
        grads, sparse = self.store.grads[lo:hi], self.store.sparse
        self.store.wait_for_sends(lo, hi)  # the live slice may still be on its way to a worker
        total = 0
        for position, (samples, staged) in enumerate(usable):
            values, indices = staged.pieces[bucket]
            self.applied_bytes += wire_bytes(values, indices)
            if expected == 0 and not sparse:  # async: as the leader's AsyncPolicy.on_part
                grads.copy_(values)
            else:
                weight = 1.0 if expected == 0 else samples / expected
                add_weighted(grads, values, indices, weight, position == 0, sparse)
            total += samples
        if not usable:  # its worker died before sending it; the leader stepped its own slice,
            grads.zero_()  # so this one steps too (momentum, weight decay)
        elif expected and total != expected:  # renormalise to the samples that came
            grads.mul_(expected / total)
        self.store.apply_range(lo, hi, lr_scale)
        self._applied.add(bucket)
        recipients = [staged.identity for _, staged in usable if staged.in_parts]
        if self.on_bucket_applied is not None and recipients:
            self.on_bucket_applied(AppliedBucket(bucket, version + 1, recipients))
