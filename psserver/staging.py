"""A follower shard's staging area: gradient slices wait here until the leader commits them.

A worker's SLICE_PUSH is staged under (worker id, token), one per worker, zero-copy (the
tensors are views of the received frames): either the whole slice, or bucket by bucket
(JobSpec.shard_buckets) as the worker's backward produces them. The leader's COMMITs queue in
order. Each bucket of the head commit is applied as soon as every slice it names has that
bucket, with exactly the arithmetic the leader used on its own slice
(psserver.store.add_weighted, in the leader's order), so every shard computes bit for bit what
one server would. Buckets are independent: the optimizer is elementwise, so the last layers'
bucket may be applied (and streamed back) while the first layers' is still on its way. Once
every bucket is applied the slice moves to the next version.

A bucket that does not come within `slice_wait` seconds of the commit (its worker died between
its pushes) is left out and the rest renormalised, as the leader does for a worker missing
from a step.
"""

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from common.errors import PSError
from common.protocol import Commit
from psserver.store import SliceStore, add_weighted

log = logging.getLogger("ps.shard")
Piece = tuple[torch.Tensor, torch.Tensor]  # (values, indices) of one bucket


@dataclasses.dataclass
class StagedSlice:
    key: tuple[int, int, int]  # (version, epoch, batch) of the push
    identity: bytes  # the connection it came on: applied buckets are streamed back there
    pieces: dict[int, Piece]  # bucket -> its gradient; a whole push fills every bucket
    refused: bool = False  # the shard refused a push of it: a commit skips it
    in_parts: bool = False  # sent bucket by bucket, so it is worth streaming back

    def complete(self, num_buckets: int) -> bool:
        return not self.refused and len(self.pieces) == num_buckets


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
        # (worker id, token) -> its latest slice. The token is part of the key, so a push
        # under a stolen worker id cannot displace the real worker's slice.
        self.staged: dict[tuple[int, str], StagedSlice] = {}
        self.commits: collections.deque[tuple[float, Commit]] = collections.deque()
        self._applied: set[int] = set()  # buckets of the head commit already applied
        self.on_bucket_applied: Callable[[AppliedBucket], None] | None = None

    def stage(
        self,
        worker_id: int,
        token: str,
        key: tuple[int, int, int],
        identity: bytes,
        bucket: int,
        piece: Piece | None,
    ) -> StagedSlice:
        """Stage a worker's slice (bucket -1) or one bucket of it; piece None: refused. Returns
        what is staged for it now."""
        staged = self.staged.pop((worker_id, token), None)
        if staged is None or staged.key != key or bucket < 0:
            staged = StagedSlice(key, identity, {})
        staged.identity = identity  # a worker that reconnected gets its buckets on the new one
        if piece is None:
            staged.refused = True
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
        self.staged[worker_id, token] = staged  # latest last: eviction drops the oldest
        while len(self.staged) > self.capacity:
            del self.staged[next(iter(self.staged))]
        return staged

    def refused(self, worker_id: int, token: str, key: tuple[int, int, int]) -> bool:
        """Whether a push of this slice was refused already."""
        staged = self.staged.get((worker_id, token))
        return staged is not None and staged.key == key and staged.refused

    @property
    def mid_commit(self) -> bool:
        """Some buckets of the head commit are applied and some not: the slice is torn."""
        return bool(self._applied)

    def add_commit(self, commit: Commit) -> None:
        self.commits.append((time.monotonic(), commit))

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
                self._apply_bucket(commit, bucket, found)
            if len(self._applied) < len(self.buckets):
                return
            for entry in commit.entries:
                self._drop(entry)
            self._applied = set()
            self.store.count_update()
            self.commits.popleft()

    def _find(self, entry: list[Any]) -> StagedSlice | None:
        worker_id, token, version, epoch, batch = entry[:5]
        staged = self.staged.get((worker_id, token))
        if staged is None or staged.key != (version, epoch, batch):
            return None
        return staged

    def _drop(self, entry: list[Any]) -> None:
        if self._find(entry) is not None:
            del self.staged[entry[0], entry[1]]

    def _apply_bucket(self, commit: Commit, bucket: int, found: list[StagedSlice | None]) -> None:
        usable = [
            (int(entry[5]), staged)
            for entry, staged in zip(commit.entries, found, strict=True)
            if staged is not None and not staged.refused and bucket in staged.pieces
        ]
        store = self.store
        lo, hi = self.buckets[bucket]
        grads = store.grads[lo:hi]
        store.wait_for_sends(lo, hi)  # the live slice may still be on its way to a worker
        if commit.expected == 0:  # async: one gradient, applied as it is
            if usable:  # as SliceStore.apply_gradient, for this range
                values, indices = usable[0][1].pieces[bucket]
                if store.sparse:
                    add_weighted(grads, values, indices, 1.0, True, True)
                else:
                    grads.copy_(values)
                store.apply_range(lo, hi, commit.lr_scale)
        else:
            total = 0
            for position, (samples, staged) in enumerate(usable):
                values, indices = staged.pieces[bucket]
                weight = samples / commit.expected
                add_weighted(grads, values, indices, weight, position == 0, store.sparse)
                total += samples
            if not usable:
                grads.zero_()
            elif total != commit.expected:  # renormalise to the samples that came, as the leader
                grads.mul_(commit.expected / total)
            store.apply_range(lo, hi, commit.lr_scale)
        self._applied.add(bucket)
        recipients = [staged.identity for _, staged in usable if staged.in_parts]
        if self.on_bucket_applied is not None and recipients:
            self.on_bucket_applied(AppliedBucket(bucket, commit.version + 1, recipients))
