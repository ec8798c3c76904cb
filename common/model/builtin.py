"""The models both roles build from a name: D2L's ResNet-18 for small images, and LeNet.

`resnet18` is the variant of Dive into Deep Learning's multi-GPU chapters: a 3x3 stride-1 stem
with no max-pool (so 28x28 inputs keep their resolution), four stages of two residual blocks
(64/128/256/512 channels), global average pooling and a linear head; 11.2M parameters, 44.7 MB
in float32. `lenet` is the from-scratch multi-GPU chapter's LeNet; it has no BatchNorm, so
synchronous training can be checked exactly against one process.

What it is not: how a job chooses its model, and the fingerprints that compare one host's
build with another's (common.catalog, the one module the roles ask).
"""

from collections.abc import Callable

import torch
from torch import nn

NUM_CLASSES = 10
IN_CHANNELS = 1  # Fashion-MNIST is greyscale


class Residual(nn.Module):
    """Two 3x3 convs with BatchNorm and a skip; a 1x1 conv matches shapes when they change."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        needs_projection = stride != 1 or in_channels != out_channels
        self.conv3 = (
            nn.Conv2d(in_channels, out_channels, 1, stride=stride) if needs_projection else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C_in, H, W)
        y = torch.relu(self.bn1(self.conv1(x)))  # (B, C_out, H/s, W/s)
        y = self.bn2(self.conv2(y))
        if self.conv3 is not None:
            x = self.conv3(x)
        return torch.relu(y + x)


def _stage(in_channels: int, out_channels: int, first: bool) -> nn.Sequential:
    # The first stage keeps the resolution; every later one halves it in its first block.
    stride = 1 if first else 2
    return nn.Sequential(
        Residual(in_channels, out_channels, stride=stride), Residual(out_channels, out_channels)
    )


def resnet18(num_classes: int = NUM_CLASSES, in_channels: int = IN_CHANNELS) -> nn.Module:
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1),
            nn.BatchNorm2d(64),
            nn.ReLU(),
        ),  # (B, 64, 28, 28)
        _stage(64, 64, first=True),  # (B, 64, 28, 28)
        _stage(64, 128, first=False),  # (B, 128, 14, 14)
        _stage(128, 256, first=False),  # (B, 256, 7, 7)
        _stage(256, 512, first=False),  # (B, 512, 4, 4)
        nn.AdaptiveAvgPool2d((1, 1)),
        nn.Flatten(),  # (B, 512)
        nn.Linear(512, num_classes),
    )


def lenet(num_classes: int = NUM_CLASSES, in_channels: int = IN_CHANNELS) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(in_channels, 20, kernel_size=3),  # (B, 20, 26, 26)
        nn.ReLU(),
        nn.AvgPool2d(2),  # (B, 20, 13, 13)
        nn.Conv2d(20, 50, kernel_size=5),  # (B, 50, 9, 9)
        nn.ReLU(),
        nn.AvgPool2d(2),  # (B, 50, 4, 4)
        nn.Flatten(),  # (B, 800)
        nn.Linear(800, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


MODELS: dict[str, Callable[[], nn.Module]] = {"resnet18": resnet18, "lenet": lenet}


def _init_d2l(module: nn.Module) -> None:
    # D2L's concise multi-GPU chapter initialises ResNet-18's conv and linear weights from
    # N(0, 0.01); BatchNorm keeps the signal alive despite the small scale.
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        nn.init.normal_(module.weight, std=0.01)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


def build_model(name: str, seed: int | None = None) -> nn.Module:
    """Build a model by name; with a seed the initial weights are reproducible on any host."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if seed is None:
        return MODELS[name]()
    generator_state = torch.random.get_rng_state()
    torch.random.default_generator.manual_seed(seed)  # CPU only: CUDA RNG untouched
    try:
        model = MODELS[name]()
        if name == "resnet18":
            model.apply(_init_d2l)
        # LeNet keeps PyTorch's default (Kaiming-uniform) init: with N(0, 0.01) and no
        # BatchNorm it sits at chance for several epochs.
    finally:
        torch.random.set_rng_state(generator_state)
    return model
