"""End-to-end runs of the real commands on localhost: ps-local on the embedded data, ResNet-18
with BatchNorm, async mode, checkpoint/resume, and the full Fashion-MNIST files if present."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.catalog import build_model
from tests.harness import CPU_WORKER, SHARED_DATA, Cluster


def run_local(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[dict, str]:
    summary = tmp_path / "summary.json"
    result = run_local_process(tmp_path, "--summary", str(summary), *args, timeout=timeout)
    return json.loads(summary.read_text()), result.stdout


def run_local_process(tmp_path: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "psserver.cli.local", "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )
    assert result.returncode == 0, f"ps-local failed:\n{result.stderr[-6000:]}"
    return result


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ps_local_trains_lenet_well_above_chance(tmp_path: Path) -> None:
    summary, stdout = run_local(
        tmp_path,
        "--model",
        "lenet",
        "--workers",
        "2",
        "--epochs",
        "3",
        "--batch-size",
        "64",
        "--lr",
        "0.1",
        "--momentum",
        "0.9",
    )
    assert summary["test_accuracy"] > 0.6, summary  # chance is 0.1
    assert summary["global_steps"] == 3 * 47
    assert summary["epochs"] == 3
    assert [e["epoch"] for e in summary["evaluations"]] == [1, 2, 3]
    for key in ("mode", "workers", "model", "wall_seconds", "images_per_second", "test_loss"):
        assert key in summary
    # The steady rate starts after both workers' first 2 pushes.
    assert summary["warmup_pushes"] == 2 * 2 and summary["steady_images_per_second"] > 0
    assert summary["train_samples_processed"] == 3 * 2 * 47 * 64 - 3 * 2 * (47 * 64 - 3000)
    # One human line at the end, and every child's output prefixed with its role.
    assert stdout.strip().splitlines()[-1].startswith("test accuracy 0.")


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_async_run_reports_staleness(tmp_path: Path) -> None:
    summary, _ = run_local(
        tmp_path,
        "--model",
        "lenet",
        "--mode",
        "async",
        "--workers",
        "2",
        "--epochs",
        "2",
        "--lr",
        "0.2",
        "--batch-size",
        "64",
        "--train-limit",
        "4096",
        "--test-limit",
        "500",
    )
    assert summary["mode"] == "async"
    assert summary["global_steps"] == 2 * 2 * 32  # every worker's every batch, applied once
    staleness = summary["staleness"]
    assert staleness["count"] == 128
    assert sum(staleness["histogram"].values()) == 128
    assert 0 <= staleness["mean"] <= staleness["max"]
    assert summary["test_accuracy"] > 0.3


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_resnet18_batchnorm_statistics_reach_the_server(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    summary, _ = run_local(
        tmp_path,
        "--workers",
        "2",
        "--max-steps",
        "3",
        "--batch-size",
        "8",
        "--train-limit",
        "256",
        "--test-limit",
        "64",
        "--checkpoint-dir",
        str(checkpoints),
    )
    assert summary["model"] == "resnet18" and summary["global_steps"] == 3
    state = torch.load(checkpoints / "latest.pt", weights_only=True)
    assert state["step"] == 3 and state["config"]["model"] == "resnet18"
    model = build_model("resnet18")
    model.load_state_dict(state["model"])  # the checkpoint loads into the model from common
    stem_bn = state["model"]["0.1.running_mean"]
    assert stem_bn.abs().sum() > 0, "BatchNorm running means never left their initial zeros"
    assert int(state["model"]["0.1.num_batches_tracked"]) == 3
    assert set(state) >= {"model", "optimizer", "step", "config"}


def test_resume_continues_exactly_where_it_stopped(cluster: Cluster) -> None:
    common = [
        "--model",
        "lenet",
        "--batch-size",
        "32",
        "--train-limit",
        "320",
        "--test-limit",
        "100",
        "--lr",
        "0.05",
        "--momentum",
        "0.9",
    ]

    def train(directory: str, *extra: str) -> tuple[dict, dict]:
        run = f"{directory}-{len(cluster.procs)}"
        summary = cluster.workdir / f"{run}.json"
        server_args = [*common, "--summary", str(summary), *extra]
        _, checkpoint = cluster.train_to_end(
            run, server_args, [CPU_WORKER], timeout=120, folder=directory
        )
        return checkpoint, json.loads(summary.read_text())

    straight, straight_summary = train("straight", "--epochs", "2")
    _, first_summary = train("resumed", "--epochs", "2", "--max-steps", "13")
    resumed, resumed_summary = train("resumed", "--epochs", "2", "--resume")
    assert straight["step"] == resumed["step"] == 20
    # Bit for bit: one worker, the same batches in the same order, the momentum restored.
    for key, value in straight["model"].items():
        assert torch.equal(resumed["model"][key], value), key

    # The resumed run's summary counts the whole run, not only its own 7 steps.
    assert first_summary["train_samples_processed"] == 13 * 32
    assert (
        resumed_summary["train_samples_processed"]
        == straight_summary["train_samples_processed"]
        == 20 * 32
    )
    assert resumed_summary["push_bytes"] == straight_summary["push_bytes"]
    assert [e["step"] for e in resumed_summary["evaluations"]] == [10, 13, 20]
    last, straight_last = resumed_summary["evaluations"][-1], straight_summary["evaluations"][-1]
    assert last["test_accuracy"] == straight_last["test_accuracy"]  # the same weights
    assert (straight_summary["sessions"], resumed_summary["sessions"]) == (1, 2)
    assert "this_session" not in straight_summary
    this_session = resumed_summary["this_session"]
    assert this_session["resumed_at_step"] == 13
    assert this_session["train_samples_processed"] == 7 * 32
    assert resumed_summary["wall_seconds"] > this_session["wall_seconds"] > 0


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_ps_local_resumed_after_the_end_reports_and_stops_its_workers(tmp_path: Path) -> None:
    """The server of a run that is already over ends before its workers train (it tells
    those that register within --stop-grace; ps-local stops the others), and ps-local reports
    the result: the run's own summary, or without --summary the resumed run's."""
    job = ["--model", "lenet", "--epochs", "1", "--train-limit", "320", "--test-limit", "100"]
    first, _ = run_local(tmp_path, *job, "--checkpoint-dir", "ckpt")
    again, stdout = run_local(tmp_path, *job, "--checkpoint-dir", "ckpt", "--resume", timeout=90)
    assert first["global_steps"] == 2  # 320 images, 2 x 128 a step
    assert again == first  # the run's own summary is kept, not replaced by an empty one
    assert stdout.strip().splitlines()[-1].startswith("test accuracy ")
    # Without --summary, ps-local's own (empty until the server writes it) is no run's own.
    result = run_local_process(tmp_path, *job, "--checkpoint-dir", "ckpt", "--resume", timeout=90)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith(f"test accuracy {first['test_accuracy']:.4f} "), last
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.realdata
@pytest.mark.timeout(600)
def test_real_fashion_mnist_files(tmp_path: Path) -> None:
    raw = SHARED_DATA / "FashionMNIST" / "raw"
    if not raw.is_dir():
        pytest.skip(f"the full Fashion-MNIST files are not in {raw}")
    data_dir = tmp_path / "data"
    shutil.copytree(SHARED_DATA / "FashionMNIST", data_dir / "FashionMNIST")  # shared is read-only
    summary, _ = run_local(
        tmp_path,
        "--model",
        "lenet",
        "--dataset",
        "fashion-mnist",
        "--data-dir",
        str(data_dir),
        "--download",
        "--workers",
        "2",
        "--epochs",
        "1",
        "--batch-size",
        "128",
        "--lr",
        "0.1",
        "--momentum",
        "0.9",
        "--train-limit",
        "20000",
    )
    assert summary["dataset"] == "fashion-mnist"
    assert summary["test_samples"] == 10000
    assert summary["test_accuracy"] > 0.7, summary
