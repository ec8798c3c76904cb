"""Fault tests: every failure docs/faults-and-security.md promises to survive is injected here
for real.

Dead and straggling workers in sync mode, workers joining and leaving a running job, a server
killed and restarted under its workers, SIGKILL at any moment during checkpointing, and
corrupt checkpoints. Run the whole fault suite with `pytest -m fault`.
"""

import io
import json
import os
import random
import re
import shutil
import signal
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from common.errors import CheckpointError
from common.wire.protocol import (
    Error,
    Heartbeat,
    Pull,
    Push,
    PushAck,
    Register,
    Stop,
    Weights,
    Welcome,
    decode,
    encode,
)
from psserver.checkpoints.files import (
    DAMAGED,
    LATEST,
    PREVIOUS,
    load_checkpoint,
    read_checkpoint,
)
from psserver.checkpoints.kept_steps import kept_checkpoints
from psserver.cli import plot
from psserver.cli.status import request_status
from tests.harness import (
    Cluster,
    free_port,
    kill,
    wait_for_log,
    wait_for_signal_handler,
    wait_for_state,
)
from tests.raw_peers import Heartbeats, RawClient, bucket_push

pytestmark = [pytest.mark.fault, pytest.mark.timeout(240)]
LENET = ["--model", "lenet", "--test-limit", "100", "--lr", "0.05", "--momentum", "0.9"]


def summary_of(cluster: Cluster) -> dict:
    return json.loads((cluster.workdir / "summary.json").read_text())


def worker_waits(worker_id: int) -> Callable[[dict[str, Any]], bool]:
    """Whether a status shows the worker waiting: it asked for work (its pull is held)."""
    return lambda status: any(
        w["id"] == worker_id and w["state"] == "waiting" for w in status["workers"]
    )


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
    wait_for_state(server, endpoint, "step 2", lambda status: status["step"] >= 2)
    kill(workers[2])
    wait_for_log(server, "declared dead", timeout=60)
    # Declared dead by the rule, after --worker-timeout of silence, as the server measured
    # it. No bound on how soon: a loaded machine delays the server's checks, not the rule.
    silence = re.search(
        r"declared dead after ([0-9.]+) s of silence \(limit 2\.0 s\)", server.stderr()
    )
    assert silence is not None and float(silence[1]) >= 2.0, server.describe()
    print(f"dead worker declared dead after {silence[1]} s of silence (--worker-timeout 2)")
    for worker in workers[:2]:
        cluster.wait(worker, timeout=120)
    cluster.wait(server, timeout=60)
    summary = summary_of(cluster)
    states = sorted(w["state"] for w in summary["per_worker"])
    assert states == ["dead", "stopped", "stopped"]
    assert summary["epochs"] == 2
    assert "epoch 1 begins: 2 workers" in server.stderr()


def test_straggler_gradients_are_dropped_and_counted(cluster: Cluster) -> None:
    """A sync step closes after --step-timeout without the straggler: each of its gradients
    that comes after its step closed is dropped, never applied to a later step, and counted.
    Counted exactly: every push the straggler sent (its debug log) was answered applied or
    dropped, but one the job's end answered; the server's counts are the worker's own."""
    server, endpoint = cluster.start_server(
        *LENET, "--workers", "2", "--train-limit", "640", "--batch-size", "32",
        "--step-timeout", "0.3", "--summary", str(cluster.workdir / "summary.json"),
    )  # fmt: skip
    fast = cluster.start_worker(endpoint, "--name", "fast", name="fast")
    logs = cluster.workdir / "slow-logs"
    slow = cluster.start_worker(
        endpoint, "--name", "slow", "--step-delay", "1.0", "--log-level", "debug",
        "--log-dir", str(logs), name="slow",
    )  # fmt: skip
    cluster.wait(fast, timeout=120)
    cluster.wait(slow, timeout=120)
    cluster.wait(server, timeout=60)
    summary = summary_of(cluster)
    assert summary["global_steps"] == 10  # the steps did not wait for the straggler
    by_name = {w["name"]: w for w in summary["per_worker"]}
    assert (by_name["fast"]["pushes"], by_name["fast"]["late_dropped"]) == (10, 0)
    (lines,) = [path.read_text().splitlines() for path in logs.glob("worker-*.jsonl")]
    records = [json.loads(line) for line in lines]
    acks = [record["applied"] for record in records if record["event"] == "step"]
    log = slow.stderr()
    asked = re.findall(r"asking \S+: (\w+)\n", log)
    sent = asked.count("Push")
    # Each push it sent was answered applied or dropped (--log-dir records each answer),
    # but the one in flight when the job ended, if any: STOP answered that one, the last
    # request it made.
    ended_a_push = int(asked[-1] == "Push")
    assert sent == len(acks) + ended_a_push, log
    assert by_name["slow"]["pushes"] == acks.count(True)
    assert by_name["slow"]["late_dropped"] == acks.count(False) >= 1
    assert log.count("was dropped: it came after the step closed") == acks.count(False)
    assert "closed after 0.3 s without workers" in server.stderr()
    print(f"the straggler sent {sent} pushes: {acks.count(True)} applied, "
          f"{acks.count(False)} dropped, {ended_a_push} answered by the job's end")  # fmt: skip


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
    kill(first[0], signal.SIGTERM)  # a polite leave: finish the step, say goodbye, exit 143
    cluster.wait(first[0], timeout=30, expect_code=128 + signal.SIGTERM)
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
    # "workers" is --workers, what the job waited for; three trained, and it says so.
    assert (summary["workers"], summary["workers_trained"]) == (2, 3)
    log = server.stderr()
    assert log.index(f"worker {leaver} (") < log.index(f"begins: 2 workers [{stayer}, 3]")


def test_a_job_whose_workers_are_all_lost_in_its_last_epoch_waits_for_new_ones(
    cluster: Cluster,
) -> None:
    """--epochs 1, and the only worker leaves mid-epoch: the epoch is abandoned, and the job
    must wait for workers and train a whole epoch, not end as if it had trained (it used to
    stop after 3 steps of 16, exit 0, and write a summary and a checkpoint of a run that was
    "already over")."""
    summary = cluster.workdir / "summary.json"
    server, endpoint = cluster.start_server(
        *LENET, "--workers", "1", "--train-limit", "256", "--batch-size", "16",
        "--summary", str(summary),
    )  # fmt: skip
    slow = cluster.start_worker(endpoint, "--step-delay", "0.3", name="slow")
    wait_for_state(server, endpoint, "step 3", lambda status: status["step"] >= 3)
    kill(slow, signal.SIGTERM)  # it finishes its step, leaves, and nobody is left
    cluster.wait(slow, timeout=30, expect_code=128 + signal.SIGTERM)
    wait_for_log(server, "epoch 0 cannot go on: 0 live workers", timeout=30)
    # It says it waits for a worker, rather than ending as if it had trained.
    waiting = "workers, 0 of the 1 needed ready"
    wait_for_state(server, endpoint, waiting, lambda status: status["waiting_for"] == waiting)
    assert server.process.poll() is None, server.describe()
    assert "training done" not in server.stderr()

    cluster.start_worker(endpoint, name="replacement")
    cluster.wait(server, timeout=120)
    log = server.stderr()
    assert (
        log.index("epoch 0 abandoned") < log.index("epoch 1 begins") < log.index("epoch 1 done")
    ), log[-3000:]
    result = json.loads(summary.read_text())
    assert (result["epochs"], result["abandoned_epochs"]) == (2, 1)
    assert result["global_steps"] > 16  # the abandoned epoch's steps, and a whole one


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
    run_dir, logs = cluster.workdir / "run", cluster.workdir / "logs"
    run = [*common, "--checkpoint-dir", str(run_dir), "--bind", bind, "--log-dir", str(logs)]
    first, _ = cluster.start_server(*run, name="first")
    patient = ["--timeout", "2", "--retries", "12", "--step-delay", "0.05"]
    workers = [
        cluster.start_worker(bind, *patient, "--log-dir", str(logs), name=f"worker{i}")
        for i in range(2)
    ]
    wait_for_log(first, "checkpoint at step 9", timeout=90)
    # Past the checkpoint, so that the workers train steps 10 and on again (the next
    # checkpoint is at 12).
    deadline = time.monotonic() + 60
    while request_status(bind, timeout_s=10)["step"] < 10:
        assert time.monotonic() < deadline, f"step 10 not reached in 60 s\n{first.describe()}"
        time.sleep(0.01)
    kill(first)
    first.process.wait(timeout=10)
    second, _ = cluster.start_server(*run, "--resume", name="second")
    for worker in workers:
        cluster.wait(worker, timeout=180)
    cluster.wait(second, timeout=60)
    assert f"resumed from {run_dir / LATEST} at step" in second.stderr()
    assert all("registering again" in w.stderr() for w in workers)
    for worker in workers:  # the steps after the checkpoint are trained again, and said so
        stopped = re.search(
            r"stopped after (\d+) steps \(\d+ images(?:; (\d+) of those steps trained again)?",
            worker.stderr(),
        )
        assert stopped is not None, worker.describe()
        steps, redone = int(stopped[1]), int(stopped[2] or 0)
        # 40, or 39 where the server died after its last commit and before the ack went out.
        assert 39 <= steps - redone <= 40, worker.describe()

    expected = torch.load(reference_dir / LATEST, weights_only=True)
    resumed = torch.load(run_dir / LATEST, weights_only=True)
    assert resumed["step"] == expected["step"] == 40
    # Bit for bit: the steps trained again see the same weights and batches, and two
    # workers' gradients add up the same in either order.
    for key, value in expected["model"].items():
        assert torch.equal(resumed["model"][key], value), key

    # The metrics hold steps 10 and on twice; ps-plot counts each once, as the run does.
    runs = plot.read_metrics(logs)
    assert len([r for r in runs["server"] if r["event"] == "update"]) > 40
    standing = plot.standing(runs)
    assert [r["step"] for r in standing["server"] if r["event"] == "update"] == [*range(1, 41)]
    for name in plot.workers(standing):  # sync: each step once in each worker's file
        steps = [r["step"] for r in standing[name] if r["event"] == "step"]
        assert steps == sorted(set(steps)), (name, steps)


def read_now(path: Path) -> bytes | None:
    """The file's bytes as a reader that opens it at this instant gets them (a rename after
    the open does not change what is read); None when there is no such file."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def assert_whole_now(path: Path, must_exist: bool = False) -> None:
    """Fail unless the file, read at this instant, is a whole zip archive as torch.save ends
    one (a cheap check, to read often), or is absent where it may be."""
    data = read_now(path)
    if data is None:
        assert not must_exist, f"{path.name} was missing while checkpoints were written"
        return
    try:
        zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise AssertionError(
            f"{path.name} was half written at a moment ({len(data)} bytes)"
        ) from None


def read_strictly(path: Path, scratch: Path) -> dict | None:
    """The checkpoint at `path` as it is at this instant, through every check of
    read_checkpoint and with no fallback to another file; None when there is no such file."""
    data = read_now(path)
    if data is None:
        return None
    scratch.write_bytes(data)
    try:
        return read_checkpoint(scratch)
    except CheckpointError as exc:
        raise AssertionError(f"{path.name} is not a whole checkpoint: {exc}") from None


def check_every_file(directory: Path, scratch: Path) -> dict:
    """Read latest.pt, previous.pt and every kept step-N.pt strictly, each on its own, and
    return latest.pt's state. latest.pt must be there; a kept file may go between the
    listing and the read (the oldest is removed as a new one is kept)."""
    latest = read_strictly(directory / LATEST, scratch)
    assert latest is not None, f"no {LATEST} in {sorted(p.name for p in directory.iterdir())}"
    read_strictly(directory / PREVIOUS, scratch)
    for step, path in kept_checkpoints(directory):
        kept = read_strictly(path, scratch)
        assert kept is None or kept["step"] == step, (path.name, kept and kept["step"])
    return latest


def test_sigkill_at_any_moment_leaves_whole_checkpoint_files(cluster: Cluster) -> None:
    """README: at every instant latest.pt is a complete checkpoint. A reader checks it while
    the server writes a checkpoint at every step: latest.pt, previous.pt and the kept
    step-N.pt over and over (there where they must be, and whole zip archives, as torch.save
    ends one: cheap enough to catch a write of a few milliseconds), and now and then through
    every check of read_checkpoint; and once more after each SIGKILL, which comes at a random
    moment (mid-write, mid-rename or between steps). load_checkpoint is not used: its
    fallback to previous.pt would hide a latest.pt that is missing or half written."""
    directory = cluster.workdir / "ckpt"
    scratch = cluster.workdir / "read.pt"
    bind = f"tcp://127.0.0.1:{free_port()}"
    common = [
        *LENET, "--workers", "1", "--train-limit", "4000", "--batch-size", "8",
        "--checkpoint-dir", str(directory), "--checkpoint-every", "1",
        "--keep-checkpoints", "3", "--bind", bind,
    ]  # fmt: skip
    rng = random.Random(0)
    server, _ = cluster.start_server(*common, name="server0")
    worker = cluster.start_worker(bind, "--timeout", "2", "--retries", "20", "--step-delay", "0.02")
    steps_seen: list[int] = []
    reads = full_reads = 0
    kills = 4
    for round_ in range(kills):
        wait_for_log(server, "checkpoint at step", timeout=60)  # latest.pt exists from here on
        kill_at = time.monotonic() + rng.uniform(0.5, 1.5)
        while time.monotonic() < kill_at:
            assert_whole_now(directory / LATEST, must_exist=True)
            assert_whole_now(directory / PREVIOUS)
            for _, path in kept_checkpoints(directory):
                assert_whole_now(path)
            reads += 1
            if reads % 50 == 0:
                check_every_file(directory, scratch)
                full_reads += 1
        kill(server)
        server.process.wait(timeout=10)
        state = check_every_file(directory, scratch)
        previous = read_strictly(directory / PREVIOUS, scratch)
        assert previous is None or previous["step"] <= state["step"]
        assert all(step <= state["step"] for step, _ in kept_checkpoints(directory))
        steps_seen.append(state["step"])
        last = round_ == kills - 1
        extra = ["--max-steps", str(state["step"] + 20)] if last else []
        server, _ = cluster.start_server(*common, "--resume", *extra, name=f"server{round_ + 1}")
    cluster.wait(server, timeout=120)
    cluster.wait(worker, timeout=60)
    print(
        f"{kills} SIGKILLs; every file read {reads} times, {full_reads} of them through "
        f"read_checkpoint; {LATEST} at steps {steps_seen} after the kills"
    )
    assert steps_seen == sorted(steps_seen) and steps_seen[0] >= 1
    assert check_every_file(directory, scratch)["step"] == steps_seen[-1] + 20


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

    # Resumed from previous.pt, a run that is already over (at --max-steps 3) writes its
    # checkpoint again, so that latest.pt is whole again. The damaged one is set aside first:
    # rotated onto previous.pt, it would have replaced the only good checkpoint.
    over, _ = cluster.start_server(
        *LENET, "--workers", "1", "--train-limit", "64", "--batch-size", "16",
        "--checkpoint-dir", str(directory), "--resume", "--max-steps", "3", "--lr", "0.01",
        "--stop-grace", "1", name="over",
    )  # fmt: skip
    cluster.wait(over, timeout=60)
    assert "already over at step 3" in over.stderr()
    assert "resuming with lr=0.01; the checkpoint's run had lr=0.05" in over.stderr()
    assert torch.load(directory / LATEST, weights_only=True)["step"] == 3
    assert torch.load(directory / PREVIOUS, weights_only=True)["step"] == 3
    assert (directory / DAMAGED).read_bytes() == data[: len(data) // 2]

    (directory / LATEST).write_bytes(data[: len(data) // 2])
    (directory / PREVIOUS).write_bytes(b"garbage")
    with pytest.raises(Exception, match="no loadable checkpoint"):
        load_checkpoint(directory)
    shutil.rmtree(directory)


def test_foreign_files_are_named_as_such_in_one_line(tmp_path: Path) -> None:
    """Files that are there but are not checkpoints of this program are not "no checkpoint"
    (whose advice, start without --resume, would throw the run away), and torch's pages of
    advice about weights_only stay out of the one-line error."""
    torch.save({"model": {}, "step": 3}, tmp_path / LATEST)  # keys of another program
    (tmp_path / PREVIOUS).write_bytes(os.urandom(100))  # not even a torch file
    with pytest.raises(CheckpointError) as raised:
        load_checkpoint(tmp_path)
    message = str(raised.value)
    assert message.startswith(f"no loadable checkpoint in {tmp_path}")
    assert "missing keys" in message and "\n" not in message and "weights_only" not in message
    for name in (LATEST, PREVIOUS):
        (tmp_path / name).unlink()
    with pytest.raises(CheckpointError, match="found no checkpoint"):
        load_checkpoint(tmp_path)


def test_curve_admits_only_trusted_workers(cluster: Cluster, tmp_path: Path) -> None:
    import subprocess
    import sys

    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    for folder in (keys, strangers):
        subprocess.run(
            [sys.executable, "-m", "psserver.cli.keys", str(folder)],
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
    # A refused handshake is told at once: neither waits out its 300 s of silence.
    patience = ["--timeout", "300", "--retries", "0"]
    stranger = cluster.start_worker(
        endpoint,
        *patience,
        "--curve-secret-key",
        str(strangers / "client-1.key_secret"),
        "--curve-server-key",
        str(keys / "server.key"),
        name="stranger",
    )
    plain = cluster.start_worker(endpoint, *patience, name="plain")
    cluster.wait(stranger, timeout=60, expect_code=1)
    cluster.wait(plain, timeout=60, expect_code=1)
    assert "refused this client's CURVE key" in stranger.stderr(), stranger.stderr()
    assert "it uses CURVE" in plain.stderr() and "--curve-server-key" in plain.stderr()
    for worker in (stranger, plain):
        assert "Traceback" not in worker.stderr(), worker.stderr()
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


def test_an_abandoned_epoch_answers_the_pushes_it_took_and_the_job_goes_on(
    cluster: Cluster,
) -> None:
    """3 workers, --min-workers 3: worker 1 pushes, worker 3 dies, so the epoch cannot go on.
    Worker 1's PUSH must be answered (not applied), and so must worker 2's, sent after the
    abandon for the same step; then a new worker makes three again and the next epoch trains.
    Before the fix worker 1 waited for ever (heartbeats kept it alive), and worker 2's push
    hit an assertion ("internal")."""
    server, endpoint = cluster.start_server(
        *LENET, "--workers", "3", "--min-workers", "3", "--worker-timeout", "2",
        "--train-limit", "192", "--batch-size", "16", "--epochs", "2", "--push-credits", "0",
    )  # fmt: skip
    context = zmq.Context()
    beats = Heartbeats(endpoint)
    try:
        clients = [RawClient(context, endpoint, timeout_s=30) for _ in range(4)]
        welcomes = [client.register(f"raw{i}") for i, client in enumerate(clients[:3])]
        assert all(isinstance(w, Welcome) for w in welcomes)
        ids = [w.worker_id for w in welcomes]
        for client, worker_id in zip(clients, ids, strict=False):
            client.send_frames(encode(Pull(worker_id, client.token)))
        weights = [client.receive("the first weights") for client in clients[:3]]
        assert all(isinstance(w, Weights) and w.epoch == 0 for w in weights)
        job = welcomes[0].job
        zeros, buffers = torch.zeros(job["num_params"]), torch.zeros(job["num_buffers"])

        def push(client: RawClient, worker_id: int, w: Weights) -> None:
            client.send_frames(
                encode(
                    Push(worker_id, client.token, w.version, w.epoch, w.batch, 16, 1.0, 0,
                         zeros, torch.empty(0, dtype=torch.int32), buffers)
                )
            )  # fmt: skip

        beats.add(ids[0], clients[0].token)
        beats.add(ids[1], clients[1].token)  # the third goes silent: it is declared dead
        push(clients[0], ids[0], weights[0])
        dropped = clients[0].receive("worker 1's PUSH_ACK after the abandon")
        assert isinstance(dropped, PushAck) and not dropped.applied, dropped
        wait_for_log(server, "cannot go on", timeout=30)
        push(clients[1], ids[1], weights[1])  # same step, after its epoch ended
        late = clients[1].receive("worker 2's PUSH_ACK")
        assert isinstance(late, PushAck) and not late.applied, late

        welcome = clients[3].register("raw3")
        assert isinstance(welcome, Welcome)
        beats.add(welcome.worker_id, clients[3].token)
        trio = [(clients[0], ids[0]), (clients[1], ids[1]), (clients[3], welcome.worker_id)]
        for client, worker_id in trio:
            client.send_frames(encode(Pull(worker_id, client.token)))
        for client, worker_id in trio:
            w = client.receive("the next epoch's weights")
            assert isinstance(w, Weights) and w.epoch == 1 and w.world_size == 3, w
            push(client, worker_id, w)
        acks = [client.receive("a PUSH_ACK in the next epoch") for client, _ in trio]
        assert all(isinstance(a, PushAck) and a.applied and a.version == 1 for a in acks), acks
        assert server.process.poll() is None
        assert "internal" not in server.stderr()
        # Only the three applied gradients count: worker 1's dropped one was counted as
        # applied, in its pushes and samples and in the images trained.
        status = request_status(endpoint, timeout_s=10)
        counts = {
            w["id"]: (w["pushes"], w["samples"], w["late_dropped"]) for w in status["workers"]
        }
        assert counts[ids[0]] == counts[ids[1]] == (1, 16, 1), counts
        assert counts[welcome.worker_id] == (1, 16, 0), counts
        assert status["throughput"]["samples"] == 3 * 16
    finally:
        beats.stop()
        for client in clients:
            client.close()
        context.term()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_ends_a_worker_whose_pull_the_server_holds(
    cluster: Cluster, signum: signal.Signals
) -> None:
    """The job waits for a second worker, so the server holds the first one's pull. SIGTERM
    or Ctrl-C must still make it leave (the server hears it) and exit at once, with 128 + the
    signal (its share is not done): it used to wait for ever (heartbeats kept the pull alive),
    or exit 130 without a word (Ctrl-C)."""
    server, endpoint = cluster.start_server(*LENET, "--workers", "2", "--train-limit", "640")
    worker = cluster.start_worker(endpoint, "--timeout", "600")
    wait_for_state(server, endpoint, "worker 1's pull held", worker_waits(1))
    kill(worker, signum)
    # At once, so long before its --timeout of 600 s that a loaded machine cannot matter.
    cluster.wait(worker, timeout=60, expect_code=128 + signum)
    wait_for_log(server, "left: shut down by a signal", timeout=30)
    assert "left the job after a shutdown signal" in worker.stderr()


def test_a_restarted_server_is_rejoined_as_soon_as_the_heartbeat_hears_it(
    cluster: Cluster,
) -> None:
    """A worker waiting for its reply when the server restarts (without --resume; the job
    waits for a second worker, so the first server held its pull) learns from its heartbeat,
    within a second, that the new server does not know it, and registers again at once; it
    used to wait out its --timeout (60 s here) first."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    job = [*LENET, "--workers", "2", "--train-limit", "640", "--worker-timeout", "3",
           "--bind", bind]  # fmt: skip
    first, _ = cluster.start_server(*job, name="first")
    worker = cluster.start_worker(bind, "--timeout", "600", "--retries", "0")
    wait_for_state(first, bind, "worker 1's pull held", worker_waits(1))
    kill(first)  # the reply to that pull will never come
    first.process.wait(timeout=10)
    second, _ = cluster.start_server(*job, name="second")
    restarted = time.monotonic()
    # At once, not after its --timeout of 600 s: 120 s leaves room for a loaded machine.
    rejoined = wait_for_log(worker, "registering again", timeout=120)
    print(f"worker registered again {rejoined - restarted:.1f} s after the restart")
    wait_for_log(second, "worker 1 registered", timeout=30)
    kill(second)
    kill(worker)


def test_a_checkpoint_that_cannot_be_written_stops_the_job_after_answering_once(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """The second checkpoint cannot be written (previous.pt is a folder, so the rotation
    fails). The push that reached it gets its PUSH_ACK and nothing else; the server then stops
    the job and says why. It used to send that worker a second reply (an ERROR), which the
    worker read as the answer to its next request, and trained on without checkpoints."""
    directory = cluster.workdir / "ckpt"
    (directory / PREVIOUS / "in-the-way").mkdir(parents=True)
    server, endpoint = cluster.start_server(
        *LENET, "--workers", "1", "--train-limit", "64", "--batch-size", "8",
        "--checkpoint-dir", str(directory), "--checkpoint-every", "1", "--bucket-mb", "0",
    )  # fmt: skip
    client = RawClient(zmq_context, endpoint, timeout_s=20)
    welcome = client.register("w")
    assert isinstance(welcome, Welcome)
    replies: list[object] = []
    for _ in range(2):
        weights = client.request(Pull(welcome.worker_id, client.token))
        assert isinstance(weights, Weights), weights
        client.send_frames(
            encode(
                Push(welcome.worker_id, client.token, weights.version, weights.epoch,
                     weights.batch, 8, 0.0, 0, torch.zeros(weights.params.numel()),
                     torch.empty(0, dtype=torch.int32), weights.buffers.clone())
            )
        )  # fmt: skip
        replies = [client.receive("the PUSH_ACK")]
        while client.socket.poll(1000):
            replies.append(decode(client.socket.recv_multipart()))
        assert isinstance(replies[0], PushAck) and len(replies) == 1, replies
    stop = client.request(Pull(welcome.worker_id, client.token))
    assert isinstance(stop, Stop) and "could not write a checkpoint" in stop.reason, stop
    code = cluster.wait(server, timeout=30, expect_code=None)
    assert code != 0 and "Error:" in server.stderr() and "Traceback" not in server.stderr()


def test_an_async_checkpoint_waits_for_a_push_whose_first_buckets_are_applied(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Async applies each bucket as it comes. A checkpoint written between A's first bucket
    and A's PUSH held that bucket in its weights but not A's batch in its data position:
    resumed, A computed the batch again and the bucket was applied twice. The checkpoint now
    waits for A's push, and answers no pull meanwhile."""
    directory = cluster.workdir / "ckpt"
    server, endpoint = cluster.start_server(
        *LENET, "--mode", "async", "--workers", "2", "--train-limit", "256", "--batch-size",
        "32", "--bucket-mb", "0.1", "--checkpoint-dir", str(directory), "--checkpoint-every",
        "1", "--push-credits", "0", "--max-steps", "50",
    )  # fmt: skip
    a, b = (RawClient(zmq_context, endpoint, timeout_s=20) for _ in range(2))
    welcome_a, welcome_b = a.register("a"), b.register("b")
    assert isinstance(welcome_a, Welcome) and isinstance(welcome_b, Welcome)
    bounds = welcome_a.job["bucket_bounds"]
    assert len(bounds) > 2, "the test needs a gradient in several buckets"
    a.send_frames(encode(Pull(welcome_a.worker_id, a.token)))
    weights_b = b.request(Pull(welcome_b.worker_id, b.token))
    weights_a = a.receive("A's weights")
    assert isinstance(weights_a, Weights) and isinstance(weights_b, Weights)

    def part(bucket: int) -> Push:
        size = bounds[bucket + 1] - bounds[bucket]
        return bucket_push(welcome_a.worker_id, a.token, weights_a.version, weights_a.epoch,
                           weights_a.batch, 32, bucket, torch.ones(size))  # fmt: skip

    a.send_frames(encode(part(0)))  # A is mid-push
    zeros = torch.zeros(weights_b.params.numel())
    ack = b.request(
        Push(welcome_b.worker_id, b.token, weights_b.version, weights_b.epoch, weights_b.batch,
             32, 1.0, 1, zeros, torch.empty(0, dtype=torch.int32), weights_b.buffers.clone())
    )  # fmt: skip
    assert isinstance(ack, PushAck) and ack.version == 1
    b.send_frames(encode(Pull(welcome_b.worker_id, b.token)))
    wait_for_log(server, "checkpoint at step 1 waits for the pushes under way", timeout=30)
    assert not b.socket.poll(500), "a pull was answered while the checkpoint waited"
    assert not (directory / LATEST).exists()

    for bucket in range(1, len(bounds) - 1):
        a.send_frames(encode(part(bucket)))
    ack = a.request(
        Push(welcome_a.worker_id, a.token, weights_a.version, weights_a.epoch, weights_a.batch,
             32, 1.0, 1, torch.empty(0), torch.empty(0, dtype=torch.int32),
             weights_a.buffers.clone(), len(bounds) - 1)
    )  # fmt: skip
    assert isinstance(ack, PushAck) and ack.applied and ack.version == 2
    assert isinstance(b.receive("B's weights, once the checkpoint is written"), Weights)
    saved = load_checkpoint(directory)
    # Both gradients are in its weights, and both batches in its data position.
    assert saved["step"] == 2 and sorted(saved["position"]["cursors"]) == [1, 1]
    kill(server)


def test_a_signal_ends_a_worker_still_waiting_to_register(cluster: Cluster) -> None:
    """Nobody answers the REGISTER (no server yet): SIGTERM must end the worker at once, not
    after every retry (about 2 minutes with --timeout 20)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = cluster.start_worker(endpoint, "--timeout", "600", "--log-level", "debug")
    wait_for_signal_handler(worker, signal.SIGTERM, timeout=60)
    wait_for_log(worker, f"asking {endpoint}: Register", timeout=60)
    kill(worker, signal.SIGTERM)
    # At once, so long before its --timeout of 600 s that a loaded machine cannot matter.
    cluster.wait(worker, timeout=60, expect_code=128 + signal.SIGTERM)
    assert "shut down by a signal before joining" in worker.stderr()


def test_a_worker_pointed_where_nothing_listens_says_so_at_once_and_gives_up_in_time(
    cluster: Cluster,
) -> None:
    """A wrong --server: with the defaults (--timeout 60, --retries 5), a worker said nothing
    for a minute and gave up after six. It says a second after it asks that nothing answers
    and that the connection is refused, says again how long it has waited, and gives up at
    its --join-timeout (18 s here), with what to check and the option that waits longer."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # No --threads: it says its share of the cores, just before it registers.
    worker = cluster.start_worker(
        endpoint, "--join-timeout", "18", "--log-level", "debug", device=["--device", "cpu"]
    )
    cluster.wait(worker, timeout=120, expect_code=1)
    stderr = worker.stderr()
    assert "Traceback" not in stderr, stderr
    # What it did, in its own words and by its own clock, not by this test's: a loaded
    # machine delays when each line is written, not what it says. One REGISTER and one wait
    # for it (--timeout 60 is longer than the --join-timeout), not six tries of 60 s.
    assert "CPU thread" in stderr, stderr
    assert stderr.count(f"asking {endpoint}: Register") == 1, stderr
    assert "retrying in" not in stderr, stderr
    said = re.findall(
        rf"nothing answers at {re.escape(endpoint)} yet \(the connection is refused: .*\): "
        r"waited (\d+) s, giving up in (\d+) s \(--join-timeout 18\)",
        stderr,
    )
    waited, left = [int(w) for w, _ in said], [int(g) for _, g in said]
    # Said a second in, then every 15 s: twice in 18 s. A worker kept from running for more
    # than a second says the second one after its deadline, that is never: once or twice,
    # and the first well before the 60 s of --timeout that it used to be silent for.
    assert len(said) in (1, 2) and 1 <= waited[0] < 15, stderr
    # Each counts down to the same deadline, 18 s after the REGISTER (rounded to seconds).
    assert all(abs(w + g - 18) <= 1 for w, g in zip(waited, left, strict=True)), said
    assert waited == sorted(waited) and (len(said) == 1 or waited[1] >= 15), said
    last = stderr.strip().splitlines()[-1]
    gave_up = re.match(rf"Error: nothing answered at {re.escape(endpoint)} in (\d+) s ", last)
    # At its deadline by its own clock: 18 s, or a little more if it was kept from running.
    assert gave_up is not None and 18 <= int(gave_up[1]) < 60, last
    assert "the connection is refused" in last and "--join-timeout (or PS_JOIN_TIMEOUT)" in last


def test_a_worker_started_before_its_server_joins_it_within_its_join_timeout(
    cluster: Cluster,
) -> None:
    """A worker that comes up before its server (a Kubernetes Job beside a StatefulSet) asks
    again after each silent --timeout until --join-timeout, and trains once the server
    listens."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    worker = cluster.start_worker(
        bind, "--timeout", "2", "--join-timeout", "120", "--log-level", "debug"
    )
    # Its second REGISTER, on a new socket: the first socket, given up, held a REGISTER too.
    wait_for_log(worker, f"asking {bind}: Register", timeout=120, count=2)
    server, _ = cluster.start_server(*LENET, "--workers", "1", "--max-steps", "3", "--bind", bind)
    cluster.wait(worker, timeout=120)
    cluster.wait(server, timeout=60)
    assert "registered as worker 1" in worker.stderr(), worker.stderr()


def test_a_signal_ends_a_worker_in_the_pause_between_two_registers(cluster: Cluster) -> None:
    """Between the attempts of a REGISTER nobody answers, the pause doubles up to 8 s: a
    SIGTERM in it ends the worker at once, not after the pause and one more attempt."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    worker = cluster.start_worker(
        endpoint, "--timeout", "0.3", "--retries", "8", "--log-level", "debug"
    )
    wait_for_log(worker, "retrying in 8.0 s", timeout=90)
    # Its debug log names each attempt as it starts: none may come after the signal.
    attempt = f"asking {endpoint}: Register"
    attempts = worker.stderr().count(attempt)
    kill(worker, signal.SIGTERM)
    cluster.wait(worker, timeout=30, expect_code=128 + signal.SIGTERM)
    assert worker.stderr().count(attempt) == attempts, "it slept out its pause, then asked"
    assert "shut down by a signal before joining" in worker.stderr()


def test_a_signal_ends_a_worker_registering_again(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """The server restarted without this worker, and what now listens there never answers
    the new REGISTER (a stand-in: a socket that tells heartbeats "unknown-worker" and reads
    everything else). SIGTERM must end the worker cleanly (exit 143), as it does at the first
    registration; it used to exit 1 with "stopped waiting for the answer to Register"."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    first, _ = cluster.start_server(
        *LENET, "--workers", "2", "--train-limit", "640", "--bind", bind
    )
    worker = cluster.start_worker(bind, "--timeout", "600", "--retries", "0")
    wait_for_log(first, "worker 1 registered", timeout=60)
    kill(first)
    first.process.wait(timeout=10)
    stand_in = zmq_context.socket(zmq.ROUTER)
    stand_in.setsockopt(zmq.LINGER, 0)
    stand_in.bind(bind)
    registers = 0
    deadline = time.monotonic() + 60
    while registers == 0 and time.monotonic() < deadline:
        if not stand_in.poll(500):
            continue
        identity, *frames = stand_in.recv_multipart()
        message = decode(frames)
        if isinstance(message, Heartbeat):
            refusal = Error(code="unknown-worker", message="worker 1 is not registered here")
            stand_in.send_multipart([identity, *encode(refusal)])
        registers += isinstance(message, Register)
    assert registers == 1, "the worker never registered again"
    kill(worker, signal.SIGTERM)  # the REGISTER came: it waits for the WELCOME
    # At once, so long before its --timeout of 600 s that a loaded machine cannot matter.
    cluster.wait(worker, timeout=60, expect_code=128 + signal.SIGTERM)
    assert "shut down by a signal while registering again" in worker.stderr()
    stand_in.close(linger=0)
