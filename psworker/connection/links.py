"""What a worker talks to during one registration, and the pull that reads from all of it.

`ServerLinks` holds the leader's weight stream, the connections to the follower shards and the
gradient pusher: everything that depends on the job's shards and buckets. It is built when the
worker registers and built again when it registers anew, because a restarted server may run
another number of shards. It is not the worker loop (psworker.trainer) and keeps no training
state.
"""

import dataclasses
import logging

import torch
from torch import nn

from common.compression import GradientCompressor
from common.errors import ServerError
from common.job import JobSpec
from common.model.flat import FlatModel
from common.wire.protocol import Pull, Stop, Weights
from psworker.connection.client import ServerConnection
from psworker.connection.shards import ShardClients
from psworker.connection.streaming import WeightStream
from psworker.pusher import GradientPusher

log = logging.getLogger("ps.worker")


@dataclasses.dataclass
class ServerLinks:
    job: JobSpec
    connection: ServerConnection
    flat: FlatModel
    stream: WeightStream  # buckets of the leader's slice streamed back after a push
    shards: ShardClients | None  # the follower shards; None with one server
    pusher: GradientPusher
    # The oldest slice version worth pulling from the follower shards: a follower holds the
    # pull until it has that many updates. In sync mode the one the last PUSH_ACK named, so
    # that no follower answers with the slice from before the step this worker pushed.
    min_version: int = 0

    @classmethod
    def open(
        cls,
        job: JobSpec,
        connection: ServerConnection,
        model: nn.Module,
        flat: FlatModel,
        compressor: GradientCompressor,
        overlap: bool,
    ) -> "ServerLinks":
        stream = WeightStream(job, flat.load_params)
        connection.on_weights_part = stream.accept
        shards = connect_shards(job, connection, flat)
        pusher = GradientPusher(job, model, flat, compressor, connection, shards, overlap)
        return cls(job, connection, flat, stream, shards, pusher)

    def pull(self, worker_id: int, token: str) -> Weights | Stop:
        """Bring the worker's weights and buffers to the server's current version, from the
        leader and every follower shard at once. What the leader streamed back whole after the
        last push is not sent again."""
        if self.shards is not None:  # on their way while the leader answers
            self.shards.request_slices(worker_id, token, self.min_version)
        reply = self.connection.request(Pull(worker_id, token, self.stream.whole_version()))
        if isinstance(reply, Stop):
            return reply
        if not isinstance(reply, Weights):
            raise ServerError(f"expected WEIGHTS, got {type(reply).__name__}")
        check_weights(self.job, reply)
        if not reply.streamed:  # the leader's slice; host to device on a GPU worker
            self.flat.load_params(self.job.shard_range(0)[0], reply.params)
        elif reply.version != self.stream.whole_version():
            raise ServerError(
                f"the server sent no weights for version {reply.version}, but this worker "
                f"holds {self.stream.whole_version()}; run the same release of ps-server and "
                "ps-worker"
            )
        self.flat.buffers.copy_(reply.buffers)
        if self.shards is not None:
            stop = self.shards.receive_slices(worker_id, token, reply.version)
            if stop is not None:  # the job's heartbeat heard it while a follower was silent
                return stop
        return reply

    def close(self) -> None:
        self.pusher.close()
        if self.shards is not None:
            self.shards.close()


def check_weights(job: JobSpec, weights: Weights) -> None:
    """WEIGHTS that fit the job: training on anything else would go on silently wrong (a
    short vector leaves part of the model as it was; int64 weights are cast)."""
    lo, hi = job.shard_range(0)
    expected = [("buffers", weights.buffers, job.num_buffers)]
    if not weights.streamed:
        expected.append(("parameters", weights.params, hi - lo))
    for what, tensor, numel in expected:
        if tensor.dtype != torch.float32 or tensor.numel() != numel:
            raise ServerError(
                f"the server sent {tensor.numel()} {what} of {tensor.dtype}, not the job's "
                f"{numel} of torch.float32; run the same release of ps-server and ps-worker"
            )


def connect_shards(
    job: JobSpec, connection: ServerConnection, flat: FlatModel
) -> ShardClients | None:
    if job.num_shards == 1:
        return None
    if len(job.shard_endpoints) != job.num_shards - 1:
        raise ServerError(
            f"the job has {job.num_shards} server shards but lists "
            f"{len(job.shard_endpoints)} follower endpoints; run the same release everywhere"
        )
    log.info("the parameters live on %d server shards", job.num_shards)
    return ShardClients(
        job,
        flat.load_params,
        connection.timeout_s,
        connection.retries,
        connection.security,
        connection.last_heard,
        lambda: connection.verdict() or connection.stopped_early(),
        connection.interrupt,
    )
