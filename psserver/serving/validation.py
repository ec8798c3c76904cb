"""What a PUSH must satisfy before it touches a shard's parameters, written once for every shard.

Decoding (common.wire.protocol) already guarantees the message is well formed; `check_push` is
about the job: the address (this shard, and a bucket it has), the gradient's dtype and shape
(dense or top-k as the job says, indices in range), finite values, the sample count and the
numbers for the logs, and, on shard 0's whole push, the BatchNorm statistics. The leader and
every follower run it on every PUSH they take, a retry of one already answered included, so
a malformed retry is refused rather than acknowledged. Each failure is a RequestRejected with
a code and a reason.

What it is not: what only the leader knows, the batch it gave each worker (`check_assignment`),
nor what the policy knows (the open step and its sample count, psserver.policies).
"""

import math

import torch

from common.compression import HALF_DTYPES, wire_bytes
from common.errors import RequestRejected
from common.finite import all_finite
from common.job import JobSpec
from common.logs import counted
from common.wire.protocol import WHOLE, Push


def push_bytes(push: Push) -> int:
    """Bytes of tensor data a push put on the wire."""
    return wire_bytes(push.grads, push.grad_indices, push.buffers)


def gradient_dtypes(job: JobSpec) -> tuple[torch.dtype, ...]:
    """The dtypes a gradient of this job may travel in: float32, and with --compress fp16 or
    bf16 that half type too (a piece whose values do not fit it goes in float32)."""
    half = HALF_DTYPES.get(job.compress)
    return (torch.float32,) if half is None else (torch.float32, half)


def check_push(job: JobSpec, shard: int, push: Push) -> None:
    """A PUSH fits this job and this shard (see the module doc); RequestRejected if not."""
    if push.shard != shard:
        raise RequestRejected(
            "wrong-shard",
            f"this is shard {shard} of {job.num_shards}; a PUSH for shard {push.shard} goes to "
            "that shard (the job's shard_endpoints)",
        )
    if push.parts < 0:
        raise RequestRejected(
            "wrong-shape", f"parts must be 0 or the slice's number of buckets, got {push.parts}"
        )
    cuts = job.shard_buckets(shard)  # a tuple: a push costs O(1), however many buckets
    lo, hi = job.shard_range(shard)
    size = hi - lo
    if push.bucket >= 0:
        if job.sparse or push.bucket >= len(cuts) - 1:
            takes = "whole top-k slices" if job.sparse else counted(len(cuts) - 1, "bucket")
            raise RequestRejected(
                "wrong-shape", f"bucket {push.bucket} does not exist: shard {shard} takes {takes}"
            )
        if push.parts:
            raise RequestRejected(
                "wrong-shape",
                "a bucket's PUSH has parts 0; the PUSH that completes the slice counts them",
            )
        size = cuts[push.bucket + 1] - cuts[push.bucket]
    elif push.bucket != WHOLE:
        raise RequestRejected(
            "wrong-shape", f"bucket {push.bucket}: -1 means the whole slice, else 0..N-1"
        )
    if push.bucket == WHOLE and push.parts:  # the gradient came before, in buckets
        if push.grads.numel() or push.grad_indices.numel():
            raise RequestRejected(
                "wrong-shape", "a PUSH that completes parts carries no gradient of its own"
            )
    else:
        check_gradient(job, size, push.grads, push.grad_indices, push.bucket >= 0)
    check_counts(job, push)
    check_buffers(job, shard, push)
    if not all_finite(push.grads):
        raise RequestRejected(
            "non-finite", f"worker {push.worker_id} pushed NaN or Inf gradients; dropped"
        )


def check_gradient(
    job: JobSpec, size: int, grads: torch.Tensor, indices: torch.Tensor, bucket: bool
) -> None:
    """`size` values of a dense gradient, or top-k's values and int32 indices into `size`."""
    dtypes = gradient_dtypes(job)
    if grads.dtype not in dtypes:
        names = " or ".join(str(dtype).removeprefix("torch.") for dtype in dtypes)
        raise RequestRejected(
            "wrong-dtype",
            f"this job's gradients travel as {names} (--compress {job.compress}), got "
            f"{str(grads.dtype).removeprefix('torch.')}; convert them, or start the server "
            "with the --compress that sends this dtype",
        )
    k = indices.numel()
    if not job.sparse and (k or grads.numel() != size):
        what = "a bucket of" if bucket else "the slice of"
        raise RequestRejected(
            "wrong-shape",
            f"grads must be {size} dense values ({what} {job.model}), got {grads.numel()} values "
            f"and {k} indices",
        )
    if job.sparse:
        if indices.dtype != torch.int32 or grads.numel() != k or k > size:
            raise RequestRejected(
                "wrong-shape",
                f"a top-k gradient needs K <= {size} values and K int32 indices, got "
                f"{grads.numel()} values and {k} {indices.dtype} indices",
            )
        low, high = (int(indices.min()), int(indices.max())) if k else (0, 0)
        if low < 0 or high >= size:
            raise RequestRejected(
                "wrong-shape", f"top-k indices must lie in [0, {size}), got [{low}, {high}]"
            )


def check_counts(job: JobSpec, push: Push) -> None:
    """The sample count the gradient is a mean over, and the numbers the logs report."""
    if push.samples < 1 or push.samples > job.batch_size:
        raise RequestRejected(
            "bad-samples", f"samples must be 1..{job.batch_size}, got {push.samples}"
        )
    if not math.isfinite(push.loss_sum) or not 0 <= push.correct <= push.samples:
        raise RequestRejected(
            "bad-samples",
            f"loss_sum must be finite and correct within 0..{push.samples}, got "
            f"{push.loss_sum} and {push.correct}",
        )


def check_buffers(job: JobSpec, shard: int, push: Push) -> None:
    """Shard 0's whole PUSH carries the worker's BatchNorm statistics; every other is empty."""
    if shard != 0 or push.bucket != WHOLE:
        if push.buffers.numel():
            raise RequestRejected(
                "wrong-shape",
                "buffers travel in shard 0's whole PUSH only (bucket -1); this one must carry "
                f"none, got {push.buffers.numel()}",
            )
        return
    f = job.num_buffers
    if push.buffers.numel() != f or (f and push.buffers.dtype != torch.float32):
        raise RequestRejected(
            "wrong-shape",
            f"buffers must be {f} float32 values for {job.model}, got "
            f"{push.buffers.numel()} {push.buffers.dtype}",
        )
    if not bool(torch.isfinite(push.buffers).all()):  # a few thousand values: exact check
        raise RequestRejected(
            "non-finite",
            f"worker {push.worker_id} pushed NaN or Inf BatchNorm statistics; dropped (they "
            "would poison the server's running averages)",
        )


def check_assignment(worker_id: int, assignment: tuple[int, int] | None, push: Push) -> None:
    """The leader's check: the push is for the batch this worker was given."""
    if assignment != (push.epoch, push.batch):
        raise RequestRejected(
            "unexpected-batch",
            f"worker {worker_id} pushed epoch {push.epoch} batch {push.batch}, but "
            f"was assigned {assignment}; pull before pushing",
        )
