"""FlatSGD: torch.optim.SGD's arithmetic over one flat vector, stepped a range at a time, with
the bulk of each range in torch's fused kernel and the ragged edges in separate ops. However
the vector is cut (buckets, shards), every value must come out bit for bit the same."""

import itertools

import pytest
import torch

from common.errors import ProtocolError
from psserver.config import ServerConfig
from psserver.store import optimizer
from psserver.store.optimizer import (
    FUSED_BLOCK,
    FlatSGD,
    OptimizerSpec,
    ServerOptimizer,
    SGDSettings,
    build_optimizer,
    fused_span,
    spec_from_config,
)

SETTINGS = SGDSettings(lr=0.1, momentum=0.9, weight_decay=5e-4)


def run_cut(
    params: torch.Tensor, gradients: list[torch.Tensor], cuts: list[int], fused: bool
) -> FlatSGD:
    """Step every gradient through FlatSGD, range by range (last range first, as buckets)."""
    ours = FlatSGD(params.clone(), torch.empty_like(params), SETTINGS, allow_fused=fused)
    assert ours.fused == (fused and optimizer.fused_kernel_agrees(SETTINGS))
    ranges = list(itertools.pairwise(cuts))
    for gradient in gradients:
        ours.grads.copy_(gradient)
        for lo, hi in reversed(ranges):
            ours.step(lo, hi)
    return ours


def test_fused_span_covers_only_whole_aligned_blocks() -> None:
    assert fused_span(0, 10 * FUSED_BLOCK) == (0, 10 * FUSED_BLOCK)
    assert fused_span(1, 3 * FUSED_BLOCK - 1) == (FUSED_BLOCK, 2 * FUSED_BLOCK)
    start, end = fused_span(5, FUSED_BLOCK + 3)  # no whole block inside
    assert start >= end


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "ops-only"])
def test_any_cut_steps_exactly_like_torch_sgd(fused: bool) -> None:
    torch.manual_seed(0)
    n = 40 * FUSED_BLOCK + 13  # a ragged end, as ResNet-18's 11,173,962 values have
    params = torch.randn(n)
    gradients = [torch.randn(n) for _ in range(4)]
    reference = torch.nn.Parameter(params.clone())
    torch_sgd = torch.optim.SGD([reference], lr=0.1, momentum=0.9, weight_decay=5e-4)
    for gradient in gradients:
        reference.grad = gradient.clone()
        torch_sgd.step()
    whole = run_cut(params, gradients, [0, n], fused)
    assert torch.equal(whole.params, reference.detach())
    assert torch.equal(whole.momentum_buffer, torch_sgd.state[reference]["momentum_buffer"])
    # Cuts inside blocks, on block edges, and ranges shorter than a block.
    for cuts in ([0, 7, 700, 701, 1900, n], [0, 64, 128, 2000, n], [0, 30, n - 5, n]):
        cut = run_cut(params, gradients, cuts, fused)
        assert torch.equal(cut.params, whole.params), cuts
        assert torch.equal(cut.momentum_buffer, whole.momentum_buffer), cuts


def test_the_fused_kernel_takes_the_bulk_when_it_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    if not optimizer.fused_kernel_agrees(SETTINGS):
        pytest.skip("torch's fused SGD rounds differently on this machine; the ops are used")
    fused_values: list[int] = []
    real = optimizer.fused_step

    def counted(param: torch.Tensor, *rest: object) -> None:
        fused_values.append(param.numel())
        real(param, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(optimizer, "fused_step", counted)
    ours = FlatSGD(torch.zeros(1000), torch.ones(1000), SETTINGS)
    assert ours.fused
    ours.step(600, 1000)
    ours.step(0, 600)
    assert fused_values == [320, 576]  # [640, 960) and [0, 576): whole blocks only


def test_without_momentum_there_is_no_buffer_and_the_step_is_plain() -> None:
    ours = FlatSGD(torch.ones(300), torch.full((300,), 2.0), SGDSettings(0.5, 0.0, 0.0))
    ours.step(0, 300)
    assert ours.momentum_buffer is None and not ours.fused
    assert torch.equal(ours.params, torch.zeros(300))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "ops-only"])
def test_a_stale_gradient_enters_the_momentum_scaled(fused: bool) -> None:
    """lr_scale 1/s steps exactly as a fresh gradient of g / s would: the stale gradient's
    whole effect is 1/s of a fresh one's, and the momentum already built up decays as usual
    (it used to scale the step, which shrank the others' momentum and kept 95 % of g's)."""
    settings = SGDSettings(lr=0.1, momentum=0.9, weight_decay=0.0)
    torch.manual_seed(0)
    n = 8 * FUSED_BLOCK + 5
    params, fresh, stale = torch.randn(n), torch.randn(n), torch.randn(n)

    def run(gradients: list[tuple[torch.Tensor, float]]) -> FlatSGD:
        ours = FlatSGD(params.clone(), torch.empty(n), settings, allow_fused=fused)
        for gradient, scale in gradients:
            ours.grads.copy_(gradient)
            ours.step(0, n, lr_scale=scale)
        return ours

    zero = torch.zeros(n)
    scaled = run([(fresh, 1.0), (stale, 0.5), *[(zero, 1.0)] * 3])
    prescaled = run([(fresh, 1.0), (stale * 0.5, 1.0), *[(zero, 1.0)] * 3])
    assert torch.equal(scaled.params, prescaled.params)
    assert torch.equal(scaled.momentum_buffer, prescaled.momentum_buffer)
    # Over a long tail of steps, a gradient at 1/2 moves the weights half as far: to float
    # rounding (assert_close's float32 defaults), as each step adds to weights of their own.
    start = params.clone()
    full = run([(stale, 1.0), *[(zero, 1.0)] * 200])
    half = run([(stale, 0.5), *[(zero, 1.0)] * 200])
    torch.testing.assert_close(half.params - start, (full.params - start) / 2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "ops-only"])
def test_a_scaled_step_is_the_same_however_the_vector_is_cut(fused: bool) -> None:
    """Shards and buckets step their ranges of a stale gradient on their own: with weight
    decay and a scale, every value must still come out as in one whole step."""
    torch.manual_seed(1)
    n = 40 * FUSED_BLOCK + 13
    params = torch.randn(n)
    gradients = [torch.randn(n) for _ in range(3)]

    def run(cuts: list[int]) -> FlatSGD:
        ours = FlatSGD(params.clone(), torch.empty(n), SETTINGS, allow_fused=fused)
        for gradient, scale in zip(gradients, [1.0, 1 / 3, 0.5], strict=True):
            ours.grads.copy_(gradient)
            for lo, hi in reversed(list(itertools.pairwise(cuts))):
                ours.step(lo, hi, lr_scale=scale)
        return ours

    whole = run([0, n])
    for cuts in ([0, 7, 700, 701, 1900, n], [0, 64, 128, 2000, n]):
        cut = run(cuts)
        assert torch.equal(cut.params, whole.params), cuts
        assert torch.equal(cut.momentum_buffer, whole.momentum_buffer), cuts


# ---- the seam: what the store and the checkpoints call ---------------------------------------


def test_the_factory_builds_sgd_from_the_servers_config() -> None:
    config = ServerConfig(lr=0.1, momentum=0.9, weight_decay=5e-4)
    spec = spec_from_config(config)
    assert spec == OptimizerSpec(0.1, 0.9, 5e-4, name="sgd")
    built = build_optimizer(spec, torch.zeros(8), torch.zeros(8))
    assert isinstance(built, FlatSGD) and built.spec == spec
    assert built.settings == SETTINGS


def test_the_spec_travels_as_a_dict_and_is_checked_when_it_comes_back() -> None:
    spec = OptimizerSpec(0.1, 0.9, 5e-4)
    assert spec.to_dict() == {"lr": 0.1, "momentum": 0.9, "weight_decay": 5e-4, "name": "sgd"}
    assert OptimizerSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="unknown optimizer 'adam'"):
        OptimizerSpec(0.1, name="adam")
    bad: list[object] = [
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},  # no name
        {**spec.to_dict(), "name": "adam"},
        {**spec.to_dict(), "lr": "0.1"},
        {**spec.to_dict(), "momentum": True},
        [0.1, 0.9],
    ]
    for raw in bad:
        with pytest.raises(ProtocolError):
            OptimizerSpec.from_dict(raw)  # type: ignore[arg-type]


def test_the_interface_steps_saves_and_restores_a_slice_bit_for_bit() -> None:
    """Two shards of a vector, each with its own optimizer, save their per-value state as one
    whole state dict (what a checkpoint holds) and restore it into fresh optimizers: those
    go on exactly as the originals do, and as one optimizer over the whole vector."""
    torch.manual_seed(2)
    n, cut = 5 * FUSED_BLOCK + 3, 2 * FUSED_BLOCK + 1
    spec = OptimizerSpec(0.1, 0.9, 5e-4)
    params, gradients = torch.randn(n), [torch.randn(n) for _ in range(4)]

    def shards(values: torch.Tensor) -> list[ServerOptimizer]:
        return [
            build_optimizer(spec, values[lo:hi].clone(), torch.empty(hi - lo))
            for lo, hi in ((0, cut), (cut, n))
        ]

    def step(optimizers: list[ServerOptimizer], gradient: torch.Tensor) -> None:
        offset = 0
        for opt in optimizers:
            assert isinstance(opt, FlatSGD)
            size = opt.params.numel()
            opt.grads.copy_(gradient[offset : offset + size])
            opt.step(0, size, lr_scale=0.5)
            offset += size

    whole = [build_optimizer(spec, params.clone(), torch.empty(n))]
    cut_up = shards(params)
    assert whole[0].flat_state() is None
    for gradient in gradients[:2]:
        step(whole, gradient)
        step(cut_up, gradient)
    gathered = torch.cat([opt.flat_state() for opt in cut_up])  # type: ignore[misc]
    assert torch.equal(gathered, whole[0].flat_state())  # type: ignore[arg-type]
    saved = cut_up[0].state_dict(gathered)
    plain = torch.nn.Parameter(torch.zeros(n))
    reference = torch.optim.SGD([plain], 0.1)
    reference.load_state_dict(saved)  # a checkpoint's optimizer is plain PyTorch's
    assert reference.param_groups[0]["momentum"] == 0.9
    assert torch.equal(reference.state[plain]["momentum_buffer"], gathered)

    current = torch.cat([opt.params for opt in cut_up if isinstance(opt, FlatSGD)])
    restored = shards(current)
    for opt, bounds in zip(restored, ((0, cut), (cut, n)), strict=True):
        assert opt.load_state_dict(saved, bounds, n) is saved["state"][0]["momentum_buffer"]
    for gradient in gradients[2:]:
        for optimizers in (whole, cut_up, restored):
            step(optimizers, gradient)
    final = [
        torch.cat([o.params for o in opts if isinstance(o, FlatSGD)]) for opts in (cut_up, restored)
    ]
    assert torch.equal(final[0], final[1])
    assert isinstance(whole[0], FlatSGD) and torch.equal(whole[0].params, final[0])
    with pytest.raises(ValueError, match=f"momentum has {n} values, the model {n + 1}"):
        restored[0].load_state_dict(saved, (0, cut), n + 1)
