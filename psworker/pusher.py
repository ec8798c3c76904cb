"""Backward and push: the gradient goes out as one PUSH per server shard, each with its slice,
either after backward or, with overlap, piece by piece during it.

Every shard takes its slice the same way (docs/protocol.md): whole, in one PUSH (bucket -1),
or bucket by bucket, one PUSH per bucket (bucket 0..N-1, never answered), each as soon as
backward has it, and then the PUSH that completes them (bucket -1, parts N), which is answered.
With overlap the leader's slice goes in buckets when it has more than one
(JobSpec.bucket_bounds), and a follower's always (JobSpec.shard_buckets), so that its applied
buckets can come back streamed. Only shard 0's whole PUSH carries the BatchNorm statistics.

All requests are sent before any reply is awaited, so the K transfers run side by side;
`finish` then collects the replies, the leader's last (it decides the step).

With flow control (job.push_credits) the leader's messages wait for its PUSH_GO unless a
credit came with the weights (psworker.connection.flow_control): they are held while backward goes
on and the follower shards' slices go out, and `finish` waits for the PUSH_GO and sends them.

A gradient with NaN or Inf values is not sent (the server would refuse it, and with several
shards each would refuse only its own slice while the others took theirs). Without overlap
nothing of it goes out; with overlap, nothing from the first piece found not finite on.
`finish` then raises NonFiniteGradient.

What this is not: how a push is cut into units (psworker.push_units), nor when the leader's
messages may go (psworker.connection.flow_control).
"""

import dataclasses

import torch

from common.compression import GradientCompressor
from common.errors import PSError
from common.finite import all_finite
from common.job import JobSpec
from common.model.flat import FlatModel
from common.sharding import shard_range, split_gradient
from common.wire.protocol import WHOLE, Message, Push, Stop, Weights
from psworker.connection.client import ServerConnection
from psworker.connection.failures import Interrupted, RequestFailed
from psworker.connection.flow_control import LeaderGate
from psworker.connection.shards import ShardClients
from psworker.overlap import GradientStreamer
from psworker.push_units import push_units

NO_TENSOR = torch.empty(0)  # a PUSH's buffers, but for shard 0's whole one
NO_INDICES = torch.empty(0, dtype=torch.int32)  # a dense gradient's


class NonFiniteGradient(PSError):
    """This step's gradient holds NaN or Inf values, though its loss is finite."""


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
        self._gate = LeaderGate(leader, job.push_credits)
        self._parts_sent = [0] * job.num_shards  # buckets sent this step, by shard
        # Whether any of this step went to the leader: a reply, or streamed weights, may come.
        self._leader_sent = False
        # The units overlap sends, in order, and their ranges (psworker.push_units).
        self._units = push_units(job)
        ranges = [(unit.lo, unit.hi) for unit in self._units]
        # Overlap needs more than one unit and per-piece compression (not top-k).
        self.streamer = (
            GradientStreamer(model, ranges, self._send_unit)
            if overlap and len(ranges) > 1 and not job.sparse
            else None
        )

    def backward_and_push(self, loss: torch.Tensor, step: OutgoingStep) -> None:
        self._step = step
        self._gate.arm(step.worker_id, step.token, step.weights.push_granted)
        self._leader_sent = False
        self._parts_sent = [0] * self.job.num_shards
        if self.streamer is not None:
            self.streamer.arm()
            loss.backward()  # fills flat.grads; the hooks send each unit when it is final
            self.streamer.flush()
            return
        loss.backward()
        if not all_finite(self.flat.grads):  # nothing goes out, so no shard takes a part
            self._outcome = NonFiniteGradient("its gradient holds NaN or Inf values")
            return
        if self.job.sparse:  # top-k over the whole gradient, then cut by shard
            values, positions = self.compressor.compress(self.flat.grads)
            self._sparse_pieces = split_gradient(values, positions, self.job.bounds, True)
        # Followers first: their bytes travel while the leader's push is still being built.
        for shard in [*range(1, self.job.num_shards), 0]:
            self._send_whole(shard)

    def _send_unit(self, unit: int) -> None:
        if self._outcome is not None:  # the step has failed: nothing more of it goes out
            return
        kind, shard, bucket, lo, hi = self._units[unit]
        if not all_finite(self.flat.grads[lo:hi]):  # inside backward: `finish` raises it
            self._outcome = NonFiniteGradient(
                f"its gradient holds NaN or Inf values (in [{lo}, {hi}) of the flat vector)"
            )
            return
        if kind == "whole":
            self._send_whole(shard)
        elif shard != 0 or self._leader_may_send(bucket):
            self._send_part(shard, bucket)

    def _send_whole(self, shard: int) -> None:
        """A shard's whole slice in one PUSH."""
        if shard == 0 and not self._leader_may_send(WHOLE):  # compressed only once it may go
            return
        if self.job.sparse:
            values, positions = self._sparse_pieces[shard]
        else:
            lo, hi = self.job.shard_range(shard)
            # Dense float32 on the CPU is sent straight from flat.grads: `finish` waits for
            # every reply before the next backward writes there again.
            values, positions = self.compressor.compress(self.flat.grads[lo:hi])
        self._request(self._push(shard, WHOLE, values, positions))

    def _send_part(self, shard: int, bucket: int) -> None:
        """One bucket of a shard's slice; after its last, the PUSH that completes them."""
        first = shard_range(self.job.bounds, shard)[0]
        cuts = self.job.shard_buckets(shard)  # O(1) a part, however many buckets
        start, end = cuts[bucket], cuts[bucket + 1]
        values, _ = self.compressor.compress(self.flat.grads[first + start : first + end])
        part = self._push(shard, bucket, values, NO_INDICES)
        if shard == 0:
            self._leader_sent = True
            self.leader.post(part)
        else:
            assert self.shards is not None
            self.shards.post_bucket(part)
        self._parts_sent[shard] += 1
        if self._parts_sent[shard] == len(cuts) - 1:
            self._request(self._push(shard, WHOLE, NO_TENSOR, NO_INDICES, parts=len(cuts) - 1))

    def _push(
        self, shard: int, bucket: int, values: torch.Tensor, positions: torch.Tensor,
        parts: int = 0,
    ) -> Push:  # fmt: skip
        step = self._step
        assert step is not None
        weights = step.weights
        buffers = step.buffers if shard == 0 and bucket == WHOLE else NO_TENSOR
        return Push(
            step.worker_id, step.token, weights.version, weights.epoch, weights.batch,
            step.samples, step.loss_sum, step.correct, values, positions, buffers, parts,
            shard, bucket,
        )  # fmt: skip

    def _request(self, push: Push) -> None:
        """A shard's whole slice, or the PUSH that completes its buckets: answered."""
        if push.shard == 0:
            self._leader_sent = True
            self.leader.send(push)
        else:
            assert self.shards is not None
            self.shards.send_push(push)

    def _leader_may_send(self, bucket: int) -> bool:
        """Flow control: whether the leader's unit `bucket` (-1: the whole slice) goes now;
        if not, the gate holds it for `_await_go`, or nothing more of the step goes."""
        try:
            return self._gate.admit(bucket)
        except Exception as exc:  # maybe inside an autograd hook: `finish` raises it
            self._outcome = exc
            return False

    def _await_go(self) -> None:
        """Wait for the PUSH_GO asked for, then send the leader's units held back meanwhile.
        A STOP or an error instead becomes the step's outcome."""
        answer = self._gate.await_go()
        if not isinstance(answer, list):
            # A STOP ends the job whatever this step's gradient was; otherwise a piece found
            # not finite after the ask stays the reason the step failed.
            if isinstance(answer, Stop) or self._outcome is None:
                self._outcome = answer
            return
        if self._outcome is not None:  # a piece found not finite after the ask
            return
        for bucket in answer:
            if bucket == WHOLE:
                self._send_whole(0)
            else:
                self._send_part(0, bucket)

    def finish(self) -> Message:
        """The leader's reply, once every follower has staged its slice."""
        if self._gate.asked:
            self._await_go()
        outcome, self._outcome = self._outcome, None
        self._step, self._sparse_pieces = None, []
        if outcome is not None:
            if self.shards is not None:
                self.shards.cancel()  # their slices will never be committed
            if self._leader_sent:  # what the leader answers to it is not wanted any more
                self.leader.reset()
            if isinstance(outcome, Stop):
                return outcome
            raise outcome
        if self.shards is not None:
            try:
                stop = self.shards.finish_pushes()
            except (Interrupted, RequestFailed):
                # The worker leaves, or a follower refused its slice: the next request must
                # not read this push's answer. (The leader forgetting this worker is answered
                # inside: the leader's answer then says whether the push counted.)
                self.shards.cancel()
                self.leader.reset()
                raise
            if stop is not None:  # the leader's reply would say the same: it is not read
                self.leader.reset()
                return stop
        return self.leader.receive()

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.remove()
