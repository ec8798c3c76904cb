"""`ps-bench comm --agent HOST ...` and `ps-bench train --agent HOST ...`: the clients run
on other hosts, through their agents.

The coordinator (this process, on the server host) says hello to every agent first, so that
an agent that is down, busy or of another release stops the benchmark before anything runs.
Then, in each phase, client i (a floor client, synthetic worker, ps-worker or DDP rank) runs
on agent i mod A; the coordinator waits for every agent's results while it watches its own
server, and cancels the agents' clients if anything fails. With shard agents, a sharded
run's leader runs here and its followers on them (psserver.bench.remoteshards).

What this is not: the link to one agent, its requests and replies (psserver.bench.agentlink),
nor what the agent does with them (psserver.bench.agent), nor placing follower shards.
"""

import contextlib
import sys
import time
from types import TracebackType
from typing import Any

import zmq

from common.errors import PSError
from common.wire.protocol import PROTOCOL_VERSION
from psserver.bench.addresses import source_address_towards
from psserver.bench.agentlink import REPLY_GRACE_S, AgentLink, agent_endpoint, round_robin
from psserver.bench.clients import CLIENT_TIMEOUT_S, AgentWork
from psserver.bench.procs import ProcessGroup
from psserver.bench.remoteshards import RemoteFollowers
from psserver.cli.devices import choose_devices


def local_address_towards(endpoint: str) -> str:
    """This host's address on its route to `endpoint`: what an agent there dials back."""
    try:
        return source_address_towards(endpoint)
    except OSError as exc:
        raise PSError(
            f"cannot find a route to the agent at {endpoint} ({exc}); check the host name, "
            "or pass this host's address with --host"
        ) from None


class RemoteClients:
    """Clients on the agents' hosts; the servers listen on `server_host` (and `server_port`,
    if given), which they dial. With `shard_agents`, a sharded run's followers run there
    (`shards`)."""

    def __init__(
        self,
        agents: list[str],
        host: str | None,
        port: int | None = None,
        shard_agents: list[str] | None = None,
    ) -> None:
        self.server_port = port
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.links = [AgentLink(self.context, agent_endpoint(agent)) for agent in agents]
        shard_links = [
            AgentLink(self.context, agent_endpoint(agent)) for agent in shard_agents or []
        ]
        self.shards = RemoteFollowers(shard_links, [], port)
        try:
            self.hosts = [self._greet(link) for link in self.links]
            self.shards.hosts = [self._greet(link) for link in shard_links]
            self.server_host = host or local_address_towards(self.links[0].endpoint)
        except BaseException:
            self.close()
            raise

    @property
    def places_followers(self) -> bool:
        return bool(self.shards.links)

    def followers(
        self,
        leader: str,
        num_shards: int,
        threads: int = 1,
        timeout: float = CLIENT_TIMEOUT_S,
        shard_secret: bytes | None = None,
    ) -> contextlib.AbstractContextManager[None]:
        """Follower shards 1..K-1 on the shard agents while the block runs (see
        RemoteFollowers.run)."""
        return self.shards.run(leader, num_shards, threads, timeout, shard_secret)

    @staticmethod
    def _greet(link: AgentLink) -> dict[str, Any]:
        hello = link.hello()
        if hello.get("wire_protocol") != PROTOCOL_VERSION:
            raise PSError(
                f"the agent at {link.endpoint} runs wire protocol {hello.get('wire_protocol')}, "
                f"this host {PROTOCOL_VERSION}: install the same release on every host"
            )
        if hello.get("busy"):
            raise PSError(
                f"the agent at {link.endpoint} is busy with another benchmark; wait for it to "
                "end, or restart that agent"
            )
        return {
            "agent": link.endpoint, "host": hello.get("host"), "cores": hello.get("cores"),
            "gpus": hello.get("gpus", 0),
        }  # fmt: skip

    def __enter__(self) -> "RemoteClients":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for link in [*self.links, *self.shards.links]:
            link.socket.close()
        self.context.term()

    def placement(self, count: int) -> dict[int, list[int]]:
        """Which clients each agent runs: client i on agent i mod A."""
        return round_robin(list(range(count)), len(self.links))

    def describe(self, count: int) -> list[dict[str, Any]]:
        return [
            {**self.hosts[agent], "clients": indices}
            for agent, indices in self.placement(count).items()
        ]

    def devices(self, count: int, device: str) -> list[str]:
        """Client i's device on its agent's host, as ps-local would choose there: one GPU
        each where that host has enough for its clients, else the CPU (--device auto).

        With --device auto, GPUs are used only if every host has enough: DDP's ranks pick
        their backend from their device (NCCL on a GPU, gloo on the CPU), and ranks of two
        backends in one group wait for each other for ever. Mixed hardware would not compare
        like with like either."""
        chosen = ["cpu"] * count
        short = []  # hosts whose clients go on the CPU: too few GPUs for them (or --device cpu)
        for agent, indices in self.placement(count).items():
            gpus = int(self.hosts[agent]["gpus"] or 0)
            try:
                mine = choose_devices(len(indices), device, gpus)
            except PSError as exc:
                raise PSError(f"on {self.hosts[agent]['host']} ({self.links[agent].endpoint}): "
                              f"{exc}") from None  # fmt: skip
            for index, chosen_device in zip(indices, mine, strict=True):
                chosen[index] = chosen_device
            if "cpu" in mine:
                short.append(self.hosts[agent]["host"])
        if short and any(name != "cpu" for name in chosen):
            print(f"ps-bench: {', '.join(short)} cannot give each of its clients a GPU, so "
                  "every client runs on the CPU (give every host enough GPUs, or fewer "
                  "clients each, to train on GPUs)", file=sys.stderr)  # fmt: skip
            return ["cpu"] * count
        return chosen

    def run(
        self,
        group: ProcessGroup,
        phase: str,
        job: AgentWork,
        count: int,
        timeout: float = CLIENT_TIMEOUT_S,
    ) -> list[dict[str, Any]]:
        """Run clients 0..count-1 of `job` on the agents; their results, in that order."""
        pending: dict[int, tuple[int, list[int]]] = {}  # agent: (request id, its clients)
        results: dict[int, dict[str, Any]] = {}
        try:
            for agent, indices in self.placement(count).items():
                request_id = self.links[agent].send(
                    "run", **job.request(indices), timeout_s=timeout
                )
                pending[agent] = (request_id, indices)
            poller = zmq.Poller()
            for link in self.links:
                poller.register(link.socket, zmq.POLLIN)
            deadline = time.monotonic() + timeout + REPLY_GRACE_S
            while pending:
                group.finished(phase)  # the server failed: say so now, not at the deadline
                self.shards.watch(phase)
                for agent in pending:
                    self.links[agent].check_alive(phase)
                if time.monotonic() > deadline:
                    names = ", ".join(self.links[agent].endpoint for agent in pending)
                    raise PSError(f"{phase}: no results from the agents at {names}")
                poller.poll(100)
                for agent, (request_id, indices) in list(pending.items()):
                    reply = self.links[agent].reply(request_id)
                    if reply is None:
                        continue
                    results.update(self._results(agent, phase, indices, reply))
                    del pending[agent]
        except BaseException:
            for agent in pending:  # their clients would otherwise run on against nothing
                self.links[agent].send("cancel")
            raise
        return [results[index] for index in range(count)]

    def _results(
        self, agent: int, phase: str, indices: list[int], reply: dict[str, Any]
    ) -> dict[int, dict[str, Any]]:
        results = reply.get("results")
        if not isinstance(results, list) or len(results) != len(indices):
            raise PSError(f"{phase}: the agent at {self.links[agent].endpoint} sent no results")
        return {
            index: {**result, "agent": self.links[agent].endpoint}
            for index, result in zip(indices, results, strict=True)
        }
