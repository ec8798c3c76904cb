"""Flow control on the worker's side: whether the leader's messages of one push may go now.

With job.push_credits the leader takes pushes from only so many workers at once (see
psserver.serving.credits). Unless a credit came with the weights, the worker asks with PUSH_READY
before the leader's first message of a step and does not wait for the answer there: the
leader's units it is handed meanwhile are held (their bytes stay in `flat.grads`, which nothing
writes before the next backward), and backward and the follower shards' slices go on. Waiting
inside backward would hold up every follower's bytes behind the leader's credit. `await_go`
then reads the PUSH_GO and hands back the units held, in order, for the pusher to send.

What this is not: building or sending the messages (psworker.pusher), nor deciding who gets a
credit (psserver.serving.credits).
"""

from typing import Literal

from common.errors import ServerError
from common.wire.protocol import PushGo, PushReady, Stop
from psworker.connection.client import ServerConnection


class LeaderGate:
    def __init__(self, leader: ServerConnection, push_credits: int) -> None:
        self.leader, self.push_credits = leader, push_credits
        self._ask: PushReady | None = None
        # May the leader's messages go? None: not asked yet; "asked": PUSH_READY is out and
        # its PUSH_GO not read yet; False: the ask or its answer failed, nothing goes.
        self._go: bool | Literal["asked"] | None = None
        self._held: list[int] = []  # buckets, in order; -1: the whole slice (as in PushUnit)

    def arm(self, worker_id: int, token: str, granted: bool) -> None:
        """A new step: `granted` says a credit came with the weights, so no ask is needed."""
        self._held = []
        if not self.push_credits or granted:
            self._ask, self._go = None, True
        else:
            self._ask, self._go = PushReady(worker_id, token), None

    @property
    def asked(self) -> bool:
        """Whether a PUSH_READY is out whose answer `await_go` has yet to read."""
        return self._go == "asked"

    def admit(self, bucket: int) -> bool:
        """Whether the leader's unit `bucket` may go now. Asks once per step, before the
        leader's first message; while the answer is not read, the unit is held instead.
        Raises what sending the ask raised: after that nothing of this step is admitted."""
        if self._go is None:
            assert self._ask is not None
            self._go = False  # unless the ask below goes out
            self.leader.send(self._ask)
            self._go = "asked"
        if self._go == "asked":
            self._held.append(bucket)
        return self._go is True

    def await_go(self) -> list[int] | Stop | Exception:
        """Wait for the PUSH_GO asked for: the units held meanwhile, now free to go. A STOP,
        another reply, or a failure to receive instead is returned, and nothing more goes."""
        assert self._go == "asked"
        try:
            reply = self.leader.receive()
        except Exception as exc:
            self._go = False
            return exc
        if not isinstance(reply, PushGo):
            self._go = False
            if isinstance(reply, Stop):
                return reply
            return ServerError(f"expected PUSH_GO, got {type(reply).__name__}")
        self._go = True
        held, self._held = self._held, []
        return held
