"""The sync policy: step t takes one gradient from each live roster worker, all computed on
version t, and applies their sample-weighted mean once; bucket by bucket when gradients come
in parts (see psserver.policies).
"""

import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from common.assignment import Assignment
from common.errors import RequestRejected
from common.job import JobSpec
from common.logs import counted
from common.wire.protocol import Push
from psserver.policies.epochs import (
    HOLD,
    NO_INDICES,
    CommitOrder,
    EpochPlan,
    EpochPolicy,
    OpenStep,
    StepResult,
    commit_entry,
    resumed_batch,
)
from psserver.store.parameters import ParameterStore, add_weighted
from psserver.store.sends import SEND_WAIT_S

log = logging.getLogger("ps.server")


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
        self._resume_batch = 0  # where a resumed run continues in its first epoch ...
        self._resume_world = 0  # ... in steps of this many workers (0: as many as now)
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
        self._buckets = job.bucket_ranges()
        self._bucket_samples: list[dict[int, int]] = [{} for _ in self._buckets]
        self._bucket_applied = [False] * len(self._buckets)
        # Which buckets may have become ready since the last look: those that gained a part,
        # or all of them when the live roster changed (a bucket that waited only for a worker
        # who left is ready now). Scanning every bucket on every part made a step cost
        # buckets^2: 3.5 s a step for LeNet in 4,960 buckets.
        self._touched: set[int] = set()
        self._scanned_roster: tuple[int, ...] | None = None
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

    def is_late(self, push: Push) -> bool:
        """For a step that has closed, or for an epoch that is over (an abandoned epoch ends
        without a new version, so the version alone cannot tell). A push for an epoch that
        has not begun is not late but wrong: the assignment check refuses it ("pull before
        pushing"), where it used to be dropped as if from an abandoned epoch."""
        if self.plan is not None and push.epoch == self.plan.epoch:
            return push.version < self.store.version
        current = self.plan.epoch if self.plan is not None else self.completed_epochs
        return push.epoch < current

    def pending(self, worker_id: int) -> bool:
        return worker_id in self._contributors

    def open_step(self, live: set[int]) -> OpenStep | None:
        """The step that is open now, and whom it waits for; None between epochs."""
        if self.plan is None or self.finished() or self.epoch_done(live):
            return None
        roster = tuple(self.live_roster(live))
        if not roster:  # nobody left to wait for: the epoch is about to be abandoned
            return None
        return OpenStep(
            self.store.version,
            self.plan.epoch,
            self.batch,
            self._expected_samples(),
            self._share(),
            roster,
        )

    def _check_open(self, worker_id: int, version: int, samples: int) -> None:
        if version != self.store.version:
            raise RequestRejected(
                "bad-version",
                f"gradient claims version {version}, the server is at {self.store.version}",
            )
        if worker_id in self._contributors:
            raise RequestRejected(
                "duplicate-push", f"worker {worker_id} already pushed for step {version}"
            )
        # Shards are padded to equal length, so every rank's batch t has the same size. The
        # follower shards weight slices by it before the COMMIT says what each worker sent.
        share = self._share() if self.plan else samples
        if samples != share:
            raise RequestRejected(
                "bad-samples",
                f"step {version} takes gradients over {counted(share, 'sample')} (batch "
                f"{self.batch} of each shard); worker {worker_id} sent one over {samples}",
            )

    def on_part(self, worker_id: int, part: Push, live: set[int]) -> bool:
        """Add one bucket of a worker's gradient, and apply the buckets now complete. False:
        the part is late (its PUSH is answered so), and ignored."""
        if self.is_late(part):
            return False
        self._check_open(worker_id, part.version, part.samples)
        self._add_to_bucket(part.bucket, worker_id, part.samples, part.grads, NO_INDICES)
        self._part_senders.add(worker_id)
        self._apply_ready_buckets(live)
        return True

    def on_push(self, worker_id: int, push: Push, live: set[int]) -> StepResult:
        self._check_open(worker_id, push.version, push.samples)
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
        self._touched.add(bucket)

    def _apply_ready_buckets(self, live: set[int]) -> None:
        """Apply every bucket that has the part of each live roster worker (and enough), in
        bucket order. Only a bucket that gained a part can have become ready, unless the
        roster changed: a part costs work for its own bucket, not for all of them."""
        roster = self.live_roster(live)
        if tuple(roster) != self._scanned_roster:
            self._scanned_roster = tuple(roster)
            candidates: list[int] = list(range(len(self._buckets)))
        else:
            candidates = sorted(self._touched)
        self._touched.clear()
        # Most candidates are not ready: their count of parts says so before the roster is
        # searched.
        needed = max(self.min_workers, len(roster))
        for bucket in candidates:
            added = self._bucket_samples[bucket]
            if len(added) < needed or self._bucket_applied[bucket]:
                continue
            if all(w in added for w in roster):
                self._apply_bucket(bucket)

    def _apply_bucket(self, bucket: int, deadline: float | None = None) -> None:
        added, expected = self._bucket_samples[bucket], self._expected_samples()
        assert added, "a step closes only with every contributor's whole gradient"
        lo, hi = self._buckets[bucket]
        total = sum(added.values())
        if total != expected:  # someone is missing: renormalise to the samples that came
            self._grad_sum[lo:hi].mul_(expected / total)
        # The live weights may still be on their way out.
        self.store.wait_for_sends(lo, hi, deadline=deadline)
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
                "step %d closed after %.1f s without workers %s (%d of %s)",
                self.store.version,
                self.step_timeout,
                missing,
                len(self._contributors),
                counted(len(self.live_roster(live)), "gradient"),
            )
        commit = CommitOrder(self.store.version, list(self._entries), self._expected_samples())
        # One budget for the waits on sends still in flight, not one per bucket: a stalled
        # worker would otherwise hold the loop (and every heartbeat) 19 times as long.
        deadline = time.monotonic() + SEND_WAIT_S
        for bucket, applied in enumerate(self._bucket_applied):
            if not applied:
                self._apply_bucket(bucket, deadline)
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
        self._touched.clear()
        for added in self._bucket_samples:
            added.clear()
        self._bucket_applied = [False] * len(self._buckets)

    def _expected_samples(self) -> int:
        """Samples in this step if every rank pushes."""
        assert self.plan is not None
        return len(self.plan.roster) * self._share()

    def _share(self) -> int:
        """Samples in each rank's batch of this step (common.assignment)."""
        assert self.plan is not None
        return self.samples.share(self.batch, len(self.plan.roster))

    def epoch_done(self, live: set[int]) -> bool:
        return self.plan is not None and self.batch >= self.plan.steps

    def stuck(self, live: set[int]) -> bool:
        """Too few live workers remain in this epoch's roster for any step to close."""
        return self.plan is not None and len(self.live_roster(live)) < self.min_workers

    def abandon_epoch(self) -> list[int]:
        """End the epoch without closing its open step; returns the workers whose gradients
        for it are dropped (each must be told, or it waits for its PUSH_ACK forever)."""
        dropped = list(self._contributors)
        if dropped:
            log.warning("dropping %s of the abandoned step", counted(len(dropped), "gradient"))
        applied = [b for b, done in enumerate(self._bucket_applied) if done]
        if applied:  # their workers died after every part was in, before their PUSH
            log.warning(
                "step %d of the abandoned epoch was already applied to buckets %s; the "
                "weights keep that part of the update",
                self.store.version,
                applied,
            )
        self._clear_step()
        self.end_epoch(abandoned=True)
        return dropped

    def end_epoch(self, abandoned: bool = False) -> None:
        super().end_epoch(abandoned)
        self.batch = 0

    def position(self) -> dict[str, Any]:
        world = len(self.plan.roster) if self.plan is not None else 0
        return {
            **self.epoch_position(), "batch": self.batch, "cursors": [], "world_size": world,
        }  # fmt: skip

    def restore(self, position: dict[str, Any]) -> None:
        self.restore_epochs(position)
        self._resume_batch = int(position["batch"])
        self._resume_world = int(position.get("world_size", 0))

    def resume_into(self, plan: EpochPlan) -> None:
        self.batch = min(
            resumed_batch(self._resume_batch, self._resume_world, len(plan.roster)), plan.steps
        )
        self._resume_batch = 0
