"""Live status: the dict a running ps-server answers a STATUS request with.

`build_status` is pure: it reads the server's parts (config, policy, membership, meter) and
returns plain msgpack data, documented field by field at `common.wire.protocol.StatusReply`. It
changes nothing, so the server's loop may call it between any two requests. What the server
does not otherwise keep (a throughput window, a count of refused requests) lives in
`StatusCounters`, which the server updates on its own thread.

This is not a metrics store: nothing here is kept after the server exits (the summary JSON is
the record of a run), and `psserver.status.prometheus` only re-exports these numbers to Prometheus.
"""

import collections
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from psserver.config import ServerConfig
from psserver.coordinator.membership import ACTIVE, Membership, WorkerRecord, WorkerState
from psserver.policies import AsyncPolicy, UpdatePolicy
from psserver.status.report import TrainingMeter

WINDOW_S = 10.0  # images/s is reported over about this many recent seconds
SAMPLE_EVERY_S = 0.5  # and sampled at most this often
# A status reply stays far below the 1 MiB header limit: 256 workers whose name and device
# membership has already cut to MAX_LABEL (120) characters each come to about 60 kB.
MAX_LISTED_WORKERS = 256


def process_cpu_seconds(pid: int) -> float | None:
    """A live process's CPU time so far (user and system, every thread), from /proc; None
    where that cannot be read (not Linux, or the process is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def followers_cpu_seconds(pids: Iterable[int]) -> float | None:
    """The CPU time of these follower processes together; None when there are none, or one
    of them cannot be read (a partial sum would pass for the whole)."""
    seconds = [process_cpu_seconds(pid) for pid in pids]
    if not seconds or None in seconds:
        return None
    return sum(s for s in seconds if s is not None)


class StatusCounters:
    """The few numbers a status needs that the rest of the server does not keep."""

    def __init__(self, started: float) -> None:
        self.started = started  # time.monotonic() when the server was built
        self.rejected_requests = 0  # requests answered with an ERROR
        # (time, samples trained so far, the process's CPU seconds so far): the oldest and
        # newest span the window that throughput and CPU use are reported over.
        self._points: collections.deque[tuple[float, int, float]] = collections.deque()

    def observe(self, now: float, samples: int, cpu_s: float) -> bool:
        """Record the meter's sample count and the server's CPU time (time.process_time());
        True when a new point was kept (at most every SAMPLE_EVERY_S), which is also a good
        moment to refresh anything derived from it."""
        if not self.due(now):
            return False
        self._points.append((now, samples, cpu_s))
        while len(self._points) > 2 and now - self._points[1][0] >= WINDOW_S:
            self._points.popleft()
        return True

    def due(self, now: float) -> bool:
        """Whether `observe` would keep a point now."""
        return not self._points or now - self._points[-1][0] >= SAMPLE_EVERY_S

    def images_per_second(self) -> float:
        if len(self._points) < 2:
            return 0.0
        (t0, s0, _), (t1, s1, _) = self._points[0], self._points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def cpu_busy(self) -> float:
        """CPU seconds per second over the window, all the server's threads together: 1.0 is
        one core kept busy. Near 1 the server's own thread is the bottleneck (add shards)."""
        if len(self._points) < 2:
            return 0.0
        (t0, _, c0), (t1, _, c1) = self._points[0], self._points[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


def _worker_status(worker: WorkerRecord, now: float) -> dict[str, Any]:
    return {
        "id": worker.worker_id,
        # As membership keeps them: printable, and cut with their real length said; cutting
        # them again here would show the length of the first cut instead.
        "name": worker.name,
        "device": worker.device,
        "state": worker.state.value,
        "pushes": worker.pushes,
        "samples": worker.samples,
        "late_dropped": worker.late,
        "rejected": worker.rejected,
        "last_seen_s": round(now - worker.last_seen, 3),
    }


def _listed_workers(membership: Membership) -> list[WorkerRecord]:
    """Active workers by id, then the most recent finished ones, at most MAX_LISTED_WORKERS."""
    workers = sorted(membership.workers.values(), key=lambda w: w.worker_id)
    active = [w for w in workers if w.state in ACTIVE]
    finished = [w for w in reversed(workers) if w.state not in ACTIVE]
    return (active + finished)[:MAX_LISTED_WORKERS]


def build_status(
    *,
    config: ServerConfig,
    version: int,
    policy: UpdatePolicy,
    membership: Membership,
    meter: TrainingMeter,
    counters: StatusCounters,
    phase: str,
    now: float,
    cpu_s: float,
    followers_cpu_s: float | None = None,
    checkpoints: dict[str, Any] | None = None,
    waiting_for: str | None = None,
    shards_joining: list[int] | None = None,
) -> dict[str, Any]:
    """The STATUS_REPLY body: plain data with string keys only."""
    plan = policy.plan
    current = None
    if plan is not None:
        current = {"epoch": plan.epoch, "roster": list(plan.roster), "steps_per_shard": plan.steps}
    staleness = None
    if isinstance(policy, AsyncPolicy):
        staleness = policy.staleness_summary()
    last_evaluation = None
    if meter.evaluations:
        last = meter.evaluations[-1]
        last_evaluation = {
            "epoch": last["epoch"],
            "step": last["step"],
            "accuracy": last["test_accuracy"],
            "loss": last["test_loss"],
        }
    wall = meter.wall_seconds
    states = collections.Counter(w.state.value for w in membership.workers.values())
    states.update(membership.retired.states)
    listed = _listed_workers(membership)
    return {
        "phase": phase,
        "waiting_for": waiting_for,  # what training waits for, while it cannot go on
        # The follower shards yet to join: registrations are held until they have.
        "shards_joining": shards_joining or [],
        "mode": config.mode,
        "model": config.model,
        "dataset": config.dataset,
        "step": version,
        "max_steps": config.max_steps,
        "uptime_s": round(now - counters.started, 3),
        "training_s": round(wall, 3),
        "epoch": {
            "completed": policy.full_epochs,  # trained to the end: what --epochs counts
            "abandoned": policy.abandoned_epochs,
            "total": config.epochs,
            "current": current,
        },
        "workers_expected": config.workers,
        "min_workers": config.min_workers,
        "rejected_requests": counters.rejected_requests,
        "late_gradients": sum(w.late for w in membership.workers.values())
        + membership.retired.late,
        "throughput": {
            "images_per_second": counters.images_per_second(),
            "window_s": WINDOW_S,
            "overall_images_per_second": meter.images_per_second,
            "samples": meter.samples,
            "gradients": meter.pushes,
        },
        "server_cpu": {
            "seconds": round(cpu_s, 3),
            "busy": counters.cpu_busy(),
            "followers_seconds": None if followers_cpu_s is None else round(followers_cpu_s, 3),
        },
        "staleness": staleness,
        "last_evaluation": last_evaluation,
        "checkpoints": checkpoints,
        "worker_states": {state.value: states.get(state.value, 0) for state in WorkerState},
        "workers": [_worker_status(w, now) for w in listed],
        "workers_omitted": len(membership.workers) - len(listed) + membership.retired.workers,
    }
