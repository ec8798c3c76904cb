"""A `ps-bench agent`'s job: the processes it runs for one request, and the command line of
a follower shard it serves.

What this is not: starting, watching or ending a job (psserver.bench.agentrunner does, on
the agent's serving loop), nor the checks of the request it comes from
(psserver.bench.agentwire).
"""

import dataclasses
from pathlib import Path
from typing import Any

from psserver.bench.addresses import tcp_endpoint
from psserver.bench.clients import AgentWork, ClientJob
from psserver.bench.procs import ProcessGroup
from psserver.bench.trainjob import TRAIN_ROLES, TrainJob


@dataclasses.dataclass
class Job:
    """Processes running for one peer's request: clients or training processes, which end
    with results, or follower shards, which run until cancelled."""

    peer_identity: bytes
    request_id: int
    group: ProcessGroup
    roles: list[str]  # the processes' names in the group
    description: str  # "2 synthetic workers", "follower shard 1"
    deadline: float
    started: float
    work: AgentWork | None  # None: follower shards
    indices: list[int]  # the processes' numbers, or the shards'


def work_for(request: dict[str, Any]) -> AgentWork:
    """What a checked `run` request asks this host to run."""
    if request["role"] in TRAIN_ROLES:
        return TrainJob.from_request(request)
    return ClientJob.from_request(request)


def describe_shards(shards: list[int]) -> str:
    return f"follower shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))}"


def follower_args(
    request: dict[str, Any], shard: int, secret_file: Path | None = None
) -> list[str]:
    """`ps-server` as follower `shard` of the leader in `request`, bound to its bind_host;
    `secret_file` holds the request's shard secret, if it has one."""
    port = request["port"] + shard if request["port"] else "*"
    secret = ["--shard-secret-file", str(secret_file)] if secret_file is not None else []
    return [
        "--shard", str(shard), "--num-shards", str(request["num_shards"]),
        "--leader", request["leader"], "--bind", tcp_endpoint(request["bind_host"], port),
        "--threads", str(shard_threads(request)), "--log-level", "warning", *secret,
    ]  # fmt: skip


def shard_threads(request: dict[str, Any]) -> int:
    """A follower shard's torch threads: the training's (train), else one (comm)."""
    return int(request.get("threads", 1))
