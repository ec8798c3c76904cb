"""The optimizer seam: what the parameter store calls to update its slice, and the one
factory that builds it from the server's config.

`ServerOptimizer` is the interface: `step(lo, hi, lr_scale)` updates a range of the slice
from the gradient already in the store's buffer; `flat_state` is what it keeps per
parameter value (one flat tensor over the slice, which shards gather for a checkpoint and hand
a follower when it joins); `state_dict` and `load_state_dict` are the checkpoint's
`optimizer` entry, in torch.optim's layout. `OptimizerSpec` is its name and settings, as the
config gives them, a follower's WELCOME carries them to the follower shards, and `build_optimizer`
turns them into one. The store and the checkpoint code see only these.

`FlatSGD` is the one optimizer today (`--lr`, `--momentum`, `--weight-decay`): SGD with momentum
and weight decay over one flat tensor, a range at a time. Its arithmetic is torch.optim.SGD's
(no dampening, no Nesterov), operation for operation, so results match it bit for bit. It is
written out here for two reasons:

- A range can be stepped on its own. With gradient buckets (see psserver.policies) the
  server updates the last layers while workers still run backward on the first ones.
- Weight decay is added into the gradient buffer in place. torch.optim.SGD allocates a fresh
  gradient-sized tensor for it at every step, 45 MB for ResNet-18, and page faults on it.

The bulk of each range goes through PyTorch's fused CPU SGD kernel (one pass over weights,
gradient and momentum instead of four: about 6 ms against 15 ms for ResNet-18 on one core).
That kernel computes its vector lanes exactly as the separate ops do, but rounds the few
values of a range's ragged end differently. So it only ever sees whole blocks of
`FUSED_BLOCK` values at block-aligned offsets, and the ragged edges of a range go through
the separate ops: every value then gets the same arithmetic however the vector is cut into
buckets and shards. `fused_kernel_agrees()` checks, once per process, that this holds on the
machine at hand with the job's settings; where it does not (another CPU, another torch),
every value takes the ops.

It is not a general optimizer: one flat parameter, one group, plain SGD.
"""

import dataclasses
import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.optim.sgd import sgd as functional_sgd

from common.errors import ProtocolError

if TYPE_CHECKING:
    from psserver.config import ServerConfig

log = logging.getLogger(__name__)

# Values per fused block: a multiple of every CPU vector width torch uses (8 floats for AVX2,
# 16 for AVX-512) and of the kernel's 16-value task unit, so an aligned block has no ragged end.
FUSED_BLOCK = 64
OPTIMIZERS = ("sgd",)


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
    """Which optimizer the server runs, and its settings."""

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    name: str = "sgd"  # one of OPTIMIZERS

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {OPTIMIZERS}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> "OptimizerSpec":
        """The spec a follower's WELCOME carries: data from the network, checked."""
        names = {field.name for field in dataclasses.fields(cls)}
        if not isinstance(raw, Mapping) or set(raw) != names:
            got = sorted(raw) if isinstance(raw, Mapping) else type(raw).__name__
            raise ProtocolError(f"optimizer must have fields {sorted(names)}, got {got}")
        lr, momentum, weight_decay = (raw[name] for name in ("lr", "momentum", "weight_decay"))
        numbers = [lr, momentum, weight_decay]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers):
            raise ProtocolError(f"optimizer settings must be numbers, got {numbers!r:.80}")
        try:
            return cls(float(lr), float(momentum), float(weight_decay), name=str(raw["name"]))
        except ValueError as exc:
            raise ProtocolError(f"malformed optimizer: {exc}") from None


def spec_from_config(config: "ServerConfig") -> OptimizerSpec:
    """The optimizer the server's command line asks for."""
    return OptimizerSpec(config.lr, config.momentum, config.weight_decay)


class ServerOptimizer(Protocol):
    """What the parameter store calls: an optimizer over one flat slice of parameters whose
    gradient the store writes into a flat buffer of the same length."""

    spec: OptimizerSpec

    def step(self, lo: int, hi: int, lr_scale: float = 1.0) -> None:
        """Update params[lo:hi] from grads[lo:hi] (the gradient buffer is scratch after).
        `lr_scale` is the staleness-aware factor; 1.0 for a fresh gradient."""

    def flat_state(self) -> torch.Tensor | None:
        """The state kept per parameter value of the slice, as one flat tensor; None while
        there is none."""

    def load_flat_state(self, state: torch.Tensor | None) -> None:
        """Take this slice's per-value state (from `flat_state` of a shard's predecessor)."""

    def state_dict(self, flat_state: torch.Tensor | None = None) -> dict[str, Any]:
        """The checkpoint's `optimizer` entry; with `flat_state` (the whole model's, gathered
        from every shard) in place of this slice's own."""

    def load_state_dict(
        self, state: dict[str, Any], bounds: tuple[int, int], total: int
    ) -> torch.Tensor | None:
        """Restore this slice, the range `bounds` of a whole model of `total` values, from a
        checkpoint's `optimizer` entry; returns the whole model's per-value state, if any."""


def build_optimizer(
    spec: OptimizerSpec, params: torch.Tensor, grads: torch.Tensor
) -> ServerOptimizer:
    """The optimizer `spec` names, over `params` with its gradient in `grads` (views the
    caller owns, (S,) each)."""
    assert spec.name == "sgd", spec  # OptimizerSpec checks the name
    return FlatSGD(params, grads, SGDSettings(spec.lr, spec.momentum, spec.weight_decay))


@dataclasses.dataclass(frozen=True)
class SGDSettings:
    lr: float
    momentum: float
    weight_decay: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class FlatSGD:
    """SGD over one flat tensor, a range at a time (see the module's docstring)."""

    def __init__(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        settings: SGDSettings,
        allow_fused: bool = True,
    ):
        self.params, self.grads, self.settings = params, grads, settings  # (S,) each
        self.spec = OptimizerSpec(settings.lr, settings.momentum, settings.weight_decay)
        # The fused kernel only ever does momentum SGD; without momentum one op is one pass.
        self.fused = allow_fused and settings.momentum != 0 and fused_kernel_agrees(settings)
        # Allocated at the first step. Zeros make that first step exact: 0 * m + g == g, which
        # is what torch.optim.SGD's clone of the first gradient holds.
        self.momentum_buffer: torch.Tensor | None = None

    def step(self, lo: int, hi: int, lr_scale: float = 1.0) -> None:
        """params[lo:hi] -= lr * (momentum-smoothed grads[lo:hi] + weight decay).

        `lr_scale` (the staleness-aware factor, 1/s for a gradient s updates old) scales
        this step's gradient, weight decay included, before it enters the momentum. The
        stale gradient then moves the weights 1/s as far as a fresh one over all the steps
        its momentum lasts, and the momentum the other workers' gradients built up decays as
        usual. (Scaling the step's learning rate instead would shrink their momentum for one
        step and leave nearly all of the stale gradient's effect: 95 % of it at s = 2 and
        momentum 0.9.) Without momentum the two are the same: a step of lr / s.

        Overwrites grads[lo:hi] when there is weight decay or a scale: they are the server's
        scratch."""
        s = self.settings
        if s.momentum != 0 and self.momentum_buffer is None:
            self.momentum_buffer = torch.zeros_like(self.params)
        if lr_scale != 1.0:
            # (g + wd * p) * k, computed as g * k + (wd * k) * p, so that the fused kernel
            # and the ops still compute every value alike (checked for these settings).
            self.grads[lo:hi].mul_(lr_scale)
            s = dataclasses.replace(s, weight_decay=s.weight_decay * lr_scale)
        fused = self.fused and (s == self.settings or fused_kernel_agrees(s))
        start, end = fused_span(lo, hi) if fused else (lo, lo)
        if start < end:
            self._step_ops(lo, start, s)
            self._step_fused(start, end, s)
            self._step_ops(end, hi, s)
        else:
            self._step_ops(lo, hi, s)

    def _step_ops(self, lo: int, hi: int, s: SGDSettings) -> None:
        """torch.optim.SGD's single-tensor arithmetic, op by op."""
        if lo >= hi:
            return
        param, grad = self.params[lo:hi], self.grads[lo:hi]  # (hi - lo,) views
        if s.weight_decay != 0:
            grad.add_(param, alpha=s.weight_decay)
        if self.momentum_buffer is not None:
            buf = self.momentum_buffer[lo:hi]
            buf.mul_(s.momentum).add_(grad, alpha=1)
            grad = buf
        param.add_(grad, alpha=-s.lr)

    def _step_fused(self, lo: int, hi: int, s: SGDSettings) -> None:
        """The same step in one pass; lo and hi are multiples of FUSED_BLOCK."""
        assert self.momentum_buffer is not None
        fused_step(self.params[lo:hi], self.grads[lo:hi], self.momentum_buffer[lo:hi], s)

    def flat_state(self) -> torch.Tensor | None:
        """The momentum buffer, or None before the first step (or without momentum)."""
        return self.momentum_buffer

    def state_dict(self, flat_state: torch.Tensor | None = None) -> dict[str, Any]:
        """In torch.optim.SGD's layout, so that checkpoints stay readable by plain PyTorch."""
        buffer = self.momentum_buffer if flat_state is None else flat_state
        state = {} if buffer is None else {0: {"momentum_buffer": buffer}}
        group = {**self.settings.to_dict(), "dampening": 0, "nesterov": False, "params": [0]}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(
        self, state: dict[str, Any], bounds: tuple[int, int], total: int
    ) -> torch.Tensor | None:
        """Only the momentum is restored: the settings are this run's (a resumed run may
        change them)."""
        momentum = state.get("state", {}).get(0, {}).get("momentum_buffer")
        if momentum is not None and momentum.numel() != total:
            raise ValueError(f"momentum has {momentum.numel()} values, the model {total}")
        lo, hi = bounds
        self.load_flat_state(None if momentum is None else momentum[lo:hi])
        return momentum

    def load_flat_state(self, state: torch.Tensor | None) -> None:
        if state is None or not state.numel():
            self.momentum_buffer = None
            return
        if state.numel() != self.params.numel():
            raise ValueError(
                f"momentum has {state.numel()} values, the parameters {self.params.numel()}"
            )
        self.momentum_buffer = state.detach().to(torch.float32).clone()


def fused_span(lo: int, hi: int) -> tuple[int, int]:
    """The whole FUSED_BLOCKs inside [lo, hi), as (start, end); start >= end when none."""
    return -(-lo // FUSED_BLOCK) * FUSED_BLOCK, hi // FUSED_BLOCK * FUSED_BLOCK


def fused_step(param: torch.Tensor, grad: torch.Tensor, buf: torch.Tensor, s: SGDSettings) -> None:
    """One SGD-with-momentum step through torch's fused kernel (a zero `buf` makes the first
    step exact: 0 * m + g == g)."""
    functional_sgd(
        [param],
        [grad],
        [buf],
        has_sparse_grad=False,
        foreach=False,
        fused=True,
        grad_scale=None,
        found_inf=None,
        weight_decay=s.weight_decay,
        momentum=s.momentum,
        lr=s.lr,
        dampening=0.0,
        nesterov=False,
        maximize=False,
    )


@functools.cache
def fused_kernel_agrees(settings: SGDSettings) -> bool:
    """Whether the fused kernel computes, on whole aligned blocks, bit for bit what the
    separate ops compute with these settings. Checked once per process and settings, on
    random values, several steps deep."""
    generator = torch.Generator().manual_seed(0)
    n = 16 * FUSED_BLOCK
    params = torch.randn(n, generator=generator)
    ops = FlatSGD(params.clone(), torch.empty(n), settings, allow_fused=False)
    ops.momentum_buffer = torch.zeros(n)
    fused_params, fused_buf = params.clone(), torch.zeros(n)
    try:
        for _ in range(3):
            gradient = torch.randn(n, generator=generator)
            ops.grads.copy_(gradient)
            ops._step_ops(0, n, settings)
            fused_step(fused_params, gradient.clone(), fused_buf, settings)
    except (RuntimeError, TypeError, NotImplementedError) as exc:  # an older torch
        log.info("fused SGD unavailable (%s); the server steps with separate ops", exc)
        return False
    agrees = torch.equal(fused_params, ops.params) and torch.equal(fused_buf, ops.momentum_buffer)
    if not agrees:
        log.info("fused SGD rounds differently here; the server steps with separate ops")
    return agrees
