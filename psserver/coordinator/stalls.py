"""When the server's own deafness excuses the silence of those it waits to hear from.

The event loop (psserver.server) ticks every POLL_MS or so, reading requests in between. A
longer gap between two ticks means that the server heard nobody (it was stopped, swapped
out, or stuck in a long request): the heartbeats of that time wait in its socket, unread, and
must not count as the silence of its workers (nor of its follower shards).

The excuse is bounded: a silence is excused once. Whoever was not heard from since a stall
excused them gets no second excuse, so a worker that is really gone is declared dead at most
--worker-timeout (and a tick) after the first stall that excused it, within about twice
--worker-timeout of its death, even when every tick is slow (a loaded machine). Excusing
every slow tick, as the server used to, declared nobody dead there, ever. Those heard between
two stalls are excused at each: a server stopped twice in a row keeps its workers.

What it is not: the reaping (psserver.coordinator.membership, psserver.shards.leader), nor the
excuses for the times the server knows it was busy (an evaluation, a checkpoint), which excuse
everyone.
"""

from collections.abc import Mapping

MAX_TICK_GAP_S = 1.0  # a longer gap between two ticks: the loop was deaf


class StallWatch:
    """Measures the gaps between the loop's ticks, and says whose silence a gap excuses.
    Times are the caller's (time.monotonic in the server, a fake clock in tests)."""

    def __init__(self, worker_timeout: float, now: float) -> None:
        # At most a quarter of the timeout: a gap that long already eats into it.
        self.limit_s = min(MAX_TICK_GAP_S, worker_timeout / 4)
        self._last_tick = now
        # kind ("workers", "shards") -> number -> the last-heard time its excuse gave it
        self._excused: dict[str, dict[int, float]] = {}

    def deaf_for(self, now: float) -> float:
        """The seconds the loop was deaf before this tick at `now`; 0.0 if it ticked in time."""
        gap, self._last_tick = now - self._last_tick, now
        return gap if gap > self.limit_s else 0.0

    def excuse(self, kind: str, last_heard: Mapping[int, float], now: float) -> dict[int, float]:
        """After a deaf gap: the new last-heard time of each of `last_heard` (workers or
        shards by number): `now` for those heard since their last excuse (or never excused),
        unchanged for the others, whose silence goes on counting from that excuse."""
        before = self._excused.get(kind, {})
        # A last-heard time still equal to the one the excuse set: nothing was heard since.
        after = {
            number: heard if before.get(number) == heard else now
            for number, heard in last_heard.items()
        }
        self._excused[kind] = after  # who is gone from `last_heard` is forgotten here too
        return dict(after)
