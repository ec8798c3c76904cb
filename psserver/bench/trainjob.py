"""The training processes of a `ps-bench train --agent` run, started on an agent's host.

Three kinds, each the same process `ps-bench train` starts on one host:

- `ps-worker`: a real ps-worker against the server on the coordinator's host;
- `ddp-rank`: one DistributedDataParallel rank. The rendezvous store runs in the coordinator
  (`endpoint`), so every rank dials the host that asked for it; the ranks then connect to
  each other, as DDP always does, through the network interface on their route to it;
- `apart-rank`: the same rank, training its own copy with no all-reduce (the compute bound);
- `single`: the one-process PyTorch reference.

The coordinator chooses each process's device from the GPUs its agent reported, so the
record says where everything ran. Each process's result comes back tagged with its host.
"""

import dataclasses
import socket
from typing import Any, Literal

from common.logs import counted
from psserver.bench.addresses import host_and_port, interface_towards
from psserver.bench.clients import usable_cores
from psserver.bench.procs import ProcessGroup

TrainRole = Literal["ps-worker", "ddp-rank", "apart-rank", "single"]
TRAIN_ROLES: tuple[TrainRole, ...] = ("ps-worker", "ddp-rank", "apart-rank", "single")
PROCESS_NAMES = {
    "ps-worker": "worker",
    "ddp-rank": "rank",
    "apart-rank": "rank",
    "single": "single",
}
RANK_ROLES = ("ddp-rank", "apart-rank")  # both meet at a rendezvous store


@dataclasses.dataclass(frozen=True)
class TrainJob:
    role: TrainRole
    endpoint: str  # the ps-server's, or the DDP rendezvous store's; "" for `single`
    model: str
    batch_size: int
    steps: int
    threads: int
    world_size: int  # ps-workers or DDP ranks in the run (1 for `single`)
    devices: tuple[str, ...]  # process i's device, for every i in the run
    overlap: bool = True  # ps-worker: push gradient buckets during backward

    def request(self, indices: list[int]) -> dict[str, Any]:
        """The agent's `run` request for processes `indices` of this job."""
        return {
            "role": self.role, "endpoint": self.endpoint, "model": self.model,
            "batch_size": self.batch_size, "steps": self.steps, "threads": self.threads,
            "world_size": self.world_size, "overlap": self.overlap, "indices": indices,
            "devices": [self.devices[i] for i in indices],
        }  # fmt: skip

    @classmethod
    def from_request(cls, request: dict[str, Any]) -> "TrainJob":
        """The job an agent's (checked) request describes; devices of other hosts unknown."""
        devices = ["?"] * request["world_size"]
        for index, device in zip(request["indices"], request["devices"], strict=True):
            devices[index] = device
        return cls(
            request["role"], request["endpoint"], request["model"], request["batch_size"],
            request["steps"], request["threads"], request["world_size"], tuple(devices),
            request["overlap"],
        )  # fmt: skip

    @property
    def target(self) -> str | None:
        """The endpoint its processes dial (checked by the agent); None: none."""
        return self.endpoint if self.role != "single" else None

    def describe(self, count: int) -> str:
        if self.role == "single":
            return f"the single process ({self.model})"
        kind = {"ps-worker": "ps-worker", "ddp-rank": "DDP rank"}.get(self.role, "rank")
        apart = " training apart" if self.role == "apart-rank" else ""
        return f"{counted(count, kind)}{apart} ({self.model})"

    def process_name(self, index: int) -> str:
        """Its name in the agent's process group: its log and result file are named so."""
        return f"{PROCESS_NAMES[self.role]}{index}"

    def start(self, group: ProcessGroup, indices: list[int]) -> None:
        if self.role in RANK_ROLES:
            interface = interface_towards(self.endpoint)
            if interface is not None:  # else gloo and NCCL look up the host name's address
                group.env["GLOO_SOCKET_IFNAME"] = group.env["NCCL_SOCKET_IFNAME"] = interface
        for index in indices:
            group.start(self.process_name(index), *self._command(group, index))

    def _command(self, group: ProcessGroup, index: int) -> list[str]:
        device, threads = self.devices[index], str(self.threads)
        if self.role == "ps-worker":
            return [
                "psworker.cli",
                *("--server", self.endpoint, "--device", device, "--threads", threads),
                *("--progress", "none", "--log-level", "warning", "--name", f"bench-{index}"),
                "--overlap" if self.overlap else "--no-overlap",
            ]
        reference = [
            *("--model", self.model, "--batch-size", str(self.batch_size)),
            *("--steps", str(self.steps), "--threads", threads, "--device", device),
            *("--out", str(group.scratch / f"{self.process_name(index)}.json")),
        ]
        if self.role == "single":
            return ["psserver.bench.ddp", "single", *reference]
        host, port = host_and_port(self.endpoint)
        return [
            "psserver.bench.ddp", "rank", *reference,
            *("--rank", str(index), "--world-size", str(self.world_size)),
            *("--master-addr", host, "--master-port", port, "--store-elsewhere"),
            *(("--no-sync",) if self.role == "apart-rank" else ()),
        ]  # fmt: skip

    def read(self, group: ProcessGroup, index: int) -> dict[str, Any]:
        """What process `index` measured (a DDP run's rank 0 and the single process write
        their timing; ps-workers' rates are the server's), with where it ran."""
        path = group.scratch / f"{self.process_name(index)}.json"
        timing: dict[str, Any] = group.read_json(path.name) if path.exists() else {}
        return {
            **timing, "device": self.devices[index], "host": socket.gethostname(),
            "cores": usable_cores(),
        }  # fmt: skip
