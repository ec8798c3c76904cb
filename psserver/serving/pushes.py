"""Gradients in, on every shard: a PUSH (a whole slice, one bucket of it, or the PUSH that
completes its buckets) authenticated, checked, and handed to where it goes.

One handler serves the leader and the follower shards (`PushHandler`). What differs is a
parameter of it:

- who may push (`Senders.authenticate`): on the leader its membership (a registered worker,
  its token and CURVE key, psserver.coordinator.membership); on a follower the roster of the
  leader's workers (psserver.shards.roster).
- where a checked push goes (`Intake`): on the leader `PolicyIntake`, which hands it to the
  policy, which applies it; on a follower its staging (psserver.serving.parts.SliceStaging),
  where it waits for the leader's COMMIT.
- push credits (psserver.serving.credits.FlowControl) and a forgotten worker's push answered
  again exist only on the leader: None on a follower.

Every shard checks every PUSH with the same code (psserver.serving.validation.check_push), a
retry included. A bucket's PUSH (bucket >= 0) gets no reply, on any shard: what goes wrong with
one is logged and told in the reply to the PUSH that completes them (psserver.serving.parts).

On the leader, `PolicyIntake` deduplicates by (version, epoch, batch): a retry of a push already
handled is answered with the same PUSH_ACK and never applied twice. A sync gradient for a step
that has closed, or whose epoch was abandoned (too few workers left), is dropped and answered
`applied=False`, also when the abandoned step had taken it already. The policy decides when an
update happens and who is acknowledged; `PolicyIntake` sends the answers (after the COMMIT that
tells the follower shards to apply it).
"""

import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from common.errors import RequestRejected
from common.job import JobSpec
from common.wire.protocol import Push, PushAck
from psserver.coordinator.membership import ACTIVE, Membership, WorkerRecord, WorkerState
from psserver.policies import StepResult, UpdatePolicy
from psserver.serving.credits import FlowControl
from psserver.serving.parts import PartLedger
from psserver.serving.socket import ServerSocket
from psserver.serving.validation import check_assignment, check_push, push_bytes
from psserver.shards.leader import ShardGroup
from psserver.status.report import TrainingMeter, UpdateRecorder
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")
Worker = TypeVar("Worker")  # what `Senders.authenticate` returns: the leader's record, an id
Worker_co = TypeVar("Worker_co", covariant=True)
Worker_contra = TypeVar("Worker_contra", contravariant=True)


class Senders(Protocol[Worker_co]):
    """Who may push to this shard."""

    def authenticate(self, worker_id: int, token: str, identity: bytes, key: str = "") -> Worker_co:
        """The sender, or RequestRejected("unknown-worker"). `key`: its CURVE key, or ""."""
        ...


class Intake(Protocol[Worker_contra]):
    """Where a push goes once it is authenticated and checked."""

    def admit_part(self, worker: Worker_contra, part: Push) -> bool:
        """Whether to take this bucket at all (False: ignored, never refused)."""
        ...

    def take_part(self, worker: Worker_contra, identity: bytes, part: Push) -> None: ...

    def take_push(self, worker: Worker_contra, identity: bytes, push: Push) -> PushAck | None:
        """Take a whole push or the one that completes its buckets: the answer to send now,
        or None (answered already, or when its step closes)."""
        ...

    def refuse(
        self, worker: Worker_contra, identity: bytes, push: Push, refusal: RequestRejected
    ) -> None:
        """This push or bucket was refused, for `refusal`."""
        ...


class PushHandler(Generic[Worker]):
    def __init__(
        self,
        router: ServerSocket,
        job: JobSpec,  # its shapes and buckets; the shard endpoints it may gain do not matter
        shard: int,
        senders: Senders[Worker],
        intake: Intake[Worker],
        count_rejected: Callable[[], None] = lambda: None,
        flow: FlowControl | None = None,  # the leader's push credits
        # The leader's: answers a push of a worker it has forgotten; True if it was one.
        answer_forgotten: Callable[[bytes, Push, str], bool] | None = None,
    ) -> None:
        self.router, self.job, self.shard = router, job, shard
        self.senders, self.intake = senders, intake
        self.count_rejected, self.flow = count_rejected, flow
        self.answer_forgotten = answer_forgotten

    def handle(self, identity: bytes, push: Push, key: str) -> None:
        """A PUSH, as the shard's dispatch hands it over."""
        if push.bucket >= 0:  # never answered
            self.on_part(identity, push, key)
        else:
            self.on_push(identity, push, key)

    def on_part(self, identity: bytes, part: Push, key: str) -> None:
        """One bucket of a worker's coming PUSH. It is never answered (the worker waits only
        for the PUSH's reply), so what goes wrong is logged and, for a known worker, told to
        it in the reply to that PUSH (see psserver.serving.parts)."""
        refusals = self.router.refusals
        try:
            worker = self.senders.authenticate(part.worker_id, part.token, identity, key)
        except RequestRejected as exc:
            refusals.refused(exc.code, logging.WARNING, "dropped a gradient part (%s): %s",
                             exc.code, exc)  # fmt: skip
            self.count_rejected()
            return
        if not self.intake.admit_part(worker, part):
            return  # its PUSH will be answered as late; or this part is in already
        try:
            check_push(self.job, self.shard, part)
            self.intake.take_part(worker, identity, part)
        except Exception as exc:  # a bug must not take the job down either
            refusal = (
                exc
                if isinstance(exc, RequestRejected)
                else RequestRejected("internal", f"server error: {exc}")
            )
            if isinstance(exc, RequestRejected):
                refusals.refused(
                    refusal.code, logging.WARNING, "refused bucket %d of worker %d (%s): %s",
                    part.bucket, part.worker_id, refusal.code, refusal,
                )  # fmt: skip
            else:
                log.exception("refused bucket %d of worker %d", part.bucket, part.worker_id)
            self.count_rejected()
            self.intake.refuse(worker, identity, part, refusal)

    def on_push(self, identity: bytes, push: Push, key: str) -> None:
        """A whole push, or the one that completes its buckets: answered now (PUSH_ACK or
        ERROR), or on the leader when its step closes."""
        if self.answer_forgotten is not None and self.answer_forgotten(identity, push, key):
            return  # sent before its worker was forgotten: whether it was applied
        worker = self.senders.authenticate(push.worker_id, push.token, identity, key)
        if self.flow is not None:  # the bytes are here: the next worker may send its own
            self.flow.release(push.worker_id)
        try:
            # Before a retry is answered: one that is malformed or not finite is refused,
            # not acknowledged as the push it claims to repeat.
            check_push(self.job, self.shard, push)
            answer = self.intake.take_push(worker, identity, push)
        except RequestRejected as exc:
            self.intake.refuse(worker, identity, push, exc)
            raise
        if answer is not None:
            self.router.send(identity, answer)


class PolicyIntake:
    """The leader's intake: each checked push handed to its policy, with the books around it
    (the parts in, retries, late gradients, what each worker pushed), and the answers."""

    def __init__(
        self,
        router: ServerSocket,
        store: ParameterStore,
        policy: UpdatePolicy,
        job: JobSpec,
        membership: Membership,
        flow: FlowControl,
        meter: TrainingMeter,
        recorder: UpdateRecorder,
        shards: ShardGroup | None,
        live: Callable[[], set[int]],  # the workers training now (TrainingSchedule.live)
        on_step: Callable[[StepResult], None],  # what a push's step result goes to
    ) -> None:
        self.router, self.store, self.policy, self.job = router, store, policy, job
        self.membership, self.flow = membership, flow
        self.meter, self.recorder, self.shards = meter, recorder, shards
        self.live, self.on_step = live, on_step
        self.parts = PartLedger(job.num_buckets)

    def forget(self, worker_id: int) -> None:
        """A worker left or died: its parts are void and its credit is free."""
        self.parts.forget(worker_id)
        self.flow.release(worker_id)

    # ---- the Intake ------------------------------------------------------------------------

    def admit_part(self, worker: WorkerRecord, part: Push) -> bool:
        return not self.policy.is_late(part) and self.parts.admit(worker.worker_id, part)

    def take_part(self, worker: WorkerRecord, identity: bytes, part: Push) -> None:
        check_assignment(worker.worker_id, worker.assignment, part)
        self.policy.on_part(worker.worker_id, part, self.live())
        self.parts.record(worker.worker_id, part)

    def refuse(
        self, worker: WorkerRecord, identity: bytes, push: Push, refusal: RequestRejected
    ) -> None:
        if push.bucket >= 0:
            self.parts.refuse(worker.worker_id, push, refusal)
        else:
            worker.rejected += 1

    def take_push(self, worker: WorkerRecord, identity: bytes, push: Push) -> PushAck | None:
        key = (push.version, push.epoch, push.batch)
        if not 0 <= push.version <= self.store.version:  # no worker was given such weights
            raise RequestRejected(
                "bad-version",
                f"gradient claims version {push.version}, the server is at {self.store.version}",
            )
        if worker.last_push == key:  # a retried push: never applied twice
            if not self.policy.pending(worker.worker_id) and worker.last_ack is not None:
                return worker.last_ack
            return None
        if self.policy.is_late(push):
            worker.last_push, worker.assignment = key, None
            self.parts.forget(worker.worker_id)  # its parts are void with it
            if push.version < self.store.version:
                why = f"late: the server is at step {self.store.version}"
            else:
                why = f"its epoch {push.epoch} ended without that step (abandoned)"
            self._drop(worker, push.version, why)
            return None
        check_assignment(worker.worker_id, worker.assignment, push)
        wire_bytes = push_bytes(push)
        if push.parts:
            wire_bytes += self.parts.complete(worker.worker_id, push)
        result = self.policy.on_push(worker.worker_id, push, self.live())  # may still refuse it
        # Booked only now: a refused push counts nowhere, and sent again it is checked again.
        worker.last_push, worker.last_ack, worker.assignment = key, None, None
        worker.samples += push.samples
        worker.pushes += 1
        worker.booked = (push.samples, push.loss_sum, push.correct, wire_bytes)
        self.meter.record_push(push.samples, push.loss_sum, push.correct, wire_bytes)
        self.recorder.record_push(push.samples, push.loss_sum, push.correct)
        self.on_step(result)
        return None

    # ---- the answers -----------------------------------------------------------------------

    def answer_forgotten(self, identity: bytes, push: Push, key: str) -> bool:
        """Answer again a push that a worker the job has forgotten (dead, left) sent before
        it was forgotten: whether it was applied. True if this push was one.

        Its worker asks again when its reply was lost, or when its heartbeat heard
        "unknown-worker" while it waited; "unknown-worker" would say "not applied", and a
        top-k worker would then keep the gradient to send again (GradientCompressor
        .take_back), applying it twice."""
        worker = self.membership.forgotten(push.worker_id, push.token, key)
        if worker is None or worker.last_ack is None:
            return False
        if worker.last_push != (push.version, push.epoch, push.batch):
            return False
        check_push(self.job, 0, push)  # an answer only for what could be that push
        log.info(
            "worker %d (%s) asked about its push for step %d: answered again (applied: %s)",
            worker.worker_id, worker.state.value, push.version, worker.last_ack.applied,
        )  # fmt: skip
        self.router.send(identity, worker.last_ack)
        return True

    def drop_abandoned(self, worker_ids: list[int], version: int) -> None:
        """Answer the pushes an abandoned step had taken: they will never be applied, so
        they are taken out of the counts they were booked into (the worker's, the meter's,
        and the --log-dir record of the next update)."""
        for worker_id in worker_ids:
            worker = self.membership.workers.get(worker_id)
            if worker is None:  # retired since: its totals are folded in already
                continue
            if worker.booked is not None:
                samples, loss_sum, correct, nbytes = worker.booked
                worker.samples -= samples
                worker.pushes -= 1
                worker.booked = None
                self.meter.retract_push(samples, loss_sum, correct, nbytes)
            why = "its epoch ended without that step (abandoned)"
            self._drop(worker, version, why, send=worker.state in ACTIVE)
        self.recorder.discard_pending()  # every push since the last update was in that step

    def _drop(self, worker: WorkerRecord, version: int, why: str, send: bool = True) -> None:
        """Answer a gradient that is not applied, `applied=False`; the worker goes on. Not
        `send`: a worker that left is answered only if it asks again (answer_forgotten)."""
        worker.late += 1
        worker.last_ack = PushAck(self.store.version, self.store.version - version, False)
        log.info("gradient from worker %d for step %d dropped: %s", worker.worker_id, version, why)
        if send:
            self.router.send(worker.identity, worker.last_ack)

    def acknowledge(self, result: StepResult) -> None:
        """Tell the follower shards about the update, then the workers it acknowledges."""
        if result.commit is not None and self.shards is not None:
            self.shards.commit(result.commit)  # first, so the shards start on it at once
        for worker_id in result.acknowledged:
            worker = self.membership.workers.get(worker_id)
            if worker is None:  # finished and retired since its push (membership)
                continue
            # Kept also for a worker that left: asked again, its push is answered with it.
            worker.last_ack = PushAck(self.store.version, result.staleness, True)
            if worker.state is WorkerState.TRAINING:
                self.router.send(worker.identity, worker.last_ack)
