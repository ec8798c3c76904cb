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
worker may send its gradient bucket by bucket (a PUSH per bucket) while backward runs, and
then a PUSH that completes it. Sync sums each bucket on arrival and applies the optimizer to it as
soon as every live roster worker's part is in, so that only the first layers' update is left
when the last PUSH comes; `on_bucket_applied` lets the server send the updated bucket to the
workers whose parts it summed (psserver.serving.streaming). Async applies each part as it arrives.
The arithmetic is the same as for a whole gradient. One thing differs when a worker fails
between its parts and its PUSH: each sync bucket is the sample-weighted mean of the parts
that reached it, and an async part that was applied stays applied.

Policies are driven from the server's single thread, so they hold no locks.
"""

from common.assignment import Assignment
from common.job import JobSpec
from psserver.policies.asynchronous import AsyncPolicy
from psserver.policies.epochs import (
    HOLD,
    CommitOrder,
    EpochPlan,
    OpenStep,
    StepResult,
)
from psserver.policies.sync import SyncPolicy
from psserver.store.parameters import ParameterStore

__all__ = [
    "HOLD",
    "Assignment",
    "AsyncPolicy",
    "CommitOrder",
    "EpochPlan",
    "OpenStep",
    "StepResult",
    "SyncPolicy",
    "UpdatePolicy",
    "make_policy",
]

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
    # An async job has no step to close: --step-timeout is sync's alone (ps-server warns).
    return AsyncPolicy(store, job, epochs, max_steps, min_workers, bound, staleness_lr)
