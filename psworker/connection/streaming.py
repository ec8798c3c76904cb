"""Weight streaming, the worker's side: updated buckets that arrive before the pull.

In sync mode the server sends each bucket of the leader's slice (a WEIGHTS with a bucket) to
the workers that pushed parts of it as soon as it is applied (see psserver.serving.streaming).
They arrive on the worker's main connection while it waits for its PUSH_ACK, and always
before it: the connection reads them on the way (psworker.connection.requests) and hands them
here, where each goes into the worker's parameters at once (`FlatModel.load_params`: on the
CPU, the parameters wholly inside a bucket are used where they landed, the rest copied). The
next PULL then names the version received whole, and the server leaves the parameters out of
its reply if it agrees.
Follower shards stream their slices the same way, each on its own connection to its own
WeightStream (psworker.connection.shards).

Loading is safe: a bucket comes back only after every worker's gradient for it was in, and
this worker reads messages only outside backward, so no autograd graph still needs the old
values.
"""

from collections.abc import Callable

import torch

from common.errors import ServerError
from common.job import JobSpec
from common.wire.protocol import Weights

# Sets the flat parameters [lo, lo + len(values)) of the worker's model: FlatModel.load_params.
ParamLoader = Callable[[int, torch.Tensor], None]


class WeightStream:
    def __init__(self, job: JobSpec, load: ParamLoader, shard: int = 0) -> None:
        self.load, self.shard = load, shard
        self.start = job.shard_range(shard)[0]  # the slice's offset in the flat parameters
        self.buckets = job.shard_bucket_ranges(shard)
        self.version = -1  # the version the buckets below belong to
        self._received: set[int] = set()

    def accept(self, part: Weights) -> None:
        if part.shard != self.shard:
            raise ServerError(
                f"shard {self.shard} streamed a bucket of shard {part.shard}'s slice; run the "
                "same release of ps-server and ps-worker"
            )
        if not 0 <= part.bucket < len(self.buckets):
            raise ServerError(
                f"the server streamed bucket {part.bucket}, the job has {len(self.buckets)}; "
                "run the same release of ps-server and ps-worker"
            )
        lo, hi = self.buckets[part.bucket]
        if part.params.dtype != torch.float32 or part.params.numel() != hi - lo:
            raise ServerError(
                f"the server streamed bucket {part.bucket} as {part.params.numel()} x "
                f"{part.params.dtype}, expected {hi - lo} x torch.float32; run the same release "
                "of ps-server and ps-worker"
            )
        if part.version != self.version:
            self.version, self._received = part.version, set()
        self.load(self.start + lo, part.params)  # host to device on a GPU worker
        self._received.add(part.bucket)

    def whole_version(self) -> int:
        """The version of which every bucket is in the parameters; -1 if none."""
        return self.version if len(self._received) == len(self.buckets) else -1

    def forget(self) -> None:
        self.version, self._received = -1, set()
