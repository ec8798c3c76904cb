"""The clients of a `ps-bench comm` run: floor clients or synthetic workers, N of them.

They run on this host (`LocalClients`) or on other hosts through `ps-bench agent`
(psserver.bench.remote). Either way each client writes its results as JSON (round times,
CPU seconds), and every result comes back tagged with the host it ran on and that host's
cores, so that the CPU bound can be taken host by host.
"""

import contextlib
import dataclasses
import os
import socket
from typing import Any, Literal, Protocol

from psserver.bench.procs import ProcessGroup

ClientRole = Literal["floor", "synthetic"]
CLIENT_ROLES: tuple[ClientRole, ...] = ("floor", "synthetic")
CLIENT_TIMEOUT_S = 600.0  # a run of either kind, from the first client's start


@dataclasses.dataclass(frozen=True)
class ClientJob:
    role: ClientRole
    endpoint: str  # the server's, as the clients dial it
    rounds: int  # timed rounds plus the warm-up ones
    nbytes: int = 0  # the floor's message size each way


def server_bind(clients: "Clients") -> str:
    """Where a phase's server listens: the clients' server host and port (an IPv6 address
    goes in brackets), or any free port."""
    host = f"[{clients.server_host}]" if ":" in clients.server_host else clients.server_host
    return f"tcp://{host}:{clients.server_port or '*'}"


def usable_cores() -> int:
    """The cores this process may run on, which the processes it starts inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def client_role(job: ClientJob, index: int) -> str:
    """The client's name in its process group: its log and its results file are named so."""
    return f"floor-client{index}" if job.role == "floor" else f"worker{index}"


def start_client(group: ProcessGroup, job: ClientJob, index: int) -> None:
    role = client_role(job, index)
    out = str(group.scratch / f"{role}.json")
    common = ("--server", job.endpoint, "--rounds", str(job.rounds), "--out", out)
    if job.role == "floor":
        group.start(role, "psserver.bench.floor", "client", *common, "--nbytes", str(job.nbytes))
    else:  # worker 0 of the run asks the server for its CPU time
        group.start(role, "psworker.synthetic", *common, *(["--server-cpu"] if index == 0 else []))


def read_client(group: ProcessGroup, job: ClientJob, index: int) -> dict[str, Any]:
    result: dict[str, Any] = group.read_json(f"{client_role(job, index)}.json")
    return {**result, "host": socket.gethostname(), "cores": usable_cores()}


def run_clients(
    group: ProcessGroup, phase: str, job: ClientJob, indices: list[int], timeout: float
) -> list[dict[str, Any]]:
    """Start the clients `indices` in `group`, wait for them all, and return their results."""
    for index in indices:
        start_client(group, job, index)
    group.wait(timeout, phase, roles=[client_role(job, index) for index in indices])
    return [read_client(group, job, index) for index in indices]


class Clients(Protocol):
    """Runs a job's clients 0..count-1 at once and returns their results in that order.

    `group` holds the run's server: a client runner stops early if it fails."""

    def run(
        self, group: ProcessGroup, phase: str, job: ClientJob, count: int
    ) -> list[dict[str, Any]]: ...

    @property
    def server_host(self) -> str:
        """The address the servers listen on, which the clients dial."""
        ...

    @property
    def server_port(self) -> int | None:
        """The port the servers listen on, one phase after the other (a sharded server's
        followers on the ports after it); None: any free port."""
        ...

    def describe(self, count: int) -> list[dict[str, Any]]:
        """Where clients 0..count-1 run: a host, its cores and its clients, per host."""
        ...

    @property
    def places_followers(self) -> bool:
        """Whether a sharded run's followers run elsewhere (`followers`), not beside the
        leader, which then starts them itself."""
        ...

    def followers(self, leader: str, num_shards: int) -> contextlib.AbstractContextManager[None]:
        """Runs follower shards 1..num_shards-1 of `leader` elsewhere while the block runs."""
        ...


class LocalClients:
    """Every client on this host, beside the server, which listens on loopback."""

    server_host = "127.0.0.1"
    places_followers = False

    def __init__(self, server_port: int | None = None) -> None:
        self.server_port = server_port

    def run(
        self, group: ProcessGroup, phase: str, job: ClientJob, count: int
    ) -> list[dict[str, Any]]:
        return run_clients(group, phase, job, list(range(count)), CLIENT_TIMEOUT_S)

    def followers(self, leader: str, num_shards: int) -> contextlib.AbstractContextManager[None]:
        raise AssertionError("a local sharded server starts its followers itself")

    def describe(self, count: int) -> list[dict[str, Any]]:
        return [
            {"host": socket.gethostname(), "cores": usable_cores(), "clients": list(range(count))}
        ]
