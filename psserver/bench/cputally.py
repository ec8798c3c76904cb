"""CPU time in the timed rounds of `ps-bench comm`: the server's, its followers' and the
workers', host by host, and the shortest round that CPU time allows (`CpuTally.bound_ms`).

What this is not: counting the CPU time (each client and the server measure their own and
report it in their results), nor the runs that produce it (psserver.bench.commruns).
"""

import dataclasses
import socket
from collections.abc import Sequence
from typing import Any

# (host, its cores, CPU seconds): the clients that ran on one host other than this one.
HostCpu = tuple[str, int, float]


@dataclasses.dataclass(frozen=True)
class CpuTally:
    """CPU seconds spent in the timed rounds of one or more runs."""

    server_s: float  # the server's (a sharded server's leader only)
    workers_s: float  # all the workers' together, wherever they ran
    rounds: int  # the rounds both cover, summed over runs
    # A sharded server's followers, all together (0 without shards); None: not counted (the
    # server did not start them itself, or could not read their CPU time).
    followers_s: float | None = 0.0
    # The workers' CPU seconds on each other host (with `--agent`), which has cores of its
    # own; empty when every worker ran beside the server.
    elsewhere: tuple[HostCpu, ...] = ()

    def __add__(self, other: "CpuTally") -> "CpuTally":
        followers = (
            None
            if self.followers_s is None or other.followers_s is None
            else self.followers_s + other.followers_s
        )
        return CpuTally(
            self.server_s + other.server_s,
            self.workers_s + other.workers_s,
            self.rounds + other.rounds,
            followers,
            by_host([*self.elsewhere, *other.elsewhere]),
        )

    def per_round_ms(self, workers: int) -> dict[str, float | None]:
        rounds = max(self.rounds, 1)
        return {
            "server": 1000 * self.server_s / rounds,
            "followers": None if self.followers_s is None else 1000 * self.followers_s / rounds,
            "each_worker": 1000 * self.workers_s / workers / rounds,
        }

    def bound_ms(self, cores: int) -> float | None:
        """The shortest round the CPU allows: on each host, the CPU time a round of what ran
        there (the server, its followers and the workers beside them on this one, with its
        `cores`), spread perfectly over its cores; the busiest host's. None when the
        followers' was not counted."""
        if self.followers_s is None:
            return None
        elsewhere_s = sum(seconds for _, _, seconds in self.elsewhere)
        here_s = self.server_s + self.followers_s + self.workers_s - elsewhere_s
        busiest_s = max([here_s / cores] + [s / c for _, c, s in self.elsewhere])
        return 1000 * busiest_s / max(self.rounds, 1)


def clients_cpu(
    server_s: float, results: Sequence[dict[str, Any]], rounds: int, followers_s: float | None
) -> CpuTally:
    """The CPU tally of one run from its clients' results, each host's apart."""
    # A host of the same name is this one: the link lab's namespaces share its cores too.
    here = socket.gethostname()
    elsewhere = [(r["host"], r["cores"], r["cpu_seconds"]) for r in results if r["host"] != here]
    return CpuTally(
        server_s,
        sum(result["cpu_seconds"] for result in results),
        rounds,
        followers_s,
        by_host(elsewhere),
    )


def by_host(entries: Sequence[HostCpu]) -> tuple[HostCpu, ...]:
    """One entry per host: the CPU seconds of the entries of each added up."""
    seconds: dict[tuple[str, int], float] = {}
    for host, cores, spent in entries:
        seconds[host, cores] = seconds.get((host, cores), 0.0) + spent
    return tuple((host, cores, spent) for (host, cores), spent in seconds.items())


NO_CPU = CpuTally(0.0, 0.0, 0)
