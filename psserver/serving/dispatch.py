"""The leader's request dispatch: which handler answers each kind of request, after the check
that a worker's request carries its registration's token.

STATUS needs no registration (anyone may ask), a bucket's PUSH is decided by its own ledger
(psserver.serving.parts), REGISTER (a worker's, or a follower shard's, which the sender's CURVE
key decides) and HEARTBEAT by admission; every other request (PULL, PUSH_READY, PUSH, LEAVE)
must name a registered worker with its token, and, where the worker registered with a CURVE
key, come with that key (psserver.coordinator.membership). A message a server does not take
(a follower's, a reply), and a PULL for another shard's slice, are refused.

What this is not: the work each request does (the handlers), nor the loop that reads the
requests (psserver.server), nor decoding them and answering what fails (psserver.serving.requests).
"""

from collections.abc import Callable

from common.errors import RequestRejected
from common.wire.protocol import (
    Heartbeat,
    Leave,
    Message,
    Pull,
    Push,
    PushReady,
    Register,
    Status,
    Stop,
)
from psserver.coordinator.admission import Admission
from psserver.coordinator.membership import Membership
from psserver.coordinator.schedule import TrainingSchedule
from psserver.serving.pulls import PullHandler
from psserver.serving.pushes import PushHandler
from psserver.serving.socket import ServerSocket
from psserver.status.handler import StatusHandler


class RequestDispatch:
    def __init__(
        self,
        router: ServerSocket,
        membership: Membership,
        admission: Admission,
        pulls: PullHandler,
        pushes: PushHandler,
        schedule: TrainingSchedule,
        status: StatusHandler,
        tick: Callable[[], None],  # the server's tick, after a pull is held
    ) -> None:
        self.router, self.membership, self.admission = router, membership, admission
        self.pulls, self.pushes, self.schedule, self.status = pulls, pushes, schedule, status
        self.tick = tick

    def handle(self, identity: bytes, message: Message, sender_key: str) -> None:
        if isinstance(message, Status):  # read-only: anyone may ask, no registration needed
            self.status.answer(identity)
            return
        if isinstance(message, Push) and message.bucket >= 0:  # never answered
            self.pushes.on_part(identity, message, sender_key, self.schedule.live())
            return
        if isinstance(message, Register):
            self.admission.on_register(identity, message, sender_key)
            return
        if not isinstance(message, (Pull, Push, PushReady, Leave, Heartbeat)):
            raise RequestRejected(
                "unexpected-message", f"a server does not accept {type(message).__name__}"
            )
        if isinstance(message, Heartbeat):
            self.admission.on_heartbeat(identity, message, sender_key)
            return
        if isinstance(message, Pull) and message.shard != 0:
            raise RequestRejected(
                "wrong-shard",
                f"this is shard 0, the leader; a PULL for shard {message.shard} goes to that "
                "shard (the job's shard_endpoints)",
            )
        if isinstance(message, Push) and self.pushes.answer_forgotten(
            identity, message, sender_key
        ):
            return  # sent before its worker was forgotten: whether it was applied
        worker = self.membership.authenticate(
            message.worker_id, message.token, identity, sender_key
        )
        if isinstance(message, Pull):
            self.pulls.hold(worker, message)
            self.tick()  # may start the job or an epoch, and answers every pull it can
        elif isinstance(message, PushReady):
            self.pushes.ask(worker)
        elif isinstance(message, Push):
            self.pushes.release_credit(worker.worker_id)
            try:
                result = self.pushes.on_push(worker, message, self.schedule.live())
            except RequestRejected:
                worker.rejected += 1
                raise
            if result is not None:
                self.schedule.acknowledge(result)
        else:
            self.membership.leave(worker, message.reason)
            self.schedule.forget(worker.worker_id)
            self.router.send(identity, Stop("left the job"))
