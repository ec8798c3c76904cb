"""`--shard-agent HOST`: a sharded run's follower shards on other hosts, through their agents.

The leader runs here; follower shard i runs on shard agent (i - 1) mod S, listening on that
agent's address, for as long as the run's clients run. The agents are asked to serve before
the clients start, watched while they run (a follower that fails ends the run with its
agent's word), and told to cancel at the end, whatever happens.

What this is not: the hello to every agent and the clients' placement
(psserver.bench.remote), nor the link to one agent (psserver.bench.agentlink).
"""

import contextlib
from collections.abc import Iterator
from typing import Any

from common.errors import PSError
from psserver.bench.agentlink import REPLY_GRACE_S, AgentLink, agent_ip, round_robin
from psserver.bench.agentwire import MAX_TIMEOUT_S


class RemoteFollowers:
    """Follower shards on the shard agents behind `links` (greeted: `hosts` are their
    hellos); they listen on `server_port` and the ports after it, if given."""

    def __init__(
        self, links: list[AgentLink], hosts: list[dict[str, Any]], server_port: int | None
    ) -> None:
        self.links, self.hosts, self.server_port = links, hosts, server_port
        self._serving: list[tuple[AgentLink, int]] = []  # follower requests of the run

    def placement(self, num_shards: int) -> dict[int, list[int]]:
        """Which follower shards each shard agent runs: shard i on agent (i - 1) mod S."""
        return round_robin(list(range(1, num_shards)), len(self.links))

    def describe(self, num_shards: int) -> list[dict[str, Any]]:
        return [
            {**self.hosts[agent], "shards": shards}
            for agent, shards in self.placement(num_shards).items()
        ]

    @contextlib.contextmanager
    def run(
        self, leader: str, num_shards: int, threads: int, timeout: float, shard_secret: bytes | None
    ) -> Iterator[None]:
        """Follower shards 1..K-1 on the shard agents, each on `threads` torch threads, while
        the block runs: `watch` watches them, and they are cancelled at the end, whatever
        happens. `timeout`: how long the block may last; the agents end the followers after
        it (and a grace) should this process vanish without cancelling them. `shard_secret`:
        what they prove to the leader (sent in the clear, as everything to an agent is)."""
        lifetime = min(timeout + REPLY_GRACE_S, MAX_TIMEOUT_S)
        secret = {} if shard_secret is None else {"shard_secret": shard_secret.decode()}
        try:
            for agent, shards in self.placement(num_shards).items():
                link = self.links[agent]
                request_id = link.send(
                    "serve", leader=leader, shards=shards, num_shards=num_shards,
                    bind_host=agent_ip(link.endpoint), port=self.server_port or 0,
                    threads=threads, timeout_s=lifetime, **secret,
                )  # fmt: skip
                self._serving.append((link, request_id))
            yield
        finally:
            for link, _ in self._serving:
                link.send("cancel")
            self._serving = []

    def watch(self, phase: str) -> None:
        """A follower shard's agent answers its request when a shard failed (reply() raises
        that error) or when the leader stopped them all: the run is over, nothing to cancel."""
        for link, request_id in list(self._serving):
            try:
                reply = link.reply(request_id)
            except PSError as exc:
                raise PSError(f"{phase}: follower shards: {exc}") from None
            if reply is not None:
                self._serving.remove((link, request_id))
            else:
                link.check_alive(f"{phase}: follower shards")
