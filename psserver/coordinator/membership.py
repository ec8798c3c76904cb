"""Who is in the job: registered workers, their state, their token, and whether they are alive.

Every worker moves through an explicit state machine:

    REGISTERED --pull--> WAITING --epoch starts--> TRAINING --run ends--> STOPPED
        |                   |                          |
        +-------------------+--------------------------+--> LEFT (said goodbye)
                                                       +--> DEAD (silent > --worker-timeout)

A worker whose gradient the open sync step holds is declared dead only once that step has
closed: its answer (applied, or dropped with an abandoned epoch) must reach it, and a
forgotten worker's push is still answered with it when asked again (psserver.serving.pushes).

A worker joins the training only at an epoch boundary (WAITING -> TRAINING), so the data
shards of an epoch never change while it runs. Any request, including a heartbeat, counts as
a sign of life. Requests carry the worker's id and the secret token from its WELCOME, so a
worker that reconnects on a new socket keeps its identity and nobody can act in another's name.

With CURVE a token works only with the key its worker registered with: a request that carries
it from another key is refused ("wrong-key"), so a token that leaked (a log, a core dump) is
of no use to a client that holds another key the server accepts. Without CURVE the token is
not tied to anything else, and cannot usefully be: a worker's requests come from several
connections (its heartbeat's socket, and a new socket after every wait that timed out), a
ZeroMQ routing id is whatever the client sets, and the token crosses the network in clear, so
whoever can read it can also connect. A request authenticated by token moves the worker's
replies to the connection it came on (that is how a worker that reconnected gets them).
"""

import collections
import dataclasses
import enum
import logging
import secrets
import time
from collections.abc import Callable

from common.errors import RequestRejected
from common.logs import counted, printable
from common.wire.protocol import PushAck, Register
from psserver.shards.roster import new_worker_key, worker_token

log = logging.getLogger("ps.server")


class WorkerState(enum.Enum):
    REGISTERED = "registered"  # welcomed; checking its data
    WAITING = "waiting"  # asked for work; trains from the next epoch on
    TRAINING = "training"  # in the current epoch's roster
    LEFT = "left"  # left on its own
    DEAD = "dead"  # silent for longer than the worker timeout
    STOPPED = "stopped"  # told that training is over


_ALLOWED = {
    WorkerState.REGISTERED: {WorkerState.WAITING, WorkerState.LEFT, WorkerState.DEAD},
    WorkerState.WAITING: {WorkerState.TRAINING, WorkerState.LEFT, WorkerState.DEAD},
    WorkerState.TRAINING: {WorkerState.LEFT, WorkerState.DEAD},
    WorkerState.LEFT: set(),
    WorkerState.DEAD: set(),
    WorkerState.STOPPED: set(),
}
ACTIVE = {WorkerState.REGISTERED, WorkerState.WAITING, WorkerState.TRAINING}


@dataclasses.dataclass
class WorkerRecord:
    worker_id: int
    token: str
    name: str
    device: str
    identity: bytes  # ZeroMQ routing id of the socket that sent the last request
    # The z85 CURVE public key the worker registered with, "" without CURVE: its token is
    # taken only with this key.
    key: str
    # The worker's process, as it said when it registered. A process the server forgot
    # registers again as a new record with the same `process` (REGISTER.process, random):
    # that tells one process from another (psserver.status.report). Host and pid, kept for people
    # to read, cannot (containers on the host's network all run their worker as pid 1).
    hostname: str
    pid: int
    process: str
    state: WorkerState = WorkerState.REGISTERED
    last_seen: float = dataclasses.field(default_factory=time.monotonic)
    assignment: tuple[int, int] | None = None  # (epoch, batch) handed out with the last pull
    last_push: tuple[int, int, int] | None = None  # (version, epoch, batch): retries dedupe
    last_ack: PushAck | None = None  # resent when a retried push arrives again
    samples: int = 0  # training samples applied from this worker
    pushes: int = 0  # gradients applied
    # The last push booked (samples, loss sum, correct, bytes), taken back if the sync step
    # that took it is abandoned with its epoch instead of applied.
    booked: tuple[int, float, int, int] | None = None
    late: int = 0  # sync gradients dropped: their step closed, or their epoch was abandoned
    rejected: int = 0  # requests refused as invalid

    def move_to(self, state: WorkerState) -> None:
        if state is WorkerState.STOPPED and self.state in ACTIVE:
            self.state = state
            return
        if state not in _ALLOWED[self.state]:
            raise AssertionError(f"worker {self.worker_id}: {self.state.name} -> {state.name}")
        self.state = state

    def report(self) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "name": self.name,
            "device": self.device,
            "hostname": self.hostname,
            "pid": self.pid,
            "process": self.process,
            "state": self.state.value,
            "pushes": self.pushes,
            "samples": self.samples,
            "late_dropped": self.late,
            "rejected": self.rejected,
        }


MAX_LABEL = 120  # characters of a worker's name or device that the server keeps
MAX_REASON = 200  # characters of a LEAVE's reason that the server logs
# Finished workers kept one by one (for the summary and ps-status); older ones are folded
# into RetiredWorkers, so that clients that register and leave in a loop cannot make the
# server's memory, or every lookup over its workers, grow without end.
MAX_FINISHED_RECORDS = 4096


@dataclasses.dataclass
class RetiredWorkers:
    """What the finished workers no longer listed one by one did, in total."""

    workers: int = 0
    trained: int = 0  # those of them that pushed a gradient that was taken
    pushes: int = 0
    samples: int = 0
    late: int = 0
    rejected: int = 0
    states: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)

    def add(self, record: "WorkerRecord") -> None:
        self.workers += 1
        self.trained += record.pushes > 0
        self.pushes += record.pushes
        self.samples += record.samples
        self.late += record.late
        self.rejected += record.rejected
        self.states[record.state.value] += 1

    def report(self) -> dict[str, object]:
        return {
            "workers": self.workers,
            "trained": self.trained,
            "pushes": self.pushes,
            "samples": self.samples,
            "late_dropped": self.late,
            "rejected": self.rejected,
            "states": dict(self.states),
        }


class Membership:
    def __init__(self, max_workers: int, worker_timeout: float) -> None:
        self.max_workers = max_workers
        self.worker_timeout = worker_timeout
        self.workers: dict[int, WorkerRecord] = {}
        self.retired = RetiredWorkers()
        self._next_id = 1
        self.token_key = new_worker_key()  # workers' tokens are derived from it
        # Called when the active workers change (not when they stop at the job's end): the
        # follower shards hear the new roster before the worker's WELCOME goes out.
        self.on_change: Callable[[], None] | None = None

    @property
    def next_id(self) -> int:
        return self._next_id

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def active(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.state in ACTIVE]

    def in_state(self, state: WorkerState) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.state is state]

    def register(self, identity: bytes, request: Register, key: str = "") -> WorkerRecord:
        if len(self.active()) >= self.max_workers:
            raise RequestRejected("job-full", self._job_full())
        self._retire_finished()
        # Labels are kept for the job's life (its summary lists every worker): a client
        # cannot make each registration cost more than a few hundred bytes. They are kept
        # escaped, as every log line and ps-status shows them (common.logs.printable).
        record = WorkerRecord(
            worker_id=self._next_id,
            token=worker_token(self.token_key, self._next_id),
            name=printable(request.worker_name, MAX_LABEL),
            device=printable(request.device, MAX_LABEL),
            identity=identity,
            key=key,
            hostname=printable(request.hostname, MAX_LABEL),
            pid=request.pid,
            process=request.process,  # at most MAX_PROCESS_CHARS (psserver.coordinator.admission)
        )
        self._next_id += 1
        self.workers[record.worker_id] = record
        log.info(
            "worker %d registered: %s on %s (pid %d); %d active",
            record.worker_id,
            record.name,
            record.device,
            request.pid,
            len(self.active()),
        )
        self._changed()
        return record

    def unheard(self, process: str, key: str = "") -> WorkerRecord | None:
        """The record of worker process `process` (with CURVE key `key`) that has not pulled
        yet, if any: its WELCOME never reached it, since a process asks again only then
        (psserver.coordinator.admission)."""
        for record in self.workers.values():
            if (
                record.process == process
                and record.state is WorkerState.REGISTERED
                and secrets.compare_digest(record.key.encode(), key.encode())
            ):
                return record
        return None

    def _job_full(self) -> str:
        """Why a registration is refused, and what to do. Workers that crashed (a crash loop,
        a pod restarted at once) hold their places until they are declared dead."""
        full = f"the job already has {counted(self.max_workers, 'worker')} (--max-workers)"
        now = time.monotonic()
        silences = [now - w.last_seen for w in self.active()]
        silent = [s for s in silences if s > self.worker_timeout / 3]  # 2 heartbeats missed
        if not silent:
            return f"{full}; raise it on the server to admit more"
        return (
            f"{full}, {len(silent)} of them silent for {max(silent):.0f} s: the server "
            f"declares a worker dead after --worker-timeout {self.worker_timeout:g} s of "
            "silence and admits another then; try again then, or raise --max-workers"
        )

    def _retire_finished(self) -> None:
        """Fold the oldest finished records into `retired` once there are too many, a batch at
        a time so that a registration pays for it only now and then."""
        if len(self.workers) < self.max_workers + MAX_FINISHED_RECORDS:
            return
        finished = [w for w in self.workers.values() if w.state not in ACTIVE]
        excess = len(finished) - MAX_FINISHED_RECORDS * 3 // 4
        for record in sorted(finished, key=lambda w: w.worker_id)[: max(0, excess)]:
            self.retired.add(record)
            del self.workers[record.worker_id]

    def authenticate(
        self, worker_id: int, token: str, identity: bytes, key: str = "", redirect: bool = True
    ) -> WorkerRecord:
        """The record for a request, or a refusal; replies then go to the request's socket.
        `key`: the CURVE key the request came with ("" without CURVE)."""
        record = self.workers.get(worker_id)
        if record is None or not secrets.compare_digest(record.token.encode(), token.encode()):
            raise RequestRejected(
                "unknown-worker", f"worker {worker_id} is not registered here; register again"
            )
        check_key(record, key)
        if record.state not in ACTIVE:
            raise RequestRejected(
                "unknown-worker",
                f"worker {worker_id} is {record.state.value}; register again to rejoin",
            )
        if redirect:
            record.identity = identity
        record.last_seen = time.monotonic()
        return record

    def leave(self, record: WorkerRecord, reason: str) -> None:
        record.move_to(WorkerState.LEFT)
        log.warning(
            "worker %d (%s) left: %s",
            record.worker_id,
            record.name,
            printable(reason, MAX_REASON),  # the worker's own words
        )
        self._changed()

    def excuse_silence(self) -> None:
        """After the server was busy (evaluating, checkpointing), silence proves nothing."""
        now = time.monotonic()
        for record in self.active():
            record.last_seen = now

    def forgotten(self, worker_id: int, token: str, key: str = "") -> WorkerRecord | None:
        """The record of a worker the job no longer counts (dead, left), if `token` (and the
        CURVE `key`) are its: a push it sent before is still answered (psserver.serving.pushes)."""
        record = self.workers.get(worker_id)
        if record is None or record.state in ACTIVE:
            return None
        if not secrets.compare_digest(record.token.encode(), token.encode()):
            return None
        return record if secrets.compare_digest(record.key.encode(), key.encode()) else None

    def reap(self, now: float, holds: Callable[[int], bool] | None = None) -> list[WorkerRecord]:
        """Declare dead every active worker silent for longer than the timeout, except one
        whose gradient the open sync step `holds`: the step applies it (or drops it) all
        the same, and its answer must reach the worker as an acknowledgement. Forgotten
        first, the worker would hear "unknown-worker", take the gradient for not applied,
        and (top-k) send it again. It is declared dead once the step has closed."""
        dead = []
        for record in self.active():
            silent = now - record.last_seen
            if silent > self.worker_timeout and not (holds and holds(record.worker_id)):
                record.move_to(WorkerState.DEAD)
                log.warning(
                    "worker %d (%s) declared dead after %.1f s of silence (limit %.1f s)",
                    record.worker_id,
                    record.name,
                    silent,
                    self.worker_timeout,
                )
                dead.append(record)
        if dead:
            self._changed()
        return dead


def check_key(record: WorkerRecord, key: str) -> None:
    """Refuse a request whose token is right but whose CURVE key is not the one its worker
    registered with (see the module doc)."""
    if not secrets.compare_digest(record.key.encode(), key.encode()):
        raise RequestRejected(
            "wrong-key",
            f"worker {record.worker_id}'s token belongs to another CURVE key; a token is taken "
            "only from the key its worker registered with: register with your own key",
        )
