"""Make the embedded data set: a class-balanced real subset of Fashion-MNIST.

Reads the four original idx files (gzip) and writes `common/assets/fashion_mnist_small.npz`
with `train_images` (6000, 28, 28) uint8, `train_labels` (6000,) uint8, `test_images`
(1000, 28, 28) and `test_labels` (1000,). Each class gets the same number of images, chosen
with a fixed seed and shuffled, so any prefix (`--train-limit`) stays roughly balanced. The
output is the same every time for the same input files.

    python scripts/make_embedded_dataset.py --raw-dir ../shared/data/FashionMNIST/raw
"""

import argparse
import gzip
import hashlib
from pathlib import Path

import numpy as np

NUM_CLASSES = 10


def read_idx(path: Path) -> np.ndarray:
    """Parse an idx file (optionally gzip'd): magic, dims as big-endian int32, then uint8 data."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    zero, dtype_code, ndim = data[0] * 256 + data[1], data[2], data[3]
    if zero != 0 or dtype_code != 0x08:
        raise SystemExit(f"{path} is not an idx file of unsigned bytes")
    dims = np.frombuffer(data, dtype=">i4", count=ndim, offset=4)
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(tuple(dims))


def balanced_subset(
    images: np.ndarray, labels: np.ndarray, per_class: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    chosen = [
        rng.choice(np.flatnonzero(labels == c), size=per_class, replace=False)
        for c in range(NUM_CLASSES)
    ]
    order = rng.permutation(np.concatenate(chosen))
    return images[order].copy(), labels[order].copy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--raw-dir", type=Path, default=Path("../shared/data/FashionMNIST/raw"))
    parser.add_argument("--out", type=Path, default=Path("common/assets/fashion_mnist_small.npz"))
    parser.add_argument("--train-per-class", type=int, default=600)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    arrays = {}
    for split, prefix, per_class in (
        ("train", "train", args.train_per_class),
        ("test", "t10k", args.test_per_class),
    ):
        images = read_idx(args.raw_dir / f"{prefix}-images-idx3-ubyte.gz")
        labels = read_idx(args.raw_dir / f"{prefix}-labels-idx1-ubyte.gz")
        arrays[f"{split}_images"], arrays[f"{split}_labels"] = balanced_subset(
            images, labels, per_class, rng
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, **arrays)
    digest = hashlib.sha256(args.out.read_bytes()).hexdigest()[:16]
    size_kb = args.out.stat().st_size / 1024
    print(f"wrote {args.out}: {size_kb:.0f} KiB, sha256 {digest}")


if __name__ == "__main__":
    main()
