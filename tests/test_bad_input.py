"""A live server answers bad input with an ERROR reply and keeps serving: garbage, wrong
versions, unknown or impostor workers, wrong shapes and dtypes, NaNs, oversized messages. A
real worker trains to the end beside all of it."""

import json
import os

import msgpack
import pytest
import torch
import zmq

from common.errors import RequestRejected
from common.job import JobSpec
from common.model.builtin import all_fingerprints
from common.wire.protocol import (
    PROTOCOL_VERSION,
    Error,
    Pull,
    Push,
    PushAck,
    Register,
    Status,
    StatusReply,
    Stop,
    Weights,
    Welcome,
    encode,
)
from psserver.coordinator.admission import MAX_PROCESS_CHARS
from psserver.serving.validation import check_push
from tests.harness import Cluster, kill
from tests.raw_peers import RawClient

NO_INDICES = torch.empty(0, dtype=torch.int32)


def expect_error(reply: object, code: str, text: str = "") -> None:
    assert isinstance(reply, Error), f"expected an ERROR {code}, got {reply!r}"
    assert reply.code == code, reply
    assert text.lower() in reply.message.lower(), reply


def garbage_frames() -> list[list[bytes]]:
    valid = encode(Pull(1, "x"))
    wrong_version = msgpack.packb(
        {"v": PROTOCOL_VERSION + 1, "type": 3, "body": {"worker_id": 1}, "tensors": []}
    )
    return [
        [b""],
        [b"\xff\x00garbage"],
        [os.urandom(64)],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"v": PROTOCOL_VERSION, "type": 99, "body": {}, "tensors": []})],
        [wrong_version],
        [bytes(valid[0]), b"an unexpected extra frame"],
        [
            msgpack.packb(
                {
                    "v": PROTOCOL_VERSION,
                    "type": 3,
                    "body": {"worker_id": "one", "token": "x"},
                    "tensors": [],
                }
            )
        ],
    ]


@pytest.mark.timeout(180)
def test_server_survives_bad_input_and_trains_to_the_end(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    summary_path = cluster.workdir / "summary.json"
    server, endpoint = cluster.start_server(
        "--mode",
        "sync",
        "--max-workers",
        "2",
        "--model",
        "lenet",
        "--workers",
        "2",
        "--train-limit",
        "256",
        "--batch-size",
        "32",
        "--test-limit",
        "100",
        "--summary",
        str(summary_path),
    )
    hostile = RawClient(zmq_context, endpoint, timeout_s=20)

    for frames in garbage_frames():
        expect_error(hostile.send_frames(frames) or hostile.receive(repr(frames)), "bad-message")
    wrong_version = garbage_frames()[5]
    hostile.send_frames(wrong_version)
    expect_error(hostile.receive("version error"), "bad-message", "protocol version")

    expect_error(hostile.request(Pull(99, "x")), "unknown-worker")
    expect_error(
        hostile.request(Register("bad", "h", "cpu", 1, "p1", {"lenet": "0000"})), "model-mismatch"
    )
    # A process identity that names no process (empty, or too long to keep) is refused; one
    # of another type never decodes (tests/test_protocol.py).
    for process in ("", "f" * (MAX_PROCESS_CHARS + 1)):
        register = Register("bad", "h", "cpu", 1, process, all_fingerprints())
        expect_error(hostile.request(register), "bad-message", "REGISTER.process")

    # An oversized message is dropped by ZeroMQ (MAXMSGSIZE) and never reaches the handler.
    flooder = RawClient(zmq_context, endpoint, timeout_s=1)
    flooder.send_frames([encode(Pull(1, "x"))[0], b"\0" * (64 << 20)])
    assert not flooder.socket.poll(1000), "an oversized message got a reply"
    flooder.close()

    # One hand-driven client and one real worker make up the job.
    welcome = hostile.register("hostile")
    assert isinstance(welcome, Welcome)
    me = welcome.worker_id
    # A push before any pull (training has not even started) is refused as such; it used to
    # be dropped as "late", from an epoch "ended without that step (abandoned)".
    job = welcome.job
    early = Push(me, hostile.token, 0, 0, 0, 32, 0.0, 0, torch.zeros(job["num_params"]),
                 NO_INDICES, torch.zeros(job["num_buffers"]))  # fmt: skip
    expect_error(hostile.request(early), "unexpected-batch", "pull before pushing")
    worker = cluster.start_worker(endpoint)
    weights = hostile.request(Pull(me, hostile.token))  # held until the worker has registered
    intruder = RawClient(zmq_context, endpoint, timeout_s=20)
    expect_error(intruder.request(Pull(me, "guessed-token")), "unknown-worker", "not registered")
    expect_error(intruder.register("third"), "job-full")

    steps = 0
    while True:
        if steps:
            weights = hostile.request(Pull(me, hostile.token))
        if isinstance(weights, Stop):
            break
        assert isinstance(weights, Weights), weights
        n = weights.params.numel()

        def push(
            grads: torch.Tensor, batch: int | None = None, samples: int = 32, w: Weights = weights
        ) -> object:
            batch = w.batch if batch is None else batch
            return hostile.request(
                Push(
                    me,
                    hostile.token,
                    w.version,
                    w.epoch,
                    batch,
                    samples,
                    0.0,
                    0,
                    grads,
                    NO_INDICES,
                    w.buffers,
                )
            )

        expect_error(push(torch.zeros(n - 1)), "wrong-shape")
        expect_error(push(torch.zeros(n, dtype=torch.int64)), "wrong-dtype")
        # float16 only where the job sends it (--compress fp16): this one is --compress none.
        expect_error(push(torch.zeros(n, dtype=torch.float16)), "wrong-dtype", "got float16")
        expect_error(push(torch.zeros(n), batch=weights.batch + 1), "unexpected-batch")
        future = Push(me, hostile.token, weights.version, 2**62, weights.batch, 32, 0.0, 0,
                      torch.zeros(n), NO_INDICES, weights.buffers)  # fmt: skip
        expect_error(hostile.request(future), "unexpected-batch")
        expect_error(push(torch.zeros(n), samples=0), "bad-samples")
        expect_error(push(torch.full((n,), float("nan"))), "non-finite")
        ack = push(torch.zeros(n))
        assert isinstance(ack, PushAck), ack
        steps += 1
        if steps < 4:  # after the last step every request is answered with STOP
            assert push(torch.zeros(n)) == ack  # a retried push is answered, not re-applied
            # A retry is checked before it is answered: a NaN or malformed one is refused,
            # not acknowledged as the push it claims to repeat.
            expect_error(push(torch.full((n,), float("nan"))), "non-finite")
            expect_error(push(torch.zeros(n - 1)), "wrong-shape")

    assert steps == 4
    cluster.wait(worker, timeout=60)
    cluster.wait(server, timeout=60)
    summary = json.loads(summary_path.read_text())
    assert summary["global_steps"] == 4
    assert "rejected a request (bad-message)" in server.stderr()
    assert "Traceback" not in server.stderr()
    # Refused pushes carried the hostile worker's token: the log shows their headers, not it.
    assert "rejected a request (wrong-shape)" in server.stderr()
    assert hostile.token not in server.stderr() and hostile.token[:12] not in server.stderr()


def test_nan_batchnorm_statistics_are_refused_like_nan_gradients() -> None:
    """The gradient was checked, the BatchNorm statistics pushed with it were not: one NaN
    would have spread into the server's running averages and every later evaluation."""
    job = JobSpec("sync", "resnet18", "embedded", 1, 8, 0, None, 64, 8, 1, None, 10, 3, "none")

    def push(buffers: torch.Tensor) -> Push:
        return Push(1, "t", 0, 0, 0, 8, 0.0, 0, torch.zeros(10), NO_INDICES, buffers)

    check_push(job, 0, push(torch.tensor([0.0, 1.0, 8.0])))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(RequestRejected, match="NaN or Inf BatchNorm statistics"):
            check_push(job, 0, push(torch.tensor([0.0, bad, 8.0])))


def test_a_worker_label_of_a_megabyte_is_kept_short() -> None:
    """Every worker's record stays for the job's summary: a client must not make one cost a
    megabyte (a register-and-leave loop grew the server by 80 MB a hundred times)."""
    from common.wire.protocol import Register
    from psserver.coordinator.membership import MAX_LABEL, Membership

    membership = Membership(max_workers=4, worker_timeout=10)
    record = membership.register(
        b"id", Register("n" * 900_000, "h" * 900_000, "d" * 900_000, 1, "p1", {})
    )
    assert len(record.name) == len(record.device) == len(record.hostname) == MAX_LABEL
    assert record.name.endswith("... (900000 characters)")
    assert membership.register(b"id2", Register("gpu-host:0", "h", "cuda:0", 2, "p2", {})).name == (
        "gpu-host:0"
    )


def test_workers_that_register_and_leave_in_a_loop_do_not_pile_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client registering and leaving for ever: the records kept stay bounded (memory, and
    every lookup over the workers), the totals stay whole, and a retired worker's token is
    refused like any unknown one."""
    from psserver.coordinator import membership as module
    from psserver.coordinator.membership import Membership, WorkerState

    # A bound of 64 records, not 4096: the same retirements, 3 rounds of the bound, in 1/64
    # of the registrations (each of which walks every record kept).
    monkeypatch.setattr(module, "MAX_FINISHED_RECORDS", 64)
    bound = module.MAX_FINISHED_RECORDS
    membership = Membership(max_workers=2, worker_timeout=10)
    stayer = membership.register(b"s", Register("stayer", "h", "cpu", 1, "p1", {}))
    first = membership.register(b"c", Register("churn", "h", "cpu", 2, "p2", {}))
    first.pushes, first.samples, first.late = 3, 96, 1
    membership.leave(first, "bye")
    rounds = 3 * bound
    for i in range(rounds):
        record = membership.register(b"c", Register("churn", "h", "cpu", 2, "p2", {}))
        record.move_to(WorkerState.DEAD if i % 2 else WorkerState.LEFT)
        assert len(membership.workers) <= 2 + bound
    retired = membership.retired
    kept = [w for w in membership.workers.values() if w.state is not WorkerState.TRAINING]
    assert retired.workers + len(kept) == rounds + 2  # the stayer, the first churner, the loop
    assert retired.pushes == 3 and retired.samples == 96 and retired.late == 1
    assert sum(retired.states.values()) == retired.workers
    assert membership.workers[stayer.worker_id] is stayer  # active workers are never retired
    with pytest.raises(RequestRejected, match="not registered"):
        membership.authenticate(first.worker_id, first.token, b"c")


@pytest.mark.timeout(120)
def test_a_refused_push_counts_nowhere_and_is_refused_again(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """Async: pushes claiming weights the server never gave out, or a NaN loss, or more
    correct answers than samples, are refused. They used to be counted (images/s, samples,
    the per-worker books) before the policy refused them, and the same push sent again then
    got no answer at all (it looked like a retry of an answered one)."""
    server, endpoint = cluster.start_server(
        "--mode", "async", "--model", "lenet", "--workers", "1", "--train-limit", "64",
        "--batch-size", "16", "--test-limit", "20", "--epochs", "5",
    )  # fmt: skip
    client = RawClient(zmq_context, endpoint, timeout_s=10)
    welcome = client.register()
    assert isinstance(welcome, Welcome)
    me = welcome.worker_id
    weights = client.request(Pull(me, client.token))
    assert isinstance(weights, Weights)

    def push(version: int, loss_sum: float = 1.0, correct: int = 3) -> object:
        return client.request(
            Push(me, client.token, version, weights.epoch, weights.batch, 16, loss_sum,
                 correct, torch.zeros(weights.params.numel()), NO_INDICES, weights.buffers)
        )  # fmt: skip

    for _ in range(2):  # the second time too: an answer, not silence
        expect_error(push(weights.version + 1), "bad-version")
        expect_error(push(-(10**12)), "bad-version")
    expect_error(push(weights.version, loss_sum=float("nan")), "bad-samples", "finite")
    expect_error(push(weights.version, correct=17), "bad-samples", "within 0..16")
    status = client.request(Status())
    assert isinstance(status, StatusReply)
    assert status.status["throughput"]["samples"] == 0, status.status
    ack = push(weights.version)
    assert isinstance(ack, PushAck) and ack.applied
    status = client.request(Status())
    assert isinstance(status, StatusReply) and status.status["throughput"]["samples"] == 16
    # Each refusal is logged with the request's fields, readable, and its token masked.
    log = server.stderr()
    header = f"header {{'v': {PROTOCOL_VERSION}, 'type': 'PUSH', 'body': {{'worker_id': {me}, "
    assert "rejected a request (bad-samples): loss_sum must be finite" in log, log[-2000:]
    assert header + "'token': '<redacted>'" in log and "'loss_sum': nan" in log, log[-2000:]
    assert client.token not in log
    kill(server)
