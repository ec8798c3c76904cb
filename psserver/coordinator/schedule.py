"""The job's course in time: when training starts, when epochs begin and end, what follows an
update (a checkpoint every so many steps), and the final evaluation.

The server's event loop (psserver.server) calls `tick` between requests and at least every
POLL_MS; a tick declares silent workers dead, closes sync steps that timed out, ends epochs
and lets waiting workers in at epoch boundaries. Everything here runs on the loop's thread.
It does not read sockets or decode requests: the handlers (psserver.serving.pulls,
psserver.serving.pushes) do.
"""

import logging
import math
import time

from common.errors import TrainingDiverged
from common.logs import counted
from psserver.checkpoints.whole_model import WholeModel
from psserver.config import ServerConfig
from psserver.coordinator.membership import Membership, WorkerRecord, WorkerState
from psserver.coordinator.stalls import StallWatch
from psserver.evaluation import Evaluation
from psserver.policies import StepResult, UpdatePolicy
from psserver.serving.pulls import PullHandler
from psserver.serving.pushes import PolicyIntake
from psserver.shards.leader import ShardGroup
from psserver.status.report import TrainingMeter, UpdateRecorder
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")


class TrainingSchedule:
    def __init__(
        self,
        config: ServerConfig,
        store: ParameterStore,
        policy: UpdatePolicy,
        membership: Membership,
        meter: TrainingMeter,
        recorder: UpdateRecorder,
        whole_model: WholeModel,
        shards: ShardGroup | None,
        pulls: PullHandler[WorkerRecord],
        pushes: PolicyIntake,
    ) -> None:
        self.config, self.store, self.policy, self.membership = config, store, policy, membership
        self.meter, self.recorder, self.shards = meter, recorder, shards
        self.whole_model = whole_model
        self.pulls, self.pushes = pulls, pushes
        self.started = False  # the first epoch began: from then on --min-workers suffice
        self._stalled_waits_seen = 0
        self._deafness = StallWatch(config.worker_timeout, time.monotonic())
        self._checkpoint_due = False  # an update reached a --checkpoint-every step
        self._checkpoint_waits_since: float | None = None  # for the pushes under way

    def live(self) -> set[int]:
        """The workers training now."""
        return {w.worker_id for w in self.membership.in_state(WorkerState.TRAINING)}

    def forget(self, worker_id: int) -> None:
        """A worker left or died: nothing may wait for it."""
        self.pulls.forget(worker_id)
        self.pushes.forget(worker_id)

    def acknowledge(self, result: StepResult) -> None:
        """Answer the pushes a step took, and record the update it made, if any."""
        self.pushes.acknowledge(result)
        if not result.updates:
            return
        self.recorder.record_update(
            self.store.version, self.policy.completed_epochs, result.staleness, result.acknowledged
        )
        version = self.store.version
        self.meter.maybe_log(version, self.policy.completed_epochs)
        every = self.config.checkpoint_every
        if self.config.checkpoint_dir is not None and every and version % every == 0:
            # Written by the loop's next tick (before any other update), not here: this may
            # run inside a request's handler, which has answered already, and a failure
            # would be sent to that worker as a second reply.
            self._checkpoint_due = True
        self.announce_step()

    def announce_step(self) -> None:
        """Tell the follower shards of the sync step now open (after the COMMIT of the one
        before): they apply its buckets as soon as every worker's slice is in."""
        if self.shards is not None:
            workers = self.membership.workers
            step = self.policy.open_step(self.live())
            # A worker of the step may have finished and been retired since (membership):
            # no slice of it can come, so its token no longer matters.
            self.shards.announce(
                step, self.store.version, lambda w: workers[w].token if w in workers else ""
            )

    def tick(self) -> None:
        self._excuse_own_stall()
        if self.shards is not None:
            self.shards.keep_alive(time.monotonic())
        if self.store.stalled_waits != self._stalled_waits_seen:
            # The loop sat in waits for a stalled worker's sends and read no heartbeats
            # meanwhile: nobody else's silence then says anything.
            self._stalled_waits_seen = self.store.stalled_waits
            self._excuse_silence()
        live = self._reap()
        policy = self.policy
        policy.observe_live(live)
        if policy.plan is not None and not policy.finished():
            self.acknowledge(policy.try_close(live))
            # Workers spared while the step held their pushes are reaped once it has closed,
            # before an evaluation excuses their silence or a new epoch counts them.
            live = self._reap()
            if policy.epoch_done(live):
                self._end_epoch("done")
            elif policy.stuck(live):
                log.warning(
                    "epoch %d cannot go on: %d live workers, --min-workers is %d; it ends "
                    "early and the next one starts when enough workers are ready",
                    policy.plan.epoch,
                    len(policy.live_roster(live)),
                    self.config.min_workers,
                )
                dropped = policy.abandon_epoch()
                self.pushes.drop_abandoned(dropped, self.store.version)
                self._reap()  # as above: the abandoned step spares nobody now
                self.pulls.streamer.reset()  # buckets it applied were streamed as the next version
                # The follower shards end the step before the evaluation asks for their
                # slices: one busy with it would never answer.
                self.announce_step()
                self._end_epoch("abandoned", already_ended=True)
        if policy.plan is None and not policy.finished():
            self._begin_epoch()
        self.announce_step()
        if self._checkpoint_due and self._checkpoint_waits_for_pushes():
            return  # no pull is answered meanwhile: no new push starts
        self.pulls.answer()

    def _reap(self) -> set[int]:
        """Forget the workers silent for too long, except those whose gradient the open sync
        step holds (psserver.coordinator.membership.reap); return the live ones."""
        for dead in self.membership.reap(time.monotonic(), self.policy.pending):
            self.forget(dead.worker_id)
        return self.live()

    def _checkpoint_waits_for_pushes(self) -> bool:
        """Write the due checkpoint, or return True while it waits for the pushes under way.

        A push whose first buckets are applied (async applies them as they come) but whose
        PUSH has not come would be in the checkpoint's weights, not in its data position:
        after a --resume its batch would be computed again and those buckets applied twice.
        A worker that pulls has finished its push, whatever its parts; one that dies mid-push
        is forgotten; and the wait is bounded all the same."""
        mid_push = self.pushes.parts.in_flight() - set(self.pulls.held)
        now = time.monotonic()
        if mid_push and self._checkpoint_waits_since is None:
            log.info("checkpoint at step %d waits for the pushes under way", self.store.version)
            self._checkpoint_waits_since = now
        waited = now - (self._checkpoint_waits_since or now)
        if mid_push and waited < self.config.worker_timeout:
            return True
        if mid_push:
            log.warning(
                "checkpoint at step %d written while workers %s are still mid-push after "
                "%.0f s: a resume from it applies their first buckets again",
                self.store.version, sorted(mid_push), waited,
            )  # fmt: skip
        self._checkpoint_waits_since = None
        self._checkpoint_due = False
        self._save_checkpoint()
        return False

    def finish(self) -> Evaluation:
        """The final evaluation and checkpoint, once the policy says training is over."""
        self.meter.finished = time.monotonic()
        # The epoch of the last update, as the lines before numbered it (from 0), not the
        # count of epochs ended, which is one more once the last epoch is over.
        plan = self.policy.plan
        last_epoch = plan.epoch if plan is not None else max(0, self.policy.completed_epochs - 1)
        self.meter.maybe_log(self.store.version, last_epoch, force=True)
        final = self.evaluate("final")
        unsaved = self.whole_model.checkpointed != self.store.version
        if self.config.checkpoint_dir is not None and unsaved:
            self._save_checkpoint()
        if self.meter.wall_seconds > 0:
            log.info(
                "training done: %s, test accuracy %.4f, %.1f img/s over %.1f s",
                counted(self.store.version, "step"),
                final.accuracy,
                self.meter.images_per_second,
                self.meter.wall_seconds,
            )
        else:  # a resumed run that was already over
            log.info(
                "training done: %s, test accuracy %.4f (nothing trained in this run)",
                counted(self.store.version, "step"), final.accuracy,
            )  # fmt: skip
        return final

    def evaluate(self, label: str) -> Evaluation:
        """Evaluate the weights; raise TrainingDiverged when their test loss is not finite.

        The server refuses every gradient that is not finite, so its weights stay finite,
        but they can grow until the outputs overflow. Training them further is pointless, and
        an elastic job would otherwise wait for ever for workers that each stop at once."""
        result = self.whole_model.evaluate(label)
        self._excuse_silence()  # nobody was heard while we were busy
        if not math.isfinite(result.loss):
            raise TrainingDiverged(
                f"training diverged: the test loss after step {self.store.version} is "
                f"{result.loss} (test accuracy {result.accuracy:.4f}), so the job stops. "
                f"{self.whole_model.divergence_advice()}"
            )
        return result

    def _begin_epoch(self) -> None:
        ready = self.membership.in_state(WorkerState.WAITING)
        ready += self.membership.in_state(WorkerState.TRAINING)
        needed = self.config.min_workers if self.started else self.config.workers
        if len(ready) < needed:
            return
        for worker in ready:
            if worker.state is WorkerState.WAITING:
                worker.move_to(WorkerState.TRAINING)
        plan = self.policy.begin_epoch(sorted(w.worker_id for w in ready))
        if not self.started:
            self.started = True
            self.policy.resume_into(plan)
            log.info("%s ready; training starts", counted(len(ready), "worker"))
            self.meter.start()
            self.recorder.start(
                self.store.version, self.policy.completed_epochs, resumed=self.config.resuming
            )

    def _end_epoch(self, how: str, already_ended: bool = False) -> None:
        if not already_ended:
            self.policy.end_epoch()
        # Numbered from 0, as "epoch N begins" and "epoch N cannot go on" number it.
        self.evaluate(f"epoch {self.policy.completed_epochs - 1} {how}")

    def _excuse_own_stall(self) -> None:
        """A long gap since the last tick: the server itself heard nobody, and the silence
        of that time is excused, once for each silence (psserver.coordinator.stalls)."""
        now = time.monotonic()
        deaf_s = self._deafness.deaf_for(now)
        if not deaf_s:
            return
        workers = self.membership.active()
        seen = self._deafness.excuse("workers", {w.worker_id: w.last_seen for w in workers}, now)
        for worker in workers:
            worker.last_seen = seen[worker.worker_id]
        if self.shards is not None:
            links = self.shards.links.values()
            heard = self._deafness.excuse(
                "shards", {link.shard: link.last_heard for link in links}, now
            )
            for link in links:
                link.last_heard = heard[link.shard]
        if deaf_s > self.config.worker_timeout and self.membership.active():
            log.warning(
                "the server heard nobody for %.1f s (it was stopped or overloaded); the "
                "silence meanwhile of the workers heard since its last such pause does not "
                "count against them", deaf_s,
            )  # fmt: skip

    def _excuse_silence(self) -> None:
        self.membership.excuse_silence()
        if self.shards is not None:
            self.shards.excuse_silence()

    def _save_checkpoint(self) -> None:
        self.whole_model.save_checkpoint()
        self._excuse_silence()
