"""The clients of a `ps-bench comm` run: floor clients or synthetic workers, N of them, on this
host beside the server. Each client writes its results as JSON (round times, CPU seconds).
"""

import dataclasses
import functools
import os
from typing import Any, Literal

from psserver.bench import floor
from psserver.bench.procs import ProcessGroup
from psserver.bench.synthetic import SYNTHETIC

ClientRole = Literal["floor", "synthetic"]
CLIENT_TIMEOUT_S = 600.0  # a run of either kind, from the first client's start


@dataclasses.dataclass(frozen=True)
class ClientJob:
    role: ClientRole
    endpoint: str  # the server's, as the clients dial it
    rounds: int  # timed rounds plus the warm-up ones
    nbytes: int = 0  # the floor's message size each way

    def process_name(self, index: int) -> str:
        """The client's name in its process group: its log and results file are named so."""
        return f"floor-client{index}" if self.role == "floor" else f"worker{index}"

    def start(self, group: ProcessGroup, index: int) -> None:
        out = group.scratch / f"{self.process_name(index)}.json"
        told = {"endpoint": self.endpoint, "rounds": self.rounds, "out": out}
        if self.role == "floor":
            group.start_role(self.process_name(index), floor.CLIENT, told, {"nbytes": self.nbytes})
        else:  # worker 0 of the run asks the server for its CPU time
            group.start_role(self.process_name(index), SYNTHETIC, told, {"server_cpu": index == 0})

    def read(self, group: ProcessGroup, index: int) -> dict[str, Any]:
        result: dict[str, Any] = group.read_json(f"{self.process_name(index)}.json")
        return result


def server_bind(port: int | None) -> str:
    """Where a phase's server listens: loopback, on `port` or any free one."""
    return f"tcp://127.0.0.1:{port or '*'}"


def usable_cores() -> int:
    """The cores this process may run on, which the processes it starts inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_clients(
    group: ProcessGroup, phase: str, job: ClientJob, count: int, timeout: float = CLIENT_TIMEOUT_S
) -> list[dict[str, Any]]:
    """Start clients 0..count-1 in `group`, wait for them all, and return their results in
    that order. Any other process of the group that fails meanwhile (the server) is reported
    at once."""
    for index in range(count):
        job.start(group, index)
    roles = [job.process_name(index) for index in range(count)]
    group.wait(timeout, phase, roles=roles, watch=functools.partial(group.finished, phase))
    return [job.read(group, index) for index in range(count)]
