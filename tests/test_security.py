"""CURVE: trusted workers get through, untrusted and plain ones get nothing and are logged;
ps-keys writes private, loadable keys; bad key files and half-given options are clear errors."""

import contextlib
import logging
import stat
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner
from zmq.auth import create_certificates

from common.errors import ConfigError
from common.security_options import client_security_from_options, server_security_from_options
from common.wire.protocol import Error, Heartbeat, HeartbeatAck, Leave, Pull, Weights, Welcome
from common.wire.security import (
    ClientSecurity,
    ServerSecurity,
    is_loopback_endpoint,
    secure_client_socket,
    warn_if_public_without_curve,
)
from psserver.cli.keys import command as ps_keys
from tests.harness import Cluster, free_port, kill, wait_for_log
from tests.raw_peers import CurveServer, RawClient

REPLY_WAIT_MS = 5000  # a trusted round trip takes milliseconds; this only bounds a failure
NOTHING_WAIT_MS = 1500  # how long a rejected client listens for a reply that must not come


def assert_receives_nothing(server: CurveServer, who: str) -> None:
    assert not server.router.poll(NOTHING_WAIT_MS), f"the CURVE server received from {who}"


def dealer(context: zmq.Context, security: ClientSecurity | None, endpoint: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.linger = 0
    if security is not None:
        secure_client_socket(socket, security)
    socket.connect(endpoint)
    return socket


def try_to_send(socket: zmq.Socket, payload: bytes) -> None:
    """Send, unless the socket cannot even queue it: a DEALER whose only peer refused its
    handshake before the send has no pipe to queue on, and a plain send would block for ever
    (it did, once, on a loaded machine). Either way nothing may reach the server."""
    socket.sndtimeo = NOTHING_WAIT_MS
    with contextlib.suppress(zmq.Again):
        socket.send(payload)


def test_trusted_client_round_trips(
    curve_keys: Path, curve_server: CurveServer, zmq_context: zmq.Context
) -> None:
    security = ClientSecurity(curve_keys / "client-2.key_secret", curve_keys / "server.key")
    socket = dealer(zmq_context, security, curve_server.endpoint)
    socket.send_multipart([b"header", b"\x00" * 1000])
    assert curve_server.router.poll(REPLY_WAIT_MS), "the CURVE server got no request from client-2"
    identity, *frames = curve_server.router.recv_multipart()
    assert frames == [b"header", b"\x00" * 1000]
    curve_server.router.send_multipart([identity, b"reply"])
    assert socket.poll(REPLY_WAIT_MS), "client-2 got no reply from the CURVE server"
    assert socket.recv_multipart() == [b"reply"]


def test_unknown_key_is_rejected_and_logged(
    tmp_path: Path,
    curve_keys: Path,
    curve_server: CurveServer,
    zmq_context: zmq.Context,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="ps.server")
    _, stranger_secret = create_certificates(tmp_path, "stranger")  # valid, but not authorized
    security = ClientSecurity(Path(stranger_secret), curve_keys / "server.key")
    socket = dealer(zmq_context, security, curve_server.endpoint)
    try_to_send(socket, b"let me in")
    assert_receives_nothing(curve_server, "a client whose key is not authorized")
    rejections = [r.getMessage() for r in caplog.records if r.name == "ps.server"]
    assert any(
        "rejected a connection from 127.0.0.1" in m and "not authorized" in m for m in rejections
    ), rejections


def test_plain_client_gets_nothing_in(curve_server: CurveServer, zmq_context: zmq.Context) -> None:
    socket = dealer(zmq_context, None, curve_server.endpoint)
    try_to_send(socket, b"no curve")
    assert_receives_nothing(curve_server, "a client without CURVE")


def test_wrong_server_key_gets_nothing_in(
    tmp_path: Path, curve_keys: Path, curve_server: CurveServer, zmq_context: zmq.Context
) -> None:
    impostor_public, _ = create_certificates(tmp_path, "impostor")
    security = ClientSecurity(curve_keys / "client-1.key_secret", Path(impostor_public))
    socket = dealer(zmq_context, security, curve_server.endpoint)
    try_to_send(socket, b"hello?")
    assert_receives_nothing(curve_server, "a client that expects another server key")


def test_ps_keys_writes_private_loadable_keys(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "keys"
    runner = CliRunner()
    result = runner.invoke(ps_keys, [str(directory), "--clients", "3"])
    assert result.exit_code == 0, result.output
    secrets = ["server.key_secret", *(f"client-{i}.key_secret" for i in (1, 2, 3))]
    for name in secrets:
        mode = stat.S_IMODE((directory / name).stat().st_mode)
        assert mode == 0o600, f"{name} has mode {oct(mode)}"
    authorized = sorted(p.name for p in (directory / "authorized_clients").iterdir())
    assert authorized == ["client-1.key", "client-2.key", "client-3.key"]
    assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".")) == []
    security = ServerSecurity(directory / "server.key_secret", directory / "authorized_clients")
    assert len(security.authorized_client_keys()) == 3
    ClientSecurity(directory / "client-3.key_secret", directory / "server.key")
    assert "--curve-authorized-clients" in result.output
    assert f"--curve-secret-key {directory}/client-3.key_secret" in result.output

    before = (directory / "server.key_secret").read_bytes()
    again = runner.invoke(ps_keys, [str(directory)])
    assert again.exit_code == 1, again.output
    assert "--force" in again.output and "server.key_secret" in again.output
    assert (directory / "server.key_secret").read_bytes() == before

    # A key put in authorized_clients by hand (ps-status's, from another folder) stays.
    (directory / "authorized_clients" / "status.key").write_bytes(
        (directory / "authorized_clients" / "client-3.key").read_bytes()
    )
    forced = runner.invoke(ps_keys, [str(directory), "--force"])
    assert forced.exit_code == 0, forced.output
    assert (directory / "server.key_secret").read_bytes() != before
    # Replacing every key: the old worker 2 and 3 would otherwise still be admitted, with
    # the new server key, which is public.
    assert "removed the older worker key pair(s) client-2, client-3" in forced.output
    assert sorted(p.name for p in directory.glob("client-*")) == ["client-1.key_secret"]
    authorized = sorted(p.name for p in (directory / "authorized_clients").iterdir())
    assert authorized == ["client-1.key", "status.key"]
    assert "(status.key)" in forced.output  # still authorized: say so


@pytest.mark.timeout(60)
def test_ps_keys_refuses_more_clients_than_one_run_writes_before_it_starts(
    tmp_path: Path,
) -> None:
    """--clients 100000000 printed nothing while it grew to gigabytes of memory."""
    directory = tmp_path / "keys"
    result = CliRunner().invoke(ps_keys, [str(directory), "--clients", "100000000"])
    assert result.exit_code == 2, result.output
    error = result.output.strip().splitlines()[-1]
    assert error.startswith(
        "Error: Invalid value for '--clients': 100000000 is more than 10000, the most one run "
        "writes"
    ), error
    assert "run ps-keys again into another DIR" in error, error
    assert not directory.exists()


def test_ps_keys_shows_progress_on_a_terminal_once_it_takes_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import sys

    import psserver.cli.keys

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(psserver.cli.keys, "PROGRESS_AFTER_S", 0.0)  # at once, for the test
    psserver.cli.keys.write_keys(tmp_path / "keys", 3, force=False)
    assert "worker key pairs: 100%" in terminal.getvalue() and "3/3" in terminal.getvalue()
    monkeypatch.setattr(psserver.cli.keys, "PROGRESS_AFTER_S", 60.0)  # a run shorter than that
    terminal.truncate(0)
    psserver.cli.keys.write_keys(tmp_path / "more", 3, force=False)
    assert terminal.getvalue() == ""


def test_key_file_errors(tmp_path: Path, curve_keys: Path) -> None:
    authorized = curve_keys / "authorized_clients"
    with pytest.raises(ConfigError, match=r"--curve-secret-key .*missing.*no such file.*ps-keys"):
        ServerSecurity(tmp_path / "missing", authorized)
    with pytest.raises(ConfigError, match=r"server\.key: holds only a public key"):
        ServerSecurity(curve_keys / "server.key", authorized)
    with pytest.raises(ConfigError, match=r"--curve-authorized-clients .*holds no \*\.key"):
        ServerSecurity(curve_keys / "server.key_secret", tmp_path)
    with pytest.raises(ConfigError, match=r"client-1\.key: holds only a public key"):
        ClientSecurity(authorized / "client-1.key", curve_keys / "server.key")
    with pytest.raises(ConfigError, match=r"--curve-server-key .*holds a secret key"):
        ClientSecurity(curve_keys / "client-1.key_secret", curve_keys / "server.key_secret")
    garbage = tmp_path / "garbage.key_secret"
    garbage.write_text('curve\n    public-key = "short"\n')
    with pytest.raises(ConfigError, match=r"garbage\.key_secret: the public key is not"):
        ClientSecurity(garbage, curve_keys / "server.key")
    empty = tmp_path / "empty.key_secret"
    empty.write_text("# nothing here\n")
    with pytest.raises(ConfigError, match=r"empty\.key_secret: not a ZeroMQ key file"):
        ClientSecurity(empty, curve_keys / "server.key")
    # One character changed to one that makes its 5-character group exceed 2**32: pyzmq's
    # z85 raises struct.error there, which used to end every role with a traceback.
    text = (curve_keys / "server.key").read_text()
    key = text.split('public-key = "')[1][:40]
    damaged = tmp_path / "damaged.key"
    damaged.write_text(text.replace(key, "#" + key[1:]))
    with pytest.raises(ConfigError, match=r"damaged\.key: the public key is not a 40-character"):
        ClientSecurity(curve_keys / "client-1.key_secret", damaged)


def test_a_secret_key_anyone_can_read_is_used_with_a_warning(
    tmp_path: Path, curve_keys: Path, zmq_context: zmq.Context, caplog: pytest.LogCaptureFixture
) -> None:
    copied = tmp_path / "client-1.key_secret"
    copied.write_bytes((curve_keys / "client-1.key_secret").read_bytes())
    copied.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="ps.security"):
        ClientSecurity(copied, curve_keys / "server.key")
    assert not caplog.records
    copied.chmod(0o644)  # a copy without -p, say
    with caplog.at_level(logging.WARNING, logger="ps.security"):
        security = ClientSecurity(copied, curve_keys / "server.key")
    assert "can be read by every user of this machine" in caplog.text
    assert "chmod 600" in caplog.text
    # Once, when the options are read: not again for each socket (a worker reconnects).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ps.security"):
        socket = zmq_context.socket(zmq.DEALER)
        try:
            secure_client_socket(socket, security)
        finally:
            socket.close(linger=0)
    assert not caplog.records


def test_options_both_or_neither(curve_keys: Path) -> None:
    assert server_security_from_options(None, None) is None
    assert client_security_from_options(None, None) is None
    with pytest.raises(ConfigError, match="--curve-authorized-clients go together"):
        server_security_from_options(curve_keys / "server.key_secret", None)
    with pytest.raises(ConfigError, match="--curve-server-key go together"):
        client_security_from_options(None, curve_keys / "server.key")
    client_1, server_key = curve_keys / "client-1.key_secret", curve_keys / "server.key"
    security = client_security_from_options(client_1, server_key)
    assert security == ClientSecurity(curve_keys / "client-1.key_secret", curve_keys / "server.key")


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.0.0.1:*", True),
        ("tcp://127.1.2.3:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://lo:5555", True),
        ("ipc:///tmp/ps.sock", True),
        ("inproc://server", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://10.0.0.7:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://trainer-0.example.com:5555", False),
        ("tcp://eth0:5555", False),
        ("tcp://127.0.0.1:4000;10.0.0.7:5555", False),
        ("not an endpoint", False),
    ],
)
def test_is_loopback_endpoint(endpoint: str, loopback: bool) -> None:
    assert is_loopback_endpoint(endpoint) is loopback


def test_warn_if_public_without_curve(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("ps.server")
    caplog.set_level(logging.WARNING, logger="ps.server")
    warn_if_public_without_curve("tcp://127.0.0.1:5555", secured=False, log=log)
    warn_if_public_without_curve("tcp://0.0.0.0:5555", secured=True, log=log)
    assert caplog.records == []
    warn_if_public_without_curve("tcp://0.0.0.0:5555", secured=False, log=log)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "tcp://0.0.0.0:5555" in record.getMessage() and "--curve-" in record.getMessage()
    assert "\n" not in record.getMessage()


def test_secure_after_bind_is_refused(curve_keys: Path, zmq_context: zmq.Context) -> None:
    socket = zmq_context.socket(zmq.DEALER)
    socket.linger = 0
    socket.connect("tcp://127.0.0.1:9")
    with pytest.raises(ValueError, match="before the socket binds or connects"):
        secure_client_socket(
            socket, ClientSecurity(curve_keys / "client-1.key_secret", curve_keys / "server.key")
        )


def test_a_follower_bound_publicly_without_curve_warns_as_the_leader_does(
    cluster: Cluster,
) -> None:
    """A follower serves slices to whoever asks (a pull carries no token): it used to bind
    to every interface without the warning the leader gives."""
    follower = cluster.start_follower(f"tcp://127.0.0.1:{free_port()}", bind="tcp://0.0.0.0:*")
    wait_for_log(follower, "reachable from other hosts without CURVE", timeout=30)
    kill(follower)


def test_a_token_is_taken_only_with_the_curve_key_it_was_issued_to(
    cluster: Cluster, curve_keys: Path, zmq_context: zmq.Context
) -> None:
    """Client-2, whose key the server accepts, holds client-1's worker token (it leaked): with
    it, it can neither beat for that worker, nor take over its replies with a PULL, nor make
    it LEAVE. A token used to be taken from any connection, and the replies followed it."""
    server, endpoint = cluster.start_server(
        "--model", "lenet", "--workers", "1", "--train-limit", "64", "--batch-size", "8",
        "--test-limit", "20", "--max-steps", "1",
        "--curve-secret-key", str(curve_keys / "server.key_secret"),
        "--curve-authorized-clients", str(curve_keys / "authorized_clients"),
    )  # fmt: skip
    keys = {
        n: ClientSecurity(curve_keys / f"client-{n}.key_secret", curve_keys / "server.key")
        for n in (1, 2)
    }
    owner = RawClient(zmq_context, endpoint, timeout_s=20, security=keys[1])
    thief = RawClient(zmq_context, endpoint, timeout_s=20, security=keys[2])
    welcome = owner.register("owner")
    assert isinstance(welcome, Welcome), welcome
    stolen = (welcome.worker_id, welcome.token)
    for request in (Heartbeat(*stolen), Pull(*stolen), Leave(*stolen, "stolen")):
        reply = thief.request(request)
        assert isinstance(reply, Error) and reply.code == "wrong-key", reply
        assert welcome.token not in reply.message
    # The owner is still in the job, and its replies still come to it.
    assert isinstance(owner.request(Heartbeat(*stolen)), HeartbeatAck)
    weights = owner.request(Pull(*stolen))
    assert isinstance(weights, Weights) and weights.version == 0, weights
    assert not thief.socket.poll(500)
    assert "rejected a request (wrong-key)" in server.stderr()
    kill(server)
