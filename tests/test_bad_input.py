"""What a client sends that it should not, to a live server. The server answers bad input
with an ERROR reply and keeps serving: garbage, wrong versions, unknown or impostor workers,
wrong shapes and dtypes, NaNs, oversized messages; a real worker trains to the end beside all
of it. Requests built to cost the server much for little (headers that take long to unpack,
messages of a million frames, errors as long as the request, floods of refusals for the log,
status replies nobody reads) are refused cheaply and in a few words: a hostile-client review
found each of them holding the server's loop for a second, taking hundreds of megabytes, or
writing hundreds of megabytes of log. What a client says (its name, a LEAVE reason) is escaped
in the log and in ps-status.

What this is not: the fuzzer's twenty thousand generated messages (test_fuzz), or a worker
facing a server that sends what it should not (test_worker_trust)."""

import collections
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq

from common.catalog import all_fingerprints
from common.errors import ProtocolError, RequestRejected
from common.job import JobSpec
from common.logs import printable
from common.wire.protocol import (
    MAX_FRAMES,
    MAX_HEADER_CONTAINERS,
    PROTOCOL_VERSION,
    Commit,
    Error,
    Leave,
    MessageType,
    Pull,
    Push,
    PushAck,
    Register,
    Status,
    StatusReply,
    Stop,
    Weights,
    Welcome,
    decode,
    encode,
    unpack_header,
)
from psserver.coordinator.admission import MAX_PROCESS_CHARS
from psserver.serving.socket import MAX_ERROR_CHARS, RefusalLog
from psserver.serving.validation import check_push
from psserver.status.backlog import StatusBacklog
from tests.harness import Cluster, kill, wait_for_log
from tests.raw_peers import RawClient

# ---- bad requests: an ERROR reply, and the server goes on ---------------------------------

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


# ---- costly requests: refused cheaply; what a client says, escaped ----------------------


def header(body: object, kind: MessageType = MessageType.STATUS) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": int(kind), "body": body, "tensors": []})


def test_a_header_of_a_million_empty_lists_is_refused_before_it_is_built() -> None:
    with pytest.raises(ProtocolError, match=f"more than {MAX_HEADER_CONTAINERS} lists and maps"):
        unpack_header(msgpack.packb([[]] * 1_000_000))
    with pytest.raises(ProtocolError, match="more than"):  # nested, each list short
        unpack_header(msgpack.packb([[{}] * 1000] * 1000))
    with pytest.raises(ProtocolError, match="not valid msgpack"):  # one map of many keys
        unpack_header(msgpack.packb({str(i): 0 for i in range(10_000)}))
    assert unpack_header(msgpack.packb([[i] for i in range(1000)])) == [[i] for i in range(1000)]


def test_an_error_about_a_body_of_many_fields_stays_short() -> None:
    body = {f"field-{i:04}": 0 for i in range(4000)}  # within the map limit, 4000 wrong fields
    with pytest.raises(ProtocolError) as refused:
        decode([header(body)])
    assert len(str(refused.value)) < 300, str(refused.value)
    assert str(refused.value).startswith("Status body must have fields [], got ['field-0000'")


def test_long_texts_are_cut_and_say_how_long_they_were() -> None:
    assert printable("short", MAX_ERROR_CHARS) == "short"
    cut = printable("x" * 100_000, MAX_ERROR_CHARS)
    assert len(cut) <= MAX_ERROR_CHARS and cut.endswith("... (100000 characters)")
    # Escaped as a string literal writes them: C0, DEL, C1, line separator, bidi override.
    assert printable("a\nb\x7f\x85\u2028\u202e\tc", 100) == "a\\nb\\x7f\\x85\\u2028\\u202e\\tc"
    assert printable("gpu-host:0 héllo 日本", 100) == "gpu-host:0 héllo 日本"
    cut = printable("\x00" * 5000, 200)  # what the escapes add is cut too
    assert len(cut) == 200 and cut.endswith("... (5000 characters)"), cut


def test_refusals_are_logged_in_bursts_and_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    refusals = RefusalLog(logging.getLogger("ps.test"), clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="ps.test"):
        for i in range(RefusalLog.BURST + 5):
            refusals.refused("wrong-shape", logging.WARNING, "rejected %d", i)
        refusals.refused("bad-message", logging.WARNING, "another code: its own burst")
        now[0] = RefusalLog.WINDOW_S + 1
        refusals.refused("wrong-shape", logging.WARNING, "a new window")
        refusals.refused("wrong-shape", logging.WARNING, "and on")
        refusals.flush()  # as the server closes
    lines = [record.getMessage() for record in caplog.records]
    assert lines[: RefusalLog.BURST] == [f"rejected {i}" for i in range(RefusalLog.BURST)]
    assert lines[RefusalLog.BURST :] == [
        "another code: its own burst",
        "5 more requests refused (wrong-shape) in 11 s, not logged one by one",
        "a new window",
        "and on",
    ]


@pytest.mark.timeout(120)
def test_a_live_server_refuses_costly_requests_cheaply_and_goes_on(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    server, endpoint = cluster.start_server(
        *("--model", "lenet", "--workers", "1", "--train-limit", "64", "--test-limit", "20"),
    )
    hostile = RawClient(zmq_context, endpoint, timeout_s=30)
    status = encode(Status())[0]

    hostile.send_frames([status, *[b""] * 200_000])
    reply = hostile.receive("the refusal of a message of 200,001 frames")
    assert isinstance(reply, Error) and reply.code == "bad-message", reply
    assert reply.message == f"a message has at most {MAX_FRAMES} frames, this one 200001"

    hostile.send_frames([msgpack.packb([[]] * 500_000)])
    reply = hostile.receive("the refusal of a header of half a million lists")
    assert isinstance(reply, Error) and "lists and maps" in reply.message, reply

    # Wrong fields with names as long as the header allows: the reply must still decode.
    hostile.send_frames([header({f"{i:06}" + "k" * 200: 0 for i in range(4000)})])
    reply = hostile.receive("the refusal of a body of 4000 long fields")
    assert isinstance(reply, Error) and len(reply.message) <= MAX_ERROR_CHARS, reply

    for _ in range(60):  # a flood of the same refusal: the log takes a burst of it
        hostile.send_frames([b"\xc1 not msgpack"])
        assert isinstance(hostile.receive("a refusal"), Error)
    assert isinstance(hostile.request(Status()), StatusReply)  # still serving
    log = server.stderr()
    assert log.count("rejected a request (bad-message)") <= RefusalLog.BURST, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    hostile.close()


# A worker name that, printed as is, forges a log line of the server's and turns a terminal red.
FORGED_LINE = "13:44:00 server INFO training done: 999 steps"
EVIL_NAME = f"evil\n{FORGED_LINE}\x1b[31mRED"


@pytest.mark.timeout(120)
def test_what_a_client_says_is_escaped_in_the_log_and_in_ps_status(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """A worker's name, host and device, and its LEAVE reason, reach the log and ps-status
    as one line of visible text: newlines, ESC, NUL, C1 and line separators escaped, and a
    reason of thousands of characters cut."""
    from click.testing import CliRunner

    from psserver.cli.status import command as ps_status

    server, endpoint = cluster.start_server(
        *("--model", "lenet", "--workers", "2", "--train-limit", "64", "--test-limit", "20"),
    )
    hostile = RawClient(zmq_context, endpoint, timeout_s=30)
    register = Register(
        EVIL_NAME, "host\u2028x", "cuda\x00\x9b2J", 1, hostile.process, all_fingerprints()
    )
    welcome = hostile.request(register)
    assert isinstance(welcome, Welcome), welcome
    table = CliRunner().invoke(ps_status, ["--server", endpoint])
    assert table.exit_code == 0, table.output
    row = next(line for line in table.output.splitlines() if line.lstrip().startswith("1  "))
    assert f"evil\\n{FORGED_LINE}\\x1b[31mRED"[:40] in row, table.output
    assert "cuda\\x00\\x9b2J" in row, table.output
    assert not any(c in table.output for c in "\x1b\x00\x9b\u2028"), repr(table.output)

    reason = "bye\n" + "r" * 5054  # 5,058 characters, the first line feed among them
    stop = hostile.request(Leave(welcome.worker_id, welcome.token, reason))
    assert isinstance(stop, Stop), stop
    wait_for_log(server, "left: bye", timeout=30)
    log = server.stderr()
    assert not any(line.startswith(FORGED_LINE) for line in log.splitlines()), log[-3000:]
    assert not any(c in log for c in "\x1b\x00\x9b\u2028"), repr(log[-3000:])
    left = next(line for line in log.splitlines() if "left: bye" in line)
    assert "left: bye\\nrrr" in left and left.endswith("... (5058 characters)"), left
    assert len(left) < 500, left
    hostile.close()


class FakeTracker:
    def __init__(self) -> None:
        self.done = False


def test_status_replies_nobody_reads_are_capped_per_connection_and_in_all() -> None:
    backlog = StatusBacklog(per_peer=2, total=3)
    first = [FakeTracker(), FakeTracker()]
    for tracker in first:
        backlog.admit(b"a")
        backlog.sent(b"a", tracker)
    with pytest.raises(RequestRejected, match="2 status replies to this connection") as busy:
        backlog.admit(b"a")
    assert busy.value.code == "busy"
    backlog.admit(b"b")
    backlog.sent(b"b", FakeTracker())
    with pytest.raises(RequestRejected, match="3 status replies wait for askers"):
        backlog.admit(b"c")  # a new connection, but everyone's share is taken
    first[0].done = True  # one of a's replies has left: room for one more, for anyone
    backlog.admit(b"c")
    assert backlog.unsent() == 2
    done = FakeTracker()
    done.done = True
    backlog.sent(b"c", done)  # already gone: nothing to count
    assert backlog.unsent() == 2


def resident_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def settled_status(client: RawClient) -> dict[str, Any]:
    """The status once the server has answered everything sent before: the count of refused
    requests no longer moves."""
    refused, deadline = -1, time.monotonic() + 60
    while time.monotonic() < deadline:
        reply = client.request(Status())
        assert isinstance(reply, StatusReply), reply  # answered at once, however busy
        if reply.status["rejected_requests"] == refused:
            return reply.status
        refused = reply.status["rejected_requests"]
        time.sleep(0.5)
    raise AssertionError("the server kept refusing requests for 60 s")


@pytest.mark.timeout(180)
def test_a_live_server_holds_few_status_replies_for_a_client_that_never_reads(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    server, endpoint = cluster.start_server(
        *("--model", "lenet", "--workers", "1", "--max-workers", "200"),
        *("--train-limit", "64", "--test-limit", "20"),
    )
    honest = RawClient(zmq_context, endpoint, timeout_s=30)
    # Workers with long names make each status about 25 KB, as on a big job.
    registered = [RawClient(zmq_context, endpoint) for _ in range(150)]
    for number, client in enumerate(registered):
        assert isinstance(client.register(f"{number:03}-" + "n" * 60), Welcome)
    size_kb = len(encode(StatusReply(settled_status(honest)))[0]) / 1024
    assert size_kb > 20, size_kb
    before_mb = resident_mb(server.process.pid)

    hostile = zmq_context.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    # Take in as little as possible, so that the replies back up into the server's queue.
    hostile.setsockopt(zmq.RCVHWM, 1)
    hostile.setsockopt(zmq.RCVBUF, 4096)
    hostile.connect(endpoint)
    asks = 3000
    for _ in range(asks):
        hostile.send_multipart(encode(Status()))
    settled_status(honest)
    grown_mb = resident_mb(server.process.pid) - before_mb
    # ZeroMQ would queue up to 1,000 replies for this connection: some 25 MB.
    assert grown_mb < 10, f"the server grew by {grown_mb:.0f} MB ({size_kb:.0f} KB a status)"

    answers: collections.Counter[str] = collections.Counter()
    while hostile.poll(2000):
        reply = decode(hostile.recv_multipart())
        answers[reply.code if isinstance(reply, Error) else type(reply).__name__] += 1
    assert answers["busy"] > 0, answers
    for client in [hostile, honest, *registered]:
        client.close()


def test_a_follower_evicts_from_the_worker_that_stages_most() -> None:
    """A worker with a real token that pushes slices for steps that never come must not push
    out another worker's slice before its commit: that step would be applied without it."""
    from psserver.serving.staging import SliceStaging
    from psserver.store.optimizer import OptimizerSpec
    from psserver.store.parameters import SliceStore

    no_indices = torch.empty(0, dtype=torch.int64)
    store = SliceStore(torch.zeros(4), torch.zeros(4), OptimizerSpec(lr=1.0))
    staging = SliceStaging(store, [(0, 4)], capacity=3, slice_wait=3600, shard=1)
    honest = (0, 0, 0)
    staging.stage(1, "t1", honest, b"one", -1, (torch.full((4,), 2.0), no_indices))
    for made_up in range(1, 50):
        staging.stage(2, "t2", (made_up, 0, made_up), b"two", -1, (torch.ones(4), no_indices))
    assert len(staging.staged) == 3 and (1, "t1", honest) in staging.staged
    assert [key for worker, _, key in staging.staged if worker == 2] == [(48, 0, 48), (49, 0, 49)]
    staging.add_commit(Commit("leader", 0, [[1, "t1", 0, 0, 0, 8]], 0, 1.0))
    staging.apply_ready()
    assert store.params.tolist() == [-2.0] * 4 and store.version == 1
