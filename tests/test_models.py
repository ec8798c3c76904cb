"""The two models: exact architecture (counted by hand), reproducible seeded init that leaves the
global RNG alone, and fingerprints that tell architectures apart."""

import pytest
import torch
from torch import nn

from common.catalog import MODEL_NAMES, all_fingerprints, build_model, fingerprint

# ---- resnet18 --------------------------------------------------------------------------------


def _sequential(name: str, seed: int = 0) -> nn.Sequential:
    model = build_model(name, seed=seed)
    assert isinstance(model, nn.Sequential)  # both models are Sequential: index their layers
    return model


def _conv(c_in: int, c_out: int, k: int) -> int:
    return c_in * c_out * k * k + c_out  # weight + bias (D2L's convs keep their bias)


def _bn(c: int) -> int:
    return 2 * c  # weight + bias


def _residual(c_in: int, c_out: int, projection: bool) -> int:
    total = _conv(c_in, c_out, 3) + _conv(c_out, c_out, 3) + _bn(c_out) + _bn(c_out)
    return total + (_conv(c_in, c_out, 1) if projection else 0)


def _resnet18_params_by_hand() -> int:
    stem = _conv(1, 64, 3) + _bn(64)
    stages = 0
    for c_in, c_out, first in (
        (64, 64, True),
        (64, 128, False),
        (128, 256, False),
        (256, 512, False),
    ):
        stages += _residual(c_in, c_out, projection=not first) + _residual(c_out, c_out, False)
    head = 512 * 10 + 10
    return stem + stages + head


RESNET18_PARAMS = 11_175_818  # 44.7 MB in float32


def test_resnet18_parameter_count() -> None:
    model = build_model("resnet18", seed=0)
    count = sum(p.numel() for p in model.parameters())
    assert _resnet18_params_by_hand() == RESNET18_PARAMS
    assert count == RESNET18_PARAMS
    assert round(count * 4 / 1e6, 1) == 44.7
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_resnet18_buffers_are_batchnorm_statistics() -> None:
    model = build_model("resnet18", seed=0)
    batchnorms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert len(batchnorms) == 1 + 4 * 2 * 2  # stem + two per block, two blocks per stage
    buffers = dict(model.named_buffers())
    assert len(buffers) == 3 * len(batchnorms)
    assert sum(n.endswith("running_mean") for n in buffers) == len(batchnorms)
    assert sum(n.endswith("running_var") for n in buffers) == len(batchnorms)
    assert sum(n.endswith("num_batches_tracked") for n in buffers) == len(batchnorms)
    float_buffer_numel = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    assert float_buffer_numel == 2 * (64 + 2 * 2 * (64 + 128 + 256 + 512))


def test_resnet18_stem_and_no_max_pool() -> None:
    model = _sequential("resnet18")
    assert not any(isinstance(m, (nn.MaxPool2d, nn.AdaptiveMaxPool2d)) for m in model.modules())
    stem_conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert stem_conv.in_channels == 1
    assert stem_conv.out_channels == 64
    assert stem_conv.kernel_size == (3, 3)
    assert stem_conv.stride == (1, 1)
    assert stem_conv.padding == (1, 1)
    assert isinstance(model[-1], nn.Linear)
    assert (model[-1].in_features, model[-1].out_features) == (512, 10)


def test_resnet18_forward_shapes() -> None:
    model = _sequential("resnet18").eval()
    x = torch.rand(3, 1, 28, 28)  # (B, 1, 28, 28)
    with torch.no_grad():
        stem = model[0](x)
        assert stem.shape == (3, 64, 28, 28)  # no max-pool: full resolution
        s1 = model[1](stem)
        assert s1.shape == (3, 64, 28, 28)
        s2 = model[2](s1)
        assert s2.shape == (3, 128, 14, 14)
        s3 = model[3](s2)
        assert s3.shape == (3, 256, 7, 7)
        s4 = model[4](s3)
        assert s4.shape == (3, 512, 4, 4)
        out = model(x)
    assert out.shape == (3, 10)
    assert torch.isfinite(out).all()


# ---- lenet -----------------------------------------------------------------------------------


def test_lenet_layers() -> None:
    model = build_model("lenet", seed=0)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    pools = [m for m in model.modules() if isinstance(m, nn.AvgPool2d)]
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [
        (1, 20, (3, 3)),
        (20, 50, (5, 5)),
    ]
    assert [p.kernel_size for p in pools] == [2, 2]
    assert [(lin.in_features, lin.out_features) for lin in linears] == [(800, 128), (128, 10)]
    assert not any(isinstance(m, (nn.MaxPool2d, nn.BatchNorm2d)) for m in model.modules())
    assert list(model.buffers()) == []
    expected = (20 * 9 + 20) + (50 * 20 * 25 + 50) + (800 * 128 + 128) + (128 * 10 + 10)
    assert sum(p.numel() for p in model.parameters()) == expected == 129_068


def test_lenet_forward_shape() -> None:
    model = _sequential("lenet")
    x = torch.rand(5, 1, 28, 28)  # (B, 1, 28, 28)
    with torch.no_grad():
        assert model[:3](x).shape == (5, 20, 13, 13)
        assert model[:7](x).shape == (5, 800)
        assert model(x).shape == (5, 10)


# ---- build_model -----------------------------------------------------------------------------


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", list(MODEL_NAMES))
def test_same_seed_same_weights(name: str) -> None:
    a, b = _state(build_model(name, seed=123)), _state(build_model(name, seed=123))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("name", list(MODEL_NAMES))
def test_different_seeds_different_weights(name: str) -> None:
    a = dict(build_model(name, seed=1).named_parameters())
    b = dict(build_model(name, seed=2).named_parameters())
    weights = [k for k in a if k.endswith("weight") and a[k].dim() > 1]  # conv and linear
    assert weights
    for key in weights:
        assert not torch.equal(a[key], b[key]), key


def test_resnet18_seeded_init_is_d2l_normal() -> None:
    model = _sequential("resnet18")
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            assert module.bias is not None
            assert torch.count_nonzero(module.bias) == 0
    head = model[-1]
    assert isinstance(head, nn.Linear)
    assert abs(head.weight.std().item() - 0.01) < 0.001  # 5120 samples of N(0, 0.01)


@pytest.mark.parametrize("name", list(MODEL_NAMES))
def test_build_model_leaves_global_rng_alone(name: str) -> None:
    torch.manual_seed(999)
    before = torch.random.get_rng_state()
    expected = torch.rand(4)
    torch.random.set_rng_state(before)
    cuda_before = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    build_model(name, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(torch.rand(4), expected)
    cuda_after = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    assert all(torch.equal(a, b) for a, b in zip(cuda_before, cuda_after, strict=True))


def test_seeded_build_ignores_global_rng() -> None:
    torch.manual_seed(1)
    a = build_model("lenet", seed=5).state_dict()
    torch.manual_seed(2)
    b = build_model("lenet", seed=5).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg")
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        build_model("vgg", seed=0)


# ---- fingerprints ----------------------------------------------------------------------------


def test_fingerprint_stable_and_distinct() -> None:
    prints = all_fingerprints()
    assert set(prints) == set(MODEL_NAMES)
    assert len(set(prints.values())) == len(prints)
    for name, value in prints.items():
        assert len(value) == 16
        int(value, 16)  # hex
        assert fingerprint(build_model(name, seed=0)) == value
        assert fingerprint(build_model(name, seed=1)) == value  # weights do not matter
        assert fingerprint(build_model(name)) == value
    assert all_fingerprints() == prints


def test_fingerprint_sees_shape_changes() -> None:
    base = fingerprint(build_model("lenet", seed=0))
    wider = _sequential("lenet")
    wider[-1] = nn.Linear(128, 11)
    assert fingerprint(wider) != base
    half = build_model("lenet", seed=0).half()
    assert fingerprint(half) != base
