"""The run summary's worker counts (psserver.report), built from real worker records
(psserver.membership) as the server builds them, without a server."""

import time

import pytest

from common.protocol import Register
from psserver.config import ServerConfig
from psserver.evaluation import Evaluation
from psserver.membership import Membership, WorkerRecord
from psserver.report import TrainingMeter, build_summary

pytestmark = pytest.mark.timeout(30)


def register(
    membership: Membership, name: str, host: str, pid: int, device: str = "cpu"
) -> WorkerRecord:
    """A registration as ps-worker sends it: its label, host, device and pid."""
    return membership.register(b"socket", Register(name, host, device, pid, {}))


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
    first = register(membership, "a", "host1", 10)
    other = register(membership, "b", "host1", 11)  # the same host, another process
    idle = register(membership, "c", "host2", 10)  # registered, never pushed
    first.pushes, other.pushes = 3, 5
    assert membership.reap(time.monotonic() + 2) == [first, other, idle]  # all silent
    again = register(membership, "a", "host1", 10)
    assert again.worker_id != first.worker_id  # a new record, as the server gives it
    again.pushes = 2
    summary = summary_of(membership)
    rows = summary["per_worker"]
    assert isinstance(rows, list)
    assert [(w["name"], w["hostname"], w["pid"], w["pushes"]) for w in rows] == [
        ("a", "host1", 10, 3), ("b", "host1", 11, 5), ("c", "host2", 10, 0),
        ("a", "host1", 10, 2),
    ]  # fmt: skip
    assert summary["workers_trained"] == 2


def test_workers_that_share_a_host_name_and_pid_are_told_apart_by_name_and_device() -> None:
    """Containers on the host's network share its host name, and each runs its worker as pid
    1: two GPU workers there are two workers where their devices or names differ (all GPUs
    visible, or distinct --names; README says so, and that alike ones count once)."""
    membership = Membership(max_workers=8, worker_timeout=1)
    for gpu in range(2):
        register(membership, f"node:cuda:{gpu}", "node", 1, f"cuda:{gpu}").pushes = 4
    assert summary_of(membership)["workers_trained"] == 2
