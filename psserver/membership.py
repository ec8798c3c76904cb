"""Who is in the job: registered workers, their ranks and the socket identity to reply to."""

import dataclasses
import logging

from common.errors import RequestRejected
from common.protocol import Register

log = logging.getLogger("ps.server")


@dataclasses.dataclass
class WorkerRecord:
    worker_id: int
    rank: int
    name: str
    device: str
    identity: bytes  # ZeroMQ routing id of the worker's socket; replies go here
    assignment: tuple[int, int] | None = None  # (epoch, batch) handed out with the last pull
    samples: int = 0  # training samples this worker has contributed
    pushes: int = 0
    ready: bool = False  # has pulled once: its data matched and it is training
    told_to_stop: bool = False


class Membership:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.workers: dict[int, WorkerRecord] = {}
        self._next_id = 1

    @property
    def complete(self) -> bool:
        """Training starts once every rank is taken by a worker that has asked for work."""
        ready = sum(w.ready for w in self.workers.values())
        return ready >= self.world_size

    def register(self, identity: bytes, request: Register) -> WorkerRecord:
        if len(self.workers) >= self.world_size:
            raise RequestRejected(
                "job-full",
                f"the job already has its {self.world_size} workers; start the server with "
                "--workers N for more",
            )
        record = WorkerRecord(
            worker_id=self._next_id,
            rank=min(set(range(self.world_size)) - {w.rank for w in self.workers.values()}),
            name=request.worker_name,
            device=request.device,
            identity=identity,
        )
        self._next_id += 1
        self.workers[record.worker_id] = record
        log.info(
            "worker %d registered: %s on %s (pid %d), rank %d, %d/%d workers",
            record.worker_id,
            request.worker_name,
            request.device,
            request.pid,
            record.rank,
            len(self.workers),
            self.world_size,
        )
        return record

    def lookup(self, worker_id: int, identity: bytes) -> WorkerRecord:
        record = self.workers.get(worker_id)
        if record is None:
            raise RequestRejected(
                "unknown-worker", f"worker id {worker_id} is not registered; register first"
            )
        if record.identity != identity:
            # Worker ids are small integers; only the connection that registered may use one.
            raise RequestRejected(
                "unknown-worker",
                f"worker id {worker_id} belongs to another connection; register to get your own",
            )
        return record

    def leave(self, record: WorkerRecord, reason: str) -> None:
        """A worker that never started training gives its rank back for another to take."""
        if record.ready:
            raise RequestRejected(
                "already-training",
                f"worker {record.worker_id} is already training; it cannot leave mid-run",
            )
        del self.workers[record.worker_id]
        log.warning(
            "worker %d (%s) left before training, freeing rank %d: %s",
            record.worker_id, record.name, record.rank, reason,
        )  # fmt: skip

    def all_told_to_stop(self) -> bool:
        return all(w.told_to_stop for w in self.workers.values())
