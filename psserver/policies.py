"""Update policies over one parameter store: when a gradient is applied, and what each worker
computes next. Sync and async are two policies, not two servers.

- `SyncPolicy`: global step t takes exactly one gradient from each of the N workers, all
  computed on version t and on batch t of their shards; it averages them weighted by sample
  count, applies them once, and only then acknowledges the pushes.
- `AsyncPolicy`: each gradient is applied when it arrives; staleness (server version at apply
  time minus the version the gradient was computed on) is recorded. Each worker walks its own
  shard, epoch after epoch.

Policies are driven from the server's single thread, so they hold no locks.
"""

import collections
import dataclasses
from typing import Protocol

import torch

from common.errors import RequestRejected
from common.job import JobSpec
from common.protocol import Push
from psserver.store import ParameterStore


@dataclasses.dataclass(frozen=True)
class Assignment:
    epoch: int
    batch: int


@dataclasses.dataclass
class StepResult:
    """What a push led to: whose pushes are now acknowledged, and how many updates happened."""

    acknowledged: list[int]  # worker ids
    staleness: int
    updates: int


class UpdatePolicy(Protocol):
    def next_assignment(self, worker_id: int) -> Assignment | None: ...
    def on_push(self, worker_id: int, push: Push) -> StepResult: ...
    def completed_epochs(self) -> int: ...
    def finished(self) -> bool: ...
    def restore(self, version: int) -> None: ...


class SyncPolicy:
    def __init__(self, store: ParameterStore, job: JobSpec, epochs: int, max_steps: int | None):
        self.store, self.job = store, job
        self.total_steps = epochs * job.steps_per_epoch
        if max_steps is not None:
            self.total_steps = min(self.total_steps, max_steps)
        # Gradients are summed on arrival into fixed buffers, so memory does not grow with N.
        self._grad_sum = torch.zeros(store.num_params)
        self._buffer_sum = torch.zeros(store.num_buffers)
        self._contributors: dict[int, int] = {}  # worker id -> samples, for the open step

    def next_assignment(self, worker_id: int) -> Assignment | None:
        if self.finished():
            return None
        epoch, batch = divmod(self.store.version, self.job.steps_per_epoch)
        return Assignment(epoch, batch)

    def on_push(self, worker_id: int, push: Push) -> StepResult:
        if push.version != self.store.version:
            raise RequestRejected(
                "stale-push",
                f"gradient for version {push.version} arrived at version {self.store.version}; "
                "it was dropped, pull the current weights",
            )
        if worker_id in self._contributors:
            raise RequestRejected(
                "duplicate-push", f"worker {worker_id} already pushed for step {push.version}"
            )
        self._grad_sum.add_(push.grads, alpha=float(push.samples))
        self._buffer_sum.add_(push.buffers)
        self._contributors[worker_id] = push.samples
        if len(self._contributors) < self.job.world_size:
            return StepResult(acknowledged=[], staleness=0, updates=0)

        total = sum(self._contributors.values())
        self.store.apply_gradient(self._grad_sum.div_(total))  # sample-weighted mean
        if self.store.num_buffers:
            self.store.set_buffers(self._buffer_sum.div_(len(self._contributors)))
        acknowledged = list(self._contributors)
        self._grad_sum.zero_()
        self._buffer_sum.zero_()
        self._contributors.clear()
        return StepResult(acknowledged=acknowledged, staleness=0, updates=1)

    def completed_epochs(self) -> int:
        return self.store.version // self.job.steps_per_epoch

    def finished(self) -> bool:
        return self.store.version >= self.total_steps

    def restore(self, version: int) -> None:
        pass  # the data position follows from the version


class AsyncPolicy:
    def __init__(self, store: ParameterStore, job: JobSpec, epochs: int, max_steps: int | None):
        self.store, self.job = store, job
        self.batches_per_worker = epochs * job.steps_per_epoch
        self.max_updates = max_steps
        self.completed: dict[int, int] = {}  # worker id -> batches pushed and applied
        self.staleness = collections.Counter[int]()
        self._start_batch = 0

    def next_assignment(self, worker_id: int) -> Assignment | None:
        done = self.completed.setdefault(worker_id, self._start_batch)
        if self.finished() or done >= self.batches_per_worker:
            return None
        epoch, batch = divmod(done, self.job.steps_per_epoch)
        return Assignment(epoch, batch)

    def on_push(self, worker_id: int, push: Push) -> StepResult:
        staleness = self.store.version - push.version
        if staleness < 0:
            raise RequestRejected(
                "bad-version",
                f"gradient claims version {push.version}, the server is at {self.store.version}",
            )
        self.store.apply_gradient(push.grads)
        if self.store.num_buffers:
            # Running average: each worker moves the master statistics 1/N of the way.
            self.store.blend_buffers(push.buffers, 1.0 / self.job.world_size)
        self.staleness[staleness] += 1
        self.completed[worker_id] = self.completed.get(worker_id, self._start_batch) + 1
        return StepResult(acknowledged=[worker_id], staleness=staleness, updates=1)

    def completed_epochs(self) -> int:
        if len(self.completed) < self.job.world_size:
            return self._start_batch // self.job.steps_per_epoch
        return min(self.completed.values()) // self.job.steps_per_epoch

    def finished(self) -> bool:
        if self.max_updates is not None and self.store.version >= self.max_updates:
            return True
        return len(self.completed) >= self.job.world_size and all(
            done >= self.batches_per_worker for done in self.completed.values()
        )

    def restore(self, version: int) -> None:
        # Resume at the start of the epoch the checkpoint was in: every worker's position is
        # not in the checkpoint yet, so the partial epoch is redone.
        per_epoch = self.job.steps_per_epoch * self.job.world_size
        self._start_batch = (version // per_epoch) * self.job.steps_per_epoch

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


def make_policy(
    mode: str, store: ParameterStore, job: JobSpec, epochs: int, max_steps: int | None
) -> SyncPolicy | AsyncPolicy:
    if mode == "sync":
        return SyncPolicy(store, job, epochs, max_steps)
    return AsyncPolicy(store, job, epochs, max_steps)
