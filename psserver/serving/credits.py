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
"""

import collections
import math
import time
from collections.abc import Callable


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
