"""What a job trains: the model seam and the data seam, by name.

Both roles go through this module, and only this one, to answer "what does this job train":
the server to build the master weights and the test set (psserver.job_setup), the worker its
copy of the model and its training set (psworker), and both the fingerprints that tell
whether they build the same architecture. A job names its model and data set; today a name is
one of the built-in models (common.model.builtin) and data sets (common.data), and an entry
point such as `mypkg.models:build` would be one more kind of name here, nowhere else.

- Model: `MODEL_NAMES`, `build_model(name, seed)`, `fingerprint(model)`,
  `all_fingerprints()`, `input_shape(name)` and `largest_state_numel()`.
- Data: `DATASET_NAMES`, `load_training_set(source, limit)` and `load_test_set(source, limit)`.

What it is not: the networks or the loaders themselves, nor which samples a worker trains
next (common.assignment).
"""

import hashlib
import json

import torch
from torch import nn

from common.data import DATASETS, DataSource, ImageSet, load_split
from common.model import builtin

MODEL_NAMES: tuple[str, ...] = tuple(sorted(builtin.MODELS))
DATASET_NAMES: tuple[str, ...] = DATASETS
# One sample's shape, (C, H, W), as every data set here gives it: Fashion-MNIST's greyscale
# 28x28 images.
IMAGE_SHAPE = (builtin.IN_CHANNELS, 28, 28)


def build_model(name: str, seed: int | None = None) -> nn.Module:
    """The model `name` names; with a seed its initial weights are the same on any host."""
    return builtin.build_model(name, seed)


def input_shape(name: str) -> tuple[int, ...]:
    """The shape of one sample the model `name` takes, (C, H, W)."""
    if name not in builtin.MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {list(MODEL_NAMES)}")
    return IMAGE_SHAPE


def fingerprint(model: nn.Module) -> str:
    """A short hash of the architecture: every state entry's name, shape and dtype."""
    entries = [
        [name, list(tensor.shape), str(tensor.dtype)] for name, tensor in model.state_dict().items()
    ]
    return hashlib.sha256(json.dumps(entries).encode()).hexdigest()[:16]


def all_fingerprints() -> dict[str, str]:
    """Fingerprints of every model this code can build (built on the meta device: no memory)."""
    with torch.device("meta"):
        return {name: fingerprint(build_model(name)) for name in MODEL_NAMES}


def largest_state_numel() -> int:
    """The most values any model this code builds holds in its parameters or its buffers
    (on the meta device: no memory). No frame a server takes is bigger than 4 bytes each."""
    with torch.device("meta"):
        models = [build_model(name) for name in MODEL_NAMES]
    return max(
        max(sum(p.numel() for p in m.parameters()), sum(b.numel() for b in m.buffers()))
        for m in models
    )


def load_training_set(source: DataSource, limit: int | None = None) -> ImageSet:
    """The job's training set, cut to its first `limit` samples."""
    return load_split(source, train=True, limit=limit)


def load_test_set(source: DataSource, limit: int | None = None) -> ImageSet:
    """The job's test set, cut to its first `limit` samples."""
    return load_split(source, train=False, limit=limit)
