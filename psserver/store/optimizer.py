"""SGD with momentum and weight decay over one flat tensor, a range at a time.

The arithmetic is torch.optim.SGD's (no dampening, no Nesterov), operation for operation, so
results match it bit for bit. It is written out here for two reasons:

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
from typing import Any

import torch
from torch.optim.sgd import sgd as functional_sgd

log = logging.getLogger(__name__)

# Values per fused block: a multiple of every CPU vector width torch uses (8 floats for AVX2,
# 16 for AVX-512) and of the kernel's 16-value task unit, so an aligned block has no ragged end.
FUSED_BLOCK = 64


@dataclasses.dataclass(frozen=True)
class SGDSettings:
    lr: float
    momentum: float
    weight_decay: float

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


class FlatSGD:
    def __init__(
        self,
        params: torch.Tensor,
        grads: torch.Tensor,
        settings: SGDSettings,
        allow_fused: bool = True,
    ):
        self.params, self.grads, self.settings = params, grads, settings  # (S,) each
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

    def state_dict(self) -> dict[str, Any]:
        """In torch.optim.SGD's layout, so that checkpoints stay readable by plain PyTorch."""
        buffer = self.momentum_buffer
        state = {} if buffer is None else {0: {"momentum_buffer": buffer}}
        group = {**self.settings.to_dict(), "dampening": 0, "nesterov": False, "params": [0]}
        return {"state": state, "param_groups": [group]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffer = state.get("state", {}).get(0, {}).get("momentum_buffer")
        self.set_momentum(buffer)

    def set_momentum(self, buffer: torch.Tensor | None) -> None:
        if buffer is None or not buffer.numel():
            self.momentum_buffer = None
            return
        if buffer.numel() != self.params.numel():
            raise ValueError(
                f"momentum has {buffer.numel()} values, the parameters {self.params.numel()}"
            )
        self.momentum_buffer = buffer.detach().to(torch.float32).clone()


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
