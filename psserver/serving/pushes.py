"""The way gradients come in to the leader: its slice's PUSHes checked and handed to the policy,
retries and late gradients answered, flow-control credits passed on, and each step's
acknowledgements sent (after the COMMIT that tells the follower shards to apply it).

A PUSH is checked (psserver.serving.validation) and then deduplicated by (version, epoch,
batch): a retry of one already handled is answered with the same PUSH_ACK and never applied
twice, and a malformed or non-finite retry is refused like any other push. A sync gradient
for a step that has closed, or whose epoch was abandoned (too few workers left), is dropped
and answered `applied=False`, also when the abandoned step had taken it already. A bucket's
PUSH (bucket >= 0) gets no reply; what goes wrong with one is told in the reply to the PUSH
that completes them (psserver.serving.parts).

What it is not: a decision maker. The policy decides when an update happens and who is
acknowledged; this module checks what arrives and sends the answers.
"""

import logging
from collections.abc import Callable

from common.errors import RequestRejected
from common.job import JobSpec
from common.wire.protocol import Push, PushAck
from psserver.coordinator.membership import ACTIVE, Membership, WorkerRecord, WorkerState
from psserver.policies import StepResult, UpdatePolicy
from psserver.serving.credits import PushCredits
from psserver.serving.parts import PartLedger
from psserver.serving.socket import ServerSocket
from psserver.serving.validation import check_assignment, check_push, push_bytes
from psserver.shards.leader import ShardGroup
from psserver.status.report import TrainingMeter, UpdateRecorder
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")


class PushHandler:
    def __init__(
        self,
        router: ServerSocket,
        store: ParameterStore,
        policy: UpdatePolicy,
        job: JobSpec,  # its shapes and buckets; the shard endpoints it may gain do not matter
        membership: Membership,
        credits: PushCredits,
        meter: TrainingMeter,
        recorder: UpdateRecorder,
        shards: ShardGroup | None,
        count_rejected: Callable[[], None],
    ) -> None:
        self.router, self.store, self.policy, self.job = router, store, policy, job
        self.membership, self.credits = membership, credits
        self.meter, self.recorder, self.shards = meter, recorder, shards
        self.count_rejected = count_rejected
        self.parts = PartLedger(job.num_buckets)
        # Workers told of once that their credit was taken: a worker whose backward alone
        # outlasts the hold limit loses it every step, and one line says so.
        self._slow_holders: set[int] = set()

    # ---- flow control ----------------------------------------------------------------------

    def ask(self, worker: WorkerRecord) -> None:
        """PUSH_READY: PUSH_ACK `go` now if a credit is free, else when one comes back. Only for a
        batch to push: a credit held by a worker that has none would never come back."""
        if worker.assignment is None:
            raise RequestRejected(
                "unexpected-batch",
                f"worker {worker.worker_id} asked to push, but holds no batch to push; pull "
                "before pushing",
            )
        if self.credits.ask(worker.worker_id):
            self.router.send(worker.identity, PushAck(self.store.version, 0, False, go=True))

    def reclaim_credits(self) -> None:
        """Credits held too long while others wait go to them (see psserver.serving.credits)."""
        taken, admitted = self.credits.reclaim()
        for worker_id in taken:
            level = logging.DEBUG if worker_id in self._slow_holders else logging.WARNING
            self._slow_holders.add(worker_id)
            log.log(
                level,
                "worker %d held a push credit for over %.0f s without pushing; it goes to a "
                "worker that waits (a push it sends later is still taken; said once per worker)",
                worker_id, self.credits.hold_limit_s,
            )  # fmt: skip
        for waiting_id in admitted:
            self._go(waiting_id)

    def release_credit(self, worker_id: int) -> None:
        """The worker's push arrived, or it is gone: its credit goes to the next in line."""
        for waiting_id in self.credits.release(worker_id):
            self._go(waiting_id)

    def _go(self, worker_id: int) -> None:
        """PUSH_ACK `go` to a worker that waited for a credit, or the credit on to the next."""
        waiting = self.membership.workers.get(worker_id)
        if waiting is not None and waiting.state in ACTIVE:
            self.router.send(waiting.identity, PushAck(self.store.version, 0, False, go=True))
        else:  # gone meanwhile: the credit goes on again
            self.release_credit(worker_id)

    def forget(self, worker_id: int) -> None:
        """A worker left or died: its parts are void and its credit is free."""
        self.parts.forget(worker_id)
        self.release_credit(worker_id)

    # ---- parts and pushes ------------------------------------------------------------------

    def on_part(self, identity: bytes, part: Push, key: str, live: set[int]) -> None:
        """One bucket of a worker's coming PUSH. It is never answered (the worker waits only
        for the PUSH's reply), so what goes wrong is logged and, for a known worker, told to
        it in the reply to that PUSH (see psserver.serving.parts)."""
        try:
            worker = self.membership.authenticate(part.worker_id, part.token, identity, key)
        except RequestRejected as exc:
            log.warning("dropped a gradient part (%s): %s", exc.code, exc)
            self.count_rejected()
            return
        if self.policy.is_late(part) or not self.parts.admit(worker.worker_id, part):
            return  # its PUSH will be answered as late; or this part is in already
        try:
            check_push(self.job, 0, part)
            check_assignment(worker.worker_id, worker.assignment, part)
            self.policy.on_part(worker.worker_id, part, live)
        except Exception as exc:  # a bug must not take the job down either
            refusal = (
                exc
                if isinstance(exc, RequestRejected)
                else RequestRejected("internal", f"server error: {exc}")
            )
            log.warning(
                "refused bucket %d of worker %d (%s): %s",
                part.bucket, worker.worker_id, refusal.code, refusal,
                exc_info=not isinstance(exc, RequestRejected),
            )  # fmt: skip
            self.count_rejected()
            self.parts.refuse(worker.worker_id, part, refusal)
            return
        self.parts.record(worker.worker_id, part)

    def on_push(self, worker: WorkerRecord, push: Push, live: set[int]) -> StepResult | None:
        """Hand a checked push to the policy; None: it was answered here (a retry, or late)."""
        key = (push.version, push.epoch, push.batch)
        if not 0 <= push.version <= self.store.version:  # no worker was given such weights
            raise RequestRejected(
                "bad-version",
                f"gradient claims version {push.version}, the server is at {self.store.version}",
            )
        # Before the retry below is answered: one that is malformed or not finite is refused,
        # not acknowledged as the push it claims to repeat.
        check_push(self.job, 0, push)
        if worker.last_push == key:  # a retried push: never applied twice
            if not self.policy.pending(worker.worker_id) and worker.last_ack is not None:
                self.router.send(worker.identity, worker.last_ack)
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
        result = self.policy.on_push(worker.worker_id, push, live)  # may still refuse it
        # Booked only now: a refused push counts nowhere, and sent again it is checked again.
        worker.last_push, worker.last_ack, worker.assignment = key, None, None
        worker.samples += push.samples
        worker.pushes += 1
        worker.booked = (push.samples, push.loss_sum, push.correct, wire_bytes)
        self.meter.record_push(push.samples, push.loss_sum, push.correct, wire_bytes)
        self.recorder.record_push(push.samples, push.loss_sum, push.correct)
        return result

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
