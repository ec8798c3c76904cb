"""Requests built to cost the server much for little: headers that take long to unpack,
messages of a million frames, errors as long as the request, and floods of refusals for the
log. A hostile-client review found each of them holding the server's loop for a second, taking
hundreds of megabytes, or writing hundreds of megabytes of log. Each must now be refused
cheaply and in a few words, and the server must go on serving."""

import logging

import msgpack
import pytest
import zmq

from common.errors import ProtocolError
from common.protocol import (
    MAX_FRAMES,
    MAX_HEADER_CONTAINERS,
    PROTOCOL_VERSION,
    Error,
    MessageType,
    Status,
    StatusReply,
    decode,
    encode,
    unpack_header,
)
from psserver.serving import MAX_ERROR_CHARS, RefusalLog, shorten
from tests.harness import Cluster, RawClient


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
    assert shorten("short") == "short"
    cut = shorten("x" * 100_000)
    assert len(cut) <= MAX_ERROR_CHARS and cut.endswith("... (100000 characters)")


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
