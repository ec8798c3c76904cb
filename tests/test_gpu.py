"""The GPU path with a real GPU: workers on cuda:0 train the weights that CPU workers train,
with and without overlap, with every compression, with BatchNorm (ResNet-18), and a batch too
big for the GPU ends with advice and a LEAVE.

Skipped where CUDA is absent (CI and the 2-core build machine); run on a GPU machine with
`pytest tests/test_gpu.py`. The GPU adds in another order than the CPU (other kernels), so
weights are compared relative to how far training moved them, not to the bit: a wrong
offset, a stale pull or a gradient read before backward wrote it moves them by as much as
training does, far beyond these tolerances.
"""

import json

import pytest
import torch

from common.catalog import build_model
from tests.harness import SHARED_DATA, Cluster

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SEED = 3
# LeNet (0.5 MB) is one bucket at the default 2 MB: its worker would push it whole, with no
# autograd hook, and get no weights streamed back. Cut into 4, it takes the overlap path:
# buckets copied off the GPU (and compressed, fp16 and bf16) inside backward, weights
# streamed back. A top-k job keeps one bucket whatever --bucket-mb says (psserver.job_setup).
LENET_BUCKETS = ("--bucket-mb", "0.1")


@pytest.fixture(autouse=True)
def full_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers compute in float32, not TF32 (PyTorch's default for convolutions on recent
    GPUs), which keeps 10 bits of mantissa. With TF32, on an H100, LeNet's last layer ended
    1.2 % of its movement away from the CPU's after 20 steps, past the 1 % bound; in float32
    it came within 1 % of that bound. cuDNN and cuBLAS read this variable in every process the
    tests start."""
    monkeypatch.setenv("NVIDIA_TF32_OVERRIDE", "0")


def job(model: str, train_limit: int, *extra: str) -> list[str]:
    return [
        "--mode",
        "sync",
        "--model",
        model,
        "--train-limit",
        str(train_limit),
        "--test-limit",
        "200",
        "--lr",
        "0.05",
        "--momentum",
        "0.9",
        "--seed",
        str(SEED),
        *extra,
    ]


def train(
    cluster: Cluster, name: str, server_args: list[str], worker_devices: list[list[str]]
) -> dict:
    """One job to its end; `worker_devices`: each worker's device options. The final
    checkpoint."""
    return cluster.train_to_end(name, server_args, worker_devices, timeout=300)[1]


def assert_same_training(gpu: dict, cpu: dict, model: str, tolerance: float) -> None:
    """Every tensor of the GPU run within `tolerance` of the CPU run, measured against how
    far the CPU run moved it from the initial weights (plus a floor for tensors that barely
    move, such as a convolution's bias before BatchNorm, whose gradient is rounding noise)."""
    assert gpu["step"] == cpu["step"] > 0
    initial = build_model(model, seed=SEED).state_dict()
    used: dict[str, float] = {}  # each tensor's distance as a fraction of its bound
    for key, expected in cpu["model"].items():
        if not expected.is_floating_point():
            assert torch.equal(gpu["model"][key], expected), key  # BatchNorm's batch counts
            continue
        moved = (expected - initial[key]).norm().item()
        assert moved > 0, f"{key} did not train; the comparison would be vacuous"
        apart = (gpu["model"][key] - expected).norm().item()
        used[key] = apart / (tolerance * moved + 1e-4)
    ranked = sorted(used, key=used.__getitem__, reverse=True)  # the closest to its bound first
    assert used[ranked[0]] <= 1, ", ".join(f"{k} at {used[k]:.0%}" for k in ranked[:8])
    worst = ranked[0]  # shown with -s: how much room the bounds leave
    print(f"GPU vs CPU: {worst} is the closest to its bound, at {used[worst]:.0%} of it")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("shards", ["1", "2"])
@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
def test_two_gpu_workers_train_what_two_cpu_workers_train(
    cluster: Cluster, overlap: str, shards: str
) -> None:
    # Both forms of naming the GPU: --gpu and --device. One GPU serves both workers. With 2
    # shards each worker also sends slices to a follower and loads the follower's slice.
    server = job(
        "lenet", 640, "--batch-size", "32", "--epochs", "2", "--num-shards", shards,
        *LENET_BUCKETS,
    )  # fmt: skip
    gpu = train(cluster, "gpu", server, [["--gpu", "0", overlap], ["--device", "cuda:0", overlap]])
    cpu = train(cluster, "cpu", server, [["--device", "cpu", overlap]] * 2)
    assert_same_training(gpu, cpu, "lenet", tolerance=1e-2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("compress", "tolerance"), [("fp16", 2e-2), ("bf16", 5e-2), ("topk:0.1", 0.1)]
)
def test_gpu_workers_compress_as_cpu_workers_do(
    cluster: Cluster, compress: str, tolerance: float
) -> None:
    # Top-k's choice near its threshold can differ with the float order: a looser bound.
    server = job(
        "lenet", 640, "--batch-size", "32", "--epochs", "2", "--compress", compress,
        *LENET_BUCKETS,
    )  # fmt: skip
    gpu = train(cluster, "gpu", server, [["--gpu", "0"]] * 2)
    cpu = train(cluster, "cpu", server, [["--device", "cpu"]] * 2)
    assert_same_training(gpu, cpu, "lenet", tolerance)


@pytest.mark.timeout(600)
def test_a_resnet18_gpu_worker_trains_weights_and_batchnorm_buffers_as_on_the_cpu(
    cluster: Cluster,
) -> None:
    # One step: ResNet-18's stem drifts apart after two even between float32 and float64 on
    # the CPU (6% of its movement; 0.15% after one), so later steps measure chaos, not the
    # GPU path. LeNet's tests (in 4 buckets) cover the pulls and streamed weights of later
    # steps.
    server = job("resnet18", 256, "--batch-size", "32", "--max-steps", "1")
    gpu = train(cluster, "gpu", server, [["--gpu", "0"]] * 2)
    cpu = train(cluster, "cpu", server, [["--device", "cpu", "--threads", "4"]] * 2)
    assert_same_training(gpu, cpu, "resnet18", tolerance=2e-2)


@pytest.mark.timeout(600)
def test_ps_local_puts_each_worker_on_a_gpu_and_ends_with_a_test_accuracy(
    cluster: Cluster,
) -> None:
    summary = cluster.workdir / "summary.json"
    proc = cluster.start(
        "ps-local",
        "psserver.cli.local",
        "--device",
        "cuda",
        "--workers",
        "1",
        "--max-steps",
        "30",
        "--batch-size",
        "64",
        "--summary",
        str(summary),
    )
    cluster.wait(proc, timeout=300)
    assert "test accuracy" in proc.output(), proc.describe()
    report = json.loads(summary.read_text())
    assert report["global_steps"] == 30
    assert [worker["device"] for worker in report["per_worker"]] == ["cuda:0"]


@pytest.mark.timeout(600)
@pytest.mark.skipif(not (SHARED_DATA / "FashionMNIST").is_dir(), reason="needs ../shared/data")
def test_a_batch_too_big_for_the_gpu_ends_the_worker_with_advice_and_a_leave(
    cluster: Cluster,
) -> None:
    # 60000 ResNet-18 images at once need a few hundred GB of activations.
    server = job("resnet18", 60000, "--batch-size", "60000", "--epochs", "1")
    server[server.index("--train-limit") : server.index("--train-limit") + 2] = []
    proc, endpoint = cluster.start_server(
        "--dataset", "fashion-mnist", "--data-dir", str(SHARED_DATA), *server, "--workers", "1"
    )
    worker = cluster.start_worker(endpoint, "--data-dir", str(SHARED_DATA), device=("--gpu", "0"))
    assert cluster.wait(worker, timeout=300, expect_code=None) != 0
    assert "cuda:0 ran out of memory" in worker.stderr(), worker.describe()
    assert "smaller --batch-size" in worker.stderr(), worker.describe()
    assert "Traceback" not in worker.stderr(), worker.describe()
    assert proc.process.poll() is None, "the server must outlive a worker's failure"
    assert "left: " in proc.stderr() and "ran out of memory" in proc.stderr(), proc.describe()
