"""A real ps-worker against a stand-in server that sends what no ps-server of this release
sends: a job of the wrong types, weights of the wrong length or dtype, a batch the job does
not have, a heartbeat interval of NaN, or "unknown-worker" after every registration
(in-process, its pauses recorded). The worker must stop with one clear line and exit 1: not
train on garbage, not crash with a traceback, not spin for ever.

Also a worker whose training diverged (weights that overflow, a gradient refused as not
finite, a gradient not finite under a finite loss): it must leave the job, so that nobody
waits for it, and say what to change."""

import math
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import psworker.connection
from common.data import DataSource
from common.errors import PSError, ServerError, TrainingDiverged
from common.wire.protocol import JOB_FAILED, Error, Stop
from psworker.connection import Connection, registration
from psworker.trainer import Worker
from tests.harness import Cluster
from tests.stand_in import LENET, F, P, StandIn

pytestmark = pytest.mark.timeout(120)

SCENARIOS = {
    "half the weights": ({"weights": {"params": LENET.params.detach()[: P // 2].clone()}},
                         f"sent {P // 2} parameters of torch.float32, not the job's {P}"),
    "int64 weights": ({"weights": {"params": torch.zeros(P, dtype=torch.int64)}},
                      "parameters of torch.int64"),
    "3 buffers too many": ({"weights": {"buffers": torch.zeros(F + 3)}}, f"{F + 3} buffers"),
    "rank 5 of 1": ({"weights": {"rank": 5}}, "batch 0 of rank 5 of 1"),
    "no workers": ({"weights": {"world_size": 0}}, "rank 0 of 0"),
    "a batch past the epoch": ({"weights": {"batch": 10**6}}, "batch 1000000 of rank 0"),
    "a batch size of 16.5": ({"job": {"batch_size": 16.5}}, "batch_size must be an integer"),
    "a string step limit": ({"job": {"max_steps": "5"}}, "max_steps must be an integer or null"),
    "an endpoint that is a number": (
        {"job": {"shard_bounds": [0, 1000, P], "shard_endpoints": [123]}},
        "shard_endpoints must be a list of strings",
    ),
    "an unknown model": ({"job": {"model": "gpt5"}}, "a model this worker does not have"),
    "heartbeats every NaN s": ({"heartbeat": math.nan}, "heartbeat every nan s"),
    "heartbeats every 0 s": ({"heartbeat": 0.0}, "heartbeat every 0.0 s"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("stand_in", "expected"),
    list(SCENARIOS.values()),
    ids=list(SCENARIOS),
    indirect=["stand_in"],
)
def test_a_worker_refuses_what_no_server_of_its_release_sends(
    stand_in: StandIn, expected: str
) -> None:
    """In this process, the Worker that ps-worker runs: it stops with an error of ours, which
    ps-worker prints as its one `Error:` line with exit code 1 (checked from a real process
    below, for weights and for a job)."""
    connection = Connection.open(stand_in.endpoint, timeout_s=30, retries=0)
    worker = Worker(connection, torch.device("cpu"), DataSource("embedded"), "t", "log")
    try:
        with pytest.raises(PSError) as refused:
            worker.run()
    finally:
        connection.close()
    assert expected in str(refused.value), refused.value
    assert stand_in.pushes == 0, "the worker trained on what it should have refused"


@pytest.mark.parametrize(
    ("stand_in", "expected"),
    [SCENARIOS["half the weights"], SCENARIOS["a batch size of 16.5"]],
    ids=["half the weights", "a batch size of 16.5"],
    indirect=["stand_in"],
)
def test_a_real_worker_refuses_what_no_server_of_its_release_sends_in_one_line(
    cluster: Cluster, stand_in: StandIn, expected: str
) -> None:
    worker = cluster.start_worker(stand_in.endpoint, "--retries", "0")
    cluster.wait(worker, timeout=90, expect_code=1)
    stderr = worker.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert expected in stderr.strip().splitlines()[-1], stderr[-1500:]
    assert stand_in.pushes == 0, "the worker trained on what it should have refused"


@pytest.mark.parametrize("stand_in", [{"forget": True}], ids=["forgetful"], indirect=True)
def test_a_worker_forgotten_after_every_registration_gives_up_with_growing_pauses(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In-process, with the pauses recorded rather than slept (they add up to 40 s): the
    worker registers 11 times, pausing longer each time, and then stops with one clear line."""
    pauses: list[float] = []
    monkeypatch.setattr(
        psworker.connection, "pause_before_registering_again",
        lambda forgotten, shutdown: pauses.append(registration.reregistration_pause_s(forgotten)),
    )  # fmt: skip
    connection = Connection.open(stand_in.endpoint, timeout_s=30, retries=0)
    worker = Worker(connection, torch.device("cpu"), DataSource("embedded"), "t", "log")
    try:
        with pytest.raises(ServerError, match="the server forgot this worker 11 times in a row"):
            worker.run()
    finally:
        connection.close()
    assert pauses == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    assert stand_in.registers == 1 + registration.MAX_REREGISTRATIONS
    assert stand_in.pushes == 0


@pytest.mark.parametrize("stand_in", [{"forget": True}], ids=["forgetful"], indirect=True)
def test_a_signal_ends_the_pause_before_registering_again(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pauses between registrations grow to 8 s (here 60 s): a shutdown signal in one
    ends it, and the worker leaves at once instead of sleeping it out."""
    paused: list[float] = []

    def pause_with_a_signal_in_it(forgotten: int) -> float:
        paused.append(time.monotonic())
        threading.Timer(0.5, worker.shutdown.set).start()  # half a second into the pause
        return 60.0

    monkeypatch.setattr(registration, "reregistration_pause_s", pause_with_a_signal_in_it)
    connection = Connection.open(stand_in.endpoint, timeout_s=30, retries=0)
    worker = Worker(connection, torch.device("cpu"), DataSource("embedded"), "t", "log")
    try:
        result = worker.run()
    finally:
        connection.close()
    assert result.by_signal, result.stop_reason
    assert len(paused) == 1, "the worker did not pause before registering again"
    assert time.monotonic() - paused[0] < 30, "the worker slept out the pause"
    assert stand_in.registers == 1  # no REGISTER after the signal


DIVERGING = {
    # Finite weights so large that the outputs overflow: the loss is not finite.
    "weights whose loss overflows": (
        {"weights": {"params": torch.full((P,), 1e30)}}, "the loss is", 0
    ),
    "a gradient refused as not finite": (
        {"refuse_push": True}, "the server refused Push (non-finite): worker 1 pushed NaN", 1
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("stand_in", "expected", "pushes"),
    list(DIVERGING.values()),
    ids=list(DIVERGING),
    indirect=["stand_in"],
)
def test_a_worker_whose_training_diverged_leaves_and_says_what_to_change(
    cluster: Cluster, stand_in: StandIn, expected: str, pushes: int
) -> None:
    worker = cluster.start_worker(stand_in.endpoint, "--retries", "0")
    cluster.wait(worker, timeout=90, expect_code=1)
    stderr = worker.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert "training diverged on epoch 0, batch 0 (weights version 0)" in last, last
    assert expected in last and "a lower --lr" in last, last
    assert stand_in.pushes == pushes, "a loss that is not finite must not be pushed"
    assert len(stand_in.leaves) == 1 and "training diverged" in stand_in.leaves[0], stand_in.leaves


def test_a_gradient_that_is_not_finite_under_a_finite_loss_is_not_pushed(
    stand_in: StandIn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss is finite, but backward gives a NaN (in-process, the model's loss given a term
    that is 0 with a NaN derivative): the worker sends none of the gradient, leaves and says
    why. With several shards the server could only have refused the slices with the NaN."""
    real_forward = Worker._forward

    def forward_with_nan_gradient(
        self: Worker, model: nn.Module, *args: Any
    ) -> tuple[torch.Tensor, float, int]:
        loss, loss_sum, correct = real_forward(self, model, *args)
        first = next(model.parameters())
        return loss + torch.sqrt(first.view(-1)[0] * 0), loss_sum, correct

    monkeypatch.setattr(Worker, "_forward", forward_with_nan_gradient)
    connection = Connection.open(stand_in.endpoint, timeout_s=30, retries=0)
    worker = Worker(connection, torch.device("cpu"), DataSource("embedded"), "t", "log")
    try:
        with pytest.raises(TrainingDiverged) as caught:
            worker.run()
    finally:
        connection.close()
    message = str(caught.value)
    assert message.startswith("training diverged on epoch 0, batch 0 (weights version 0): the "
                              "loss is finite ("), message  # fmt: skip
    assert "but its gradient holds NaN or Inf values" in message and "a lower --lr" in message
    assert stand_in.pushes == 0
    assert len(stand_in.leaves) == 1 and "its gradient holds NaN" in stand_in.leaves[0]


FORGED = "bad\n12:00:00 worker INFO all is well\x1b[2J"
SERVER_WORDS = {
    "an error": (Error("odd\x1b[31m", FORGED), 1, "the server refused Pull (odd\\x1b[31m): bad\\n"),
    "a stop": (Stop(FORGED + JOB_FAILED), 1, "the server stopped the job: bad\\n12:00:00"),
}


@pytest.mark.parametrize(
    ("stand_in", "code", "expected"),
    [({"pull_answer": answer}, code, expected) for answer, code, expected in SERVER_WORDS.values()],
    ids=list(SERVER_WORDS),
    indirect=["stand_in"],
)
def test_what_a_server_says_is_escaped_in_the_workers_output(
    cluster: Cluster, stand_in: StandIn, code: int, expected: str
) -> None:
    """Another release's server, or one that is not ps-server, may answer with newlines that
    forge the worker's log lines and escapes that rewrite its terminal: printed escaped."""
    worker = cluster.start_worker(stand_in.endpoint, "--retries", "0")
    cluster.wait(worker, timeout=90, expect_code=code)
    stderr = worker.stderr()
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "\x1b" not in stderr and "\n12:00:00 worker INFO all is well" not in stderr, stderr
    assert expected in stderr.strip().splitlines()[-1], stderr[-1500:]
