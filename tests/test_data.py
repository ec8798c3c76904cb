"""Data sets and sharding: the shards are exactly DistributedSampler's, the union of one batch
over ranks is one big batch (the basis of sync equivalence), and every broken data dir is a
DataError that says how to fix it."""

import gzip
import importlib.util
import logging
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from common.assignment import batch_slice, shard_indices, shard_size, steps_per_epoch
from common.data import DOWNLOAD_TIMEOUT_S, DataSource, load_split, unpack_gzipped
from common.errors import DataError
from tests.harness import make_fashion_mnist, write_idx

REPO = Path(__file__).parents[1]
SHARED_DATA = Path(__file__).parents[2] / "shared" / "data"
SHARED_RAW = SHARED_DATA / "FashionMNIST" / "raw"
EMBEDDED_NPZ = REPO / "common" / "assets" / "fashion_mnist_small.npz"
RAW_NAMES = [
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
]


def _real_data_or_skip() -> None:
    missing = [n for n in RAW_NAMES if not (SHARED_RAW / f"{n}.gz").is_file()]
    if missing:
        pytest.skip(f"the full Fashion-MNIST files are not in {SHARED_RAW} (missing {missing})")


# ---- sharding --------------------------------------------------------------------------------

SHARD_CASES = [
    # (num_samples, world_size, epoch)
    (100, 1, 0),
    (100, 4, 0),
    (100, 4, 3),
    (101, 4, 1),  # not divisible: rank 0 gets one wrapped sample ...
    (103, 8, 2),
    (6000, 3, 5),
    (3, 5, 0),  # fewer samples than ranks: wrap around the permutation
    (2, 7, 4),  # ... more than once
    (1, 3, 0),
]


@pytest.mark.parametrize(("num_samples", "world_size", "epoch"), SHARD_CASES)
@pytest.mark.parametrize("seed", [0, 42])
def test_shard_indices_match_distributed_sampler(
    num_samples: int, world_size: int, epoch: int, seed: int
) -> None:
    shards = []
    for rank in range(world_size):
        sampler: DistributedSampler[int] = DistributedSampler(
            range(num_samples),  # type: ignore[arg-type]
            num_replicas=world_size,
            rank=rank,
            shuffle=True,
            seed=seed,
        )
        sampler.set_epoch(epoch)
        ours = shard_indices(num_samples, epoch, seed, rank, world_size)
        assert ours.dtype == torch.int64
        assert ours.tolist() == list(sampler)
        assert len(ours) == shard_size(num_samples, world_size) == len(sampler)
        shards.append(ours)
    # Every sample is used; only the wrapped padding repeats.
    together = torch.cat(shards)
    assert set(together.tolist()) == set(range(num_samples))
    assert len(together) - num_samples == -num_samples % world_size


def test_epochs_and_seeds_give_different_permutations() -> None:
    a = shard_indices(1000, epoch=0, seed=0, rank=0, world_size=1)
    assert sorted(a.tolist()) == list(range(1000))
    assert not torch.equal(a, shard_indices(1000, epoch=1, seed=0, rank=0, world_size=1))
    assert not torch.equal(a, shard_indices(1000, epoch=0, seed=1, rank=0, world_size=1))
    # seed + epoch is what counts, as in DistributedSampler
    assert torch.equal(
        shard_indices(1000, epoch=2, seed=3, rank=0, world_size=1),
        shard_indices(1000, epoch=0, seed=5, rank=0, world_size=1),
    )


@pytest.mark.parametrize(
    ("num_samples", "world_size", "batch_size"),
    [(640, 4, 32), (640, 2, 64), (600, 3, 7), (96, 4, 5), (60, 6, 10), (8, 8, 1)],
)
def test_union_of_rank_batches_is_one_big_batch(
    num_samples: int, world_size: int, batch_size: int
) -> None:
    assert num_samples % world_size == 0
    for epoch in (0, 3):
        single = shard_indices(num_samples, epoch, 11, rank=0, world_size=1)
        shards = [
            shard_indices(num_samples, epoch, 11, rank, world_size) for rank in range(world_size)
        ]
        steps = steps_per_epoch(num_samples, world_size, batch_size)
        assert steps == steps_per_epoch(num_samples, 1, world_size * batch_size)
        for k in range(steps):
            union = torch.cat([batch_slice(s, k, batch_size) for s in shards])
            big = batch_slice(single, k, world_size * batch_size)
            assert len(union) == len(big) > 0
            # Multisets: sort and compare exactly (a set would hide duplicates).
            assert sorted(union.tolist()) == sorted(big.tolist())
        # Past the last step every batch is empty.
        assert all(len(batch_slice(s, steps, batch_size)) == 0 for s in shards)


@pytest.mark.parametrize(
    ("num_samples", "world_size", "batch_size", "expected"),
    [
        (6000, 1, 64, 94),  # 93 full batches and one of 48
        (6000, 2, 64, 47),  # 3000 per rank
        (6000, 4, 256, 6),  # 1500 per rank
        (101, 4, 5, 6),  # 26 per rank after padding
        (100, 4, 25, 1),
        (100, 4, 26, 1),
        (100, 4, 24, 2),
        (3, 5, 1, 1),  # one (wrapped) sample per rank
        (60000, 8, 32, 235),  # 7500 per rank: 234.4 batches
    ],
)
def test_steps_per_epoch(num_samples: int, world_size: int, batch_size: int, expected: int) -> None:
    assert steps_per_epoch(num_samples, world_size, batch_size) == expected
    shard = shard_indices(num_samples, 0, 0, 0, world_size)
    sizes = [len(batch_slice(shard, k, batch_size)) for k in range(expected)]
    assert sum(sizes) == len(shard)
    assert all(size > 0 for size in sizes)
    assert sizes[:-1] == [batch_size] * (expected - 1)


# ---- the embedded data set -------------------------------------------------------------------


@pytest.mark.parametrize(("train", "size", "per_class"), [(True, 6000, 600), (False, 1000, 100)])
def test_embedded_data_set(train: bool, size: int, per_class: int) -> None:
    data = load_split(DataSource("embedded"), train=train)
    assert len(data) == size
    assert data.images.shape == (size, 1, 28, 28)
    assert data.images.dtype == torch.float32
    assert data.labels.shape == (size,)
    assert data.labels.dtype == torch.int64
    assert data.images.min() >= 0.0 and data.images.max() <= 1.0
    assert data.images.max() == 1.0  # real images use the full range
    assert torch.bincount(data.labels, minlength=10).tolist() == [per_class] * 10
    # Pixels are k / 255 for integer k, as torchvision's ToTensor makes them.
    scaled = data.images * 255
    assert torch.equal(scaled, scaled.round())
    # A shuffled balanced subset: a prefix is roughly balanced too.
    assert torch.bincount(data.labels[: size // 10], minlength=10).min() > 0


def test_embedded_train_and_test_do_not_overlap() -> None:
    train = load_split(DataSource("embedded"), train=True).images.reshape(6000, -1)
    test = load_split(DataSource("embedded"), train=False).images.reshape(1000, -1)
    train_rows = {row.numpy().tobytes() for row in train}
    assert not any(row.numpy().tobytes() in train_rows for row in test)


def test_train_limit_cuts_a_prefix() -> None:
    source = DataSource("embedded")
    full = load_split(source, train=True)
    cut = load_split(source, train=True, limit=100)
    assert len(cut) == 100
    assert torch.equal(cut.images, full.images[:100])
    assert torch.equal(cut.labels, full.labels[:100])
    assert len(load_split(source, train=True, limit=10**9)) == 6000


@pytest.mark.parametrize("limit", [0, -1])
def test_non_positive_limit(limit: int) -> None:
    with pytest.raises(DataError, match=f"must be positive, got {limit}"):
        load_split(DataSource("embedded"), train=True, limit=limit)


def test_unknown_data_set() -> None:
    with pytest.raises(DataError, match="unknown data set 'cifar10'"):
        DataSource("cifar10")


def test_fashion_mnist_needs_a_data_dir() -> None:
    with pytest.raises(DataError, match="needs --data-dir"):
        DataSource("fashion-mnist", None)


# ---- the fashion-mnist loader on small idx files ---------------------------------------------


@pytest.mark.parametrize(("train", "prefix"), [(True, "train"), (False, "t10k")])
def test_fashion_mnist_loader_reads_idx_files_exactly(
    tmp_path: Path, train: bool, prefix: str
) -> None:
    arrays = make_fashion_mnist(tmp_path)
    data = load_split(DataSource("fashion-mnist", tmp_path, download=False), train=train)
    images = arrays[f"{prefix}-images-idx3-ubyte"]
    labels = arrays[f"{prefix}-labels-idx1-ubyte"]
    assert data.images.shape == (len(images), 1, 28, 28)
    assert data.images.dtype == torch.float32
    assert data.labels.dtype == torch.int64
    expected = torch.from_numpy(images).unsqueeze(1).float() / 255
    assert torch.equal(data.images, expected)
    assert torch.equal(
        (data.images * 255).round().to(torch.uint8), torch.from_numpy(images)[:, None]
    )
    assert data.labels.tolist() == labels.tolist()
    cut = load_split(DataSource("fashion-mnist", tmp_path), train=train, limit=5)
    assert torch.equal(cut.images, expected[:5])


def test_missing_data_dir(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="does not exist") as info:
        load_split(DataSource("fashion-mnist", missing, download=False), train=True)
    assert "--download" in str(info.value)
    assert str(missing) in str(info.value)
    assert not missing.exists()  # nothing was created


def test_data_dir_without_files(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="train-images-idx3-ubyte is missing") as info:
        load_split(DataSource("fashion-mnist", tmp_path, download=False), train=True)
    assert "--download" in str(info.value)


def test_data_dir_missing_one_file(tmp_path: Path) -> None:
    """The message names the file that is missing (it used to say only "not in raw")."""
    make_fashion_mnist(tmp_path)
    (tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte is missing.*--download"):
        load_split(DataSource("fashion-mnist", tmp_path), train=True)


def test_a_gzipped_file_without_its_suffix_is_named(tmp_path: Path) -> None:
    """It used to be "corrupt (AssertionError: )", with neither the file nor the cause."""
    make_fashion_mnist(tmp_path)
    path = tmp_path / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte"
    path.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(DataError, match=r"train-labels-idx1-ubyte is gzipped; name it .*\.gz"):
        load_split(DataSource("fashion-mnist", tmp_path), train=True)


@pytest.mark.parametrize("train", [True, False], ids=["train", "test"])
def test_labels_outside_the_ten_classes_are_refused_at_load(tmp_path: Path, train: bool) -> None:
    """A test label of 10 used to pass loading and crash the server at the first evaluation,
    after a whole epoch of training."""
    arrays = make_fashion_mnist(tmp_path)
    name = "train-labels-idx1-ubyte" if train else "t10k-labels-idx1-ubyte"
    labels = arrays[name].copy()
    labels[3] = 10
    write_idx(tmp_path / "FashionMNIST" / "raw" / name, labels)
    with pytest.raises(DataError, match=rf"labels in .*{name} must be 0\.\.9, got 0\.\.10"):
        load_split(DataSource("fashion-mnist", tmp_path), train=train)


def unpack_together(raw: Path, barrier: threading.Barrier, errors: list[str]) -> None:
    barrier.wait(timeout=30)
    try:
        unpack_gzipped(raw)
    except DataError as exc:
        errors.append(str(exc))


def test_unpacking_the_same_files_at_once_leaves_them_whole(tmp_path: Path) -> None:
    """Two workers on one host unpack the same .gz files at once. They used to share one
    temporary name, so one could truncate the file another was writing: a load failed with
    a wrong message (here in 4 trials of 5), or read corrupted images without any error.
    Threads stand in for the processes: they start the unpacking together."""
    make_fashion_mnist(tmp_path, n_train=4000)
    raw = tmp_path / "FashionMNIST" / "raw"
    originals = {name: (raw / name).read_bytes() for name in RAW_NAMES}
    packed = {name: gzip.compress(data, compresslevel=1) for name, data in originals.items()}
    for _ in range(5):
        for name in RAW_NAMES:
            (raw / name).unlink(missing_ok=True)
            (raw / f"{name}.gz").write_bytes(packed[name])
        barrier, errors = threading.Barrier(3), []
        threads = [
            threading.Thread(target=unpack_together, args=(raw, barrier, errors)) for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
        assert all((raw / name).read_bytes() == originals[name] for name in RAW_NAMES)
        assert not list(raw.glob(".*partial"))


def test_a_download_that_fails_is_one_line_with_what_to_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchvision's error spans lines and its cause was reported as a failed read."""
    import torchvision.datasets

    seen_timeouts: list[float | None] = []

    def unreachable(self: object, *args: object, **kwargs: object) -> None:
        seen_timeouts.append(socket.getdefaulttimeout())
        raise RuntimeError(
            "Error downloading train-images-idx3-ubyte.gz:\nTried http://example/, got:\n"
            "<urlopen error [Errno -2] Name or service not known>\n"
        )

    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "__init__", unreachable)
    before = socket.getdefaulttimeout()
    with pytest.raises(DataError) as info:
        load_split(DataSource("fashion-mnist", tmp_path, download=True), train=True)
    message = str(info.value)
    assert "\n" not in message
    assert "could not download Fashion-MNIST into" in message
    assert "Name or service not known" in message and "check the network" in message
    assert seen_timeouts == [DOWNLOAD_TIMEOUT_S]  # no network wait lasts for ever
    assert socket.getdefaulttimeout() == before  # and the process's default is restored


def test_a_download_whose_proxy_never_answers_is_a_download_error_in_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A proxy (here a real socket on 127.0.0.1) that takes the request and never answers:
    torchvision lets the timeout through, and it was reported as `could not read
    Fashion-MNIST in DIR (timed out)`, after a wait nothing had announced."""
    import urllib.request

    from common import data

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepted by the kernel, never read, never answered
    proxy = f"http://127.0.0.1:{silent.getsockname()[1]}"
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.setenv(name, proxy)
    for name in ("no_proxy", "NO_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)  # so that it reads the proxy anew
    monkeypatch.setattr(data, "DOWNLOAD_TIMEOUT_S", 1.0)
    started = time.monotonic()
    try:
        with caplog.at_level(logging.INFO, logger="ps.data"), pytest.raises(DataError) as info:
            load_split(DataSource("fashion-mnist", tmp_path, download=True), train=True)
    finally:
        silent.close()
    raw = tmp_path / "FashionMNIST" / "raw"
    assert str(info.value) == (
        f"could not download Fashion-MNIST into {raw} (no answer within 1 s); check the "
        f"network (and any proxy), or copy the four original files into {raw} and leave out "
        "--download"
    )
    # A guard against waiting for ever (no timeout at all), far above the 1 s the message
    # says it waited, so that a loaded machine cannot decide it.
    assert time.monotonic() - started < 30
    assert f"downloading Fashion-MNIST into {raw} (a network wait gives up after 1 s)" in (
        caplog.text
    )


def test_a_limit_beyond_the_set_says_that_all_of_it_is_used(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="ps.data"):
        data = load_split(DataSource(), train=False, limit=100_000)
    assert len(data) == 1000
    assert "--test-limit 100000 is more than the 1000 test images: using all of them" in (
        caplog.text
    )


@pytest.mark.parametrize(
    ("name", "keep"),
    [
        ("train-images-idx3-ubyte", 16 + 28 * 28 * 3 + 5),  # truncated pixel data
        ("train-images-idx3-ubyte", 10),  # truncated header
        ("train-images-idx3-ubyte", 0),  # empty file
        ("train-labels-idx1-ubyte", 8 + 7),  # fewer labels than images
    ],
)
def test_corrupt_idx_file(tmp_path: Path, name: str, keep: int) -> None:
    make_fashion_mnist(tmp_path)
    path = tmp_path / "FashionMNIST" / "raw" / name
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(DataError, match="Fashion-MNIST") as info:
        load_split(DataSource("fashion-mnist", tmp_path), train=True)
    assert str(path.parent) in str(info.value)  # says where the bad files are


def gzip_in_place(raw: Path) -> None:
    """Leave only NAME.gz, as the files are published."""
    for name in RAW_NAMES:
        (raw / f"{name}.gz").write_bytes(gzip.compress((raw / name).read_bytes()))
        (raw / name).unlink()


def test_gzipped_files_load_without_download(tmp_path: Path) -> None:
    """The original .gz files, as published, load without --download: they are unpacked
    beside themselves. torchvision reads only unpacked files, so they used to be refused
    with a message that said .gz files would do."""
    arrays = make_fashion_mnist(tmp_path)
    raw = tmp_path / "FashionMNIST" / "raw"
    gzip_in_place(raw)
    train = load_split(DataSource("fashion-mnist", tmp_path), train=True)
    expected = torch.from_numpy(arrays["train-labels-idx1-ubyte"]).long()
    assert torch.equal(train.labels, expected) and len(train.images) == 40
    assert all((raw / name).is_file() for name in RAW_NAMES)
    assert not list(raw.glob(".*partial"))


def cut_short(data: bytes) -> bytes:
    return data[:100]


def not_gzip(data: bytes) -> bytes:
    return b"<html>Not Found</html>" + data[22:]


def garbled(data: bytes) -> bytes:
    """The deflate stream's first bytes, right after the 10-byte gzip header: zlib.error."""
    return data[:10] + bytes(b ^ 0xFF for b in data[10:18]) + data[18:]


def bad_checksum(data: bytes) -> bytes:
    """The CRC-32 at the end, of the unpacked bytes."""
    return data[:-8] + bytes(b ^ 0xFF for b in data[-8:-4]) + data[-4:]


@pytest.mark.parametrize("damage", [cut_short, not_gzip, garbled, bad_checksum])
def test_a_damaged_gzipped_file_is_a_clear_error(
    tmp_path: Path, damage: Callable[[bytes], bytes]
) -> None:
    """It said to unpack the files with gunzip, which fails on them too, or to copy the folder
    somewhere writable, which is not what is wrong."""
    make_fashion_mnist(tmp_path)
    raw = tmp_path / "FashionMNIST" / "raw"
    gzip_in_place(raw)
    packed = raw / "train-images-idx3-ubyte.gz"
    packed.write_bytes(damage(packed.read_bytes()))
    with pytest.raises(DataError) as info:
        load_split(DataSource("fashion-mnist", tmp_path), train=True)
    message = str(info.value)
    assert message.startswith(f"{packed} is damaged or incomplete ("), message
    assert message.endswith(
        "); copy it again from where it came from, or delete it and add --download"
    )
    assert "gunzip" not in message and "writable" not in message
    assert not (raw / "train-images-idx3-ubyte").exists() and not list(raw.glob(".*partial"))


def test_a_gzipped_file_in_a_folder_it_cannot_write_to_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_fashion_mnist(tmp_path)
    raw = tmp_path / "FashionMNIST" / "raw"
    gzip_in_place(raw)

    def read_only(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(13, "Permission denied")  # as for a read-only folder (not root)

    monkeypatch.setattr(tempfile, "mkstemp", read_only)
    with pytest.raises(DataError, match=r"could not unpack .*gunzip -k.*somewhere writable"):
        load_split(DataSource("fashion-mnist", tmp_path), train=True)


def test_idx_file_with_wrong_image_size(tmp_path: Path) -> None:
    make_fashion_mnist(tmp_path)
    raw = tmp_path / "FashionMNIST" / "raw"
    write_idx(raw / "train-images-idx3-ubyte", np.zeros((40, 32, 32), dtype=np.uint8))
    with pytest.raises(DataError, match=r"expected \(N, 28, 28\)"):
        load_split(DataSource("fashion-mnist", tmp_path), train=True)


# ---- real Fashion-MNIST ----------------------------------------------------------------------


@pytest.mark.realdata
def test_real_fashion_mnist(tmp_path: Path) -> None:
    _real_data_or_skip()
    shutil.copytree(SHARED_DATA / "FashionMNIST", tmp_path / "FashionMNIST")
    # download=True: torchvision finds the .gz files, checks their md5 and unpacks them; the
    # network is never touched because every file is already there and verified.
    source = DataSource("fashion-mnist", tmp_path, download=True)
    train = load_split(source, train=True)
    test = load_split(source, train=False)
    assert train.images.shape == (60000, 1, 28, 28)
    assert test.images.shape == (10000, 1, 28, 28)
    assert torch.bincount(train.labels, minlength=10).tolist() == [6000] * 10
    assert torch.bincount(test.labels, minlength=10).tolist() == [1000] * 10
    assert train.images.min() == 0.0 and train.images.max() == 1.0
    for name in RAW_NAMES:
        assert (tmp_path / "FashionMNIST" / "raw" / name).is_file()  # unpacked beside the .gz


def _load_script() -> ModuleType:
    path = REPO / "scripts" / "make_embedded_dataset.py"
    spec = importlib.util.spec_from_file_location("make_embedded_dataset", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_read_idx_and_balanced_subset_on_small_files(tmp_path: Path) -> None:
    script = _load_script()
    arrays = make_fashion_mnist(tmp_path, n_train=200)
    raw = tmp_path / "FashionMNIST" / "raw"
    images = script.read_idx(raw / "train-images-idx3-ubyte")
    labels = script.read_idx(raw / "train-labels-idx1-ubyte")
    assert np.array_equal(images, arrays["train-images-idx3-ubyte"])
    assert np.array_equal(labels, arrays["train-labels-idx1-ubyte"])
    per_class = int(np.bincount(labels, minlength=10).min())
    assert per_class > 0
    sub_images, sub_labels = script.balanced_subset(
        images, labels, per_class, np.random.default_rng(0)
    )
    assert np.bincount(sub_labels, minlength=10).tolist() == [per_class] * 10
    # Every chosen image keeps its own label, and none is chosen twice.
    rows = {images[i].tobytes(): labels[i] for i in range(len(images))}
    assert all(rows[img.tobytes()] == lab for img, lab in zip(sub_images, sub_labels, strict=True))
    assert len({img.tobytes() for img in sub_images}) == len(sub_images)


@pytest.mark.realdata
def test_embedded_npz_regenerates_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _real_data_or_skip()
    script = _load_script()
    out = tmp_path / "fashion_mnist_small.npz"
    argv = ["make_embedded_dataset.py", "--raw-dir", str(SHARED_RAW), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    script.main()
    with np.load(out) as fresh, np.load(EMBEDDED_NPZ) as shipped:
        assert (
            sorted(fresh.files)
            == sorted(shipped.files)
            == sorted(["train_images", "train_labels", "test_images", "test_labels"])
        )
        for key in shipped.files:
            assert fresh[key].dtype == shipped[key].dtype == np.uint8, key
            assert fresh[key].shape == shipped[key].shape, key
            assert np.array_equal(fresh[key], shipped[key]), key
    # Stronger still: the file itself is byte-identical. numpy stamps every zip entry with a
    # fixed 1980 date, and zlib compresses the same bytes the same way (a different zlib build
    # could break only this line; the arrays above are what the loader reads).
    assert out.read_bytes() == EMBEDDED_NPZ.read_bytes()
