"""The async policy (and SSP, its bounded-staleness form): each gradient is applied as it
arrives, with a learning rate scaled down by its staleness; a worker too far ahead of the
slowest waits (see psserver.policies).
"""

import collections
import logging
from typing import Any, Literal

from common.assignment import Assignment
from common.errors import RequestRejected
from common.job import JobSpec
from common.wire.protocol import Push
from psserver.policies.epochs import (
    HOLD,
    CommitOrder,
    EpochPlan,
    EpochPolicy,
    OpenStep,
    StepResult,
    commit_entry,
    resumed_batch,
)
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")


class AsyncPolicy(EpochPolicy):
    def __init__(
        self,
        store: ParameterStore,
        job: JobSpec,
        epochs: int,
        max_steps: int | None,
        min_workers: int = 1,
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
        # Worker id -> ((epoch, batch), staleness, lr scale) of the push its first part began:
        # every part, the PUSH and the followers' COMMIT use that one learning rate, however
        # far the version moves while the parts come.
        self._begun: dict[int, tuple[tuple[int, int], int, float]] = {}

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

    def open_step(self, live: set[int]) -> OpenStep | None:
        return None  # each gradient is its own update: the COMMIT comes as it is applied

    def is_late(self, push: Push) -> bool:
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

    def _push_staleness(self, worker_id: int, message: Push) -> tuple[int, float]:
        """The staleness and lr scale of the push this part or PUSH belongs to: fixed by its
        first part (a step computed again after "incomplete-push" keeps those of the parts
        applied the first time)."""
        measured = self._staleness(message.version)  # also refuses a version from the future
        begun = self._begun.get(worker_id)
        if begun is not None and begun[0] == (message.epoch, message.batch):
            return begun[1], begun[2]
        return measured

    def on_part(self, worker_id: int, part: Push, live: set[int]) -> bool:
        """Apply one bucket of a worker's gradient at once; never late (see is_late)."""
        staleness, lr_scale = self._push_staleness(worker_id, part)
        self._begun[worker_id] = ((part.epoch, part.batch), staleness, lr_scale)
        lo, hi = self.job.bucket_range(part.bucket)
        self.store.grads[lo:hi].copy_(part.grads)
        self.store.apply_range(lo, hi, lr_scale)
        return True

    def on_push(self, worker_id: int, push: Push, live: set[int]) -> StepResult:
        staleness, lr_scale = self._push_staleness(worker_id, push)
        self._begun.pop(worker_id, None)
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
        # The live workers' shares, or, with none of the roster left, everyone's: an epoch
        # whose workers all died before their shares were done is stuck, not done.
        roster = self.live_roster(live) or self.plan.roster
        return all(self.cursors.get(w, 0) >= self.plan.steps for w in roster)

    def stuck(self, live: set[int]) -> bool:
        return self.plan is not None and not self.live_roster(live)

    def abandon_epoch(self) -> list[int]:
        self.end_epoch(abandoned=True)
        return []  # every push was answered as it was applied

    def position(self) -> dict[str, Any]:
        roster = self.plan.roster if self.plan else ()
        return {
            **self.epoch_position(),
            "batch": 0,
            "cursors": [self.cursors.get(w, 0) for w in roster],
        }

    def restore(self, position: dict[str, Any]) -> None:
        self.restore_epochs(position)
        self._resume_cursors = [int(c) for c in position.get("cursors", [])]

    def resume_into(self, plan: EpochPlan) -> None:
        # Each rank continues where the rank of the same number stopped. With another number
        # of workers the shards differ: every rank goes on from where the slowest had got to
        # (the batches all ranks had done form a prefix of the permutation, as in sync).
        saved, self._resume_cursors = self._resume_cursors, []
        if len(saved) == len(plan.roster):
            self.cursors = dict(zip(plan.roster, saved, strict=True))
        elif saved:
            cursor = resumed_batch(min(saved), len(saved), len(plan.roster))
            self.cursors = dict.fromkeys(plan.roster, min(cursor, plan.steps))

    def staleness_summary(self) -> dict[str, object]:
        """Staleness counts versions behind; SSP's bound counts steps ahead of the slowest
        worker, which is not the same: with N workers and bound S a gradient can be up to
        (S + 1)(N - 1) versions old. So the bound goes by its own name, steps_ahead_bound
        (None in async), and is not read as a bound on the staleness next to it."""
        total = sum(self.staleness.values())
        summary: dict[str, object] = {"count": total, "mean": 0.0, "max": 0, "histogram": {}}
        if total:
            summary["mean"] = sum(k * v for k, v in self.staleness.items()) / total
            summary["max"] = max(self.staleness)
            summary["histogram"] = {str(k): v for k, v in sorted(self.staleness.items())}
        return {**summary, "steps_ahead_bound": self.staleness_bound}
