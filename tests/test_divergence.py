"""A job whose learning rate is far too high: the weights overflow within a few steps. Every
worker must leave with one line that names the cause, and the server, finding its own test
loss not finite, must stop the job (exit 1) rather than wait for ever for workers that would
each stop at once. Weights that overflow are never checkpointed: the job stops first."""

import pytest
import torch
import zmq

from common.wire.protocol import Pull, Push, PushAck, Weights, encode
from psserver.checkpoints.files import read_checkpoint
from tests.harness import Cluster
from tests.raw_peers import RawClient

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


def test_weights_that_overflow_stop_the_job_before_a_checkpoint_of_them(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Finite gradients, a learning rate far too high: the weights overflow to infinity. A
    checkpoint of them could never be loaded, and writing it would rotate the last good one
    to previous.pt, then out. The server stops instead, and names what it keeps."""
    checkpoints = cluster.workdir / "ck"
    server, endpoint = cluster.start_server(
        *("--mode", "async", "--model", "lenet", "--workers", "1", "--lr", "10"),
        *("--max-steps", "5", "--train-limit", "64", "--batch-size", "8", "--test-limit", "10"),
        *("--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1"),
        *("--stop-grace", "1"),  # the raw client never asks again: no grace to wait out
    )
    client = RawClient(zmq_context, endpoint)
    client.register()
    for gradient in (0.0, 1e38):  # the second, times lr 10, is past float32's range
        weights = client.request(Pull(1, client.token))
        assert isinstance(weights, Weights), weights
        push = Push(
            1, client.token, weights.version, weights.epoch, weights.batch, 8, 0.0, 0,
            torch.full_like(weights.params, gradient), torch.empty(0, dtype=torch.int32),
            torch.empty(0),
        )  # fmt: skip
        client.send_frames(encode(push))
        if gradient == 0.0:
            assert isinstance(client.receive("the first push's answer"), PushAck)
    cluster.wait(server, timeout=60, expect_code=1)
    client.close()
    last = server.stderr().strip().splitlines()[-1]
    assert last.startswith("Error: training diverged: after step 2 the weights hold values "
                           "that are not finite (in /'model'/"), last  # fmt: skip
    assert f"{checkpoints} holds latest.pt (step 1); go on from one with --resume-from " in last
    assert "--lr 10," in last, last
    assert read_checkpoint(checkpoints / "latest.pt")["step"] == 1  # the good one stays
    assert not (checkpoints / "previous.pt").exists()
