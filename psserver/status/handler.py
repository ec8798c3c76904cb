"""The leader's view of itself while it runs: STATUS answered, the throughput sampled, and the
Prometheus metrics refreshed at the same pace.

Anyone may ask for the status, without registering; each reply is built afresh from the
server's parts by `psserver.status.live.build_status` and sent tracked, so that askers who never
read cannot pile replies up (psserver.status.backlog). Throughput is sampled between requests, at
most every psserver.status.live.SAMPLE_EVERY_S; only then is the CPU clock read and are the
metrics published.

What it is not: the status's contents (psserver.status.live) or `ps-status` (psserver.cli.status).
It changes nothing of the job, and it is called on the server's one thread only.
"""

import time
from collections.abc import Callable
from typing import Any

from common.wire.protocol import StatusReply
from psserver.checkpoints.whole_model import WholeModel
from psserver.config import ServerConfig
from psserver.coordinator.membership import Membership, WorkerState
from psserver.coordinator.schedule import TrainingSchedule
from psserver.policies import UpdatePolicy
from psserver.serving.socket import ServerSocket
from psserver.shards.leader import ShardGroup
from psserver.status.backlog import StatusBacklog
from psserver.status.live import StatusCounters, build_status, followers_cpu_seconds
from psserver.status.prometheus import MetricsExporter
from psserver.status.report import TrainingMeter
from psserver.store.parameters import ParameterStore


class StatusHandler:
    def __init__(
        self,
        config: ServerConfig,
        router: ServerSocket,
        store: ParameterStore,
        policy: UpdatePolicy,
        membership: Membership,
        meter: TrainingMeter,
        counters: StatusCounters,
        whole_model: WholeModel,
        shards: ShardGroup | None,
        schedule: TrainingSchedule,
        metrics: MetricsExporter | None,  # --metrics-port's, stopped by stop_metrics
        follower_pids: Callable[[], list[int]],  # the followers this command started
    ) -> None:
        self.config, self.router, self.store, self.policy = config, router, store, policy
        self.membership, self.meter, self.counters = membership, meter, counters
        self.whole_model, self.shards, self.schedule = whole_model, shards, schedule
        self.metrics = metrics
        self.follower_pids = follower_pids
        self.backlog = StatusBacklog()

    def answer(self, identity: bytes) -> None:
        """A STATUS request: read-only, so anyone may ask."""
        self.backlog.admit(identity)
        self.backlog.sent(identity, self.router.send_watched(identity, StatusReply(self.status())))

    def status(self, phase: str | None = None) -> dict[str, Any]:
        now = time.monotonic()
        return build_status(
            config=self.config,
            version=self.store.version,
            policy=self.policy,
            membership=self.membership,
            meter=self.meter,
            counters=self.counters,
            phase=phase or ("training" if self.schedule.started else "waiting"),
            now=now,
            cpu_s=time.process_time(),
            followers_cpu_s=followers_cpu_seconds(self.follower_pids()),
            checkpoints=self.whole_model.checkpoint_status(now),
            waiting_for=self.waiting_for(),
            shards_joining=self.shards.waiting_for() if self.shards is not None else [],
        )

    def waiting_for(self) -> str | None:
        """What keeps training from going on, in words, while it cannot."""
        if self.shards is not None and not self.shards.ready:
            return f"follower shards {self.shards.waiting_for()} to join"
        if self.policy.plan is not None or self.policy.finished():
            return None
        ready = len(self.membership.in_state(WorkerState.WAITING))
        ready += len(self.membership.in_state(WorkerState.TRAINING))
        needed = self.config.min_workers if self.schedule.started else self.config.workers
        return f"workers, {ready} of the {needed} needed ready"

    def observe(self, phase: str | None = None) -> None:
        """Sample the throughput and, at the same pace, refresh the Prometheus metrics."""
        # Asked after every request: the CPU clock (a system call that sums every thread's
        # time) is read only when a point is due.
        now = time.monotonic()
        if not self.counters.due(now):
            return
        if self.counters.observe(now, self.meter.samples, time.process_time()) and self.metrics:
            self.metrics.publish(self.status(phase))

    def stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None
