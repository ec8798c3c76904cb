"""The end of a job: every worker is told to stop, and nobody is left waiting for an answer.

Held pulls are answered with STOP at once, and so are the workers waiting for PUSH_GO (they
asked, and will not ask again). For `grace_s` more seconds, every request that
comes is answered with STOP too (a status request with the status), so that workers in the
middle of a step hear the news on their next request (or their heartbeat) instead of timing
out. A bucket's PUSH is never answered: the PUSH that completes them hears STOP.

A job that ends before any worker came (a resumed run that was already over) waits, within
the same grace, for `newcomers` workers to register, and tells each the job is over: without
it they would retry a gone server for minutes.
"""

import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from common.wire.protocol import Push, Register, Status, StatusReply, Stop
from psserver.coordinator.membership import ACTIVE, Membership, WorkerState
from psserver.serving.pulls import PullHandler
from psserver.serving.socket import ServerSocket

log = logging.getLogger("ps.server")
POLL_MS = 100


def drain(
    router: ServerSocket,
    membership: Membership,
    pulls: PullHandler,
    waiting_for_go: Iterable[int],  # the workers that asked for PUSH_GO, by id
    grace_s: float,
    reason: str,
    status: Callable[[], dict[str, Any]],
    observe: Callable[[], None],
    newcomers: int = 0,
) -> None:
    for worker_id in waiting_for_go:
        waiting = membership.workers.get(worker_id)
        if waiting is not None and waiting.state in ACTIVE:
            router.send(waiting.identity, Stop(reason))
            waiting.move_to(WorkerState.STOPPED)
    pulls.stop_all(reason)
    deadline = time.monotonic() + grace_s
    told: set[bytes] = set()  # the newcomers told, by connection
    if newcomers:
        log.info("telling the workers that register in the next %g s that the job is over", grace_s)
    while (membership.active() or len(told) < newcomers) and time.monotonic() < deadline:
        membership.reap(time.monotonic())
        observe()
        if not router.poll(POLL_MS):
            continue
        identity, message = router.receive()
        if isinstance(message, Status):
            router.send(identity, StatusReply(status()))
            continue
        if isinstance(message, Push) and message.bucket >= 0:
            continue  # never answered: its PUSH hears STOP
        router.send(identity, Stop(reason))
        if isinstance(message, Register):
            told.add(identity)
        sender = membership.workers.get(getattr(message, "worker_id", -1))
        # A heartbeat's STOP tells the worker too: its request under way (or its next one)
        # ends with what the heartbeat heard. It may never ask here again (it waited for a
        # follower shard): waiting for it would only end in "declared dead".
        token = getattr(message, "token", "").encode()
        if (
            sender is not None
            and sender.state in ACTIVE
            and secrets.compare_digest(sender.token.encode(), token)
        ):
            sender.move_to(WorkerState.STOPPED)
    missing = [w.worker_id for w in membership.active()]
    if missing:
        log.warning("workers %s did not ask again before shutdown; they will time out", missing)
