"""The way weights go out: pulls held until there is work, answered with the weights, and (sync
mode) updated buckets streamed to the workers before they ask.

A PULL is held until the policy has a batch for the worker (a sync step still open, an epoch
boundary, the job not started yet). It is then answered with WEIGHTS: the store's version,
the batch to compute, the flow-control offer, and the parameters, unless the worker received
them all as streamed buckets already (psserver.serving.streaming). Weights are sent zero-copy
from the store and tracked, so the store waits for ZeroMQ before it changes that memory.

What it is not: a decision maker. The policy says what each worker computes next and when a
bucket is applied; this module only sends.
"""

import logging

import torch

from common.wire.protocol import Pull, Stop, Weights
from psserver.coordinator.membership import Membership, WorkerRecord, WorkerState
from psserver.policies import HOLD, UpdatePolicy
from psserver.serving.credits import PushCredits
from psserver.serving.socket import ServerSocket
from psserver.serving.streaming import WeightStreamer
from psserver.status.report import TrainingMeter
from psserver.store.parameters import ParameterStore

log = logging.getLogger("ps.server")
NO_PARAMS = torch.empty(0)  # WEIGHTS for a worker that holds them already


class PullHandler:
    def __init__(
        self,
        router: ServerSocket,
        store: ParameterStore,
        policy: UpdatePolicy,
        credits: PushCredits,
        membership: Membership,
        meter: TrainingMeter,
        buckets: list[tuple[int, int]],
    ) -> None:
        self.router, self.store, self.policy = router, store, policy
        self.credits, self.membership, self.meter = credits, membership, meter
        self.streamer = WeightStreamer(store, buckets)
        self.held: dict[int, WorkerRecord] = {}  # worker id -> a pull to answer
        self.starved = False  # held pulls wait for a snapshot slot, not for work

    def hold(self, worker: WorkerRecord, pull: Pull) -> None:
        self.streamer.claim(worker.worker_id, pull.have_version)
        if worker.state is WorkerState.REGISTERED:
            worker.move_to(WorkerState.WAITING)
        self.held[worker.worker_id] = worker

    def forget(self, worker_id: int) -> None:
        """A worker left or died: its pull is void, and what it was sent proves nothing."""
        self.held.pop(worker_id, None)
        self.streamer.forget(worker_id)

    def answer(self) -> None:
        """Answer every held pull the policy has work (or STOP) for."""
        self.starved = False
        for worker_id, worker in list(self.held.items()):
            decision = self.policy.next_assignment(worker_id)
            if decision == HOLD:
                continue
            if decision is None:
                del self.held[worker_id]
                self.stop(worker, "training is over")
                continue
            assert not isinstance(decision, str)
            snapshot = self.store.snapshot()
            if snapshot is None:  # every copy of the weights is still being sent
                self.starved = True  # look again in a moment, not after a whole poll
                return
            del self.held[worker_id]
            worker.assignment = (decision.epoch, decision.batch)
            version, params, buffers = snapshot
            streamed = self.streamer.covers(worker_id)  # the worker has these params
            self.meter.streamed_pulls += streamed
            weights = Weights(
                version, decision.epoch, decision.batch, decision.rank, decision.world_size,
                self.credits.offer(worker_id), NO_PARAMS if streamed else params, buffers,
                streamed,
            )  # fmt: skip
            self.store.track_send(self.router.send_tracked([worker.identity], weights))

    def stream_bucket(self, bucket: int, version: int, worker_ids: list[int]) -> None:
        """A bucket was applied in sync mode: its new values go to these workers now."""
        workers = [self.membership.workers.get(worker_id) for worker_id in worker_ids]
        training = [w for w in workers if w is not None and w.state is WorkerState.TRAINING]
        if not training:
            return
        part = self.streamer.part([w.worker_id for w in training], bucket, version)
        lo, hi = self.streamer.buckets[bucket]  # only an update of these waits for the send
        sent = self.router.send_tracked([w.identity for w in training], part)
        self.store.track_send(sent, lo, hi)
        self.meter.streamed_bytes += len(training) * part.params.nbytes

    def stop(self, worker: WorkerRecord, reason: str) -> None:
        self.router.send(worker.identity, Stop(reason))
        worker.move_to(WorkerState.STOPPED)

    def stop_all(self, reason: str) -> None:
        """Answer every held pull with STOP (the job is over)."""
        for worker in self.held.values():
            self.stop(worker, reason)
        self.held.clear()
