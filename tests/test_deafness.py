"""The rule by which the server's own deafness excuses its workers' silence
(psserver.coordinator.stalls), on a fake clock: what a stall excuses, and that a gone worker is
declared dead in bounded time even when every tick of the loop is slow."""

import pytest

from psserver.coordinator.stalls import MAX_TICK_GAP_S, StallWatch

TIMEOUT_S = 10.0  # --worker-timeout


def run_loop(
    watch: StallWatch, ticks: list[float], heard: dict[int, list[float]]
) -> dict[int, float]:
    """Tick at each of `ticks` as the server does (excuse a stall, then reap); worker `n` is
    heard at the times `heard[n]` (between ticks). Returns when each worker was declared
    dead; all are heard at 0.0, when they registered."""
    last = {number: 0.0 for number in heard}
    dead: dict[int, float] = {}
    previous = 0.0
    for now in ticks:
        for number, times in heard.items():  # the requests read since the last tick
            if number not in dead and any(previous < t <= now for t in times):
                last[number] = max(t for t in times if t <= now)
        previous = now
        if watch.deaf_for(now):
            alive = {number: seen for number, seen in last.items() if number not in dead}
            last.update(watch.excuse("workers", alive, now))
        for number, seen in last.items():
            if number not in dead and now - seen > TIMEOUT_S:
                dead[number] = now
    return dead


def test_ticks_in_time_excuse_nobody() -> None:
    watch = StallWatch(TIMEOUT_S, now=0.0)
    assert watch.deaf_for(0.1) == 0.0
    assert watch.deaf_for(0.1 + MAX_TICK_GAP_S) == 0.0  # not longer than the limit
    assert watch.deaf_for(1.2 + MAX_TICK_GAP_S) == pytest.approx(1.1)
    assert StallWatch(2.0, now=0.0).deaf_for(0.6) == 0.6  # a quarter of a short timeout


def test_a_gone_worker_is_declared_dead_although_every_tick_is_slow() -> None:
    """Every tick 1.5 s after the one before (more than MAX_TICK_GAP_S), worker 1 heard
    between all of them, worker 2 never after registering. Excusing every slow tick kept
    worker 2 alive for ever; it is excused once, and dead within 2 x --worker-timeout."""
    ticks = [1.5 * i for i in range(1, 200)]
    dead = run_loop(StallWatch(TIMEOUT_S, now=0.0), ticks, {1: [t - 0.5 for t in ticks], 2: []})
    assert list(dead) == [2], dead
    assert dead[2] <= 2 * TIMEOUT_S, dead


def test_a_stall_excuses_everyone_heard_since_the_last_one() -> None:
    """A server stopped for 3 x --worker-timeout, running for a second, then stopped as long
    again, keeps the worker it heard in between, and declares the silent one dead only
    --worker-timeout after the stall that excused it, not after the second stall."""
    ticks = [0.1 * i for i in range(1, 10)]  # in time
    ticks += [30.0 + 0.1 * i for i in range(10)]  # the first stall ends at 30 s
    ticks += [61.0 + 0.1 * i for i in range(150)]  # the second at 61 s
    heard = {1: [t - 0.05 for t in ticks], 2: [0.5]}  # 1's heartbeats queue up in a stall
    dead = run_loop(StallWatch(TIMEOUT_S, now=0.0), ticks, heard)
    assert list(dead) == [2], dead
    assert dead[2] == 61.0, dead  # 31 s after its excuse at 30 s; not excused again


def test_what_is_excused_is_kept_apart_by_kind_and_forgotten_when_gone() -> None:
    watch = StallWatch(TIMEOUT_S, now=0.0)
    assert watch.excuse("workers", {1: 0.0}, now=5.0) == {1: 5.0}
    assert watch.excuse("shards", {1: 0.0}, now=5.0) == {1: 5.0}  # another number space
    assert watch.excuse("workers", {1: 5.0}, now=9.0) == {1: 5.0}  # not heard since: no more
    assert watch.excuse("workers", {1: 7.0}, now=9.0) == {1: 9.0}  # heard since: excused
    assert watch.excuse("workers", {}, now=12.0) == {}
    assert watch.excuse("workers", {1: 9.0}, now=15.0) == {1: 15.0}  # a new record
