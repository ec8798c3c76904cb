"""The built-in data sets, loaded into memory.

Two sources, one format: an `ImageSet` of float images in [0, 1] shaped (N, 1, 28, 28) and
int64 labels, held in memory (Fashion-MNIST is 47 MB as uint8; batches are slices, no loader).

- `embedded`: a class-balanced real subset of Fashion-MNIST shipped inside this package (6,000
  training and 1,000 test images), made by `scripts/make_embedded_dataset.py`. No download.
- `fashion-mnist`: torchvision's FashionMNIST under `--data-dir`, optionally downloaded.

What it is not: the choice of a data set, which the roles make through common.catalog, nor
which samples a worker trains (common.assignment).
"""

import dataclasses
import gzip
import http.client
import io
import logging
import os
import shutil
import socket
import tempfile
import zlib
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.errors import DataError
from common.logs import counted

if TYPE_CHECKING:  # imported where used: torchvision is slow to import
    from torchvision.datasets import FashionMNIST

DATASETS = ("embedded", "fashion-mnist")
# The original files, as torchvision reads them; they are published gzipped (NAME.gz).
RAW_FILES = (
    "train-images-idx3-ubyte", "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
)  # fmt: skip
EMBEDDED_ASSET = "fashion_mnist_small.npz"
NUM_CLASSES = 10  # the models' outputs
# The idx format's magic numbers (big-endian, the file's first 4 bytes), and gzip's.
IDX_MAGIC = {"images": 2051, "labels": 2049}
GZIP_MAGIC = b"\x1f\x8b"
# Seconds a --download may wait on one network operation. torchvision's urlopen waits for
# ever, so a proxy that accepts and never answers hung the server at start.
DOWNLOAD_TIMEOUT_S = 60.0

log = logging.getLogger("ps.data")


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


def unpack_gzipped(raw: Path) -> None:
    """Unpack NAME.gz beside itself where only that is there: torchvision reads the unpacked
    files only (with --download it unpacks them too, but may go to the network first).

    Several processes may do this at once (two workers on one host): each unpacks into a
    temporary file of its own and renames it into place, so a reader only ever sees a whole
    file, whichever process's it is."""
    for name in RAW_FILES:
        target, packed = raw / name, raw / f"{name}.gz"
        if target.is_file() or not packed.is_file():
            continue
        partial: Path | None = None
        try:
            fd, partial_name = tempfile.mkstemp(dir=raw, prefix=f".{name}.", suffix=".partial")
            partial = Path(partial_name)
            with gzip.open(packed) as source, os.fdopen(fd, "wb") as sink:
                shutil.copyfileobj(source, sink)
            os.replace(partial, target)  # whole or not at all
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:  # BadGzipFile is an OSError
            if partial is not None:
                partial.unlink(missing_ok=True)
            # A copy cut short, or not gzip at all: gunzip fails on it too, and another folder
            # would not help.
            raise DataError(
                f"{packed} is damaged or incomplete ({exc}); copy it again from where it came "
                "from, or delete it and add --download"
            ) from None
        except OSError as exc:  # most likely a folder this process cannot write to
            if partial is not None:
                partial.unlink(missing_ok=True)
            raise DataError(
                f"could not unpack {packed} ({exc}); unpack the four files there yourself "
                "(gunzip -k), or copy the folder somewhere writable and point --data-dir at it"
            ) from None


def _check_raw_files(raw: Path) -> None:
    """The four idx files are there (torchvision wants all four for either split) and are idx
    files, else say which one is not and why: torchvision says only "not found", or fails an
    assert with no message."""
    for name in RAW_FILES:
        path = raw / name
        if not path.is_file():
            raise DataError(
                f"{path} is missing; put the four original Fashion-MNIST files (or their .gz) "
                f"in {raw}, or add --download"
            )
        with open(path, "rb") as f:
            head = f.read(4)
        kind = "images" if "images" in name else "labels"
        if head.startswith(GZIP_MAGIC):
            raise DataError(f"{path} is gzipped; name it {path.name}.gz, or gunzip it")
        if len(head) < 4 or int.from_bytes(head, "big") != IDX_MAGIC[kind]:
            raise DataError(
                f"{path} is not a Fashion-MNIST idx {kind} file (it starts "
                f"{head.hex() or 'empty'}); copy the original file again"
            )


def _download(root: Path, raw: Path, train: bool) -> "FashionMNIST":
    """torchvision's FashionMNIST with download=True, with a bound on every network wait and
    its several-line download error turned into one line."""
    from torchvision.datasets import FashionMNIST  # slow import; only this source needs it

    if not all((raw / name).is_file() for name in RAW_FILES):  # else torchvision reads them
        log.info(
            "downloading Fashion-MNIST into %s (a network wait gives up after %g s)",
            raw,
            DOWNLOAD_TIMEOUT_S,
        )
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # urllib's sockets take it; restored below
    try:
        return FashionMNIST(root=str(root), train=train, download=True)
    except RuntimeError as exc:
        if "Error downloading" not in str(exc):
            raise
        cause = str(exc).strip().splitlines()[-1]
    # torchvision catches a URLError only: a server or proxy that stops answering once the
    # request is sent ends the download with the timeout itself, or a dropped connection.
    except TimeoutError:
        cause = f"no answer within {DOWNLOAD_TIMEOUT_S:g} s"
    except (ConnectionError, http.client.HTTPException) as exc:
        cause = f"{type(exc).__name__}: {exc}"
    finally:
        socket.setdefaulttimeout(previous)
    raise DataError(
        f"could not download Fashion-MNIST into {raw} ({cause}); check the network (and any "
        f"proxy), or copy the four original files into {raw} and leave out --download"
    )


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
        unpack_gzipped(raw)
        _check_raw_files(raw)
    try:
        if source.download:
            dataset = _download(root, raw, train)
        else:
            dataset = FashionMNIST(root=str(root), train=train, download=False)
    except DataError:
        raise
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
            f"{counted(len(labels), 'label')}; expected (N, 28, 28) and N labels"
        )
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < NUM_CLASSES:
        split = "train" if train else "t10k"
        raise DataError(
            f"labels in {raw / f'{split}-labels-idx1-ubyte'} must be 0..{NUM_CLASSES - 1}, "
            f"got {int(labels.min())}..{int(labels.max())}; these are not Fashion-MNIST labels"
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
    if limit is not None and limit > len(labels):
        split = "training" if train else "test"
        log.warning(
            "--%s-limit %d is more than the %s: using all of them",
            "train" if train else "test", limit, counted(len(labels), f"{split} image"),
        )  # fmt: skip
    return _to_image_set(images, labels, limit)
