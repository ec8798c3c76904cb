"""FlatModel: parameters, gradients and floating buffers live in three flat tensors, and the
model's own tensors are views into them. Checked against an untouched copy of the model."""

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

from common.catalog import build_model
from common.model.flat import FlatModel


def _small_bn_model() -> nn.Sequential:
    with torch.random.fork_rng():  # reproducible, and the global RNG is left alone
        torch.manual_seed(0)
        return _bn_layers()


def _bn_layers() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 13 * 13, 10),
    )


def _batch(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 28, 28, generator=generator)  # (B, 1, 28, 28)
    y = torch.randint(0, 10, (n,), generator=generator)  # (B,)
    return x, y


def _inside(tensor: torch.Tensor, flat: torch.Tensor) -> bool:
    start, end = flat.data_ptr(), flat.data_ptr() + flat.numel() * flat.element_size()
    last = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return start <= tensor.data_ptr() and last <= end


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("name", ["lenet", "resnet18"])
def test_layout_is_flat_and_parameters_are_views(name: str) -> None:
    model = build_model(name, seed=0)
    reference = copy.deepcopy(model)
    flat = FlatModel(model)
    params = list(model.parameters())
    assert flat.params.dim() == 1 and flat.grads.dim() == 1 and flat.buffers.dim() == 1
    assert flat.num_params == sum(p.numel() for p in params) == flat.grads.numel()
    assert flat.params.is_contiguous() and flat.grads.is_contiguous()
    # Values survive the move, in model.parameters() order.
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert torch.equal(flat.params, expected)
    offset = 0
    for p in params:
        assert _inside(p, flat.params)
        assert p.data_ptr() == flat.params.data_ptr() + offset * 4
        assert p.grad is not None and _inside(p.grad, flat.grads)
        assert p.grad.data_ptr() == flat.grads.data_ptr() + offset * 4
        offset += p.numel()
    float_buffers = [b for b in model.buffers() if b.is_floating_point()]
    assert flat.num_buffers == sum(b.numel() for b in float_buffers)
    for b in float_buffers:
        assert _inside(b, flat.buffers)
    ref_buffers = [b.reshape(-1) for b in reference.buffers() if b.is_floating_point()]
    assert torch.equal(flat.buffers, torch.cat(ref_buffers) if ref_buffers else torch.empty(0))


def test_lenet_has_no_buffers() -> None:
    flat = FlatModel(build_model("lenet", seed=0))
    assert flat.num_buffers == 0
    assert flat.buffers.shape == (0,)


def test_writing_flat_params_changes_the_model() -> None:
    model = build_model("lenet", seed=0).eval()
    flat = FlatModel(model)
    x, _ = _batch()
    with torch.no_grad():
        before = model(x)
        flat.params.zero_()
        assert all(torch.count_nonzero(p) == 0 for p in model.parameters())
        assert torch.count_nonzero(model(x)) == 0  # zero weights and biases: zero logits
        # The last bias is the last 10 entries of the flat vector.
        flat.params[-10:] = torch.arange(10, dtype=torch.float32)
        assert torch.equal(model(x), torch.arange(10.0).expand(8, 10))
    assert not torch.equal(before, model(x).detach())


@pytest.mark.parametrize("name", ["lenet", "resnet18"])
def test_backward_fills_flat_grads_exactly(name: str) -> None:
    model = build_model(name, seed=0)
    reference = copy.deepcopy(model)
    flat = FlatModel(model)
    x, y = _batch(n=2 if name == "resnet18" else 8)

    _backward(model, x, y)
    _backward(reference, x, y)
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])  # type: ignore[union-attr]
    assert torch.count_nonzero(flat.grads) > 0
    assert torch.equal(flat.grads, expected)
    # backward wrote into the flat storage; it did not replace the .grad tensors
    for p in model.parameters():
        assert p.grad is not None and _inside(p.grad, flat.grads)

    # A second backward accumulates, as for any model ...
    _backward(model, x, y)
    assert torch.equal(flat.grads, expected + expected)

    # ... and after zero_grad the flat gradient is exactly the new batch's.
    flat.zero_grad()
    assert torch.count_nonzero(flat.grads) == 0
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())  # type: ignore[arg-type]
    x2, y2 = _batch(n=x.shape[0], seed=2)
    _backward(model, x2, y2)
    reference.zero_grad(set_to_none=True)
    _backward(reference, x2, y2)
    expected2 = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])  # type: ignore[union-attr]
    assert torch.equal(flat.grads, expected2)


def test_optimizer_step_on_flat_matches_per_parameter_step() -> None:
    model = build_model("lenet", seed=0)
    reference = copy.deepcopy(model)
    flat = FlatModel(model)
    x, y = _batch()
    _backward(model, x, y)
    _backward(reference, x, y)
    with torch.no_grad():
        flat.params.sub_(0.1 * flat.grads)  # one SGD step on the flat vectors
        for p in reference.parameters():
            p.sub_(0.1 * p.grad)  # type: ignore[operator]
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_batchnorm_running_stats_land_in_flat_buffers() -> None:
    model = _small_bn_model()
    reference = copy.deepcopy(model)
    flat = FlatModel(model)
    initial = flat.buffers.clone()
    x, _ = _batch()
    model.train()
    reference.train()
    with torch.no_grad():
        model(x)
        reference(x)
    expected = torch.cat([b.reshape(-1) for b in reference.buffers() if b.is_floating_point()])
    assert not torch.equal(flat.buffers, initial)
    assert torch.equal(flat.buffers, expected)
    # Eval-mode forwards read the statistics and leave them alone.
    model.eval()
    with torch.no_grad():
        model(x)
    assert torch.equal(flat.buffers, expected)


def test_writing_flat_buffers_changes_eval_output() -> None:
    model = _small_bn_model().eval()
    flat = FlatModel(model)
    x, _ = _batch()
    with torch.no_grad():
        before = model(x)
        bn = model[1]
        assert isinstance(bn, nn.BatchNorm2d)
        flat.buffers[:4] = 0.5  # the first BatchNorm's running_mean
        assert torch.equal(bn.running_mean, torch.full((4,), 0.5))  # type: ignore[arg-type]
        assert not torch.equal(model(x), before)


def test_set_batches_tracked() -> None:
    model = _small_bn_model()
    flat = FlatModel(model)
    counters = [b for n, b in model.named_buffers() if n.endswith("num_batches_tracked")]
    assert len(counters) == 2
    model.train()
    with torch.no_grad():
        model(_batch()[0])
    assert [int(c) for c in counters] == [1, 1]
    flat.set_batches_tracked(41)
    assert [int(c) for c in counters] == [41, 41]
    assert all(c.dtype == torch.int64 for c in counters)
    # The integer counters are not part of the flat float buffers.
    assert flat.num_buffers == 2 * (4 + 6)


# ---- load_params: received weights used where they landed ------------------------------


def _received(values: torch.Tensor) -> torch.Tensor:
    """`values` in read-only memory of their own, as a frame ZeroMQ received."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # frombuffer warns about read-only memory
        return torch.frombuffer(values.numpy().tobytes(), dtype=torch.float32)


def _loaded_copy(values: torch.Tensor) -> nn.Module:
    """LeNet with these flat weights, set the ordinary way."""
    model = build_model("lenet", seed=0).eval()
    torch.nn.utils.vector_to_parameters(values, model.parameters())
    return model


def _same_outputs(model: nn.Module, values: torch.Tensor) -> bool:
    x, _ = _batch()
    with torch.no_grad():
        return torch.equal(model.eval()(x), _loaded_copy(values)(x))


def test_loaded_weights_are_used_in_place_and_kept_alive() -> None:
    model = build_model("lenet", seed=0)
    flat = FlatModel(model)
    values = torch.randn(flat.num_params, generator=torch.Generator().manual_seed(3))
    frame = _received(values)
    flat.load_params(0, frame)
    for p in model.parameters():
        assert _inside(p, frame), "a whole parameter must be a view of the received memory"
    del frame
    gc.collect()  # the parameters alone keep the received memory alive
    assert _same_outputs(model, values)
    # Backward still fills the flat gradient, as before any load.
    reference = _loaded_copy(values).train()
    x, y = _batch()
    _backward(model.train(), x, y)
    _backward(reference, x, y)
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])  # type: ignore[union-attr]
    assert torch.equal(flat.grads, expected)


def test_a_parameter_that_ranges_cut_through_is_copied_home_every_time() -> None:
    model = build_model("lenet", seed=0)
    flat = FlatModel(model)
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    biggest = max(range(len(params)), key=sizes.__getitem__)
    start = sum(sizes[:biggest])
    cut = start + sizes[biggest] // 2  # through the middle of the biggest parameter
    generator = torch.Generator().manual_seed(4)

    def load_in_two(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        head, tail = _received(values[:cut]), _received(values[cut:])
        flat.load_params(cut, tail)  # in either order, as streamed buckets come
        flat.load_params(0, head)
        return head, tail

    for _ in range(2):  # the second time the cut parameter's home holds the old values
        values = torch.randn(flat.num_params, generator=generator)
        head, tail = load_in_two(values)
        for index, p in enumerate(params):
            if index == biggest:
                assert _inside(p, flat.params) and p.data_ptr() == flat.params[start:].data_ptr()
            else:
                assert _inside(p, head if index < biggest else tail)
        assert _same_outputs(model, values)
        # A whole load in between: every parameter a view again, the cut one included.
        whole = torch.randn(flat.num_params, generator=generator)
        received = _received(whole)
        flat.load_params(0, received)
        assert all(_inside(p, received) for p in params)
        assert _same_outputs(model, whole)


def test_weights_of_another_dtype_are_copied_into_the_flat_storage() -> None:
    model = build_model("lenet", seed=0)
    flat = FlatModel(model)
    values = torch.randn(flat.num_params, generator=torch.Generator().manual_seed(5))
    flat.load_params(0, _received(values))  # first borrowed ...
    flat.load_params(0, values.half())  # ... then a copy (as from any other device)
    assert torch.equal(flat.params, values.half().float())
    assert _same_outputs(model, values.half().float())
    # The copy went home; a later borrow of part of the range leaves the rest there.
    assert all(_inside(p, flat.params) for p in model.parameters())
