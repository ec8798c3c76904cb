"""Weight streaming, the server's books: which updated buckets each worker has been sent.

In sync mode with gradient buckets, the policy applies a bucket as soon as every live roster
worker's part of it is in (psserver.policies). The server then sends the bucket's new values
(a WEIGHTS with that bucket) at once to the workers that pushed parts of it, instead of
waiting for their next PULL. The bytes travel while the slowest worker still runs backward
on its first layers, so on a slow link most of the pull overlaps compute, and the server's
link carries gradients in and weights out at the same time.

A worker's next PULL says which version it holds whole (`have_version`). The shard leaves
the parameters out of its WEIGHTS only if its own books agree: it sent that worker every
bucket of the version the store is at now. The books are cleared when that stops being a
proof: when the worker is forgotten, and when a step is abandoned after some of its buckets
were applied (the next step then streams the same version number with other values).

The pull handler (psserver.serving.pulls.PullHandler) keeps these books on every shard, under
the key it holds pulls by: the worker id on the leader; on a follower the connection a worker's
slices came on, so that a worker that connects again gets a new key, and with it the whole
slice.

This is not used in async mode, where a bucket changes with every push and each pull takes
whatever version is current.
"""

from collections.abc import Hashable, Iterable

import torch

from common.wire.protocol import Weights
from psserver.store.parameters import SliceStore

NO_TENSOR = torch.empty(0)


class WeightStreamer:
    def __init__(self, store: SliceStore, buckets: list[tuple[int, int]], shard: int = 0) -> None:
        self.store, self.shard = store, shard
        self.buckets = buckets  # [lo, hi) of each bucket within the store's slice
        # worker id (leader) or connection (follower) -> (version, buckets sent of it)
        self._sent: dict[Hashable, tuple[int, set[int]]] = {}
        self._claimed: dict[Hashable, int] = {}  # worker id or connection -> PULL.have_version

    def part(self, recipients: Iterable[Hashable], bucket: int, version: int) -> Weights:
        """The message for these workers (one message, sent to each), noted as sent to them.
        The store's live tensor goes out zero-copy: the caller must track the send
        (ParameterStore.track_send)."""
        for recipient in recipients:
            sent_version, sent = self._sent.get(recipient, (version, set()))
            if sent_version != version:
                sent = set()
            sent.add(bucket)
            self._sent[recipient] = (version, sent)
        lo, hi = self.buckets[bucket]
        return Weights(
            version, -1, -1, -1, 0, False, self.store.params[lo:hi], NO_TENSOR,
            shard=self.shard, bucket=bucket,
        )  # fmt: skip

    def claim(self, worker_id: Hashable, have_version: int) -> None:
        """What the worker's PULL says it holds."""
        self._claimed[worker_id] = have_version

    def covers(self, worker_id: Hashable) -> bool:
        """Whether this worker holds every bucket of the store's current version: both it
        and our books say so."""
        claimed = self._claimed.pop(worker_id, -1)
        return claimed == self.store.version and self.sent_whole(worker_id)

    def sent_whole(self, worker_id: Hashable) -> bool:
        """Whether our books show every bucket of the store's current version sent there."""
        sent_version, sent = self._sent.get(worker_id, (-1, set()))
        return sent_version == self.store.version and len(sent) == len(self.buckets)

    def forget(self, worker_id: Hashable) -> None:
        self._sent.pop(worker_id, None)
        self._claimed.pop(worker_id, None)

    def forget_older(self, version: int) -> None:
        """Drop the books of versions before this one: they can prove nothing any more, and
        a follower's books would otherwise keep every connection ever seen."""
        for key in [k for k, (v, _) in self._sent.items() if v < version]:
            del self._sent[key]

    def reset(self) -> None:
        """Nothing sent so far proves anything any more (an abandoned step)."""
        self._sent.clear()
