"""Backward and push: the gradient goes out as one PUSH to the leader plus one SLICE_PUSH per
follower shard, either after backward or, with overlap, slice by slice during it.

All requests are sent before any reply is awaited, so the K transfers run side by side;
`finish` then collects the replies, the leader's last (it decides the step). With flow control
(job.push_credits) the leader's push waits for its PUSH_GO first (see psserver.credits).
"""

import dataclasses

import torch

from common.compression import GradientCompressor
from common.errors import ServerError
from common.flat import FlatModel
from common.job import JobSpec
from common.protocol import Message, Push, PushGo, PushReady, SlicePush, Stop, Weights
from common.sharding import split_gradient
from psworker.client import ServerConnection
from psworker.overlap import GradientStreamer
from psworker.shards import ShardClients


@dataclasses.dataclass(frozen=True)
class OutgoingStep:
    """What every message of one push shares: whose gradient, on which weights and batch."""

    worker_id: int
    token: str
    weights: Weights
    samples: int
    loss_sum: float
    correct: int
    buffers: torch.Tensor  # (F,) on the CPU


class GradientPusher:
    def __init__(
        self,
        job: JobSpec,
        model: torch.nn.Module,
        flat: FlatModel,
        compressor: GradientCompressor,
        leader: ServerConnection,
        shards: ShardClients | None,
        overlap: bool,
    ) -> None:
        self.job, self.flat, self.compressor = job, flat, compressor
        self.leader, self.shards = leader, shards
        self._step: OutgoingStep | None = None
        # Set when the server answered PUSH_READY with STOP or an error, possibly inside an
        # autograd hook, where raising would be wrapped: `finish` hands it on.
        self._outcome: Stop | BaseException | None = None
        self._sparse_pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Overlap needs shards (one slice is nothing to overlap) and per-slice compression.
        self.streamer = (
            GradientStreamer(model, job.bounds, self._send)
            if overlap and shards is not None and not job.sparse
            else None
        )

    def backward_and_push(self, loss: torch.Tensor, step: OutgoingStep) -> None:
        self._step = step
        if self.streamer is not None:
            self.streamer.arm()
            loss.backward()  # fills flat.grads; the hooks send each slice when it is final
            self.streamer.flush()
            return
        loss.backward()
        if self.job.sparse:  # top-k over the whole gradient, then cut by shard
            values, positions = self.compressor.compress(self.flat.grads)
            self._sparse_pieces = split_gradient(values, positions, self.job.bounds, True)
        # Followers first: their bytes travel while the leader's push is still being built.
        for shard in [*range(1, self.job.num_shards), 0]:
            self._send(shard)

    def _send(self, shard: int) -> None:
        step = self._step
        assert step is not None
        if self.job.sparse:
            values, positions = self._sparse_pieces[shard]
        else:
            lo, hi = self.job.shard_range(shard)
            # Dense float32 on the CPU is sent straight from flat.grads: `finish` waits for
            # every reply before the next backward writes there again.
            values, positions = self.compressor.compress(self.flat.grads[lo:hi])
        weights = step.weights
        if shard == 0:
            if self.job.push_credits and not weights.push_granted and not self._may_push(step):
                return
            self.leader.send(
                Push(
                    step.worker_id, step.token, weights.version, weights.epoch, weights.batch,
                    step.samples, step.loss_sum, step.correct, values, positions, step.buffers,
                )
            )  # fmt: skip
            return
        assert self.shards is not None
        self.shards.send_slice(
            shard,
            SlicePush(
                step.worker_id, step.token, weights.version, weights.epoch, weights.batch,
                values, positions,
            ),
        )  # fmt: skip

    def _may_push(self, step: OutgoingStep) -> bool:
        try:
            reply = self.leader.request(PushReady(step.worker_id, step.token))
        except Exception as exc:
            self._outcome = exc
            return False
        if isinstance(reply, PushGo):
            return True
        self._outcome = (
            reply
            if isinstance(reply, Stop)
            else ServerError(f"expected PUSH_GO, got {type(reply).__name__}")
        )
        return False

    def finish(self) -> Message:
        """The leader's reply, once every follower has staged its slice."""
        outcome, self._outcome = self._outcome, None
        self._step, self._sparse_pieces = None, []
        if outcome is not None:
            if self.shards is not None:
                self.shards.cancel()  # their slices will never be committed
            if isinstance(outcome, Stop):
                return outcome
            raise outcome
        if self.shards is not None:
            self.shards.finish_pushes()
        return self.leader.receive()

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.remove()
