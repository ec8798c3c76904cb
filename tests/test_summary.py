"""The run summary's worker counts (psserver.status.report), built from real worker records
(psserver.coordinator.membership) as the server builds them, without a server."""

import time

import pytest

from common.wire.protocol import Register
from psserver.config import ServerConfig
from psserver.coordinator.membership import Membership, WorkerRecord
from psserver.evaluation import Evaluation
from psserver.status.report import TrainingMeter, build_summary

pytestmark = pytest.mark.timeout(30)


def register(
    membership: Membership, name: str, host: str, pid: int, process: str, device: str = "cpu"
) -> WorkerRecord:
    """A registration as ps-worker sends it: its label, host, device, pid and the identity
    its process drew at start."""
    return membership.register(b"socket", Register(name, host, device, pid, process, {}))


def summary_of(membership: Membership) -> dict[str, object]:
    retired = membership.retired
    return build_summary(
        config=ServerConfig(model="lenet").to_dict(),
        meter=TrainingMeter(),
        final=Evaluation(accuracy=0.5, loss=1.0, samples=10),
        global_steps=7,
        epochs=1,
        workers=[w.report() for w in membership.workers.values()],
        staleness=None,
        retired_workers=retired.report() if retired.workers else None,
    )


def test_a_worker_that_registered_again_is_counted_once_among_those_that_trained() -> None:
    """Worker a trains, is declared dead (paused past --worker-timeout), registers again as
    the same process and trains on: two rows in per_worker, one worker that trained. It used
    to count as two."""
    membership = Membership(max_workers=8, worker_timeout=1)
    first = register(membership, "a", "host1", 10, "a1")
    other = register(membership, "b", "host1", 11, "b1")  # the same host, another process
    idle = register(membership, "c", "host2", 10, "c1")  # registered, never pushed
    first.pushes, other.pushes = 3, 5
    assert membership.reap(time.monotonic() + 2) == [first, other, idle]  # all silent
    again = register(membership, "a", "host1", 10, "a1")
    assert again.worker_id != first.worker_id  # a new record, as the server gives it
    again.pushes = 2
    summary = summary_of(membership)
    rows = summary["per_worker"]
    assert isinstance(rows, list)
    assert [(w["name"], w["hostname"], w["pid"], w["process"], w["pushes"]) for w in rows] == [
        ("a", "host1", 10, "a1", 3), ("b", "host1", 11, "b1", 5), ("c", "host2", 10, "c1", 0),
        ("a", "host1", 10, "a1", 2),
    ]  # fmt: skip
    assert summary["workers_trained"] == 2


def test_workers_alike_in_host_pid_name_and_device_are_told_apart_by_their_process() -> None:
    """Containers on the host's network share its host name, and each runs its worker as pid
    1 on a GPU it sees as cuda:0 under the default name: two such workers are alike in all
    four, and used to count once. Their process identities differ: they count twice, and
    each still counts once after the server forgot it and it registered again."""
    membership = Membership(max_workers=8, worker_timeout=1)
    twins = [register(membership, "node:cuda:0", "node", 1, p, "cuda:0") for p in ("p1", "p2")]
    for twin in twins:
        twin.pushes = 4
    assert summary_of(membership)["workers_trained"] == 2
    assert membership.reap(time.monotonic() + 2) == twins  # both paused past the timeout
    for process in ("p1", "p2"):
        register(membership, "node:cuda:0", "node", 1, process, "cuda:0").pushes = 1
    assert summary_of(membership)["workers_trained"] == 2
    register(membership, "node:cuda:0", "node", 1, "p3", "cuda:0").pushes = 1  # a restart
    assert summary_of(membership)["workers_trained"] == 3
