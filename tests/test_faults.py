"""Fault tests: every failure the README promises to survive is injected here for real.

Dead and straggling workers in sync mode, workers joining and leaving a running job, a server
killed and restarted under its workers, SIGKILL at any moment during checkpointing, and
corrupt checkpoints. Run the whole fault suite with `pytest -m fault`.
"""

import json
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from psserver.checkpoint import LATEST, PREVIOUS, load_checkpoint
from tests.harness import Cluster, free_port, kill, wait_for_log

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]
LENET = ["--model", "lenet", "--test-limit", "100", "--lr", "0.05", "--momentum", "0.9"]


def summary_of(cluster: Cluster) -> dict:
    return json.loads((cluster.workdir / "summary.json").read_text())


def test_dead_worker_is_detected_and_sync_training_goes_on(cluster: Cluster) -> None:
    server, endpoint = cluster.start_server(
        *LENET,
        "--workers",
        "3",
        "--train-limit",
        "960",
        "--batch-size",
        "16",
        "--epochs",
        "2",
        "--worker-timeout",
        "2",
        "--summary",
        str(cluster.workdir / "summary.json"),
    )
    workers = [
        cluster.start_worker(endpoint, "--step-delay", "0.05", name=f"w{i}") for i in range(3)
    ]
    wait_for_log(server, "training starts", timeout=60)
    time.sleep(1.0)
    killed_at = time.monotonic()
    kill(workers[2])
    detected_at = wait_for_log(server, "declared dead", timeout=30)
    detection = detected_at - killed_at
    print(f"dead worker detected {detection:.2f} s after SIGKILL (--worker-timeout 2)")
    assert detection < 6.0
    for worker in workers[:2]:
        cluster.wait(worker, timeout=120)
    cluster.wait(server, timeout=60)
    summary = summary_of(cluster)
    states = sorted(w["state"] for w in summary["per_worker"])
    assert states == ["dead", "stopped", "stopped"]
    assert summary["epochs"] == 2
    assert "epoch 1 begins: 2 workers" in server.stderr()


def test_straggler_gradients_are_dropped_and_counted(cluster: Cluster) -> None:
    server, endpoint = cluster.start_server(
        *LENET,
        "--workers",
        "2",
        "--train-limit",
        "640",
        "--batch-size",
        "32",
        "--step-timeout",
        "0.3",
        "--summary",
        str(cluster.workdir / "summary.json"),
    )
    fast = cluster.start_worker(endpoint, name="fast")
    slow = cluster.start_worker(endpoint, "--step-delay", "1.0", name="slow")
    cluster.wait(fast, timeout=120)
    cluster.wait(slow, timeout=120)
    cluster.wait(server, timeout=60)
    summary = summary_of(cluster)
    assert summary["global_steps"] == 10  # the steps did not wait for the straggler
    by_late = sorted(summary["per_worker"], key=lambda w: w["late_dropped"])
    assert by_late[0]["late_dropped"] == 0 and by_late[0]["pushes"] == 10
    assert by_late[1]["late_dropped"] >= 1  # every late gradient was dropped and counted
    assert by_late[1]["pushes"] + by_late[1]["late_dropped"] <= 10
    assert "closed after 0.3 s without workers" in server.stderr()


def test_workers_join_and_leave_at_epoch_boundaries(cluster: Cluster) -> None:
    server, endpoint = cluster.start_server(
        *LENET,
        "--workers",
        "2",
        "--train-limit",
        "600",
        "--batch-size",
        "10",
        "--epochs",
        "6",
        "--summary",
        str(cluster.workdir / "summary.json"),
    )
    delay = ["--step-delay", "0.05"]
    first = [cluster.start_worker(endpoint, *delay, name=f"w{i}") for i in range(2)]
    wait_for_log(server, "training starts", timeout=60)
    joiner = cluster.start_worker(endpoint, *delay, name="joiner")
    # Shards change only at an epoch boundary: 2 shards of 300 (30 steps), then 3 of 200.
    wait_for_log(server, "begins: 3 workers [1, 2, 3], 20 steps per shard", timeout=90)
    leaver = int(first[0].stderr().split("registered as worker ")[1].split(":")[0])
    stayer = ({1, 2} - {leaver}).pop()
    kill(first[0], signal.SIGTERM)  # a polite leave: finish the step, say goodbye, exit 0
    cluster.wait(first[0], timeout=30)
    assert "left the job after a shutdown signal" in first[0].stderr()
    wait_for_log(server, f"begins: 2 workers [{stayer}, 3], 30 steps per shard", timeout=120)
    cluster.wait(first[1], timeout=120)
    cluster.wait(joiner, timeout=120)
    cluster.wait(server, timeout=60)
    summary = summary_of(cluster)
    assert summary["epochs"] == 6
    states = {w["worker_id"]: w["state"] for w in summary["per_worker"]}
    assert states == {leaver: "left", stayer: "stopped", 3: "stopped"}
    assert all(w["pushes"] > 0 for w in summary["per_worker"])
    log = server.stderr()
    assert log.index(f"worker {leaver} (") < log.index(f"begins: 2 workers [{stayer}, 3]")


def test_server_restart_workers_reconnect_and_the_result_is_unchanged(cluster: Cluster) -> None:
    common = [
        *LENET,
        "--workers",
        "2",
        "--train-limit",
        "640",
        "--batch-size",
        "16",
        "--epochs",
        "2",
        "--checkpoint-every",
        "3",
    ]
    # The reference: the same job, never interrupted.
    reference_dir = cluster.workdir / "reference"
    _ref_server, ref_endpoint = cluster.start_server(
        *common, "--checkpoint-dir", str(reference_dir), name="reference"
    )
    for i in range(2):
        cluster.start_worker(ref_endpoint, name=f"ref-worker{i}")
    cluster.wait_all(timeout=120)

    port = free_port()
    bind = f"tcp://127.0.0.1:{port}"
    run_dir = cluster.workdir / "run"
    first, _ = cluster.start_server(
        *common, "--checkpoint-dir", str(run_dir), "--bind", bind, name="first"
    )
    workers = [
        cluster.start_worker(
            bind, "--timeout", "2", "--retries", "12", "--step-delay", "0.05", name=f"worker{i}"
        )
        for i in range(2)
    ]
    wait_for_log(first, "checkpoint at step 9", timeout=90)
    kill(first)
    first.process.wait(timeout=10)
    second, _ = cluster.start_server(
        *common, "--checkpoint-dir", str(run_dir), "--bind", bind, "--resume", name="second"
    )
    for worker in workers:
        cluster.wait(worker, timeout=180)
    cluster.wait(second, timeout=60)
    assert "resumed at step" in second.stderr()
    assert all("registering again" in w.stderr() for w in workers)

    expected = torch.load(reference_dir / LATEST, weights_only=True)
    resumed = torch.load(run_dir / LATEST, weights_only=True)
    assert resumed["step"] == expected["step"] == 40
    for key, value in expected["model"].items():
        torch.testing.assert_close(resumed["model"][key], value, rtol=1e-4, atol=1e-5)


def test_sigkill_at_any_moment_leaves_a_loadable_checkpoint(cluster: Cluster) -> None:
    directory = cluster.workdir / "ckpt"
    bind = f"tcp://127.0.0.1:{free_port()}"
    common = [
        *LENET,
        "--workers",
        "1",
        "--train-limit",
        "4000",
        "--batch-size",
        "8",
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        "1",
        "--bind",
        bind,
    ]
    rng = random.Random(0)
    server, _ = cluster.start_server(*common, name="server0")
    worker = cluster.start_worker(bind, "--timeout", "2", "--retries", "20", "--step-delay", "0.02")
    steps_seen: list[int] = []
    kills = 4
    for round_ in range(kills):
        wait_for_log(server, "checkpoint at step", timeout=60)
        time.sleep(rng.uniform(0.0, 1.0))  # anywhere: mid-write, mid-rename, between steps
        kill(server)
        server.process.wait(timeout=10)
        state = load_checkpoint(directory)  # never raises: latest.pt or previous.pt is whole
        steps_seen.append(state["step"])
        last = round_ == kills - 1
        extra = ["--max-steps", str(state["step"] + 20)] if last else []
        server, _ = cluster.start_server(*common, "--resume", *extra, name=f"server{round_ + 1}")
    cluster.wait(server, timeout=120)
    cluster.wait(worker, timeout=60)
    print(f"{kills} SIGKILLs survived; checkpoints found at steps {steps_seen}")
    assert steps_seen == sorted(steps_seen) and steps_seen[0] >= 1
    assert load_checkpoint(directory)["step"] == steps_seen[-1] + 20


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    directory = cluster.workdir / "ckpt"
    _server, endpoint = cluster.start_server(
        *LENET,
        "--workers",
        "1",
        "--train-limit",
        "64",
        "--batch-size",
        "16",
        "--checkpoint-dir",
        str(directory),
        "--checkpoint-every",
        "1",
    )
    cluster.start_worker(endpoint)
    cluster.wait_all(timeout=60)
    latest = torch.load(directory / LATEST, weights_only=True)
    previous = torch.load(directory / PREVIOUS, weights_only=True)
    assert (latest["step"], previous["step"]) == (4, 3)

    data = (directory / LATEST).read_bytes()
    (directory / LATEST).write_bytes(data[: len(data) // 2])  # truncated, as by a full disk
    with caplog.at_level("WARNING", logger="ps.server"):
        state = load_checkpoint(directory)
    assert state["step"] == previous["step"]
    assert "trying the previous checkpoint" in caplog.text

    (directory / PREVIOUS).write_bytes(b"garbage")
    with pytest.raises(Exception, match="no loadable checkpoint"):
        load_checkpoint(directory)
    shutil.rmtree(directory)


def test_curve_admits_only_trusted_workers(cluster: Cluster, tmp_path: Path) -> None:
    import subprocess
    import sys

    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    for folder in (keys, strangers):
        subprocess.run(
            [sys.executable, "-m", "psserver.keys", str(folder)],
            check=True,
            capture_output=True,
            timeout=60,
        )
    server, endpoint = cluster.start_server(
        *LENET,
        "--workers",
        "1",
        "--train-limit",
        "128",
        "--batch-size",
        "32",
        "--curve-secret-key",
        str(keys / "server.key_secret"),
        "--curve-authorized-clients",
        str(keys / "authorized_clients"),
        "--summary",
        str(cluster.workdir / "summary.json"),
    )
    stranger = cluster.start_worker(
        endpoint,
        "--timeout",
        "2",
        "--retries",
        "0",
        "--curve-secret-key",
        str(strangers / "client-1.key_secret"),
        "--curve-server-key",
        str(keys / "server.key"),
        name="stranger",
    )
    plain = cluster.start_worker(endpoint, "--timeout", "2", "--retries", "0", name="plain")
    cluster.wait(stranger, timeout=60, expect_code=1)
    cluster.wait(plain, timeout=60, expect_code=1)
    assert "no reply from the server" in stranger.stderr()
    assert "rejected a connection" in server.stderr()
    assert "registered" not in server.stderr().split("rejected a connection")[0]

    trusted = cluster.start_worker(
        endpoint,
        "--curve-secret-key",
        str(keys / "client-1.key_secret"),
        "--curve-server-key",
        str(keys / "server.key"),
        name="trusted",
    )
    cluster.wait(trusted, timeout=120)
    cluster.wait(server, timeout=60)
    assert summary_of(cluster)["global_steps"] == 4
