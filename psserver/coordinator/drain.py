"""The end of a job: every worker is told to stop, and nobody is left waiting for an answer.

Held pulls are answered with STOP at once, and so are the workers waiting for their go (they
asked, and will not ask again). For `grace_s` more seconds, every request that
comes is answered with STOP too (a status request with the status), so that workers in the
middle of a step hear the news on their next request (or their heartbeat) instead of timing
out. A bucket's PUSH is never answered: the PUSH that completes them hears STOP.

A job that ends before any worker came (a resumed run that was already over) waits, within
the same grace, for `newcomers` workers to register, and tells each the job is over: without
it they would retry a gone server for minutes.

A finished job may also `linger` after its summary is written (`--linger`): it goes on
answering every request the same way for that long, however many workers have heard already.
A supervisor that restarts a worker after the end (a Kubernetes Job whose pod failed as the
job finished) gets that worker told "the job is over", and it exits 0, instead of retrying a
closed port until its restarts run out. The run's owner (a JobSet that completes once every
worker has) ends the lingering server with SIGTERM.
"""

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from common.logs import counted, printable
from common.wire.protocol import WORKER, Message, Push, Register, Status, StatusReply, Stop
from psserver.coordinator.membership import ACTIVE, MAX_LABEL, Membership, WorkerRecord, WorkerState
from psserver.serving.credits import FlowControl
from psserver.serving.pulls import PullHandler
from psserver.serving.socket import ServerSocket

log = logging.getLogger("ps.server")
POLL_MS = 100


def drain(
    router: ServerSocket,
    membership: Membership,
    pulls: PullHandler[WorkerRecord],
    flow: FlowControl,
    grace_s: float,
    reason: str,
    status: Callable[[], dict[str, Any]],
    observe: Callable[[], None],
    newcomers: int = 0,
) -> None:
    flow.stop_waiting(reason)
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
        identity, message = answer_with_stop(router, membership, reason, status)
        if isinstance(message, Register):
            told.add(identity)
    missing = [w.worker_id for w in membership.active()]
    if missing:
        log.warning("workers %s did not ask again before shutdown; they will time out", missing)


def linger(
    router: ServerSocket,
    membership: Membership,
    linger_s: float,
    reason: str,
    status: Callable[[], dict[str, Any]],
    observe: Callable[[], None],
) -> None:
    """Answer every request with STOP (a status request with the status) for `linger_s`
    seconds, whoever asks and however many have heard (see the module doc)."""
    log.info(
        "the job is over; answering every worker that comes with STOP for %g s (--linger), "
        "or until stopped",
        linger_s,
    )
    deadline = time.monotonic() + linger_s
    late = 0
    while time.monotonic() < deadline:
        observe()
        if not router.poll(POLL_MS):
            continue
        _identity, message = answer_with_stop(router, membership, reason, status)
        if isinstance(message, Register) and message.form == WORKER:
            late += 1
            log.info(
                "told worker %s, which registered after the end, that the job is over",
                printable(message.worker_name, MAX_LABEL),
            )
    log.info("stopped lingering after %g s; %s told after the end", linger_s,
             counted(late, "worker"))  # fmt: skip


def answer_with_stop(
    router: ServerSocket, membership: Membership, reason: str, status: Callable[[], dict[str, Any]]
) -> tuple[bytes, Message | None]:
    """Receive one request and answer it for a job that is over: STOP, the status for a
    status request, nothing for a bucket's PUSH. Returns who asked, and what."""
    identity, message = router.receive()
    if isinstance(message, Status):
        router.send(identity, StatusReply(status()))
        return identity, message
    if isinstance(message, Push) and message.bucket >= 0:
        return identity, message  # never answered: its PUSH hears STOP
    router.send(identity, Stop(reason))
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
    return identity, message
