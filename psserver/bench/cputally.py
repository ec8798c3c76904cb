"""CPU time in the timed rounds of `ps-bench comm`: the server's, its followers' and the
workers', and the shortest round that CPU time allows on the cores they share
(`CpuTally.bound_ms`).

What this is not: counting the CPU time (each client and the server measure their own and
report it in their results), nor the runs that produce it (psserver.bench.commruns).
"""

import dataclasses
from collections.abc import Sequence
from typing import Any


@dataclasses.dataclass(frozen=True)
class CpuTally:
    """CPU seconds spent in the timed rounds of one or more runs."""

    server_s: float  # the server's (a sharded server's leader only)
    workers_s: float  # all the workers' together, wherever they ran
    rounds: int  # the rounds both cover, summed over runs
    # A sharded server's followers, all together (0 without shards); None: not counted (the
    # server did not start them itself, or could not read their CPU time).
    followers_s: float | None = 0.0

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
        )

    def per_round_ms(self, workers: int) -> dict[str, float | None]:
        rounds = max(self.rounds, 1)
        return {
            "server": 1000 * self.server_s / rounds,
            "followers": None if self.followers_s is None else 1000 * self.followers_s / rounds,
            "each_worker": 1000 * self.workers_s / workers / rounds,
        }

    def bound_ms(self, cores: int) -> float | None:
        """The shortest round the CPU allows: the CPU time a round of the server, its
        followers and the workers, spread perfectly over the `cores` they share. None when
        the followers' was not counted."""
        if self.followers_s is None:
            return None
        total_s = self.server_s + self.followers_s + self.workers_s
        return 1000 * total_s / cores / max(self.rounds, 1)


def clients_cpu(
    server_s: float, results: Sequence[dict[str, Any]], rounds: int, followers_s: float | None
) -> CpuTally:
    """The CPU tally of one run from its clients' results."""
    workers_s = sum(result["cpu_seconds"] for result in results)
    return CpuTally(server_s, workers_s, rounds, followers_s)


NO_CPU = CpuTally(0.0, 0.0, 0)
