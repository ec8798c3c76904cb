"""The parameter server's event loop: one ROUTER socket, one thread, one request at a time.

Every request is decoded and validated before it touches any state; a bad one gets an ERROR
reply and is logged with its header, and the loop keeps serving. All state (store, policy,
membership) is changed on this thread only, so nothing needs a lock. Between requests, and at
least every POLL_MS, the schedule ticks (psserver.schedule): it declares silent workers dead,
closes sync steps that timed out, ends epochs and lets waiting workers in at epoch boundaries.

Lifecycle: bind -> wait for `--workers` workers to ask for work -> epochs of training (the
roster may change at each epoch boundary) -> final evaluation, checkpoint and summary ->
answer every worker's next request with STOP -> exit.
"""

import logging
import subprocess
import time
from typing import Any

import torch
import zmq

from common.data import load_split
from common.errors import CheckpointError, PSError, RequestRejected, TrainingDiverged
from common.logs import counted
from common.protocol import (
    Heartbeat,
    Leave,
    Message,
    Pull,
    Push,
    PushPart,
    PushReady,
    Register,
    ShardHello,
    Status,
    StatusReply,
    Stop,
)
from common.security import ServerSecurity
from common.sharding import shard_bucket_bounds
from psserver.admission import Admission
from psserver.backlog import StatusBacklog
from psserver.config import ServerConfig
from psserver.credits import PushCredits
from psserver.drain import drain
from psserver.keeper import ModelKeeper
from psserver.launch import FollowerExited, check_launched
from psserver.membership import ACTIVE, Membership, WorkerRecord, WorkerState
from psserver.policies import SyncPolicy, make_policy
from psserver.prometheus import MetricsExporter
from psserver.pulls import PullDesk
from psserver.pushes import PushDesk
from psserver.report import WARMUP_STEPS, TrainingMeter, UpdateRecorder
from psserver.router import ServerSocket
from psserver.schedule import TrainingSchedule
from psserver.shards import ShardGroup, ShardLost
from psserver.status import StatusCounters, build_status, followers_cpu_seconds
from psserver.store import ParameterStore

log = logging.getLogger("ps.server")
POLL_MS = 100
STARVED_POLL_MS = 1  # while pulls wait for a snapshot slot to come free
SHARD_WAIT_LOG_S = 15.0  # how often the leader says whom it still waits for
FOLLOWER_EXITED = (
    "the server stopped before training began: a follower shard it started exited (see the "
    "server's log); start the server again"
)
REFUSAL_LINGER_MS = 1000  # the most the exit waits for refusals to leave; they take far less
# Why a job stops early, as its log line and every worker's STOP say it; the error itself,
# with what to do, is the command's last line.
STOP_REASONS: dict[type[PSError], str] = {
    ShardLost: "a server shard was lost",
    CheckpointError: "the server could not write a checkpoint",
    TrainingDiverged: "training diverged (its weights or test loss are not finite)",
}


class ParameterServer:
    def __init__(
        self,
        config: ServerConfig,
        security: ServerSecurity | None = None,
        shard_secret: bytes | None = None,  # what followers prove (psserver.shard_auth)
    ) -> None:
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        source = config.data_source()
        train_size = len(load_split(source, train=True, limit=config.train_limit))
        test_set = load_split(source, train=False, limit=config.test_limit)
        self.store = ParameterStore(
            config.model,
            config.seed,
            config.lr,
            config.momentum,
            config.weight_decay,
            sparse=config.compress.startswith("topk"),
            num_shards=config.num_shards,
        )
        sizes = [p.numel() for p in self.store.model.parameters()]
        # Top-k gradients travel whole: their entries are chosen over the whole vector.
        bucket_numel = 0 if self.store.sparse else config.bucket_numel
        buckets = shard_bucket_bounds(sizes, self.store.shard_bounds, bucket_numel)
        if bucket_numel:
            log.info(
                "gradient buckets of about %.3g MB: %s per shard",
                config.bucket_size_mb,
                ", ".join(str(len(cuts) - 1) for cuts in buckets),
            )
        job = config.job_spec(
            train_size,
            self.store.num_params,
            self.store.num_buffers,
            self.store.shard_bounds,
            buckets[0],
            tuple(buckets[1:]),
        )
        self.policy = make_policy(
            config.mode,
            self.store,
            job,
            config.epochs,
            config.max_steps,
            config.min_workers,
            config.step_timeout,
            config.staleness,
            config.staleness_lr,
        )
        self.membership = Membership(config.worker_limit, config.worker_timeout)
        self.meter = TrainingMeter(warmup_pushes=WARMUP_STEPS * config.workers)
        self.recorder = UpdateRecorder(config.log_dir)  # --log-dir metrics, or a no-op
        self.counters = StatusCounters(time.monotonic())
        self.status_backlog = StatusBacklog()
        self.context = zmq.Context()
        self.shards: ShardGroup | None = None  # the follower shards, with --num-shards > 1
        # The followers this command started on this machine (one command for K shards), by
        # shard: the leader stops waiting for one that exited, and the status reports their
        # CPU time beside the server's own.
        self.launched_followers: dict[int, subprocess.Popen[bytes]] = {}
        self._shard_wait_logged = time.monotonic()
        if config.num_shards > 1:
            self.shards = ShardGroup(
                self.context,
                self.store.shard_bounds,
                security,
                timeout_s=config.worker_timeout,
                ping_interval_s=config.heartbeat_interval,
                shard_secret=shard_secret,
            )
        # A credit stands for a whole gradient's bytes: with K shards the leader receives
        # slices of 1/K the size, so K times as many fit in the same memory.
        # A credit unused for as long as a silent worker would be declared dead is given to
        # one that waits: a real push takes far less.
        self.credits = PushCredits(
            config.push_credits * config.num_shards, hold_limit_s=config.worker_timeout
        )
        self.keeper = ModelKeeper(
            config, self.store, self.policy, self.shards, test_set, self.meter, self.recorder
        )
        if config.resuming:
            self.keeper.resume()
        self.metrics: MetricsExporter | None = None
        if config.metrics_port is not None:
            self.metrics = MetricsExporter(config.metrics_port, config.bind)
        try:
            self.router = ServerSocket(
                self.context,
                config.bind,
                security,
                # Nothing legitimate is bigger than one flat tensor plus a header.
                max_message_bytes=4 * self.store.num_params + (1 << 20),
                endpoint_file=config.endpoint_file,
            )
        except BaseException:
            self._stop_metrics()
            raise
        self.endpoint = self.router.endpoint
        if self.shards is not None:
            self.shards.gate.warn_if_open(self.endpoint)
        self.admission = Admission(
            config, self.store, job, self.membership, self.shards, self.router.send
        )
        self.pulls = PullDesk(
            self.router, self.store, self.policy, self.credits, self.membership, self.meter,
            job.bucket_ranges(),
        )  # fmt: skip
        self.pushes = PushDesk(
            self.router, self.store, self.policy, job, self.membership, self.credits,
            self.meter, self.recorder, self.shards, self._count_rejected,
        )  # fmt: skip
        self.schedule = TrainingSchedule(
            config, self.store, self.policy, self.membership, self.meter, self.recorder,
            self.keeper, self.shards, self.pulls, self.pushes,
        )  # fmt: skip
        if isinstance(self.policy, SyncPolicy) and config.stream_weights:
            # Updated buckets go out as soon as they are applied (psserver.streaming).
            self.policy.on_bucket_applied = self.pulls.stream_bucket
        log.info(
            "listening on %s: %s mode, %s, %s, batch %d per worker",
            self.endpoint,
            config.mode,
            config.model,
            counted(config.workers, "worker"),
            config.batch_size,
        )

    # ---- the loop --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            try:
                trained_nothing = self.policy.finished()
                if trained_nothing:
                    self._nothing_to_train()
                while not self.policy.finished():
                    self._serve_once()
                    self._watch_shards()
                    self._tick()
                final = self.schedule.finish()
            except FollowerExited:  # the command line says which; the workers held are told
                if self.admission.refuse_waiting(FOLLOWER_EXITED):
                    self.router.linger_for_last_replies(REFUSAL_LINGER_MS)
                raise
            except (ShardLost, CheckpointError, TrainingDiverged) as exc:
                # A disk full, say, stops the job while the last checkpoint is good. The whole
                # explanation ends the output as its `Error:` line; this one says what happens
                # while the workers are told, which can take --stop-grace.
                reason = STOP_REASONS[type(exc)]
                log.error("stopping the job: %s", reason)
                self._drain(f"{reason}; the job stopped")
                raise
            # Workers started for a run that was already over hear so as they come.
            self._drain(newcomers=self.config.workers if trained_nothing else 0)
            retired = self.membership.retired
            return self.keeper.summarize(
                final,
                [w.report() for w in self.membership.workers.values()],
                retired.report() if retired.workers else None,
                keep_existing=trained_nothing,
            )
        finally:
            if self.shards is not None:
                self.shards.stop()
            self.recorder.close()
            self.router.close()
            self._stop_metrics()
            self.context.term()

    def _nothing_to_train(self) -> None:
        """A resumed run that was already over: it is evaluated and ends at once, once the
        follower shards have joined, so that they too hear STOP and end cleanly."""
        log.info(
            "the checkpoint's run is already over at step %d: nothing to train; raise "
            "--epochs or --max-steps to train on",
            self.store.version,
        )
        if self.shards is None:
            return
        deadline = time.monotonic() + self.config.worker_timeout
        while not self.shards.ready and time.monotonic() < deadline:
            self._serve_once()
            self._watch_shards()

    def _watch_shards(self) -> None:
        """While follower shards have yet to join: stop if one this command started has
        exited (it never will), and say now and then whom the leader waits for."""
        if self.shards is None or self.shards.ready:
            return
        waiting = self.shards.waiting_for()
        check_launched(self.launched_followers, waiting)
        now = time.monotonic()
        if now - self._shard_wait_logged >= SHARD_WAIT_LOG_S:
            log.info("waiting for shards %s to join", waiting)
            self._shard_wait_logged = now

    def _stop_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None

    def _serve_once(self) -> None:
        if self.router.poll(STARVED_POLL_MS if self.pulls.starved else POLL_MS):
            self.router.serve(self._handle, self._count_rejected)

    def _count_rejected(self) -> None:
        self.counters.rejected_requests += 1

    def _send(self, identity: bytes, message: Message) -> None:
        self.router.send(identity, message)

    def _handle(self, identity: bytes, message: Message, sender_key: str) -> None:
        if isinstance(message, Status):  # read-only: anyone may ask, no registration needed
            self.status_backlog.admit(identity)
            self.status_backlog.sent(
                identity, self.router.send_watched(identity, StatusReply(self._status()))
            )
            return
        if isinstance(message, ShardHello):  # the one request a CURVE key decides
            self.admission.on_shard_hello(identity, message, sender_key)
            return
        if isinstance(message, PushPart):
            self.pushes.on_part(identity, message, self.schedule.live())
            return
        if isinstance(message, Register):
            self.admission.on_register(identity, message)
            return
        if not isinstance(message, (Pull, Push, PushReady, Leave, Heartbeat)):
            raise RequestRejected(
                "unexpected-message", f"a server does not accept {type(message).__name__}"
            )
        if isinstance(message, Heartbeat):
            self.admission.on_heartbeat(identity, message)
            return
        worker = self.membership.authenticate(message.worker_id, message.token, identity)
        if isinstance(message, Pull):
            self._on_pull(worker, message)
        elif isinstance(message, PushReady):
            self.pushes.ask(worker)
        elif isinstance(message, Push):
            self.pushes.release_credit(worker.worker_id)
            try:
                result = self.pushes.on_push(worker, message, self.schedule.live())
            except RequestRejected:
                worker.rejected += 1
                raise
            if result is not None:
                self.schedule.acknowledge(result)
        else:
            self.membership.leave(worker, message.reason)
            self.schedule.forget(worker.worker_id)
            self._send(identity, Stop("left the job"))

    # ---- requests --------------------------------------------------------------------------

    def _on_pull(self, worker: WorkerRecord, pull: Pull) -> None:
        self.pulls.hold(worker, pull)
        self._tick()  # may start the job or an epoch, and answers every pull it can

    def _tick(self) -> None:
        self.schedule.tick()
        self.pushes.reclaim_credits()
        self._observe()

    # ---- live status -----------------------------------------------------------------------

    def _status(self, phase: str | None = None) -> dict[str, Any]:
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
            followers_cpu_s=followers_cpu_seconds(
                [child.pid for child in self.launched_followers.values()]
            ),
            checkpoints=self.keeper.checkpoint_status(now),
            waiting_for=self._waiting_for(),
        )

    def _waiting_for(self) -> str | None:
        """What keeps training from going on, in words, while it cannot."""
        if self.shards is not None and not self.shards.ready:
            return f"follower shards {self.shards.waiting_for()} to join"
        if self.policy.plan is not None or self.policy.finished():
            return None
        ready = len(self.membership.in_state(WorkerState.WAITING))
        ready += len(self.membership.in_state(WorkerState.TRAINING))
        needed = self.config.min_workers if self.schedule.started else self.config.workers
        return f"workers, {ready} of the {needed} needed ready"

    def _observe(self, phase: str | None = None) -> None:
        """Sample the throughput and, at the same pace, refresh the Prometheus metrics."""
        # Asked after every request: the CPU clock (a system call that sums every thread's
        # time) is read only when a point is due.
        now = time.monotonic()
        if not self.counters.due(now):
            return
        if self.counters.observe(now, self.meter.samples, time.process_time()) and self.metrics:
            self.metrics.publish(self._status(phase))

    # ---- the end ---------------------------------------------------------------------------

    def _drain(self, reason: str = "training is over", newcomers: int = 0) -> None:
        """Tell every worker to stop: answer its next request (or a held one) with STOP; and
        `newcomers` workers yet to register, within the grace (see psserver.drain)."""
        # The followers need no more rosters, and one of them may be the shard that was lost.
        self.membership.on_change = None
        # A worker waiting for PUSH_GO asked and will not ask again: it is answered now.
        for worker_id in self.pushes.credits.waiting:
            waiting = self.membership.workers.get(worker_id)
            if waiting is not None and waiting.state in ACTIVE:
                self._send(waiting.identity, Stop(reason))
                waiting.move_to(WorkerState.STOPPED)
        drain(
            self.router, self.membership, self.pulls, self.config.stop_grace, reason,
            status=lambda: self._status("stopping"), observe=lambda: self._observe("stopping"),
            newcomers=newcomers,
        )  # fmt: skip
