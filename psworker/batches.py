"""Which samples a step trains on: the batch the server assigned, turned into sample indices
by the job's sample assignment (common.assignment); and how many steps the progress bar
counts. It chooses nothing itself: the server says the epoch, batch, rank and world size
(see psserver.policies)."""

import torch

from common.assignment import Assignment, sample_assignment
from common.errors import ServerError
from common.job import JobSpec
from common.wire.protocol import Weights


def planned_steps(job: JobSpec) -> int:
    """The most steps this worker can compute, for its progress bar: its shard of every epoch,
    and no more than --max-steps. (In async mode the steps are not shared out evenly: a fast
    worker computes more of --max-steps than a slow one, so an even share undercounted.)"""
    return capped_by_max_steps(job, job.epochs * job.steps_per_epoch)


def planned_sync_steps(job: JobSpec, reply: Weights) -> int:
    """In sync mode, planned_steps again once an epoch's roster is known: a worker that joins
    a job of 2 --workers as its third counted 16 steps an epoch where there were 11 ("step
    33/48" in a job that ended at 43). The steps before this epoch (the version less the
    batches of this one), and this epoch and the rest cut for this epoch's world size. An
    abandoned epoch does not count toward --epochs, and the worker cannot tell one: the
    count assumes at least this epoch is still to go."""
    steps = sample_assignment(job.train_size, job.batch_size, job.seed).steps(reply.world_size)
    return capped_by_max_steps(
        job, reply.version - reply.batch + steps * max(1, job.epochs - reply.epoch)
    )


def capped_by_max_steps(job: JobSpec, total: int) -> int:
    return total if job.max_steps is None else min(total, job.max_steps)


class BatchPicker:
    """The sample indices, on the worker's device, of the batch the server assigned."""

    def __init__(self, job: JobSpec, device: torch.device) -> None:
        self.samples = sample_assignment(job.train_size, job.batch_size, job.seed, device)

    def pick(self, reply: Weights) -> torch.Tensor:
        world = reply.world_size
        steps = self.samples.steps(world) if world >= 1 else 0
        if not (reply.epoch >= 0 and 0 <= reply.rank < world and 0 <= reply.batch < steps):
            raise ServerError(
                f"the server assigned batch {reply.batch} of rank {reply.rank} of "
                f"{reply.world_size} in epoch {reply.epoch}, which this job does not have; run "
                "the same release of ps-server and ps-worker"
            )
        assignment = Assignment(reply.epoch, reply.batch, reply.rank, world)
        return self.samples.indices(assignment)  # (B,)
