"""Checks a PUSH must pass before it touches the parameter store.

Decoding (common.wire.protocol) already guarantees the message is well formed; these checks are
about the job: the shapes and dtypes of this model, the batch this worker was assigned, the
sample count, and finite values. Each failure is a RequestRejected with a code and a reason.
"""

import math

import torch

from common.compression import wire_bytes
from common.errors import RequestRejected
from common.finite import all_finite
from common.job import JobSpec
from common.wire.protocol import Push, PushPart, SlicePush

GRADIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NO_INDICES = torch.empty(0, dtype=torch.int32)  # a PUSH_PART is dense: it carries none


def push_bytes(push: Push) -> int:
    """Bytes of tensor data a push put on the wire."""
    return wire_bytes(push.grads, push.grad_indices, push.buffers)


def validate_gradient(
    job: JobSpec, size: int, grads: torch.Tensor, indices: torch.Tensor, worker_id: int
) -> None:
    """A gradient (or a shard's slice of one, `size` long) fits the job: dtype, shape, dense
    or top-k as the job says, indices in range, and finite values."""
    check_gradient_shape(job, size, grads, indices)
    check_finite(grads, worker_id)


def check_gradient_shape(
    job: JobSpec, size: int, grads: torch.Tensor, indices: torch.Tensor
) -> None:
    if grads.dtype not in GRADIENT_DTYPES:
        raise RequestRejected(
            "wrong-shape", f"grads must be float32, float16 or bfloat16, got {grads.dtype}"
        )
    k = indices.numel()
    if not job.sparse and (k or grads.numel() != size):
        raise RequestRejected(
            "wrong-shape",
            f"grads must be {size} dense values for {job.model}, got {grads.numel()} values "
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


def check_finite(grads: torch.Tensor, worker_id: int) -> None:
    if not all_finite(grads):
        raise RequestRejected(
            "non-finite", f"worker {worker_id} pushed NaN or Inf gradients; dropped"
        )


def validate_push(
    job: JobSpec, worker_id: int, assignment: tuple[int, int] | None, push: Push
) -> None:
    lo, hi = job.shard_range(0)  # with shards, the leader takes only its own slice
    f = job.num_buffers
    if push.buffers.numel() != f or push.buffers.dtype != torch.float32:
        raise RequestRejected(
            "wrong-shape",
            f"buffers must be {f} float32 values for {job.model}, got "
            f"{push.buffers.numel()} {push.buffers.dtype}",
        )
    if push.parts:  # the gradient came before, as PUSH_PARTs (see validate_part)
        if push.grads.numel() or push.grad_indices.numel():
            raise RequestRejected(
                "wrong-shape", "a PUSH that completes parts carries no gradient of its own"
            )
    else:
        check_gradient_shape(job, hi - lo, push.grads, push.grad_indices)
    check_assignment(job, worker_id, assignment, push)
    check_finite(push.grads, worker_id)
    if not bool(torch.isfinite(push.buffers).all()):  # a few thousand values: exact check
        raise RequestRejected(
            "non-finite",
            f"worker {worker_id} pushed NaN or Inf BatchNorm statistics; dropped (they would "
            "poison the server's running averages)",
        )


def check_assignment(
    job: JobSpec, worker_id: int, assignment: tuple[int, int] | None, push: Push | PushPart
) -> None:
    if assignment != (push.epoch, push.batch):
        raise RequestRejected(
            "unexpected-batch",
            f"worker {worker_id} pushed epoch {push.epoch} batch {push.batch}, but "
            f"was assigned {assignment}; pull before pushing",
        )
    if push.samples < 1 or push.samples > job.batch_size:
        raise RequestRejected(
            "bad-samples", f"samples must be 1..{job.batch_size}, got {push.samples}"
        )
    if isinstance(push, Push) and (
        not math.isfinite(push.loss_sum) or not 0 <= push.correct <= push.samples
    ):  # they feed the training loss and accuracy the server reports
        raise RequestRejected(
            "bad-samples",
            f"loss_sum must be finite and correct within 0..{push.samples}, got "
            f"{push.loss_sum} and {push.correct}",
        )


def validate_part(
    job: JobSpec, worker_id: int, assignment: tuple[int, int] | None, part: PushPart
) -> None:
    """One bucket of a dense gradient, for the batch this worker was given."""
    if job.sparse or not 0 <= part.bucket < job.num_buckets:
        raise RequestRejected(
            "wrong-shape",
            f"bucket {part.bucket} does not exist: this job has {job.num_buckets} bucket(s)"
            + (" and top-k gradients travel whole" if job.sparse else ""),
        )
    lo, hi = job.bucket_range(part.bucket)
    check_gradient_shape(job, hi - lo, part.grads, NO_INDICES)
    check_assignment(job, worker_id, assignment, part)
    check_finite(part.grads, worker_id)


def validate_slice_push(
    job: JobSpec, shard: int, buckets: list[tuple[int, int]], push: SlicePush
) -> None:
    """A follower's slice of a gradient, whole (bucket -1) or one of `buckets` of it."""
    lo, hi = job.shard_range(shard)
    size = hi - lo
    if push.bucket >= 0:
        if push.bucket >= len(buckets) or job.sparse:
            takes = "whole top-k slices" if job.sparse else f"{len(buckets)} buckets"
            raise RequestRejected(
                "wrong-shape", f"bucket {push.bucket} does not exist: shard {shard} takes {takes}"
            )
        start, end = buckets[push.bucket]
        size = end - start
    elif push.bucket != -1:
        raise RequestRejected("wrong-shape", f"bucket {push.bucket}: -1 means the whole slice")
    validate_gradient(job, size, push.grads, push.grad_indices, push.worker_id)
