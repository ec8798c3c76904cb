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
    told_to_stop: bool = False


class Membership:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.workers: dict[int, WorkerRecord] = {}
        self._next_id = 1

    @property
    def complete(self) -> bool:
        return len(self.workers) >= self.world_size

    def register(self, identity: bytes, request: Register) -> WorkerRecord:
        if self.complete:
            raise RequestRejected(
                "job-full",
                f"the job already has its {self.world_size} workers; start the server with "
                "--workers N for more",
            )
        record = WorkerRecord(
            worker_id=self._next_id,
            rank=len(self.workers),
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

    def all_told_to_stop(self) -> bool:
        return all(w.told_to_stop for w in self.workers.values())
