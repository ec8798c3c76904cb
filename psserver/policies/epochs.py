"""What both update policies share: the epoch plan and roster, the end conditions, and the
small records a policy hands the server (a step's result, a commit order; the assignment it
hands a worker is common.assignment's).

See psserver.policies for how sync and async use them.
"""

import dataclasses
import logging
from typing import Any, Literal

import torch

from common.assignment import sample_assignment
from common.job import JobSpec
from common.logs import counted
from common.wire.protocol import Push
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")
HOLD: Literal["hold"] = "hold"  # no work yet: answer the pull later
NO_INDICES = torch.empty(0, dtype=torch.int32)


def resumed_batch(batch: int, saved_world: int, world: int) -> int:
    """Where an epoch resumed with `world` workers goes on, when `batch` steps of it were done
    with `saved_world` workers.

    A sync step b of N workers takes the contiguous block perm[N·B·b : N·B·(b+1)] of the
    epoch's permutation (rank r takes every N-th sample from r, as DistributedSampler does),
    so `batch` steps took its first saved_world·B·batch samples. With another N the epoch
    goes on at the step whose block starts there, or, when none does, at the one before:
    fewer than N·B samples are then seen twice, and none is skipped.

    That bound is sync's. Async workers' cursors differ; the caller passes the slowest, so
    every sample the faster ones had gone past it is seen again as well (none is skipped)."""
    if saved_world <= 0 or saved_world == world or batch == 0:
        return batch  # the same roster size (or a checkpoint that did not record it)
    resumed = batch * saved_world // world
    log.info(
        "the checkpoint's epoch had done %s of %s; with %d it goes on at step %d",
        counted(batch, "step"), counted(saved_world, "worker"), world, resumed,
    )  # fmt: skip
    return resumed


@dataclasses.dataclass(frozen=True)
class CommitOrder:
    """An update for the other shards to repeat on their slices (see protocol.Commit)."""

    version: int  # the store's version before the update
    entries: list[list[Any]]  # [worker_id, token, version, epoch, batch, samples] per gradient
    expected: int  # sync: the step's expected samples; 0 for async
    lr_scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class OpenStep:
    """The sync step under way, for the follower shards (see protocol.StepPlan)."""

    version: int
    epoch: int
    batch: int
    expected: int  # samples, if every rank pushes
    share: int  # samples each worker's gradient must be over
    workers: tuple[int, ...]  # the live roster when the step opened, by rank

    @property
    def key(self) -> tuple[int, int, int]:
        return (self.version, self.epoch, self.batch)


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a push or a timer led to: whose pushes are now acknowledged, and the update."""

    acknowledged: list[int]  # worker ids
    staleness: int = 0
    updates: int = 0
    commit: CommitOrder | None = None


def commit_entry(worker_id: int, push: Push) -> list[Any]:
    return [worker_id, push.token, push.version, push.epoch, push.batch, push.samples]


@dataclasses.dataclass(frozen=True)
class EpochPlan:
    epoch: int
    roster: tuple[int, ...]  # worker ids; the index is the rank
    steps: int  # batches in each shard this epoch


class EpochPolicy:
    """What both policies share: the epoch plan, the end conditions, the data position."""

    def __init__(self, store: ParameterStore, job: JobSpec, epochs: int, max_steps: int | None):
        self.store, self.job = store, job
        # Which samples each rank's batch holds (common.assignment): the steps of an epoch.
        self.samples = sample_assignment(job.train_size, job.batch_size, job.seed)
        self.epochs, self.max_steps = epochs, max_steps
        self.plan: EpochPlan | None = None
        self.completed_epochs = 0  # epochs ended, trained to the end or abandoned
        # Epochs ended early for want of workers: they do not count toward --epochs, so a job
        # whose workers are all lost in its last epoch waits for new ones rather than ending
        # as if it had trained.
        self.abandoned_epochs = 0
        self._live: set[int] = set()  # ids of the workers alive at the last tick

    def observe_live(self, live: set[int]) -> None:
        self._live = live

    def begin_epoch(self, roster: list[int]) -> EpochPlan:
        steps = self.samples.steps(len(roster))
        self.plan = EpochPlan(self.completed_epochs, tuple(roster), steps)
        log.info(
            "epoch %d begins: %s %s, %s per shard",
            self.plan.epoch,
            counted(len(roster), "worker"),
            list(roster),
            counted(steps, "step"),
        )
        return self.plan

    def end_epoch(self, abandoned: bool = False) -> None:
        self.completed_epochs += 1
        self.abandoned_epochs += abandoned
        self.plan = None

    @property
    def full_epochs(self) -> int:
        """Epochs trained to the end: what --epochs counts."""
        return self.completed_epochs - self.abandoned_epochs

    def finished(self) -> bool:
        if self.max_steps is not None and self.store.version >= self.max_steps:
            return True
        return self.full_epochs >= self.epochs

    def epoch_position(self) -> dict[str, int]:
        """The epoch counts of a checkpoint's data position."""
        return {"epoch": self.completed_epochs, "abandoned": self.abandoned_epochs}

    def restore_epochs(self, position: dict[str, Any]) -> None:
        self.completed_epochs = int(position["epoch"])
        self.abandoned_epochs = int(position.get("abandoned", 0))  # older checkpoints: none

    def rank_of(self, worker_id: int) -> int | None:
        if self.plan is None or worker_id not in self.plan.roster:
            return None
        return self.plan.roster.index(worker_id)

    def live_roster(self, live: set[int]) -> list[int]:
        return [w for w in self.plan.roster if w in live] if self.plan else []
