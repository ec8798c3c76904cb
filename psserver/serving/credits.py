"""Push credits: at most `limit` workers may send a gradient at once.

ZeroMQ receives a message in full before the server sees it, so N workers pushing at the same
moment would put N gradients (45 MB each for ResNet-18) in the server's memory. A worker
therefore sends PUSH_READY first and its PUSH only after the leader's go (a PUSH_ACK with `go`).
A credit returns when the push arrives (the next worker's transfer then overlaps the server's
work on this one) or when its holder dies or leaves, so the server holds at most `limit + 1`
gradients, for any N.

A credit free when a worker pulls is handed out with its weights (WEIGHTS.push_granted), so
in the common case, no more workers than credits, nobody ever asks. A worker that got none
asks when its gradient is ready, and waits at most for the pushes ahead of it.

A PUSH sent without asking (an older or hand-written client) is still served: the bytes are
already here, and refusing them would only make the client send them again.

A credit held longer than `hold_limit_s` while others wait is taken back (see reclaim): two
clients that asked and never pushed held both credits, and every real worker waited for ever.
Taking one back costs nothing but the memory bound: its holder's push is still served.

`PushCredits` keeps the books; `FlowControl` sends the leader's answers from them. Credits are
the leader's alone: a follower shard takes whatever slices the leader's credits let through.
"""

import collections
import logging
import math
import time
from collections.abc import Callable

from common.errors import RequestRejected
from common.wire.protocol import PushAck, Stop
from psserver.coordinator.membership import ACTIVE, Membership, WorkerRecord, WorkerState
from psserver.serving.socket import ServerSocket, SocketsAsked
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")


class PushCredits:
    def __init__(
        self,
        limit: int,
        hold_limit_s: float = math.inf,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit, self.hold_limit_s, self.clock = limit, hold_limit_s, clock
        self.granted: dict[int, float] = {}  # worker ids allowed to push now: when granted
        self.waiting: collections.deque[int] = collections.deque()

    def ask(self, worker_id: int) -> bool:
        """A worker asks to push; True: it may at once (it may ask again after a retry)."""
        if self.limit == 0 or worker_id in self.granted:  # 0: no flow control
            return True
        if len(self.granted) < self.limit:
            self.granted[worker_id] = self.clock()
            return True
        if worker_id not in self.waiting:
            self.waiting.append(worker_id)
        return False

    def offer(self, worker_id: int) -> bool:
        """With its weights, a worker gets a credit if one is free and nobody waits for it."""
        if self.limit == 0 or worker_id in self.granted:
            return True
        if self.waiting or len(self.granted) >= self.limit:
            return False
        self.granted[worker_id] = self.clock()
        return True

    def release(self, worker_id: int) -> list[int]:
        """The worker's push came, or the worker is gone: the workers to tell to go now."""
        self.granted.pop(worker_id, None)
        if worker_id in self.waiting:
            self.waiting.remove(worker_id)
        return self._admit()

    def reclaim(self) -> tuple[list[int], list[int]]:
        """Take back the credits held past `hold_limit_s` while workers wait: the holders,
        and the workers to tell to go now."""
        if not self.waiting:
            return [], []
        now = self.clock()
        stale = [w for w, since in self.granted.items() if now - since > self.hold_limit_s]
        for worker_id in stale[: len(self.waiting)]:  # no more than the waiting need
            del self.granted[worker_id]
        return stale[: len(self.waiting)], self._admit()

    def _admit(self) -> list[int]:
        admitted = []
        while self.waiting and len(self.granted) < self.limit:
            nxt = self.waiting.popleft()
            self.granted[nxt] = self.clock()
            admitted.append(nxt)
        return admitted


class FlowControl:
    """The leader's answers about credits: `go` to a worker whose turn it is, a credit taken
    back from one that held it too long, a credit passed on when its holder pushed or left."""

    def __init__(
        self,
        router: ServerSocket,
        store: ParameterStore,
        membership: Membership,
        credits: PushCredits,
    ) -> None:
        self.router, self.store, self.membership, self.credits = router, store, membership, credits
        # The sockets each worker waiting for its go asked on (socket.asked_on).
        self.asked_on = SocketsAsked()
        # Workers told of once that their credit was taken: a worker whose backward alone
        # outlasts the hold limit loses it every step, and one line says so.
        self._slow_holders: set[int] = set()

    def ask(self, worker: WorkerRecord, identity: bytes) -> None:
        """PUSH_READY: PUSH_ACK `go` now if a credit is free, else when one comes back. Only for a
        batch to push: a credit held by a worker that has none would never come back."""
        if worker.assignment is None:
            raise RequestRejected(
                "unexpected-batch",
                f"worker {worker.worker_id} asked to push, but holds no batch to push; pull "
                "before pushing",
            )
        if self.credits.ask(worker.worker_id):
            self.router.send(identity, PushAck(self.store.version, 0, False, go=True))
        else:  # its go comes on every socket it asked on
            self.asked_on.again(worker.worker_id, identity)

    def stop_waiting(self, reason: str) -> None:
        """The job is over: STOP, on every socket it asked on, to each worker still waiting
        for its go. It asked already and will not ask again, so nothing else would tell it."""
        for worker_id in self.credits.waiting:
            told = self._answer(worker_id, Stop(reason))
            if told is not None:
                told.move_to(WorkerState.STOPPED)

    def reclaim(self) -> None:
        """Credits held too long while others wait go to them (see PushCredits.reclaim)."""
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

    def release(self, worker_id: int) -> None:
        """The worker's push arrived, or it is gone: its credit goes to the next in line."""
        self.asked_on.forget(worker_id)
        for waiting_id in self.credits.release(worker_id):
            self._go(waiting_id)

    def _go(self, worker_id: int) -> None:
        """PUSH_ACK `go` to a worker that waited for a credit, or the credit on to the next."""
        if self._answer(worker_id, PushAck(self.store.version, 0, False, go=True)) is None:
            self.release(worker_id)  # gone meanwhile: the credit goes on again

    def _answer(self, worker_id: int, answer: PushAck | Stop) -> WorkerRecord | None:
        """Send a waiting worker `answer` on every socket it asked on (its last one where none
        is known). None, and nothing sent, if it is gone."""
        waiting = self.membership.workers.get(worker_id)
        if waiting is None or waiting.state not in ACTIVE:
            return None
        for identity in self.asked_on.take(worker_id, waiting.identity):
            self.router.send(identity, answer)
        return waiting
