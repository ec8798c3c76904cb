"""Data sets and sharding.

Two sources, one format: an `ImageSet` of float images in [0, 1] shaped (N, 1, 28, 28) and
int64 labels, held in memory (Fashion-MNIST is 47 MB as uint8; batches are slices, no loader).

- `embedded`: a class-balanced real subset of Fashion-MNIST shipped inside this package (6,000
  training and 1,000 test images), made by `scripts/make_embedded_dataset.py`. No download.
- `fashion-mnist`: torchvision's FashionMNIST under `--data-dir`, optionally downloaded.

Sharding follows torch's DistributedSampler: one permutation per epoch seeded with
`seed + epoch`, padded by wrapping to a multiple of the world size, and rank r takes
`perm[r::world_size]`. Batch k of every rank together is exactly batch k of a single worker
with a batch size world_size times larger, which is what makes sync training equal to
single-process training.
"""

import dataclasses
import gzip
import io
import math
import os
import shutil
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from common.errors import DataError

DATASETS = ("embedded", "fashion-mnist")
# The original files, as torchvision reads them; they are published gzipped (NAME.gz).
RAW_FILES = (
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
)  # fmt: skip
EMBEDDED_ASSET = "fashion_mnist_small.npz"


@dataclasses.dataclass(frozen=True)
class ImageSet:
    images: torch.Tensor  # (N, 1, 28, 28) float32 in [0, 1]
    labels: torch.Tensor  # (N,) int64

    def __len__(self) -> int:
        return int(self.labels.numel())


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where a role reads its data from. Each host has its own data dir."""

    dataset: str = "embedded"
    data_dir: Path | None = None
    download: bool = False

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise DataError(f"unknown data set {self.dataset!r}; choose one of {DATASETS}")
        if self.dataset == "fashion-mnist" and self.data_dir is None:
            raise DataError(
                "--dataset fashion-mnist needs --data-dir DIR (add --download to fetch)"
            )


def _to_image_set(images: torch.Tensor, labels: torch.Tensor, limit: int | None) -> ImageSet:
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    # uint8 (N, 28, 28) -> float32 (N, 1, 28, 28) in [0, 1], as torchvision's ToTensor does.
    return ImageSet(images.unsqueeze(1).float().div_(255.0), labels.long())


def _load_embedded(train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    split = "train" if train else "test"
    asset = resources.files("common") / "assets" / EMBEDDED_ASSET
    try:
        with np.load(io.BytesIO(asset.read_bytes())) as arrays:
            images, labels = arrays[f"{split}_images"], arrays[f"{split}_labels"]
    except (OSError, KeyError, ValueError) as exc:
        raise DataError(
            f"the embedded data set is missing or damaged ({exc}); reinstall the package, or "
            "run scripts/make_embedded_dataset.py"
        ) from None
    return torch.from_numpy(images), torch.from_numpy(labels)


def _unpack_gzipped(raw: Path) -> None:
    """Unpack NAME.gz beside itself where only that is there: torchvision reads the unpacked
    files only (with --download it unpacks them too, but may go to the network first)."""
    for name in RAW_FILES:
        target, packed = raw / name, raw / f"{name}.gz"
        if target.is_file() or not packed.is_file():
            continue
        partial = raw / f".{name}.partial"
        try:
            with gzip.open(packed) as source, open(partial, "wb") as sink:
                shutil.copyfileobj(source, sink)
            os.replace(partial, target)  # whole or not at all
        except (OSError, EOFError) as exc:  # a read-only folder, or a damaged archive
            partial.unlink(missing_ok=True)
            raise DataError(
                f"could not unpack {packed} ({exc}); unpack the four files there yourself "
                "(gunzip -k), or copy the folder somewhere writable and point --data-dir at it"
            ) from None


def _load_fashion_mnist(source: DataSource, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from torchvision.datasets import FashionMNIST  # slow import; only this source needs it

    assert source.data_dir is not None
    root = source.data_dir
    raw = root / "FashionMNIST" / "raw"
    if not source.download and not root.is_dir():
        raise DataError(
            f"data dir {root} does not exist; create it with the Fashion-MNIST files in "
            f"{raw}, or add --download"
        )
    if not source.download:
        _unpack_gzipped(raw)
    try:
        dataset = FashionMNIST(root=str(root), train=train, download=source.download)
    except RuntimeError as exc:
        if "not found" in str(exc).lower():
            raise DataError(
                f"Fashion-MNIST is not in {raw}; put the four original files "
                "(*-idx?-ubyte or .gz) there, or add --download"
            ) from None
        raise DataError(f"could not read Fashion-MNIST from {raw}: {exc}") from None
    except OSError as exc:
        action = "check the network or copy the files there" if source.download else "re-copy"
        raise DataError(f"could not read Fashion-MNIST in {raw} ({exc}); {action}") from None
    except Exception as exc:  # torchvision raises assorted errors for corrupt idx files
        raise DataError(
            f"Fashion-MNIST files in {raw} are corrupt ({type(exc).__name__}: {exc}); delete "
            "them and copy the original files again"
        ) from None
    images, labels = dataset.data, dataset.targets
    if images.dim() != 3 or tuple(images.shape[1:]) != (28, 28) or len(images) != len(labels):
        raise DataError(
            f"Fashion-MNIST files in {raw} have images of shape {tuple(images.shape)} and "
            f"{len(labels)} labels; expected (N, 28, 28) and N labels"
        )
    return images, labels


def load_split(source: DataSource, train: bool, limit: int | None = None) -> ImageSet:
    """Load the training or test split, cut to the first `limit` samples."""
    if source.dataset == "embedded":
        images, labels = _load_embedded(train)
    else:
        images, labels = _load_fashion_mnist(source, train)
    if limit is not None and limit <= 0:
        raise DataError(f"a sample limit must be positive, got {limit}")
    return _to_image_set(images, labels, limit)


def shard_size(num_samples: int, world_size: int) -> int:
    return math.ceil(num_samples / world_size)


def steps_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    return math.ceil(shard_size(num_samples, world_size) / batch_size)


def shard_indices(
    num_samples: int, epoch: int, seed: int, rank: int, world_size: int
) -> torch.Tensor:
    """This rank's sample indices for an epoch, exactly as DistributedSampler(shuffle=True)."""
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    perm = torch.randperm(num_samples, generator=generator)  # (N,)
    total = shard_size(num_samples, world_size) * world_size
    if total > num_samples:  # wrap around so every rank gets the same number of samples
        repeats = math.ceil((total - num_samples) / num_samples)
        perm = torch.cat([perm, perm.repeat(repeats)[: total - num_samples]])
    return perm[rank:total:world_size]


def batch_slice(shard: torch.Tensor, batch: int, batch_size: int) -> torch.Tensor:
    """Indices of batch `batch` of a shard; the last batch of an epoch may be short."""
    return shard[batch * batch_size : (batch + 1) * batch_size]
