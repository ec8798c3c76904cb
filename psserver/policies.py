"""Update policies over one parameter store: when a gradient is applied, and what each worker
computes next. Sync and async are two policies, not two servers.

Both walk the data in epochs. An epoch has a fixed roster: the workers training in it, whose
positions in the roster are their ranks. Shards (DistributedSampler style) are cut for that
roster, so a worker that joins or leaves changes the shards only from the next epoch on, and
no sample is doubled within an epoch. A worker that dies mid-epoch takes the rest of its
shard with it for that epoch.

- `SyncPolicy`: step t takes at most one gradient from each roster worker, all computed on
  version t and on batch t of their shards. The step closes when every live roster worker has
  pushed, or when `step_timeout` has passed and at least `min_workers` have; the gradients
  that arrived are averaged weighted by sample count and applied once. A gradient for a step
  that is already closed is late: it is dropped and counted, never applied to the wrong step.
- `AsyncPolicy`: each gradient is applied when it arrives; staleness (server version at apply
  time minus the version the gradient was computed on) is recorded. A worker that finished
  its shard waits for the epoch to end.

Gradient buckets (JobSpec.bucket_bounds) let the update start before the step is complete. A
worker may send its gradient bucket by bucket (PUSH_PART) while backward runs, and then a
PUSH that completes it. Sync sums each bucket on arrival and applies the optimizer to it as
soon as every live roster worker's part is in, so that only the first layers' update is left
when the last PUSH comes; `on_bucket_applied` lets the server send the updated bucket to the
workers whose parts it summed (psserver.streaming). Async applies each part as it arrives.
The arithmetic is the same as for a whole gradient. One thing differs when a worker fails
between its parts and its PUSH: each sync bucket is the sample-weighted mean of the parts
that reached it, and an async part that was applied stays applied.

Policies are driven from the server's single thread, so they hold no locks.
"""

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from common.data import shard_size, steps_per_epoch
from common.errors import RequestRejected
from common.job import JobSpec
from common.protocol import Push, PushPart
from psserver.store import ParameterStore, add_weighted

log = logging.getLogger("ps.server")
HOLD: Literal["hold"] = "hold"  # no work yet: answer the pull later
NO_INDICES = torch.empty(0, dtype=torch.int32)


@dataclasses.dataclass(frozen=True)
class Assignment:
    epoch: int
    batch: int
    rank: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class CommitOrder:
    """An update for the other shards to repeat on their slices (see protocol.Commit)."""

    version: int  # the store's version before the update
    entries: list[list[Any]]  # [worker_id, token, version, epoch, batch, samples] per gradient
    expected: int  # sync: the step's expected samples; 0 for async
    lr_scale: float = 1.0


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
        self.epochs, self.max_steps = epochs, max_steps
        self.plan: EpochPlan | None = None
        self.completed_epochs = 0
        self._live: set[int] = set()  # ids of the workers alive at the last tick

    def observe_live(self, live: set[int]) -> None:
        self._live = live

    def begin_epoch(self, roster: list[int]) -> EpochPlan:
        steps = steps_per_epoch(self.job.train_size, len(roster), self.job.batch_size)
        self.plan = EpochPlan(self.completed_epochs, tuple(roster), steps)
        log.info(
            "epoch %d begins: %d workers %s, %d steps per shard",
            self.plan.epoch,
            len(roster),
            list(roster),
            steps,
        )
        return self.plan

    def end_epoch(self) -> None:
        self.completed_epochs += 1
        self.plan = None

    def finished(self) -> bool:
        if self.max_steps is not None and self.store.version >= self.max_steps:
            return True
        return self.completed_epochs >= self.epochs

    def rank_of(self, worker_id: int) -> int | None:
        if self.plan is None or worker_id not in self.plan.roster:
            return None
        return self.plan.roster.index(worker_id)

    def live_roster(self, live: set[int]) -> list[int]:
        return [w for w in self.plan.roster if w in live] if self.plan else []


class SyncPolicy(EpochPolicy):
    def __init__(
        self,
        store: ParameterStore,
        job: JobSpec,
        epochs: int,
        max_steps: int | None,
        min_workers: int = 1,
        step_timeout: float = float("inf"),
    ) -> None:
        super().__init__(store, job, epochs, max_steps)
        self.min_workers, self.step_timeout = min_workers, step_timeout
        # While a step is open the weights change only in buckets that every roster worker has
        # pushed, so after its pull: pulls can get them uncopied.
        store.publish_live = True
        self.batch = 0  # the open step's batch index within the epoch
        self._resume_batch = 0  # where a resumed run continues in its first epoch
        self.step_opened = time.monotonic()
        # Gradients are summed on arrival into fixed buffers, so memory does not grow with N.
        # The sum is built in the store's own gradient buffer: applying it copies nothing. Each
        # push is scaled by samples / (samples expected in this step) as it is added, so the
        # sum is already the sample-weighted mean unless someone's gradient is missing.
        self._grad_sum = store.grads
        self._buffer_sum = torch.zeros(store.num_buffers)
        self._contributors: dict[int, int] = {}  # worker id -> samples, for the open step
        self._entries: list[list[Any]] = []  # the same pushes, in arrival order, for shards
        # Per bucket of the store's slice: whose gradient is in the sum (worker id ->
        # samples), and whether the optimizer has already applied it in this step.
        self._buckets = [job.bucket_range(b) for b in range(job.num_buckets)]
        self._bucket_samples: list[dict[int, int]] = [{} for _ in self._buckets]
        self._bucket_applied = [False] * len(self._buckets)
        self._part_senders: set[int] = set()  # who sent parts in this step: they get streams
        # Called with (bucket, the version it belongs to, worker ids) once a bucket is applied.
        self.on_bucket_applied: Callable[[int, int, list[int]], None] | None = None

    def begin_epoch(self, roster: list[int]) -> EpochPlan:
        plan = super().begin_epoch(roster)
        self.step_opened = time.monotonic()
        return plan

    def next_assignment(self, worker_id: int) -> Assignment | Literal["hold"] | None:
        if self.finished():
            return None
        rank = self.rank_of(worker_id)
        if rank is None or worker_id in self._contributors or self.epoch_done(set()):
            return HOLD
        assert self.plan is not None
        return Assignment(self.plan.epoch, self.batch, rank, len(self.plan.roster))

    def is_late(self, push: Push | PushPart) -> bool:
        return push.version < self.store.version

    def pending(self, worker_id: int) -> bool:
        return worker_id in self._contributors

    def _check_open(self, worker_id: int, version: int) -> None:
        if version != self.store.version:
            raise RequestRejected(
                "bad-version",
                f"gradient claims version {version}, the server is at {self.store.version}",
            )
        if worker_id in self._contributors:
            raise RequestRejected(
                "duplicate-push", f"worker {worker_id} already pushed for step {version}"
            )

    def on_part(self, worker_id: int, part: PushPart, live: set[int]) -> None:
        self._check_open(worker_id, part.version)
        self._add_to_bucket(part.bucket, worker_id, part.samples, part.grads, NO_INDICES)
        self._part_senders.add(worker_id)
        self._apply_ready_buckets(live)

    def on_push(self, worker_id: int, push: Push, live: set[int]) -> StepResult:
        self._check_open(worker_id, push.version)
        # With parts, the server has checked that every one of them came before this PUSH.
        if not push.parts and len(self._buckets) == 1:  # also top-k: indices span the slice
            self._add_to_bucket(0, worker_id, push.samples, push.grads, push.grad_indices)
        elif not push.parts:
            for bucket, (lo, hi) in enumerate(self._buckets):
                self._add_to_bucket(bucket, worker_id, push.samples, push.grads[lo:hi], NO_INDICES)
        if not self._contributors:
            self._buffer_sum.copy_(push.buffers)
        else:
            self._buffer_sum.add_(push.buffers)
        self._contributors[worker_id] = push.samples
        self._entries.append(commit_entry(worker_id, push))
        self._apply_ready_buckets(live)
        return self.try_close(live)

    def _add_to_bucket(
        self, bucket: int, worker_id: int, samples: int, grads: torch.Tensor, indices: torch.Tensor
    ) -> None:
        """Add a worker's gradient for one bucket, weighted by its share of the step's samples.

        A bucket already added (a part sent again) is ignored: it is the same gradient."""
        added = self._bucket_samples[bucket]
        if worker_id in added:
            return
        assert not self._bucket_applied[bucket], "every live worker's part was in"
        lo, hi = self._buckets[bucket]
        weight = samples / self._expected_samples()
        add_weighted(self._grad_sum[lo:hi], grads, indices, weight, not added, self.store.sparse)
        added[worker_id] = samples

    def _apply_ready_buckets(self, live: set[int]) -> None:
        """Apply every bucket that has the part of each live roster worker (and enough)."""
        roster = self.live_roster(live)
        for bucket, added in enumerate(self._bucket_samples):
            ready = len(added) >= self.min_workers and all(w in added for w in roster)
            if ready and not self._bucket_applied[bucket]:
                self._apply_bucket(bucket)

    def _apply_bucket(self, bucket: int) -> None:
        added, expected = self._bucket_samples[bucket], self._expected_samples()
        assert added, "a step closes only with every contributor's whole gradient"
        lo, hi = self._buckets[bucket]
        total = sum(added.values())
        if total != expected:  # someone is missing: renormalise to the samples that came
            self._grad_sum[lo:hi].mul_(expected / total)
        self.store.wait_for_sends()  # the live weights may still be on their way out
        self.store.apply_range(lo, hi)
        self._bucket_applied[bucket] = True
        recipients = [w for w in added if w in self._part_senders]
        if self.on_bucket_applied is not None and recipients:
            # The step closes as version + 1, whether this is an early bucket or the last.
            self.on_bucket_applied(bucket, self.store.version + 1, recipients)

    def try_close(self, live: set[int]) -> StepResult:
        """Close the open step if everyone alive has pushed, or if it timed out with enough."""
        if len(self._contributors) < self.min_workers:
            return StepResult(acknowledged=[])
        everyone = all(w in self._contributors for w in self.live_roster(live))
        timed_out = time.monotonic() - self.step_opened >= self.step_timeout
        if not (everyone or timed_out):
            return StepResult(acknowledged=[])
        if not everyone:
            missing = [w for w in self.live_roster(live) if w not in self._contributors]
            log.warning(
                "step %d closed after %.1f s without workers %s (%d of %d gradients)",
                self.store.version,
                self.step_timeout,
                missing,
                len(self._contributors),
                len(self.live_roster(live)),
            )
        commit = CommitOrder(self.store.version, list(self._entries), self._expected_samples())
        for bucket, applied in enumerate(self._bucket_applied):
            if not applied:
                self._apply_bucket(bucket)
        self.store.count_update()
        if self.store.num_buffers:
            self.store.set_buffers(self._buffer_sum.div_(len(self._contributors)))
        acknowledged = list(self._contributors)
        self._clear_step()
        self.batch += 1
        self.step_opened = time.monotonic()
        return StepResult(acknowledged=acknowledged, updates=1, commit=commit)

    def _clear_step(self) -> None:
        self._contributors.clear()
        self._entries.clear()
        self._part_senders.clear()
        for added in self._bucket_samples:
            added.clear()
        self._bucket_applied = [False] * len(self._buckets)

    def _expected_samples(self) -> int:
        """Samples in this step if every rank pushes: shards are padded to equal length."""
        assert self.plan is not None
        world = len(self.plan.roster)
        shard = shard_size(self.job.train_size, world)
        return world * max(1, min(self.job.batch_size, shard - self.batch * self.job.batch_size))

    def epoch_done(self, live: set[int]) -> bool:
        return self.plan is not None and self.batch >= self.plan.steps

    def stuck(self, live: set[int]) -> bool:
        """Too few live workers remain in this epoch's roster for any step to close."""
        return self.plan is not None and len(self.live_roster(live)) < self.min_workers

    def abandon_epoch(self) -> None:
        if self._contributors:
            log.warning("dropping %d gradients of the abandoned step", len(self._contributors))
        applied = [b for b, done in enumerate(self._bucket_applied) if done]
        if applied:  # their workers died after every part was in, before their PUSH
            log.warning(
                "step %d of the abandoned epoch was already applied to buckets %s; the "
                "weights keep that part of the update",
                self.store.version,
                applied,
            )
        self._clear_step()
        self.end_epoch()

    def end_epoch(self) -> None:
        super().end_epoch()
        self.batch = 0

    def position(self) -> dict[str, Any]:
        return {"epoch": self.completed_epochs, "batch": self.batch, "cursors": []}

    def restore(self, position: dict[str, Any]) -> None:
        self.completed_epochs = int(position["epoch"])
        self._resume_batch = int(position["batch"])

    def resume_into(self, plan: EpochPlan) -> None:
        self.batch = min(self._resume_batch, plan.steps)
        self._resume_batch = 0


class AsyncPolicy(EpochPolicy):
    def __init__(
        self,
        store: ParameterStore,
        job: JobSpec,
        epochs: int,
        max_steps: int | None,
        min_workers: int = 1,
        step_timeout: float = float("inf"),
        staleness_bound: int | None = None,
        staleness_lr: bool = True,
    ) -> None:
        super().__init__(store, job, epochs, max_steps)
        self.min_workers = min_workers
        # SSP: a worker may run at most this many steps ahead of the slowest live worker.
        self.staleness_bound = staleness_bound
        self.staleness_lr = staleness_lr
        self.cursors: dict[int, int] = {}  # worker id -> next batch in its shard this epoch
        self.staleness = collections.Counter[int]()
        self._resume_cursors: list[int] = []

    def begin_epoch(self, roster: list[int]) -> EpochPlan:
        plan = super().begin_epoch(roster)
        self.cursors = {w: 0 for w in roster}
        return plan

    def next_assignment(self, worker_id: int) -> Assignment | Literal["hold"] | None:
        if self.finished():
            return None
        rank = self.rank_of(worker_id)
        if rank is None:
            return HOLD
        assert self.plan is not None
        if self.cursors[worker_id] >= self.plan.steps:
            return HOLD  # this shard is done; wait for the epoch to end
        if self.staleness_bound is not None and self._too_far_ahead(worker_id):
            return HOLD  # SSP: wait for the slowest to catch up
        return Assignment(self.plan.epoch, self.cursors[worker_id], rank, len(self.plan.roster))

    def _too_far_ahead(self, worker_id: int) -> bool:
        assert self.staleness_bound is not None
        others = [self.cursors[w] for w in self.live_roster(self._live) if w != worker_id]
        return bool(others) and self.cursors[worker_id] - min(others) > self.staleness_bound

    def is_late(self, push: Push | PushPart) -> bool:
        return False  # staleness is measured, and shrinks the step, but is not punished

    def pending(self, worker_id: int) -> bool:
        return False

    def _staleness(self, version: int) -> tuple[int, float]:
        """How many updates old a gradient is, and the learning-rate factor that goes with it."""
        staleness = self.store.version - version
        if staleness < 0:
            raise RequestRejected(
                "bad-version",
                f"gradient claims version {version}, the server is at {self.store.version}",
            )
        # Staleness-aware learning rate: a gradient s updates old takes a step 1/s as long.
        return staleness, 1.0 / max(1, staleness) if self.staleness_lr else 1.0

    def on_part(self, worker_id: int, part: PushPart, live: set[int]) -> None:
        _, lr_scale = self._staleness(part.version)
        lo, hi = self.job.bucket_range(part.bucket)
        self.store.grads[lo:hi].copy_(part.grads)
        self.store.apply_range(lo, hi, lr_scale)

    def on_push(self, worker_id: int, push: Push, live: set[int]) -> StepResult:
        staleness, lr_scale = self._staleness(push.version)
        commit = CommitOrder(self.store.version, [commit_entry(worker_id, push)], 0, lr_scale)
        if push.parts:  # applied part by part as they came
            self.store.count_update()
        else:
            self.store.apply_gradient(push.grads, push.grad_indices, lr_scale)
        if self.store.num_buffers:
            # Running average: each push moves the master statistics 1/N of the way.
            roster_size = len(self.plan.roster) if self.plan else 1
            self.store.blend_buffers(push.buffers, 1.0 / roster_size)
        self.staleness[staleness] += 1
        self.cursors[worker_id] += 1
        return StepResult(acknowledged=[worker_id], staleness=staleness, updates=1, commit=commit)

    def try_close(self, live: set[int]) -> StepResult:
        return StepResult(acknowledged=[])

    def epoch_done(self, live: set[int]) -> bool:
        if self.plan is None:
            return False
        return all(self.cursors[w] >= self.plan.steps for w in self.live_roster(live))

    def stuck(self, live: set[int]) -> bool:
        return self.plan is not None and not self.live_roster(live)

    def abandon_epoch(self) -> None:
        self.end_epoch()

    def position(self) -> dict[str, Any]:
        roster = self.plan.roster if self.plan else ()
        return {
            "epoch": self.completed_epochs,
            "batch": 0,
            "cursors": [self.cursors.get(w, 0) for w in roster],
        }

    def restore(self, position: dict[str, Any]) -> None:
        self.completed_epochs = int(position["epoch"])
        self._resume_cursors = [int(c) for c in position.get("cursors", [])]

    def resume_into(self, plan: EpochPlan) -> None:
        # Each rank continues where the rank of the same number stopped; with another number
        # of workers the shards differ, so the epoch starts over.
        if len(self._resume_cursors) == len(plan.roster):
            self.cursors = dict(zip(plan.roster, self._resume_cursors, strict=True))
        self._resume_cursors = []

    def staleness_summary(self) -> dict[str, object]:
        total = sum(self.staleness.values())
        if total == 0:
            return {"count": 0, "mean": 0.0, "max": 0, "histogram": {}}
        mean = sum(k * v for k, v in self.staleness.items()) / total
        return {
            "count": total,
            "mean": mean,
            "max": max(self.staleness),
            "histogram": {str(k): v for k, v in sorted(self.staleness.items())},
        }


UpdatePolicy = SyncPolicy | AsyncPolicy


def make_policy(
    mode: str,
    store: ParameterStore,
    job: JobSpec,
    epochs: int,
    max_steps: int | None,
    min_workers: int,
    step_timeout: float,
    staleness: int = 2,
    staleness_lr: bool = True,
) -> UpdatePolicy:
    if mode == "sync":
        return SyncPolicy(store, job, epochs, max_steps, min_workers, step_timeout)
    bound = staleness if mode == "ssp" else None
    return AsyncPolicy(
        store, job, epochs, max_steps, min_workers, step_timeout, bound, staleness_lr
    )
