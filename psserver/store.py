"""The parameter store: master weights and BatchNorm buffers in CPU memory, and the optimizer.

Parameters, gradients and floating buffers live in flat contiguous tensors (see
`common.flat.FlatModel`), so an update is one copy of the incoming gradient plus the optimizer's
in-place step. The store knows nothing about workers, sockets or sync/async: policies decide
*when* to call `apply_gradient`; the store only applies.

`SliceStore` is the optimizer over one contiguous slice of the flat vector; a sharded server
(psserver.follower) holds only that. `ParameterStore` adds the whole model around it: with K
shards, the leader's slice is the first one and the model's other slices are filled in from
the other shards before an evaluation or a checkpoint.
"""

import logging
import time
from typing import Any

import torch
import zmq

from common.flat import FlatModel
from common.models import build_model, fingerprint
from common.sharding import shard_bounds, shard_range

log = logging.getLogger("ps.server")
SEND_WAIT_S = 2.0


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
    elif first:  # the first gradient initialises the sum: no zeroing pass
        torch.mul(values, weight, out=total)
    else:  # fp16 and bf16 are widened by add_ itself
        total.add_(values, alpha=weight)


class SliceStore:
    """SGD over one flat slice: `params` and `grads` are views the caller owns."""

    def __init__(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        lr: float,
        momentum: float,
        weight_decay: float,
        sparse: bool = False,
    ) -> None:
        self.params, self.grads, self.sparse = params, grads, sparse  # (S,) each
        # The optimizer sees one flat parameter sharing storage with `params`: a step is one
        # fused pass over the slice instead of a Python loop over the model's tensors.
        self._flat_param = torch.nn.Parameter(params)
        self._flat_param.grad = grads
        self.optimizer = torch.optim.SGD(
            [self._flat_param], lr=lr, momentum=momentum, weight_decay=weight_decay
        )
        self.version = 0  # number of updates applied
        self.publish_live = False
        self._snapshot: tuple[int, torch.Tensor] | None = None
        self._in_flight: list[zmq.MessageTracker] = []

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
        if lr_scale != 1.0:
            base = [group["lr"] for group in self.optimizer.param_groups]
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * lr_scale
            self.optimizer.step()
            for group, lr in zip(self.optimizer.param_groups, base, strict=True):
                group["lr"] = lr
        else:
            self.optimizer.step()
        self.version += 1

    def momentum(self) -> torch.Tensor | None:
        """SGD's momentum buffer for the slice, or None before the first step (or without)."""
        buffer = self.optimizer.state.get(self._flat_param, {}).get("momentum_buffer")
        return buffer if isinstance(buffer, torch.Tensor) else None

    def set_momentum(self, buffer: torch.Tensor) -> None:
        if buffer.numel():
            self.optimizer.state[self._flat_param]["momentum_buffer"] = buffer.clone()

    def snapshot_params(self) -> tuple[int, torch.Tensor]:
        """The slice at the current version, safe to send zero-copy.

        Without `publish_live`, one copy per version is shared by every pull of that version;
        ZeroMQ keeps it alive until the last send is done while the store goes on updating.
        With `publish_live` (sync mode) the live tensor itself is sent, saving a copy per step;
        the server then calls `wait_for_sends` before each update.
        """
        if self.publish_live:
            return self.version, self.params
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, self.params.clone())
        return self._snapshot

    def track_send(self, trackers: list[zmq.MessageTracker]) -> None:
        self._in_flight.extend(trackers)

    def wait_for_sends(self, timeout_s: float = SEND_WAIT_S) -> None:
        """Block until ZeroMQ has finished with every live tensor it was given to send."""
        pending = [t for t in self._in_flight if not t.done]
        self._in_flight = []
        if not pending:
            return
        deadline = time.monotonic() + timeout_s
        for tracker in pending:
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                # A stalled peer: its weights may change mid-send; its gradient will be late
                # and dropped, so the torn copy is never applied.
                log.warning("weights still in flight to a stalled worker after %.1f s", timeout_s)
                return


class ParameterStore(SliceStore):
    """The whole model; the optimizer owns `bounds`, the leader's slice (all of it if K = 1)."""

    def __init__(
        self,
        model_name: str,
        seed: int,
        lr: float,
        momentum: float,
        weight_decay: float,
        sparse: bool = False,
        num_shards: int = 1,
    ) -> None:
        self.model_name = model_name
        self.model = build_model(model_name, seed=seed)
        self.model.eval()  # the server never trains; it evaluates with running statistics
        self.flat = FlatModel(self.model)
        self.fingerprint = fingerprint(self.model)
        self.shard_bounds = shard_bounds(self.flat.num_params, num_shards)
        lo, hi = self.bounds = shard_range(self.shard_bounds, 0)
        self._buffer_snapshot: tuple[int, torch.Tensor] | None = None
        super().__init__(
            self.flat.params[lo:hi], self.flat.grads[lo:hi], lr, momentum, weight_decay, sparse
        )

    @property
    def num_params(self) -> int:
        return self.flat.num_params

    @property
    def num_buffers(self) -> int:
        return self.flat.num_buffers

    def apply_accumulated_gradient(self, lr_scale: float = 1.0) -> None:
        super().apply_accumulated_gradient(lr_scale)
        self.flat.set_batches_tracked(self.version)

    def set_buffers(self, buffers: torch.Tensor) -> None:
        self.flat.buffers.copy_(buffers)

    def blend_buffers(self, buffers: torch.Tensor, weight: float) -> None:
        """Running average: move the buffers a fraction `weight` towards a worker's."""
        self.flat.buffers.lerp_(buffers, weight)

    def snapshot(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """This store's slice of the weights and the buffers, safe to send zero-copy."""
        version, params = self.snapshot_params()
        if self.publish_live:
            return version, params, self.flat.buffers
        if self._buffer_snapshot is None or self._buffer_snapshot[0] != version:
            self._buffer_snapshot = (version, self.flat.buffers.clone())
        return version, params, self._buffer_snapshot[1]

    def state_dict(self, momentum: torch.Tensor | None = None) -> dict[str, Any]:
        """Model and optimizer state of the whole model, the same for any number of shards.

        With shards, `momentum` is the whole momentum vector gathered from all of them."""
        optimizer = self.optimizer.state_dict()
        if momentum is not None:
            optimizer["state"] = {0: {"momentum_buffer": momentum}}
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": optimizer,
            "version": self.version,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> torch.Tensor | None:
        """Restore a whole-model state; returns the whole momentum vector, if it had one."""
        # load_state_dict copies into the existing tensors, so the flat views stay intact.
        self.model.load_state_dict(state["model"])
        optimizer = state["optimizer"]
        momentum = optimizer.get("state", {}).get(0, {}).get("momentum_buffer")
        lo, hi = self.bounds
        if momentum is not None:
            if momentum.numel() != self.num_params:
                raise ValueError(
                    f"momentum has {momentum.numel()} values, the model {self.num_params}"
                )
            optimizer = {**optimizer, "state": {0: {"momentum_buffer": momentum[lo:hi]}}}
        self.optimizer.load_state_dict(optimizer)
        self.version = int(state["version"])
        self._snapshot = self._buffer_snapshot = None
        return momentum
