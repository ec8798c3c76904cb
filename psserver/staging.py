"""A follower shard's staging area: gradient slices wait here until the leader commits them.

A worker's SLICE_PUSH is staged under (worker id, token), one per worker, zero-copy (the
tensors are views of the received frames). The leader's COMMITs queue in order; the head one
is applied as soon as every slice it names is staged, with exactly the arithmetic the leader
used on its own slice (psserver.store.add_weighted, in the leader's order), so every shard
computes bit for bit what one server would. A slice that does not come within `slice_wait`
seconds (its worker died between its pushes) is left out and the rest renormalised, as the
leader does for a worker missing from a step.
"""

import collections
import dataclasses
import logging
import time
from typing import Any

import torch

from common.errors import PSError
from common.protocol import Commit
from psserver.store import SliceStore, add_weighted

log = logging.getLogger("ps.shard")


@dataclasses.dataclass
class StagedSlice:
    key: tuple[int, int, int]  # (version, epoch, batch) of the push
    values: torch.Tensor | None  # None: the shard refused the slice (a commit skips it)
    indices: torch.Tensor


class SliceStaging:
    def __init__(self, store: SliceStore, capacity: int, slice_wait: float, shard: int) -> None:
        self.store, self.capacity, self.slice_wait, self.shard = store, capacity, slice_wait, shard
        # (worker id, token) -> its latest slice. The token is part of the key, so a push
        # under a stolen worker id cannot displace the real worker's slice.
        self.staged: dict[tuple[int, str], StagedSlice] = {}
        self.commits: collections.deque[tuple[float, Commit]] = collections.deque()

    def stage(self, worker_id: int, token: str, staged: StagedSlice) -> None:
        self.staged.pop((worker_id, token), None)
        self.staged[worker_id, token] = staged  # latest last: eviction drops the oldest
        while len(self.staged) > self.capacity:
            del self.staged[next(iter(self.staged))]

    def add_commit(self, commit: Commit) -> None:
        self.commits.append((time.monotonic(), commit))

    def apply_ready(self) -> None:
        """Apply the queued commits whose slices are all here (or waited for long enough)."""
        while self.commits:
            arrived, commit = self.commits[0]
            if commit.version != self.store.version:
                raise PSError(
                    f"shard {self.shard} is at step {self.store.version} but the leader "
                    f"committed step {commit.version}; the shards are out of step: restart the "
                    "job with --resume"
                )
            found = [self._take(entry, remove=False) for entry in commit.entries]
            missing = [e[0] for e, s in zip(commit.entries, found, strict=True) if s is None]
            if missing and time.monotonic() - arrived < self.slice_wait:
                return  # the slices may still be on their way
            if missing:
                log.warning(
                    "step %d: no slice from workers %s after %.1f s; applied without them",
                    commit.version, missing, self.slice_wait,
                )  # fmt: skip
            self._apply(commit, [self._take(entry, remove=True) for entry in commit.entries])
            self.commits.popleft()

    def _take(self, entry: list[Any], remove: bool) -> StagedSlice | None:
        worker_id, token, version, epoch, batch = entry[:5]
        staged = self.staged.get((worker_id, token))
        if staged is None or staged.key != (version, epoch, batch):
            return None
        if remove:
            del self.staged[worker_id, token]
        return staged

    def _apply(self, commit: Commit, found: list[StagedSlice | None]) -> None:
        usable = [
            (int(entry[5]), s.values, s.indices)
            for entry, s in zip(commit.entries, found, strict=True)
            if s is not None and s.values is not None
        ]
        store = self.store
        store.wait_for_sends()  # the live slice may still be on its way to a worker
        if commit.expected == 0:  # async: one gradient, applied as it is
            if usable:
                _, values, indices = usable[0]
                store.apply_gradient(values, indices, commit.lr_scale)
            else:
                store.version += 1  # keep the step count in line with the leader
            return
        total = 0
        for position, (samples, values, indices) in enumerate(usable):
            weight = samples / commit.expected
            add_weighted(store.grads, values, indices, weight, position == 0, store.sparse)
            total += samples
        if not usable:
            store.grads.zero_()
        elif total != commit.expected:  # renormalise to the samples that came, as the leader
            store.grads.mul_(commit.expected / total)
        store.apply_accumulated_gradient(commit.lr_scale)
