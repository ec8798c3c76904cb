"""Going back to an earlier checkpoint: a real ps-server keeps the last K checkpoints as
DIR/step-N.pt (--keep-checkpoints K), and a second one goes on from one of them
(--resume-from FILE) in the same folder. With the same options it must end where the first
run ended, to the bit, and leave the folder holding its own line of checkpoints."""

import os

import pytest
import torch

from psserver.checkpoints.files import LATEST, PREVIOUS, read_checkpoint
from psserver.checkpoints.kept_steps import kept_checkpoints
from tests.harness import Cluster, kill, wait_for_log

pytestmark = pytest.mark.timeout(180)
# One worker, 320 images in batches of 16: 20 steps, a checkpoint every 4.
JOB = (
    *("--model", "lenet", "--workers", "1", "--train-limit", "320", "--batch-size", "16"),
    *("--test-limit", "100", "--lr", "0.05", "--momentum", "0.9", "--checkpoint-every", "4"),
    *("--keep-checkpoints", "2"),
)


def test_a_run_resumed_from_a_kept_checkpoint_ends_where_the_first_one_did(
    cluster: Cluster,
) -> None:
    folder = cluster.workdir / "ck"
    first, endpoint = cluster.start_server(*JOB, "--checkpoint-dir", str(folder), name="first")
    cluster.start_worker(endpoint, name="first-worker")
    cluster.wait(first, timeout=120)
    assert [step for step, _ in kept_checkpoints(folder)] == [16, 20]
    assert (folder / LATEST).samefile(folder / "step-00000020.pt")
    first_end = read_checkpoint(folder / LATEST)
    first_latest = os.stat(folder / LATEST).st_ino

    # Going on without a folder to write to saves nothing: the server says so at once.
    unsaved, _ = cluster.start_server(*JOB[:-4], "--resume-from", str(folder / PREVIOUS),
                                      name="unsaved")  # fmt: skip
    wait_for_log(unsaved, "no --checkpoint-dir: this run goes on from", timeout=60)
    kill(unsaved)
    unsaved.process.wait(timeout=10)

    back = folder / "step-00000016.pt"
    second, endpoint = cluster.start_server(
        *JOB, "--checkpoint-dir", str(folder), "--resume-from", str(back), name="second"
    )
    cluster.start_worker(endpoint, name="second-worker")
    cluster.wait(second, timeout=120)
    assert f"resumed from {back} at step 16" in second.stderr()
    assert f"first checkpoint will replace {folder / LATEST}" in second.stderr()

    second_end = read_checkpoint(folder / LATEST)
    assert second_end["step"] == 20
    for name, value in first_end["model"].items():
        assert torch.equal(second_end["model"][name], value), name
    for index, state in first_end["optimizer"]["state"].items():
        assert torch.equal(second_end["optimizer"]["state"][index]["momentum_buffer"],
                           state["momentum_buffer"])  # fmt: skip
    # The second run's step 20 replaced the first's, as latest.pt and among the kept files;
    # previous.pt is now the file the second run went on from, the one before its latest.
    assert [step for step, _ in kept_checkpoints(folder)] == [16, 20]
    assert (folder / LATEST).samefile(folder / "step-00000020.pt")
    assert os.stat(folder / LATEST).st_ino != first_latest
    assert (folder / PREVIOUS).samefile(back)

    # Going back to the end of a run that is over trains nothing, so writes nothing: the
    # folder's latest.pt and previous.pt stay what they were. The worker that comes hears
    # that the job is over, and the server ends then, long before its --stop-grace.
    before = {name: os.stat(folder / name).st_ino for name in (LATEST, PREVIOUS)}
    over, endpoint = cluster.start_server(
        *JOB, "--checkpoint-dir", str(folder), "--stop-grace", "600",
        "--resume-from", str(folder / "step-00000020.pt"), name="over",
    )  # fmt: skip
    late = cluster.start_worker(endpoint, name="late-worker")
    cluster.wait(late, timeout=120)
    cluster.wait(over, timeout=60)
    assert "already over at step 20: nothing to train" in over.stderr()
    assert "will replace" not in over.stderr()
    assert {name: os.stat(folder / name).st_ino for name in (LATEST, PREVIOUS)} == before
