"""Gradients in, on every shard: a PUSH (a whole slice, one bucket of it, or the PUSH that
completes its buckets) authenticated, checked, and handed to where it goes.

One handler serves the leader and the follower shards (`PushHandler`). What differs is a
parameter of it:

- who may push (`Senders.authenticate`): on the leader its membership (a registered worker,
  its token and CURVE key, psserver.coordinator.membership); on a follower the roster of the
  leader's workers (psserver.shards.roster).
- where a checked push goes (`Intake`): on the leader `PolicyIntake`, which hands it to the
  policy, which applies it; on a follower its staging (psserver.serving.staging.SliceStaging),
  where it waits for the leader's COMMIT.
- push credits (psserver.serving.credits.FlowControl) and a forgotten worker's push answered
  again exist only on the leader: None on a follower.

Every shard checks every PUSH with the same code (psserver.serving.validation.check_push), a
retry included.

Gradients in parts. A worker sends one PUSH per bucket of a shard's slice (bucket 0..N-1) while
backward runs, and then the PUSH that completes them (bucket -1, parts N), all on one
connection, so they arrive in that order. Parts get no reply (the worker is not waiting for
one): a part the shard refuses is remembered, and the completing PUSH is answered with that
refusal. A PUSH whose parts did not all come (its connection was replaced, say) is answered
with "incomplete-push"; the worker computes the step again, and the parts that did come count
once. Every shard keeps these books in a `PartialPush` and answers the completing PUSH with
`check_complete`; what differs is when a part is applied:

- the leader hands each part to its policy at once (psserver.policies), so only the books are
  kept (`PartLedger`); a part of the same batch sent again is ignored, also when it was
  computed again on newer weights (async). (In sync mode a bucket that already had every
  worker's part may have been applied meanwhile, so the step computed again sees those
  buckets updated; this happens only when a connection is replaced mid-push.)
- a follower keeps the gradients themselves until the leader names them
  (psserver.serving.staging).

On the leader, `PolicyIntake` deduplicates by (version, epoch, batch): a retry of a push already
handled is answered with the same PUSH_ACK and never applied twice. A push whose step is still
open is answered, when it closes, on every socket it came on (psserver.serving.socket.asked_on):
a server stopped while its worker sent it again may read the old socket's copy last.

A sync gradient for a step that has closed, or whose epoch was abandoned (too few workers
left), is dropped and answered `applied=False`, also when the abandoned step had taken it
already. The policy decides when an update happens and who is acknowledged; `PolicyIntake`
sends the answers (after the COMMIT that tells the follower shards to apply it).
"""

import dataclasses
import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

from common.compression import wire_bytes
from common.errors import RequestRejected
from common.job import JobSpec
from common.logs import counted
from common.wire.protocol import Push, PushAck
from psserver.coordinator.membership import ACTIVE, Membership, WorkerRecord, WorkerState
from psserver.policies import StepResult, UpdatePolicy
from psserver.serving.credits import FlowControl
from psserver.serving.socket import ServerSocket, SocketsAsked
from psserver.serving.validation import check_assignment, check_push, push_bytes
from psserver.shards.leader import ShardGroup
from psserver.status.report import TrainingMeter, UpdateRecorder
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")
Worker = TypeVar("Worker")  # what `Senders.authenticate` returns: the leader's record, an id
Worker_co = TypeVar("Worker_co", covariant=True)
Worker_contra = TypeVar("Worker_contra", contravariant=True)
Piece = tuple[torch.Tensor, torch.Tensor]  # (values, indices) of one bucket
# The epoch and batch a gradient is for. Not the weights version: a step computed again (async
# after "incomplete-push") is on newer weights, and its parts already applied must not count
# twice. Within an epoch, (epoch, batch) names one sync step or one async shard batch.
PushKey = tuple[int, int]
StepKey = tuple[int, int, int]  # (version, epoch, batch): a step, and the pushes made for it


@dataclasses.dataclass
class PartialPush:
    """A worker's push as far as it came: on any shard."""

    key: tuple[int, ...]  # the step it is for: PushKey on the leader, StepKey on a follower
    received: set[int] = dataclasses.field(default_factory=set)  # bucket indices in parts
    wire_bytes: int = 0
    # Why a part of it was refused (the first refusal): the completing PUSH is answered with
    # it, and a follower's commit skips it.
    refusal: RequestRejected | None = None
    # A follower's: the gradient of each bucket, kept until the leader names it (a whole
    # push fills every bucket), and the connection it came on, where applied buckets stream.
    pieces: dict[int, Piece] = dataclasses.field(default_factory=dict)
    identity: bytes = b""

    @property
    def refused(self) -> bool:
        return self.refusal is not None

    @property
    def in_parts(self) -> bool:
        """Sent bucket by bucket, so it is worth streaming back."""
        return bool(self.received)


def check_complete(partial: PartialPush | None, parts: int, num_buckets: int, where: str) -> None:
    """The PUSH that completes a push sent in `parts` buckets: raise the refusal of one of
    them, or "incomplete-push" if some did not come (the worker computes the step again; the
    parts that did come are kept, and count once). `where`: the slice, as the reply names it."""
    if partial is not None and partial.refusal is not None:
        raise partial.refusal
    missing = sorted(set(range(num_buckets)) - (partial.received if partial else set()))
    if parts != num_buckets or missing:
        raise RequestRejected(
            "incomplete-push",
            f"the PUSH announces {counted(parts, 'part')} of {num_buckets}, and buckets "
            f"{missing}{where} did not arrive before it; compute the step again",
        )


def push_key(message: Push) -> PushKey:
    return message.epoch, message.batch


def step_key(message: Push) -> StepKey:
    return message.version, message.epoch, message.batch


class PartLedger:
    """The leader's books: one push being assembled per worker; its policy took each part."""

    def __init__(self, num_buckets: int) -> None:
        self.num_buckets = num_buckets
        self._partial: dict[int, PartialPush] = {}  # worker id -> its push being assembled

    def _partial_for(self, worker_id: int, part: Push) -> PartialPush:
        """The books for this part's push; a part of another step starts them over."""
        partial = self._partial.get(worker_id)
        if partial is None or partial.key != push_key(part):
            partial = self._partial[worker_id] = PartialPush(push_key(part))
        return partial

    def admit(self, worker_id: int, part: Push) -> bool:
        """Whether the policy should take this part: not one already taken for the same push,
        and not after an earlier part of it was refused."""
        partial = self._partial_for(worker_id, part)
        return partial.refusal is None and part.bucket not in partial.received

    def record(self, worker_id: int, part: Push) -> None:
        partial = self._partial[worker_id]
        partial.received.add(part.bucket)
        partial.wire_bytes += wire_bytes(part.grads)

    def refuse(self, worker_id: int, part: Push, refusal: RequestRejected) -> None:
        partial = self._partial_for(worker_id, part)
        partial.refusal = partial.refusal or refusal

    def complete(self, worker_id: int, push: Push) -> int:
        """Check that every part of this PUSH came and was taken; returns their wire bytes.

        Raises as `check_complete` (the books of a refused push go; those of an incomplete
        one are kept, so that the parts sent again when the worker retries count once)."""
        partial = self._partial.get(worker_id)
        if partial is not None and partial.key != push_key(push):
            partial = None  # the books of another step
        if partial is not None and partial.refusal:
            del self._partial[worker_id]
        check_complete(partial, push.parts, self.num_buckets, "")
        assert partial is not None  # check_complete raised otherwise
        del self._partial[worker_id]
        return partial.wire_bytes

    def forget(self, worker_id: int) -> None:
        self._partial.pop(worker_id, None)

    def in_flight(self) -> set[int]:
        """The workers with parts of a push here whose PUSH has not come yet."""
        return set(self._partial)


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
        it in the reply to that PUSH (see PartialPush)."""
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
        # The sockets each worker's push still waiting for its step came on (socket.asked_on).
        self.asked_on = SocketsAsked()

    def forget(self, worker_id: int) -> None:
        """A worker left or died: its parts are void and its credit is free."""
        self.parts.forget(worker_id)
        self.flow.release(worker_id)
        self.asked_on.forget(worker_id)

    # ---- the Intake ------------------------------------------------------------------------

    def admit_part(self, worker: WorkerRecord, part: Push) -> bool:
        return self.parts.admit(worker.worker_id, part)

    def take_part(self, worker: WorkerRecord, identity: bytes, part: Push) -> None:
        check_assignment(worker.worker_id, worker.assignment, part)
        # The policy adds it, or says it is late (its PUSH will be answered so).
        if self.policy.on_part(worker.worker_id, part, self.live()):
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
        if worker.last_push == key:  # a retried push, or the first one read after it
            if not self.policy.pending(worker.worker_id) and worker.last_ack is not None:
                return worker.last_ack
            self.asked_on.again(worker.worker_id, identity)  # each answered
            return None
        if self.policy.is_late(push):
            worker.last_push, worker.assignment = key, None
            self.asked_on.first(worker.worker_id, identity)
            self.parts.forget(worker.worker_id)  # its parts are void with it
            if push.version < self.store.version:
                why = f"late: the server is at step {self.store.version}"
            else:
                why = f"its epoch {push.epoch} ended without that step (abandoned)"
            self._drop(worker, push.version, why)
            return None
        check_assignment(worker.worker_id, worker.assignment, push)
        nbytes = push_bytes(push)
        if push.parts:
            nbytes += self.parts.complete(worker.worker_id, push)
        result = self.policy.on_push(worker.worker_id, push, self.live())  # may still refuse it
        # Booked only now: a refused push counts nowhere, and sent again it is checked again.
        worker.last_push, worker.last_ack, worker.assignment = key, None, None
        self.asked_on.first(worker.worker_id, identity)
        worker.samples += push.samples
        worker.pushes += 1
        worker.booked = (push.samples, push.loss_sum, push.correct, nbytes)
        self.meter.record_push(push.samples, push.loss_sum, push.correct, nbytes)
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
        self._answer(worker, send)

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
            self._answer(worker, worker.state is WorkerState.TRAINING)

    def _answer(self, worker: WorkerRecord, send: bool) -> None:
        """Send `worker.last_ack` on every socket its push came on (module doc), or where none
        is known, on the socket of its last request."""
        sockets = self.asked_on.take(worker.worker_id, worker.identity)
        ack = worker.last_ack
        if send and ack is not None:
            for identity in sockets:
                self.router.send(identity, ack)
