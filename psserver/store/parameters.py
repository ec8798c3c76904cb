"""The parameter store: master weights and BatchNorm buffers in CPU memory, and the optimizer.

Parameters, gradients and floating buffers live in flat contiguous tensors (see
`common.model.flat.FlatModel`), so an update is one copy of the incoming gradient plus the
optimizer's in-place step. The store knows nothing about workers, sockets or sync/async: policies
decide *when* to call `apply_gradient`; the store only applies.

`SliceStore` is the optimizer (psserver.store.optimizer, through its `ServerOptimizer`
interface only) over one contiguous slice of the flat vector; a sharded server
(psserver.shards.follower) holds only that. `ParameterStore` adds the whole model around it: with K
shards, the leader owns the last range (common.sharding.shard_range), and the model's other
slices are filled in from the other shards before an evaluation or a checkpoint.

What this is not: keeping track of the sends still reading the weights, zero-copy, and of the
copies async pulls are sent from (psserver.store.sends); the store only asks it.
"""

from typing import Any

import torch
import zmq

from common.catalog import build_model, fingerprint
from common.errors import ConfigError
from common.model.flat import FlatModel
from common.sharding import shard_bounds, shard_range
from psserver.store.optimizer import OptimizerSpec, ServerOptimizer, build_optimizer
from psserver.store.sends import SEND_WAIT_S, WeightSends


def add_weighted(
    total: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    weight: float,
    first: bool,
    sparse: bool,
) -> None:
    """total (+)= weight * gradient, for a dense gradient or top-k values at indices.

    Every shard adds up its slice with this one function, in the leader's order, so K shards
    compute bit for bit what one server computes.
    """
    if sparse:
        if first:
            total.zero_()
        if indices.numel():
            total.index_add_(0, indices.long(), values.float(), alpha=weight)
    elif first and values.dtype == total.dtype:  # the first initialises the sum: no zeroing
        torch.mul(values, weight, out=total)
    elif first:  # fp16 or bf16: widen, then scale. torch.mul would scale in half precision
        # and round small values, so the sum would depend on which gradient came first.
        total.copy_(values).mul_(weight)
    else:  # fp16 and bf16 are widened by add_ itself
        total.add_(values, alpha=weight)


class SliceStore:
    """The optimizer over one flat slice: `params` and `grads` are views the caller owns."""

    def __init__(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        optimizer: OptimizerSpec,
        sparse: bool = False,
    ) -> None:
        self.params, self.grads, self.sparse = params, grads, sparse  # (S,) each
        self.optimizer: ServerOptimizer = build_optimizer(optimizer, params, grads)
        self.version = 0  # number of updates applied
        self.publish_live = False
        # Async pulls are sent from copies; sync mode sends the live weights (see
        # `snapshot_params`). Either way, what ZeroMQ still reads is tracked here.
        self.sends = WeightSends()

    def apply_gradient(
        self, values: torch.Tensor, indices: torch.Tensor | None = None, lr_scale: float = 1.0
    ) -> None:
        """One optimizer step with this gradient (dense, or top-k values at indices)."""
        if indices is None or not self.sparse:
            self.grads.copy_(values)
        else:
            add_weighted(self.grads, values, indices, 1.0, first=True, sparse=True)
        self.apply_accumulated_gradient(lr_scale)

    def apply_accumulated_gradient(self, lr_scale: float = 1.0) -> None:
        """One optimizer step with the gradient already summed into `grads` in place.

        `lr_scale` shrinks this one step (staleness-aware learning rate)."""
        self.optimizer.step(0, self.params.numel(), lr_scale)
        self.count_update()

    def apply_range(self, lo: int, hi: int, lr_scale: float = 1.0) -> None:
        """The optimizer step for [lo, hi) of the slice only, with the gradient already in
        `grads[lo:hi]`; the version moves on with `count_update` once every range is done."""
        self.optimizer.step(lo, hi, lr_scale)

    def count_update(self) -> None:
        self.version += 1

    def momentum(self) -> torch.Tensor | None:
        """The optimizer's per-value state of the slice (SGD's momentum), or None before the
        first step (or without)."""
        return self.optimizer.flat_state()

    def set_momentum(self, buffer: torch.Tensor) -> None:
        self.optimizer.load_flat_state(buffer)

    def snapshot_params(self) -> tuple[int, torch.Tensor] | None:
        """The slice at the current version, safe to send zero-copy; None: try again soon.

        With `publish_live` (sync mode) the live tensor itself is sent, saving a copy per step;
        the server then calls `wait_for_sends` before each update. Otherwise the copy in a
        snapshot slot is sent, shared by every pull of that version; when every slot is still
        being sent, there is none to give (the caller holds the pull and asks again).
        """
        if self.publish_live:
            return self.version, self.params
        slot = self.sends.slot(self.version, [self.params])
        return None if slot is None else (slot.version, slot.tensors[0])

    @property
    def stalled_waits(self) -> int:
        """Waits for a stalled peer's sends that gave up (see WeightSends.stalled_waits)."""
        return self.sends.stalled_waits

    def track_send(
        self, trackers: list[zmq.MessageTracker], lo: int = 0, hi: int | None = None
    ) -> None:
        """Sends of what `snapshot` just returned: the slot (or live tensor) stays theirs.

        In sync mode a send may cover only [lo, hi) of the live slice (a streamed bucket), and
        only an update of that range has to wait for it."""
        end = self.params.numel() if hi is None else hi
        self.sends.track(trackers, lo, end, live=self.publish_live)

    def wait_for_sends(
        self,
        lo: int = 0,
        hi: int | None = None,
        timeout_s: float = SEND_WAIT_S,
        deadline: float | None = None,
    ) -> None:
        """Block until ZeroMQ has finished with every live tensor it was given to send that
        overlaps [lo, hi) of the slice (all of it by default), for at most `timeout_s`, or
        until `deadline` (time.monotonic()) when several waits share one budget."""
        end = self.params.numel() if hi is None else hi
        self.sends.wait(lo, end, timeout_s, deadline)


class ParameterStore(SliceStore):
    """The whole model; the optimizer owns `bounds`, the leader's slice (all of it if K = 1)."""

    def __init__(
        self,
        model_name: str,
        seed: int,
        optimizer: OptimizerSpec,
        sparse: bool = False,
        num_shards: int = 1,
    ) -> None:
        self.model_name = model_name
        self.model = build_model(model_name, seed=seed)
        self.model.eval()  # the server never trains; it evaluates with running statistics
        self.flat = FlatModel(self.model)
        self.fingerprint = fingerprint(self.model)
        if num_shards > self.flat.num_params:  # a range of no parameters serves nothing
            raise ConfigError(
                f"--num-shards {num_shards}: {model_name} has {self.flat.num_params} "
                f"parameters, so at most {self.flat.num_params} shards; ask for fewer"
            )
        self.shard_bounds = shard_bounds(self.flat.num_params, num_shards)
        lo, hi = self.bounds = shard_range(self.shard_bounds, 0)
        super().__init__(self.flat.params[lo:hi], self.flat.grads[lo:hi], optimizer, sparse)

    @property
    def num_params(self) -> int:
        return self.flat.num_params

    @property
    def num_buffers(self) -> int:
        return self.flat.num_buffers

    def count_update(self) -> None:
        super().count_update()
        self.flat.set_batches_tracked(self.version)

    def set_buffers(self, buffers: torch.Tensor) -> None:
        self.flat.buffers.copy_(buffers)

    def blend_buffers(self, buffers: torch.Tensor, weight: float) -> None:
        """Running average: move the buffers a fraction `weight` towards a worker's."""
        self.flat.buffers.lerp_(buffers, weight)

    def snapshot(self) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """This store's slice of the weights and the buffers, safe to send zero-copy (see
        `snapshot_params`); None when every snapshot slot is still being sent."""
        if self.publish_live:
            return self.version, self.params, self.flat.buffers
        slot = self.sends.slot(self.version, [self.params, self.flat.buffers])
        return None if slot is None else (slot.version, slot.tensors[0], slot.tensors[1])

    def state_dict(self, momentum: torch.Tensor | None = None) -> dict[str, Any]:
        """Model and optimizer state of the whole model, the same for any number of shards.

        With shards, `momentum` is the optimizer's whole per-value state gathered from all of
        them."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(momentum),
            "version": self.version,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> torch.Tensor | None:
        """Restore a whole-model state; returns the optimizer's whole per-value state (SGD's
        momentum), if it had one."""
        # load_state_dict copies into the existing tensors, so the flat views stay intact.
        self.model.load_state_dict(state["model"])
        momentum = self.optimizer.load_state_dict(state["optimizer"], self.bounds, self.num_params)
        self.version = int(state["version"])
        self.sends.forget_slots()
        return momentum
