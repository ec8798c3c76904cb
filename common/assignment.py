"""Which samples a worker trains next: the sample-assignment seam.

The leader hands each worker an `Assignment` with the weights it pulls (epoch, batch, rank
and world size, the fields of WEIGHTS), and a push names the (epoch, batch) it was computed
for (`Assignment.key`). A `SampleAssignment` turns that into samples, the same on both sides:

- the leader's side (psserver.policies): `steps(world_size)`, the batches each worker trains
  in an epoch of that many workers, and `share(batch, world_size)`, the samples in each
  worker's batch (what a sync step weighs every gradient by);
- the worker's side (psworker.batches): `indices(assignment)`, the sample indices it trains.

`StaticShards` is the one implementation, and `sample_assignment` the one factory: a static
shard per epoch, as torch's DistributedSampler cuts it. One permutation per epoch seeded
with `seed + epoch`, padded by wrapping to a multiple of the world size, and rank r takes
`perm[r::world_size]`; batch k is the k-th slice of `batch_size` of that. Batch k of every
rank together is exactly batch k of a single worker with a batch size world_size times
larger, which is what makes sync training equal to single-process training. (When
world_size does not divide the set, the last step also holds the few padding samples, which
are repeats, that the single worker's last batch lacks.)

What it is not: the data itself (common.catalog, common.data), nor when a worker gets work
(the policies: sync's steps, async's cursors, the epoch's roster).
"""

import dataclasses
import math
from typing import Protocol

import torch


@dataclasses.dataclass(frozen=True)
class Assignment:
    """One batch for one worker: what the leader hands out with the weights."""

    epoch: int
    batch: int  # the step within the epoch
    rank: int  # the worker's index in the epoch's roster
    world_size: int  # workers in the epoch's roster

    @property
    def key(self) -> tuple[int, int]:
        """What a push names to say which assignment it was computed for."""
        return (self.epoch, self.batch)


class SampleAssignment(Protocol):
    """How an epoch's samples are dealt out to the workers, batch by batch."""

    def steps(self, world_size: int) -> int:
        """Batches each of `world_size` workers trains in one epoch."""

    def share(self, batch: int, world_size: int) -> int:
        """Samples in each worker's batch `batch` of an epoch of `world_size` workers."""

    def indices(self, assignment: Assignment) -> torch.Tensor:
        """The sample indices of the assigned batch, (B,) int64."""


def sample_assignment(
    num_samples: int, batch_size: int, seed: int, device: torch.device | None = None
) -> SampleAssignment:
    """How this job deals out its `num_samples` training samples; `device` is where the
    worker wants the indices (the CPU by default)."""
    return StaticShards(num_samples, batch_size, seed, device or torch.device("cpu"))


class StaticShards:
    """A static shard of every epoch per rank (see the module's docstring). The shard is drawn
    again only when the epoch, rank or world size changes."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, device: torch.device):
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.device = device
        self._key = (-1, -1, -1)  # (epoch, rank, world size) of the shard below
        self._shard = torch.empty(0, dtype=torch.long)

    def steps(self, world_size: int) -> int:
        return steps_per_epoch(self.num_samples, world_size, self.batch_size)

    def share(self, batch: int, world_size: int) -> int:
        # Shards are padded to equal length, so every rank's batch has the same size.
        shard = shard_size(self.num_samples, world_size)
        return max(1, min(self.batch_size, shard - batch * self.batch_size))

    def indices(self, assignment: Assignment) -> torch.Tensor:
        key = (assignment.epoch, assignment.rank, assignment.world_size)
        if key != self._key:
            self._key = key
            self._shard = shard_indices(
                self.num_samples, assignment.epoch, self.seed, assignment.rank,
                assignment.world_size,
            ).to(self.device)  # fmt: skip
        return batch_slice(self._shard, assignment.batch, self.batch_size)  # (B,)


def shard_size(num_samples: int, world_size: int) -> int:
    return math.ceil(num_samples / world_size)


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    return math.ceil(shard_size(num_samples, world_size) / batch_size)


def shard_indices(
    num_samples: int, epoch: int, seed: int, rank: int, world_size: int
) -> torch.Tensor:
    """This rank's sample indices for an epoch, exactly as DistributedSampler(shuffle=True)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    perm = torch.randperm(num_samples, generator=generator)  # (N,)
    total = shard_size(num_samples, world_size) * world_size
    if total > num_samples:  # wrap around so every rank gets the same number of samples
        repeats = math.ceil((total - num_samples) / num_samples)
        perm = torch.cat([perm, perm.repeat(repeats)[: total - num_samples]])
    return perm[rank:total:world_size]


def batch_slice(shard: torch.Tensor, batch: int, batch_size: int) -> torch.Tensor:
    """Indices of batch `batch` of a shard; the last batch of an epoch may be short."""
    return shard[batch * batch_size : (batch + 1) * batch_size]
