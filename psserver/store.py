"""The parameter store: master weights and BatchNorm buffers in CPU memory, and the optimizer.

Parameters, gradients and floating buffers live in flat contiguous tensors (see
`common.flat.FlatModel`), so an update is one copy of the incoming gradient plus the optimizer's
in-place step. The store knows nothing about workers, sockets or sync/async: policies decide
*when* to call `apply_gradient`; the store only applies.

`SliceStore` is the optimizer over one contiguous slice of the flat vector; a sharded server
(psserver.follower) holds only that. `ParameterStore` adds the whole model around it: with K
shards, the leader owns the last range (common.sharding.shard_range), and the model's other
slices are filled in from the other shards before an evaluation or a checkpoint.
"""

import dataclasses
import logging
import time
from typing import Any

import torch
import zmq

from common.errors import ConfigError
from common.flat import FlatModel
from common.models import build_model, fingerprint
from common.sharding import shard_bounds, shard_range
from psserver.optimizer import FlatSGD, SGDSettings

log = logging.getLogger("ps.server")
SEND_WAIT_S = 2.0
SNAPSHOT_SLOTS = 3  # copies of the weights that async pulls may be sent from at once
# Slots given up on because a peer stopped reading their sends (a stalled or hostile client):
# replaced by fresh ones, freed by ZeroMQ whenever those sends end. At most this many at once.
RETIRED_SLOTS = 3


@dataclasses.dataclass
class SnapshotSlot:
    """A reusable copy of the weights of one version, and the sends still reading it."""

    version: int
    tensors: list[torch.Tensor]
    trackers: list[zmq.MessageTracker]
    filled: float = 0.0  # time.monotonic() when it took this version

    def busy(self) -> bool:
        return any(not tracker.done for tracker in self.trackers)


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
        self.optimizer = FlatSGD(params, grads, SGDSettings(lr, momentum, weight_decay))
        self.version = 0  # number of updates applied
        self.publish_live = False
        # Async pulls are sent from copies: a few fixed slots, reused once ZeroMQ is done
        # with them, so memory does not grow with the number of workers (nor page-faults).
        self._slots: list[SnapshotSlot] = []
        self._last_slot: SnapshotSlot | None = None
        self._in_flight: list[tuple[int, int, zmq.MessageTracker]] = []  # [lo, hi) sent
        self._retired: list[SnapshotSlot] = []  # see RETIRED_SLOTS
        # Waits for a stalled peer's sends that gave up: each held the loop for up to
        # SEND_WAIT_S, unable to read heartbeats, so the caller excuses the silence after.
        self.stalled_waits = 0
        self._warned_stall = 0.0  # when it was last said (once per timeout is enough)

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
        """SGD's momentum buffer for the slice, or None before the first step (or without)."""
        return self.optimizer.momentum_buffer

    def set_momentum(self, buffer: torch.Tensor) -> None:
        self.optimizer.set_momentum(buffer)

    def snapshot_params(self) -> tuple[int, torch.Tensor] | None:
        """The slice at the current version, safe to send zero-copy; None: try again soon.

        With `publish_live` (sync mode) the live tensor itself is sent, saving a copy per step;
        the server then calls `wait_for_sends` before each update. Otherwise the copy in a
        snapshot slot is sent, shared by every pull of that version; when every slot is still
        being sent, there is none to give (the caller holds the pull and asks again).
        """
        if self.publish_live:
            return self.version, self.params
        slot = self._snapshot_slot([self.params])
        return None if slot is None else (slot.version, slot.tensors[0])

    def _snapshot_slot(self, sources: list[torch.Tensor]) -> SnapshotSlot | None:
        slot = next((s for s in self._slots if s.version == self.version), None)
        if slot is None:
            slot = next((s for s in self._slots if not s.busy()), None)
            if slot is not None:
                for copy, source in zip(slot.tensors, sources, strict=True):
                    copy.copy_(source)
            elif len(self._slots) < SNAPSHOT_SLOTS or self._retire_stalled_slot():
                slot = SnapshotSlot(-1, [source.clone() for source in sources], [])
                self._slots.append(slot)
            else:
                return None
            slot.version, slot.trackers, slot.filled = self.version, [], time.monotonic()
        self._last_slot = slot
        return slot

    def _retire_stalled_slot(self) -> bool:
        """Give up on the oldest slot busy for over SEND_WAIT_S (its sends go to a peer that
        stopped reading), so that the other workers' pulls do not wait for ever; at most
        RETIRED_SLOTS at once. Whether one was given up on."""
        self._retired = [slot for slot in self._retired if slot.busy()]
        oldest = min(self._slots, key=lambda slot: slot.filled)
        if len(self._retired) >= RETIRED_SLOTS or time.monotonic() - oldest.filled < SEND_WAIT_S:
            return False
        stalled_s = time.monotonic() - oldest.filled
        log.warning(
            "a copy of the weights (step %d) is still being sent after %.0f s: a worker stopped "
            "reading; a fresh copy takes its place", oldest.version, stalled_s,
        )  # fmt: skip
        self._slots.remove(oldest)
        self._retired.append(oldest)
        return True

    def track_send(
        self, trackers: list[zmq.MessageTracker], lo: int = 0, hi: int | None = None
    ) -> None:
        """Sends of what `snapshot` just returned: the slot (or live tensor) stays theirs.

        In sync mode a send may cover only [lo, hi) of the live slice (a streamed bucket), and
        only an update of that range has to wait for it."""
        if self.publish_live or self._last_slot is None:
            end = self.params.numel() if hi is None else hi
            self._in_flight.extend((lo, end, tracker) for tracker in trackers)
        else:
            self._last_slot.trackers.extend(trackers)

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
        pending = [t for t in self._in_flight if not t[2].done]
        self._in_flight = [t for t in pending if t[1] <= lo or t[0] >= end]  # not ours
        waited = [tracker for start, stop, tracker in pending if start < end and stop > lo]
        if not waited:
            return
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        for tracker in waited:
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone:
                # A stalled peer: its weights may change mid-send; its gradient will be late
                # and dropped, so the torn copy is never applied.
                if not self.stalled_waits or time.monotonic() - self._warned_stall > timeout_s:
                    log.warning(
                        "weights still in flight to a stalled worker after %.1f s", timeout_s
                    )
                    self._warned_stall = time.monotonic()
                self.stalled_waits += 1
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
        if num_shards > self.flat.num_params:  # a range of no parameters serves nothing
            raise ConfigError(
                f"--num-shards {num_shards}: {model_name} has {self.flat.num_params} "
                f"parameters, so at most {self.flat.num_params} shards; ask for fewer"
            )
        self.shard_bounds = shard_bounds(self.flat.num_params, num_shards)
        lo, hi = self.bounds = shard_range(self.shard_bounds, 0)
        super().__init__(
            self.flat.params[lo:hi], self.flat.grads[lo:hi], lr, momentum, weight_decay, sparse
        )

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
        slot = self._snapshot_slot([self.params, self.flat.buffers])
        return None if slot is None else (slot.version, slot.tensors[0], slot.tensors[1])

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
        self._slots, self._last_slot = [], None
        return momentum
