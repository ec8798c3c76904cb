"""The parameter server's event loop: one ROUTER socket, one thread, one request at a time.

Every request is decoded and validated before it touches any state; a bad one gets an ERROR
reply and is logged with its header, and the loop keeps serving. All state (store, policy,
membership) is changed on this thread only, so nothing needs a lock. Between requests, and at
least every POLL_MS, the schedule ticks (psserver.coordinator.schedule): it declares silent workers
dead, closes sync steps that timed out, ends epochs and lets waiting workers in at epoch boundaries.

Lifecycle: bind -> wait for `--workers` workers to ask for work -> epochs of training (the
roster may change at each epoch boundary) -> final evaluation, checkpoint and summary ->
answer every worker's next request with STOP -> summary -> with --linger, answer every late
worker with STOP for that long -> exit.

What it is not: the work each request does. This module builds the leader's parts (the job
from psserver.job_setup, the handlers, the schedule, the whole model, the follower shards) and
its dispatch table: each kind of request it takes, and the handler whose job it is
(psserver.serving.socket routes them). STATUS needs no registration, REGISTER (a worker's, or a
follower shard's, which the sender's CURVE key decides) and HEARTBEAT are admission's, a PUSH
is the push handler's (as on every shard); PULL, PUSH_READY and LEAVE must name a registered
worker with its token, and, where the worker registered with a CURVE key, come with that key
(membership.authenticate).
"""

import logging
import subprocess
import time
from typing import Any

import zmq

from common.cpu_share import CpuShare
from common.errors import CheckpointError, PSError, RequestRejected, TrainingDiverged
from common.logs import counted
from common.wire.protocol import (
    JOB_FAILED,
    Heartbeat,
    Leave,
    Pull,
    Push,
    PushReady,
    Register,
    Status,
    Stop,
)
from common.wire.security import ServerSecurity
from psserver.checkpoints.whole_model import WholeModel
from psserver.config import ServerConfig
from psserver.coordinator.admission import Admission
from psserver.coordinator.drain import drain, linger
from psserver.coordinator.membership import Membership, WorkerRecord
from psserver.coordinator.schedule import TrainingSchedule
from psserver.job_setup import build_job
from psserver.policies import SyncPolicy
from psserver.serving.credits import FlowControl, PushCredits
from psserver.serving.pulls import AssignmentTerms, PullHandler
from psserver.serving.pushes import PolicyIntake, PushHandler
from psserver.serving.socket import Dispatch, ServerSocket, route
from psserver.shards.follower_link import ShardLost
from psserver.shards.launch import FollowerExited
from psserver.shards.leader import ShardGroup
from psserver.status.handler import StatusHandler
from psserver.status.live import StatusCounters
from psserver.status.prometheus import MetricsExporter
from psserver.status.report import WARMUP_STEPS, TrainingMeter, UpdateRecorder

log = logging.getLogger("ps.server")
POLL_MS = 100
STARVED_POLL_MS = 1  # while pulls wait for a snapshot slot to come free
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
        shard_secret: bytes | None = None,  # what followers prove (psserver.shards.auth)
    ) -> None:
        self.config = config
        self.cpu_share = CpuShare(config.threads)  # updates and evaluation
        built = build_job(config)  # the store, the job, its policy, the test set
        self.store, self.policy, job = built.store, built.policy, built.job
        self.membership = Membership(config.worker_limit, config.worker_timeout)
        self.meter = TrainingMeter(warmup_pushes=WARMUP_STEPS * config.workers)
        # --log-dir metrics, or a no-op
        self.recorder = UpdateRecorder(config.log_dir, config.mode, config.model)
        self.counters = StatusCounters(time.monotonic())
        self.context = zmq.Context()
        self.shards: ShardGroup | None = None  # the follower shards, with --num-shards > 1
        # The followers this command started on this machine (one command for K shards), by
        # shard: the leader stops waiting for one that exited, and the status reports their
        # CPU time beside the server's own.
        self.launched_followers: dict[int, subprocess.Popen[bytes]] = {}
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
        self.whole_model = WholeModel(
            config, self.store, self.policy, self.shards, built.test_set, self.meter, self.recorder
        )
        if config.resuming:
            self.whole_model.resume()
        metrics: MetricsExporter | None = None
        if config.metrics_port is not None:
            metrics = MetricsExporter(config.metrics_port, config.bind)
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
            if metrics is not None:
                metrics.stop()
            raise
        self.endpoint = self.router.endpoint
        if self.shards is not None:
            self.shards.gate.warn_if_open(self.endpoint)
        self.admission = Admission(
            config, self.store, job, self.membership, self.shards, self.router.send
        )
        # The pull handler of every shard, with the leader's terms: a membership record asks,
        # and the policy's next batch for it goes with the weights.
        self.pulls: PullHandler[WorkerRecord] = PullHandler(
            self.router, self.store, job.bucket_ranges(),
            AssignmentTerms(self.store, self.policy, self.credits, self.membership), self.meter,
        )  # fmt: skip
        self.flow = FlowControl(self.router, self.store, self.membership, self.credits)
        self.intake = PolicyIntake(
            self.router, self.store, self.policy, job, self.membership, self.flow,
            self.meter, self.recorder, self.shards,
            live=lambda: self.schedule.live(), on_step=lambda r: self.schedule.acknowledge(r),
        )  # fmt: skip
        self.pushes = PushHandler(
            self.router, job, 0, self.membership, self.intake, self._count_rejected,
            self.flow, self.intake.answer_forgotten,
        )  # fmt: skip
        self.schedule = TrainingSchedule(
            config, self.store, self.policy, self.membership, self.meter, self.recorder,
            self.whole_model, self.shards, self.pulls, self.intake,
        )  # fmt: skip
        self.status = StatusHandler(
            config, self.router, self.store, self.policy, self.membership, self.meter,
            self.counters, self.whole_model, self.shards, self.schedule, metrics,
            lambda: [child.pid for child in self.launched_followers.values()],
        )  # fmt: skip
        # Every kind a worker, a follower or anyone sends the leader, and the handler that
        # answers it; everything else is refused (psserver.serving.socket).
        self.dispatch = Dispatch(
            [
                route(Status, lambda identity, _, __: self.status.answer(identity)),
                # A worker's, or a follower shard's (which its CURVE key decides).
                route(Register, self.admission.on_register),
                route(Heartbeat, self.admission.on_heartbeat),
                route(Pull, self._on_pull),
                route(PushReady, self._on_push_ready),
                route(Push, self.pushes.handle),
                route(Leave, self._on_leave),
            ],
            "a server does not accept {kind}",
        )
        if isinstance(self.policy, SyncPolicy) and config.stream_weights:
            # Updated buckets go out as soon as they are applied (psserver.serving.streaming).
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
                self._drain(reason + JOB_FAILED)
                raise
            # Workers started for a run that was already over hear so as they come.
            self._drain(newcomers=self.config.workers if trained_nothing else 0)
            retired = self.membership.retired
            summary = self.whole_model.summarize(
                final,
                [w.report() for w in self.membership.workers.values()],
                retired.report() if retired.workers else None,
                keep_existing=trained_nothing,
            )
            if self.config.linger:
                self._linger()
            return summary
        finally:
            if self.shards is not None:
                self.shards.stop()
            self.recorder.close()
            self.router.close()
            self.status.stop_metrics()
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

    def followers_told_to_stop(self) -> set[int]:
        """The follower shards this run sent its STOP: they had joined (see stop_followers)."""
        return set() if self.shards is None else set(self.shards.told_to_stop)

    def _watch_shards(self) -> None:
        if self.shards is not None:  # followers yet to join: has one of ours exited?
            self.shards.watch_joining(self.launched_followers)

    def _serve_once(self) -> None:
        if self.router.poll(STARVED_POLL_MS if self.pulls.starved else POLL_MS):
            self.router.serve(self.dispatch, self._count_rejected)

    # ---- the requests of a registered worker, with its token (and CURVE key) ---------------

    def _on_pull(self, identity: bytes, pull: Pull, sender_key: str) -> None:
        if pull.shard != 0:
            raise RequestRejected(
                "wrong-shard",
                f"this is shard 0, the leader; a PULL for shard {pull.shard} goes to that "
                "shard (the job's shard_endpoints)",
            )
        worker = self.membership.authenticate(pull.worker_id, pull.token, identity, sender_key)
        self.pulls.hold(worker.worker_id, worker, identity, pull)
        self._tick()  # may start the job or an epoch, and answers every pull it can

    def _on_push_ready(self, identity: bytes, ready: PushReady, sender_key: str) -> None:
        worker = self.membership.authenticate(ready.worker_id, ready.token, identity, sender_key)
        self.flow.ask(worker, identity)

    def _on_leave(self, identity: bytes, leave: Leave, sender_key: str) -> None:
        worker = self.membership.authenticate(leave.worker_id, leave.token, identity, sender_key)
        self.membership.leave(worker, leave.reason)
        self.schedule.forget(worker.worker_id)
        self.router.send(identity, Stop("left the job"))

    def _count_rejected(self) -> None:
        self.counters.rejected_requests += 1

    def _tick(self) -> None:
        self.cpu_share.recount()
        self.schedule.tick()
        self.flow.reclaim()
        self.status.observe()

    # ---- the end ---------------------------------------------------------------------------

    def _linger(self) -> None:
        """After the summary, answer the workers that come late (see psserver.drain). The
        follower shards are stopped first: nobody needs them now, and a follower that heard
        nothing from its leader for --leader-timeout would end with an error."""
        if self.shards is not None:
            self.shards.stop()
        linger(
            self.router, self.membership, self.config.linger, "training is over",
            status=lambda: self.status.status("finished"),
            observe=lambda: self.status.observe("finished"),
        )  # fmt: skip

    def _drain(self, reason: str = "training is over", newcomers: int = 0) -> None:
        """Tell every worker to stop: answer its next request (or a held one, or its wait for
        its go) with STOP; and `newcomers` workers yet to register, within the grace (see
        psserver.coordinator.drain)."""
        # The followers need no more rosters, and one of them may be the shard that was lost.
        self.membership.on_change = None
        drain(
            self.router, self.membership, self.pulls, self.flow,
            self.config.stop_grace, reason,
            status=lambda: self.status.status("stopping"),
            observe=lambda: self.status.observe("stopping"),
            newcomers=newcomers,
        )  # fmt: skip
