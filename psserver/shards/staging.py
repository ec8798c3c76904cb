"""A follower shard's staging area: gradient slices wait here until the leader names them.

A worker's PUSH is staged under (worker id, token, the step it is for), zero-copy (the
tensors are views of the received frames): either the whole slice, or bucket by bucket
(JobSpec.shard_buckets) as the worker's backward produces them, and then the PUSH that
completes them asks whether they all came (`complete`). A worker may have several slices
staged: in async mode its next push can come before the commit of its last one is applied
(commits apply in order, and one may wait for a straggler's slice). The leader names slices
in two ways:

- STEP_PLAN (sync): the step now open, and the workers it waits for. Each bucket that every
  one of them has sent in parts, and the shard accepted, is applied at once, so it streams
  back while the other buckets' gradients are still on their way, as the leader's own
  buckets do. A slice pushed whole streams nothing, so it waits for the COMMIT: the leader
  may yet drop its worker's push as late, and then no shard may apply it.
- COMMIT: the update itself, with the gradients the leader took, in the order it added
  them. Commits queue in order; each bucket the plan did not cover is applied as soon as the
  slices it names have that bucket, and once every bucket is applied the slice moves to the
  next version.

Both add up with exactly the arithmetic the leader used on its own slice
(psserver.shards.slice_update), so every shard computes bit for bit what one server would.

A bucket that does not come within `slice_wait` seconds of the commit (its worker died between
its pushes) is left out and the rest renormalised, as the leader does for a missing worker.
Slices no commit ever names (a late sync gradient, which the leader dropped) stay until more
than `capacity` slices are staged; then those that no queued commit or plan names go, the oldest
of the worker with the most first.
A step abandoned after some buckets were applied by its plan keeps them, as the leader does.

What this is not: the arithmetic of a bucket's update (psserver.shards.slice_update).
"""

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from common.errors import PSError, RequestRejected
from common.wire.protocol import Commit, StepPlan
from psserver.shards.slice_update import Piece, update_bucket
from psserver.store.parameters import SliceStore

log = logging.getLogger("ps.shard")
StepKey = tuple[int, int, int]  # (version, epoch, batch): a step, and the pushes made for it
SliceKey = tuple[int, str, StepKey]  # (worker id, token, step): one staged slice


def slice_key(entry: list[Any]) -> SliceKey:
    """The staged slice a COMMIT or STEP_PLAN entry [worker id, token, version, epoch, batch,
    ...] names."""
    worker_id, token, version, epoch, batch = entry[:5]
    return worker_id, token, (version, epoch, batch)


@dataclasses.dataclass
class StagedSlice:
    key: tuple[int, int, int]  # (version, epoch, batch) of the push
    identity: bytes  # the connection it came on: applied buckets are streamed back there
    pieces: dict[int, Piece]  # bucket -> its gradient; a whole push fills every bucket
    # Why the shard refused a push of it (the first refusal): a commit skips it, and the
    # PUSH that completes it is answered with it.
    refusal: RequestRejected | None = None
    in_parts: bool = False  # sent bucket by bucket, so it is worth streaming back

    @property
    def refused(self) -> bool:
        return self.refusal is not None


@dataclasses.dataclass(frozen=True)
class AppliedBucket:
    bucket: int
    version: int  # the slice's version once the commit is complete
    recipients: list[bytes]  # connections whose parts were in it


class SliceStaging:
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
        self.staged: dict[SliceKey, StagedSlice] = {}
        # Slices a commit has applied and let go, and why one was refused (None: it was not):
        # the PUSH that completes a slice sent in buckets may come after its commit applied
        # the buckets, and is answered from here. The latest `capacity` of them.
        self.finished: collections.OrderedDict[SliceKey, RequestRejected | None] = (
            collections.OrderedDict()
        )
        self.commits: collections.deque[tuple[float, Commit]] = collections.deque()
        self.plan: StepPlan | None = None  # the sync step the leader said is open
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
    ) -> StagedSlice:
        """Stage a worker's slice (bucket -1) or one bucket of it; piece None: refused, for
        `refusal`. Returns what is staged for it now."""
        staged = self.staged.pop((worker_id, token, key), None)
        if staged is None or bucket < 0:
            staged = StagedSlice(key, identity, {})
        staged.identity = identity  # a worker that reconnected gets its buckets on the new one
        if piece is None:
            refusal = refusal or RequestRejected("refused", "a push of it was refused")
            staged.refusal = staged.refusal or refusal
        elif bucket >= 0:
            staged.pieces[bucket] = piece
            staged.in_parts = True
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
            named.update((worker_id, token, step) for worker_id, token, _ in self.plan.entries)
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
        if staged is not None and staged.refusal is not None:
            raise staged.refusal
        got = set(staged.pieces) if staged is not None and staged.in_parts else set()
        missing = sorted(set(range(len(self.buckets))) - got)
        if parts != len(self.buckets) or missing:
            raise RequestRejected(
                "incomplete-push",
                f"the PUSH announces {parts} parts of {len(self.buckets)}, and buckets "
                f"{missing} of shard {self.shard}'s slice did not arrive before it; compute the "
                "step again",
            )

    @property
    def mid_commit(self) -> bool:
        """Some buckets of the next version are applied and some not: the slice is torn."""
        return bool(self._applied)

    def add_commit(self, commit: Commit) -> None:
        self.commits.append((time.monotonic(), commit))

    def set_plan(self, plan: StepPlan) -> None:
        """The step the leader opened (entries), or the end of one without a commit (none)."""
        for entry in plan.entries:
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
                    f"a STEP_PLAN entry is [worker_id, token, samples], got {entry!r}",
                )
        self.plan = plan if plan.entries else None
        if not plan.entries and not self.commits:
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
        usable: list[tuple[int, StagedSlice]] = []  # (samples, slice) by rank
        for worker_id, token, samples in plan.entries:
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

    def _find(self, entry: list[Any]) -> StagedSlice | None:
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
        usable: list[tuple[int, StagedSlice]],  # (samples, slice), in the order to add them
        version: int,
        expected: int,
        lr_scale: float,
    ) -> None:
        lo, hi = self.buckets[bucket]
        gradients = [(samples, staged.pieces[bucket]) for samples, staged in usable]
        self.applied_bytes += update_bucket(self.store, lo, hi, gradients, expected, lr_scale)
        self._applied.add(bucket)
        recipients = [staged.identity for _, staged in usable if staged.in_parts]
        if self.on_bucket_applied is not None and recipients:
            self.on_bucket_applied(AppliedBucket(bucket, version + 1, recipients))
