"""A job whose learning rate is far too high: the weights overflow within a few steps. Every
worker must leave with one line that names the cause, and the server, finding its own test
loss not finite, must stop the job (exit 1) rather than wait for ever for workers that would
each stop at once."""

import pytest

from tests.harness import Cluster

pytestmark = pytest.mark.timeout(180)


def test_a_diverging_job_stops_everywhere_with_the_reason(cluster: Cluster) -> None:
    server, endpoint = cluster.start_server(
        *("--model", "lenet", "--workers", "2", "--batch-size", "32", "--epochs", "3"),
        *("--lr", "1e4", "--momentum", "0.9", "--train-limit", "2000", "--test-limit", "200"),
        # Longer than the test waits: the workers must leave, not be declared dead.
        *("--worker-timeout", "600"),
    )
    workers = [cluster.start_worker(endpoint, name=f"w{i}") for i in range(2)]
    for worker in workers:
        cluster.wait(worker, timeout=120, expect_code=1)
        last = worker.stderr().strip().splitlines()[-1]
        assert last.startswith("Error: training diverged on epoch 0"), last
        assert "a lower --lr" in last, last
    cluster.wait(server, timeout=60, expect_code=1)
    log = server.stderr()
    assert "Traceback" not in log, log[-3000:]
    assert log.count("left: training diverged on epoch 0") == 2, log[-3000:]
    assert "declared dead" not in log, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("Error: training diverged: the test loss after step"), last
    assert "--lr 10000, --momentum 0.9, batch 32 per worker" in last, last
