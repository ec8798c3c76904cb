"""The parameter store: master weights and BatchNorm buffers in CPU memory, and the optimizer.

Parameters, gradients and floating buffers live in flat contiguous tensors (see
`common.flat.FlatModel`), so an update is one copy of the incoming gradient plus the optimizer's
in-place step. The store knows nothing about workers, sockets or sync/async: policies decide
*when* to call `apply_gradient`; the store only applies.
"""

import logging
import time
from typing import Any

import torch
import zmq

from common.flat import FlatModel
from common.models import build_model, fingerprint

log = logging.getLogger("ps.server")
SEND_WAIT_S = 2.0


class ParameterStore:
    def __init__(
        self, model_name: str, seed: int, lr: float, momentum: float, weight_decay: float
    ) -> None:
        self.model_name = model_name
        self.model = build_model(model_name, seed=seed)
        self.model.eval()  # the server never trains; it evaluates with running statistics
        self.flat = FlatModel(self.model)
        self.fingerprint = fingerprint(self.model)
        # The optimizer sees one flat parameter sharing storage with the model's: a step is one
        # fused pass over 11M floats instead of a Python loop over 62 tensors.
        self._flat_param = torch.nn.Parameter(self.flat.params)
        self._flat_param.grad = self.flat.grads
        self.optimizer = torch.optim.SGD(
            [self._flat_param], lr=lr, momentum=momentum, weight_decay=weight_decay
        )
        self.version = 0  # number of updates applied
        self.publish_live = False
        self._snapshot: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._in_flight: list[zmq.MessageTracker] = []

    @property
    def num_params(self) -> int:
        return self.flat.num_params

    @property
    def num_buffers(self) -> int:
        return self.flat.num_buffers

    def apply_gradient(
        self, values: torch.Tensor, indices: torch.Tensor | None = None, lr_scale: float = 1.0
    ) -> None:
        """One optimizer step with this flat gradient (dense, or top-k values at indices)."""
        if indices is None or indices.numel() == 0:
            self.flat.grads.copy_(values)  # every param.grad is a view of flat.grads
        else:
            self.flat.grads.zero_()
            self.flat.grads.index_add_(0, indices.long(), values.float())
        self.apply_accumulated_gradient(lr_scale)

    def apply_accumulated_gradient(self, lr_scale: float = 1.0) -> None:
        """One optimizer step with the gradient already summed into `flat.grads` in place.

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
        self.flat.set_batches_tracked(self.version)

    def set_buffers(self, buffers: torch.Tensor) -> None:
        self.flat.buffers.copy_(buffers)

    def blend_buffers(self, buffers: torch.Tensor, weight: float) -> None:
        """Running average: move the buffers a fraction `weight` towards a worker's."""
        self.flat.buffers.lerp_(buffers, weight)

    def snapshot(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """Weights and buffers of the current version, safe to send zero-copy.

        Without `publish_live`, one copy per version is shared by every pull of that version;
        ZeroMQ keeps it alive until the last send is done while the store goes on updating.
        With `publish_live` (sync mode) the live tensors themselves are sent, saving a 45 MB
        copy per step; the server then calls `wait_for_sends` before each update.
        """
        if self.publish_live:
            return self.version, self.flat.params, self.flat.buffers
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, self.flat.params.clone(), self.flat.buffers.clone())
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

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "version": self.version,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # load_state_dict copies into the existing tensors, so the flat views stay intact.
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self._snapshot = None
