"""A refused handshake is told at once, with what to fix; the server logs who failed it.

Without the handshake watch a worker with the wrong CURVE keys (or none) waited out its
timeout on every retry, minutes by default, and then blamed the network; the server said
nothing for a missing key or a wrong server key, which never reach its ZAP handler.
"""

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner
from zmq.auth import create_certificates

from common.errors import PSError
from common.wire.handshake import LOG_EVERY_S, HandshakeLogger, HandshakeRefused, HandshakeWatch
from common.wire.protocol import Heartbeat, HeartbeatAck, decode, encode
from common.wire.security import ClientSecurity, ServerSecurity
from psserver.cli.keys import command as ps_keys
from psserver.shards.joining import FollowerConfig, join_leader
from psworker.connection.requests import ServerConnection
from tests.raw_peers import CurveServer

pytestmark = pytest.mark.timeout(120)
PATIENT_S = 300.0  # the clients' timeout: a refusal must be told long before it
TOLD_WITHIN_S = 60.0  # generous for a loaded host; a refusal takes about a second


def refusal(
    endpoint: str, security: ClientSecurity | None, meanwhile: Callable[[], None] = lambda: None
) -> str:
    """What a worker's connection says when it registers there; fails if it is not refused
    within TOLD_WITHIN_S. `meanwhile`, between connecting and the request, may wait for the
    refusal to come first (after which libzmq stops reconnecting, and a plain send would
    block)."""
    connection = ServerConnection(endpoint, timeout_s=PATIENT_S, retries=0, security=security)
    meanwhile()
    started = time.monotonic()
    try:
        with pytest.raises(HandshakeRefused) as refused:
            connection.request(Heartbeat(1, "token"))
    finally:
        connection.close()
    assert time.monotonic() - started < TOLD_WITHIN_S
    return str(refused.value)


def test_a_worker_without_keys_is_told_the_server_uses_curve(
    curve_server: CurveServer, zmq_context: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ps.server")
    message = refusal(curve_server.endpoint, None)
    assert message.startswith(f"the server at {curve_server.endpoint} refused every handshake")
    assert "it uses CURVE" in message and "--curve-server-key" in message
    # Whichever end reads the other's greeting first names the mismatch; when it is the
    # client, the server sees only a closed connection, which it does not log (health
    # probes do that). Plain clients keep trying until the server has seen one.
    wait_for_record(
        caplog, "a client without CURVE keys tried to connect",
        lambda: knock(zmq_context, curve_server.endpoint),
    )  # fmt: skip


def test_a_worker_with_another_servers_key_is_told_so(
    tmp_path: Path, curve_keys: Path, curve_server: CurveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ps.server")
    impostor_public, _ = create_certificates(tmp_path, "impostor")
    security = ClientSecurity(curve_keys / "client-1.key_secret", Path(impostor_public))
    message = refusal(curve_server.endpoint, security)
    assert "--curve-server-key is not that server's public key" in message
    wait_for_record(caplog, "its --curve-server-key is not this server's public key")


def test_a_worker_whose_key_is_not_authorized_is_told_which_folder(
    tmp_path: Path, curve_keys: Path, curve_server: CurveServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ps.server")
    _, stranger_secret = create_certificates(tmp_path, "stranger")
    security = ClientSecurity(Path(stranger_secret), curve_keys / "server.key")
    rejected = "rejected a connection from"
    for refused_first in (False, True):  # the request sent before the refusal, and after
        seen = sum(rejected in record.getMessage() for record in caplog.records)

        def server_rejected(seen: int = seen) -> None:  # the server logs it as it refuses
            wait_for_record(caplog, rejected, count=seen + 1)

        message = refusal(
            curve_server.endpoint, security, server_rejected if refused_first else lambda: None
        )
        assert "refused this client's CURVE key" in message
        assert "--curve-authorized-clients" in message


def test_a_worker_with_keys_is_told_a_plain_server_does_not_use_curve(
    curve_keys: Path, zmq_context: zmq.Context
) -> None:
    router = zmq_context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        security = ClientSecurity(curve_keys / "client-1.key_secret", curve_keys / "server.key")
        message = refusal(f"tcp://127.0.0.1:{port}", security)
    finally:
        router.close(linger=0)
    # Named as such, or (when the server closed first) among the causes of closed handshakes.
    assert "does not use CURVE" in message, message


@pytest.mark.parametrize("keys_of", ["none", "another job"])
def test_a_follower_shard_with_other_keys_than_its_leader_is_told_at_once(
    tmp_path: Path, curve_server: CurveServer, keys_of: str
) -> None:
    security = None
    if keys_of == "another job":
        other = tmp_path / "other"
        assert CliRunner().invoke(ps_keys, [str(other)]).exit_code == 0
        security = ServerSecurity(other / "server.key_secret", other / "authorized_clients")
    config = FollowerConfig(1, 2, curve_server.endpoint, leader_timeout=PATIENT_S)
    context = zmq.Context()
    started = time.monotonic()
    try:
        with pytest.raises(PSError) as refused:
            join_leader(context, config, "tcp://127.0.0.1:1", security)
    finally:
        context.term()  # returns only once the watch's monitor is closed
    assert time.monotonic() - started < TOLD_WITHIN_S
    message = str(refused.value)
    assert message.startswith(f"shard 1: the leader at {curve_server.endpoint} ")
    if security is None:
        assert "it uses CURVE" in message, message
    else:
        assert "the shards of one job share the leader's --curve-secret-key" in message


def test_a_connection_cut_mid_handshake_is_not_a_refusal(
    zmq_context: zmq.Context,
) -> None:
    """A connection closed during its handshake (a server killed at that moment) fails the
    handshake once: not a refusal. Here a bare TCP listener closes the first connection, then
    a real ROUTER takes over the port and answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    cut = threading.Event()

    def cut_one_then_serve() -> None:
        conn, _ = listener.accept()
        conn.close()
        listener.close()
        cut.set()

    cutter = threading.Thread(target=cut_one_then_serve, daemon=True)
    cutter.start()
    client = zmq_context.socket(zmq.DEALER)
    client.linger = 0
    watch = HandshakeWatch(client, endpoint, secured=False)
    client.connect(endpoint)
    assert cut.wait(30), "the client never connected"
    router = zmq_context.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(endpoint)
    try:
        client.send_multipart(encode(Heartbeat(1, "token")))
        deadline = time.monotonic() + 30
        while not router.poll(100):
            watch.check()  # one cut handshake must not count as a refusal
            assert time.monotonic() < deadline, "the request never reached the server"
        identity, *request = router.recv_multipart()
        assert isinstance(decode(request), Heartbeat)
        router.send_multipart([identity, *encode(HeartbeatAck(0))])
        assert client.poll(30_000)
        assert isinstance(decode(client.recv_multipart()), HeartbeatAck)
        watch.check()
    finally:
        watch.close()
        client.close(linger=0)
        router.close(linger=0)


def test_the_server_logs_each_reason_at_most_once_a_minute(
    zmq_context: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="ps.test")
    now = [1000.0]
    router = zmq_context.socket(zmq.ROUTER)
    router.linger = 0
    logger = HandshakeLogger(router, True, logging.getLogger("ps.test"), clock=lambda: now[0])
    try:
        logger.record("mechanism")
        for _ in range(4):
            now[0] += 1
            logger.record("mechanism")
        logger.record("server-key")  # another reason is logged on its own
        now[0] += LOG_EVERY_S
        logger.record("mechanism")
    finally:
        logger.close()
        router.close(linger=0)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 3, messages
    assert "without CURVE keys" in messages[0] and "times" not in messages[0]
    assert "is not this server's public key" in messages[1]
    assert messages[2].endswith("(5 times since this was last logged)"), messages[2]


def wait_for_record(
    caplog: pytest.LogCaptureFixture, text: str, meanwhile: Callable[[], None] = lambda: None,
    count: int = 1,
) -> None:  # fmt: skip
    """The handshake log runs on its own thread: wait for its record (`count` of them)."""
    deadline = time.monotonic() + 30
    while sum(text in record.getMessage() for record in caplog.records) < count:
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        meanwhile()
        time.sleep(0.05)


def knock(context: zmq.Context, endpoint: str) -> None:
    """One plain client's try at a handshake."""
    client = context.socket(zmq.DEALER)
    client.linger = 0
    client.connect(endpoint)
    client.send(b"hello", zmq.NOBLOCK)
    time.sleep(0.2)
    client.close(linger=0)
