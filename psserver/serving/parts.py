"""Gradients that arrive in buckets: which parts of each worker's coming PUSH are in.

A worker sends one PUSH per bucket of the leader's slice (bucket 0..N-1) while backward runs
and then the PUSH that completes them (bucket -1, parts N), all on one connection, so they
arrive in that order. Parts get no reply (the worker is not waiting
for one): a part the server refuses is remembered here, and the PUSH is answered with that
refusal. A PUSH whose parts did not all come (its connection was replaced, say) is answered
with "incomplete-push"; the worker computes the step again, and the parts that did come count
once, because a part of the same batch sent again is ignored, also when it was computed
again on newer weights (async). (In sync mode a bucket that already had every worker's part
may have been applied meanwhile, so the step computed again sees those buckets updated; this
happens only when a connection is replaced mid-push.)

This module only keeps the books; the policy adds or applies each part (psserver.policies).
"""

import dataclasses

from common.compression import wire_bytes
from common.errors import RequestRejected
from common.logs import counted
from common.wire.protocol import Push

# The epoch and batch a gradient is for. Not the weights version: a step computed again (async
# after "incomplete-push") is on newer weights, and its parts already applied must not count
# twice. Within an epoch, (epoch, batch) names one sync step or one async shard batch.
PushKey = tuple[int, int]


@dataclasses.dataclass
class PartialPush:
    key: PushKey
    received: set[int] = dataclasses.field(default_factory=set)  # bucket indices
    wire_bytes: int = 0
    refusal: RequestRejected | None = None


def push_key(message: Push) -> PushKey:
    return message.epoch, message.batch


class PartLedger:
    def __init__(self, num_buckets: int) -> None:
        self.num_buckets = num_buckets
        self._partial: dict[int, PartialPush] = {}  # worker id -> its push being assembled

    def _partial_for(self, worker_id: int, part: Push) -> PartialPush:
        """The books for this part's push; a part of another step starts them over."""
        partial = self._partial.get(worker_id)
        if partial is None or partial.key != push_key(part):
            partial = self._partial[worker_id] = PartialPush(push_key(part))
        return partial

    def admit(self, worker_id: int, part: Push) -> bool:
        """Whether the policy should take this part: not one already taken for the same push,
        and not after an earlier part of it was refused."""
        partial = self._partial_for(worker_id, part)
        return partial.refusal is None and part.bucket not in partial.received

    def record(self, worker_id: int, part: Push) -> None:
        partial = self._partial[worker_id]
        partial.received.add(part.bucket)
        partial.wire_bytes += wire_bytes(part.grads)

    def refuse(self, worker_id: int, part: Push, refusal: RequestRejected) -> None:
        partial = self._partial_for(worker_id, part)
        partial.refusal = partial.refusal or refusal

    def complete(self, worker_id: int, push: Push) -> int:
        """Check that every part of this PUSH came and was taken; returns their wire bytes.

        Raises the refusal of a part, or "incomplete-push" (the books are kept, so that the
        parts sent again when the worker retries the step count once)."""
        partial = self._partial.get(worker_id)
        if partial is not None and partial.key != push_key(push):
            partial = None  # the books of another step
        if partial is not None and partial.refusal:
            del self._partial[worker_id]
            raise partial.refusal
        missing = sorted(set(range(self.num_buckets)) - (partial.received if partial else set()))
        if push.parts != self.num_buckets or missing or partial is None:
            raise RequestRejected(
                "incomplete-push",
                f"the PUSH announces {counted(push.parts, 'part')} of {self.num_buckets}, and "
                f"buckets {missing} did not arrive before it; compute the step again",
            )
        del self._partial[worker_id]
        return partial.wire_bytes

    def forget(self, worker_id: int) -> None:
        self._partial.pop(worker_id, None)

    def in_flight(self) -> set[int]:
        """The workers with parts of a push here whose PUSH has not come yet."""
        return set(self._partial)
