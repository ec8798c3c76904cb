"""Backward and push: the gradient goes out as one PUSH per server shard, each with its slice,
either after backward or, with overlap, piece by piece during it.

Every shard takes its slice the same way (docs/protocol.md): whole, in one PUSH (bucket -1),
or bucket by bucket, one PUSH per bucket (bucket 0..N-1, never answered), each as soon as
backward has it, and then the PUSH that completes them (bucket -1, parts N), which is answered.
With overlap the leader's slice goes in buckets when it has more than one
(JobSpec.bucket_bounds), and a follower's always (JobSpec.shard_buckets), so that its applied
buckets can come back streamed. Only shard 0's whole PUSH carries the BatchNorm statistics.

Overlap cuts the flat gradient into units (`push_units`), in the order it sends them: the
leader's slice bucket by bucket (or whole, with one bucket), then each follower's bucket by
bucket. Backward produces gradients from the last layer to the first, so a unit is final as
soon as every parameter that overlaps it has its gradient: a post-accumulate-grad hook per
parameter (`GradientStreamer`) counts them down and sends the unit at zero. ZeroMQ's I/O thread
then moves those bytes, and the server adds them up or applies them, while autograd works on
the earlier layers. On the CPU the hooks run on the thread that called backward(); on CUDA on
autograd's device thread, while the calling thread waits in backward(). Either way one thread
at a time touches the sockets. Not for top-k: choosing the top entries needs the whole
gradient.

All requests are sent before any reply is awaited, so the K transfers run side by side;
`finish` then collects the replies, the leader's last (it decides the step).

With flow control (job.push_credits) the leader's messages wait for its go unless a credit
came with the weights (psworker.connection): they are held while backward goes on and the
follower shards' slices go out, and `finish` waits for the go and sends them.

A gradient with NaN or Inf values is not sent (the server would refuse it, and with several
shards each would refuse only its own slice while the others took theirs). Without overlap
nothing of it goes out; with overlap, nothing from the first piece found not finite on.
`finish` then raises NonFiniteGradient.

What this is not: where each message goes, the leader's credit, or the answers
(psworker.connection).
"""

import dataclasses
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import nn

from common.compression import GradientCompressor
from common.errors import PSError
from common.finite import all_finite
from common.job import JobSpec
from common.model.flat import FlatModel
from common.sharding import shard_range, split_gradient
from common.wire.protocol import WHOLE, Push, PushAck, Stop, Weights
from psworker.connection import Connection

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


class PushUnit(NamedTuple):
    # "part": one bucket of a shard's slice (a PUSH with that bucket); "whole": the slice in
    # one PUSH (bucket -1).
    kind: Literal["part", "whole"]
    shard: int  # 0: the leader
    bucket: int  # -1: the whole slice
    lo: int  # [lo, hi) of the flat gradient
    hi: int


def push_units(job: JobSpec) -> list[PushUnit]:
    """The units overlap sends, in order (the module doc). A follower's slice goes bucket by
    bucket also when it has one bucket: a bucket that comes back streamed is worth sending as
    a bucket."""
    lo, hi = job.shard_range(0)
    units: list[PushUnit] = []
    if job.num_buckets > 1:
        for bucket, (start, end) in enumerate(job.bucket_ranges()):
            units.append(PushUnit("part", 0, bucket, lo + start, lo + end))
    else:
        units.append(PushUnit("whole", 0, WHOLE, lo, hi))
    for shard in range(1, job.num_shards):
        first = shard_range(job.bounds, shard)[0]
        for bucket, (start, end) in enumerate(job.shard_bucket_ranges(shard)):
            units.append(PushUnit("part", shard, bucket, first + start, first + end))
    return units


class GradientStreamer:
    """Calls `send(i)` during backward once unit i of the flat gradient is final (the module
    doc)."""

    def __init__(
        self, model: nn.Module, units: list[tuple[int, int]], send: Callable[[int], None]
    ) -> None:
        """`units`: [lo, hi) ranges of the flat gradient; `send(i)` once unit i is final."""
        self.send = send
        self.num_units = len(units)
        # Which units each parameter's gradient feeds (a range may cut a tensor in two).
        self._feeds: list[list[int]] = []
        self._needs = [0] * self.num_units  # parameters each unit waits for
        offset = 0
        for param in model.parameters():
            start, end = offset, offset + param.numel()
            feeds = [u for u, (lo, hi) in enumerate(units) if start < hi and lo < end]
            self._feeds.append(feeds)
            for unit in feeds:
                self._needs[unit] += 1
            offset = end
        self._waiting = list(self._needs)
        self._sent = [True] * self.num_units  # disarmed: hooks do nothing outside a step
        self._handles = [
            param.register_post_accumulate_grad_hook(self._hook(index))
            for index, param in enumerate(model.parameters())
        ]

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient(_: torch.Tensor) -> None:
            for unit in self._feeds[index]:
                self._waiting[unit] -= 1
                if self._waiting[unit] == 0 and not self._sent[unit]:
                    self._sent[unit] = True
                    self.send(unit)

        return on_gradient

    def arm(self) -> None:
        """Before backward: every unit waits for all of its parameters again."""
        self._waiting = list(self._needs)
        self._sent = [False] * self.num_units

    def flush(self) -> list[int]:
        """After backward: send whatever no hook sent (a parameter that got no gradient,
        say), last units first; returns those units."""
        late = [unit for unit in reversed(range(self.num_units)) if not self._sent[unit]]
        for unit in late:
            self._sent[unit] = True
            self.send(unit)
        return late

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class GradientPusher:
    def __init__(
        self,
        job: JobSpec,
        model: torch.nn.Module,
        flat: FlatModel,
        compressor: GradientCompressor,
        connection: Connection,
        overlap: bool,
    ) -> None:
        self.job, self.flat, self.compressor = job, flat, compressor
        self.connection = connection
        self._step: OutgoingStep | None = None
        # Set when the server answered PUSH_READY with STOP or an error, possibly inside an
        # autograd hook, where raising would be wrapped: `finish` hands it on.
        self._outcome: Stop | BaseException | None = None
        self._sparse_pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._parts_sent = [0] * job.num_shards  # buckets sent this step, by shard
        # The units overlap sends, in order, and their ranges.
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
        self.connection.begin_push(step.weights.push_granted)
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
        self.connection.send(self._push(shard, WHOLE, values, positions))

    def _send_part(self, shard: int, bucket: int) -> None:
        """One bucket of a shard's slice; after its last, the PUSH that completes them."""
        first = shard_range(self.job.bounds, shard)[0]
        cuts = self.job.shard_buckets(shard)  # O(1) a part, however many buckets
        start, end = cuts[bucket], cuts[bucket + 1]
        values, _ = self.compressor.compress(self.flat.grads[first + start : first + end])
        self.connection.post(self._push(shard, bucket, values, NO_INDICES))
        self._parts_sent[shard] += 1
        if self._parts_sent[shard] == len(cuts) - 1:
            self.connection.send(
                self._push(shard, WHOLE, NO_TENSOR, NO_INDICES, parts=len(cuts) - 1)
            )

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

    def _leader_may_send(self, bucket: int) -> bool:
        """Flow control: whether the leader's unit `bucket` (-1: the whole slice) goes now;
        if not, the connection holds it for `_await_go`, or nothing more of the step goes."""
        try:
            return self.connection.admit(bucket)
        except Exception as exc:  # maybe inside an autograd hook: `finish` raises it
            self._outcome = exc
            return False

    def _await_go(self) -> None:
        """Wait for the go asked for, then send the leader's units held back meanwhile.
        A STOP or an error instead becomes the step's outcome."""
        answer = self.connection.await_go()
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

    def finish(self) -> PushAck | Stop:
        """The leader's answer to the push, once every follower has staged its slice."""
        if self.connection.asked:
            self._await_go()
        outcome, self._outcome = self._outcome, None
        self._step, self._sparse_pieces = None, []
        if outcome is not None:
            self.connection.drop_push()
            if isinstance(outcome, Stop):
                return outcome
            raise outcome
        return self.connection.finish_push()

    def close(self) -> None:
        if self.streamer is not None:
            self.streamer.remove()
