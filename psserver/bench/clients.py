"""The clients of a `ps-bench comm` run: floor clients or synthetic workers, N of them.

They run on this host (`LocalClients`) or on other hosts through `ps-bench agent`
(psserver.bench.remote). Either way each client writes its results as JSON (round times,
CPU seconds), and every result comes back tagged with the host it ran on and that host's
cores, so that the CPU bound can be taken host by host.
"""

import contextlib
import dataclasses
import functools
import os
import socket
from typing import Any, Literal, Protocol

from psserver.bench.addresses import tcp_endpoint
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

    def request(self, indices: list[int]) -> dict[str, Any]:
        """The agent's `run` request for clients `indices` of this job."""
        return {"role": self.role, "endpoint": self.endpoint, "rounds": self.rounds,
                "nbytes": self.nbytes, "indices": indices}  # fmt: skip

    @classmethod
    def from_request(cls, request: dict[str, Any]) -> "ClientJob":
        return cls(request["role"], request["endpoint"], request["rounds"], request["nbytes"])

    @property
    def target(self) -> str:
        """The endpoint its clients dial."""
        return self.endpoint

    def describe(self, count: int) -> str:
        kind = "floor client" if self.role == "floor" else "synthetic worker"
        return f"{count} {kind}{'s' if count > 1 else ''}"

    def process_name(self, index: int) -> str:
        """The client's name in its process group: its log and results file are named so."""
        return f"floor-client{index}" if self.role == "floor" else f"worker{index}"

    def start(self, group: ProcessGroup, indices: list[int]) -> None:
        for index in indices:
            out = str(group.scratch / f"{self.process_name(index)}.json")
            common = ("--server", self.endpoint, "--rounds", str(self.rounds), "--out", out)
            if self.role == "floor":
                group.start(
                    self.process_name(index), "psserver.bench.floor", "client", *common,
                    "--nbytes", str(self.nbytes),
                )  # fmt: skip
            else:  # worker 0 of the run asks the server for its CPU time
                group.start(
                    self.process_name(index), "psworker.synthetic", *common,
                    *(["--server-cpu"] if index == 0 else []),
                )  # fmt: skip

    def read(self, group: ProcessGroup, index: int) -> dict[str, Any]:
        result: dict[str, Any] = group.read_json(f"{self.process_name(index)}.json")
        return {**result, "host": socket.gethostname(), "cores": usable_cores()}


class AgentWork(Protocol):
    """Processes an agent runs for a coordinator: a ClientJob's, or a TrainJob's
    (psserver.bench.trainjob). Each ends with a result."""

    def request(self, indices: list[int]) -> dict[str, Any]: ...

    @property
    def target(self) -> str | None: ...

    def describe(self, count: int) -> str: ...

    def process_name(self, index: int) -> str: ...

    def start(self, group: ProcessGroup, indices: list[int]) -> None: ...

    def read(self, group: ProcessGroup, index: int) -> dict[str, Any]: ...


def server_bind(clients: "Clients") -> str:
    """Where a phase's server listens: the clients' server host and port (an IPv6 address
    goes in brackets), or any free port."""
    return tcp_endpoint(clients.server_host, clients.server_port or "*")


def usable_cores() -> int:
    """The cores this process may run on, which the processes it starts inherit."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_clients(
    group: ProcessGroup, phase: str, job: ClientJob, indices: list[int], timeout: float
) -> list[dict[str, Any]]:
    """Start the clients `indices` in `group`, wait for them all, and return their results.
    Any other process of the group that fails meanwhile (the server) is reported at once."""
    job.start(group, indices)
    roles = [job.process_name(index) for index in indices]
    group.wait(timeout, phase, roles=roles, watch=functools.partial(group.finished, phase))
    return [job.read(group, index) for index in indices]


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

    def followers(
        self,
        leader: str,
        num_shards: int,
        threads: int = 1,
        timeout: float = CLIENT_TIMEOUT_S,
        shard_secret: bytes | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Runs follower shards 1..num_shards-1 of `leader` elsewhere, on `threads` torch
        threads each, while the block runs (for at most `timeout` seconds); they prove
        `shard_secret` to the leader, if given."""
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

    def followers(
        self,
        leader: str,
        num_shards: int,
        threads: int = 1,
        timeout: float = CLIENT_TIMEOUT_S,
        shard_secret: bytes | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        raise AssertionError("a local sharded server starts its followers itself")

    def describe(self, count: int) -> list[dict[str, Any]]:
        return [
            {"host": socket.gethostname(), "cores": usable_cores(), "clients": list(range(count))}
        ]
