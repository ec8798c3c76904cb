"""Only a shard of the job may join it: a follower's REGISTER proves the job's shard secret, or
comes over CURVE with the server's own key. A stranger that registers as a shard first is refused
(bad-shard), the real followers join, and the job trains to its end."""

import io
import logging
import os
import sys
from pathlib import Path

import pytest
import zmq

from common.catalog import all_fingerprints
from common.errors import ConfigError, RequestRejected
from common.wire.protocol import Error, Register, decode, encode
from common.wire.security import ClientSecurity, ServerSecurity, secure_client_socket
from psserver.serving.socket import sender_key
from psserver.shards.auth import (
    MIN_SECRET_BYTES,
    ShardGate,
    read_shard_secret,
    shard_proof,
)
from tests.harness import Cluster, Proc, kill, wait_for_log
from tests.raw_peers import RawClient

SECRET = b"0123456789abcdef0123456789abcdef"
SHORT_JOB = [
    "--model", "lenet", "--workers", "1", "--train-limit", "64", "--test-limit", "20",
    "--batch-size", "16", "--max-steps", "2",
]  # fmt: skip


def hello(shard: int = 1, proof: str = "", endpoint: str = "tcp://127.0.0.1:1") -> Register:
    """A follower shard's REGISTER."""
    return Register(
        shard=shard, num_shards=2, endpoint=endpoint, fingerprints=all_fingerprints(), proof=proof
    )


def write_secret(path: Path, secret: bytes = SECRET, mode: int = 0o600) -> Path:
    path.write_bytes(secret + b"\n")
    path.chmod(mode)
    return path


# ---- the proof and the gate -----------------------------------------------------------------


def test_the_proof_covers_the_secret_the_shard_and_the_endpoint() -> None:
    proof = shard_proof(SECRET, 1, 3, "tcp://h:5556")
    assert proof == shard_proof(SECRET, 1, 3, "tcp://h:5556") and len(proof) == 64
    others = {
        shard_proof(SECRET[::-1], 1, 3, "tcp://h:5556"),
        shard_proof(SECRET, 2, 3, "tcp://h:5556"),
        shard_proof(SECRET, 1, 4, "tcp://h:5556"),
        shard_proof(SECRET, 1, 3, "tcp://stranger:5556"),
        shard_proof(SECRET, 13, 3, "tcp://h:5556"),  # "1|3|..." must not read as "13|..."
    }
    assert proof not in others and len(others) == 5


def test_a_gate_with_a_secret_takes_only_its_proof() -> None:
    gate = ShardGate(SECRET)
    gate.check(hello(proof=shard_proof(SECRET, 1, 2, "tcp://127.0.0.1:1")), "")
    for proof, reason in [
        ("", "proves no shard secret"),
        (shard_proof(b"another secret of 32 bytes......", 1, 2, "tcp://127.0.0.1:1"), "not this"),
        (shard_proof(SECRET, 1, 2, "tcp://stranger:1"), "not this leader's"),  # endpoint swapped
        ("é" * 64, "not this leader's"),  # compare_digest raised TypeError on non-ASCII text
    ]:
        with pytest.raises(RequestRejected, match=reason) as info:
            gate.check(hello(proof=proof), "")
        assert info.value.code == "bad-shard"
        assert "same --shard-secret-file as the leader" in str(info.value)
    assert SECRET.decode() not in repr(gate)  # a gate may be logged; its secret is not


def test_a_curve_gate_takes_only_the_servers_own_key() -> None:
    gate = ShardGate(None, server_key="S" * 40)
    gate.check(hello(), "S" * 40)
    for key in ("W" * 40, ""):
        with pytest.raises(RequestRejected, match="a worker's key connects but cannot join"):
            gate.check(hello(), key)
    both = ShardGate(SECRET, server_key="S" * 40)  # a secret given too is checked too
    with pytest.raises(RequestRejected, match="proves no shard secret"):
        both.check(hello(), "S" * 40)


def test_a_leader_without_either_admits_anyone_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="ps.server"):
        ShardGate().warn_if_open("tcp://0.0.0.0:5555")
        ShardGate(SECRET).warn_if_open("tcp://0.0.0.0:5555")
        ShardGate(None, "S" * 40).warn_if_open("tcp://0.0.0.0:5555")
    [record] = caplog.records
    assert "any host that reaches tcp://0.0.0.0:5555 can join this job" in record.message
    assert "--shard-secret-file" in record.message and "CURVE" in record.message
    ShardGate().check(hello(), "")  # as before


def test_a_plain_connection_has_no_sender_key(zmq_context: zmq.Context) -> None:
    """pyzmq raises EINVAL for the User-Id of a connection without ZAP: that is "" here."""
    router = zmq_context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = RawClient(zmq_context, f"tcp://127.0.0.1:{port}", timeout_s=10)
    client.send_frames([b"hello"])
    assert router.poll(10_000), "no message from the plain client in 10 s"
    router.recv()  # its identity
    assert sender_key(router.recv(copy=False)) == ""
    client.close()
    router.close(linger=0)


# ---- the secret file ----------------------------------------------------------------------


def test_a_secret_file_is_read_without_its_line_end(tmp_path: Path) -> None:
    assert read_shard_secret(write_secret(tmp_path / "s")) == SECRET


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "no such file; make one with"),
        (b"", "is empty; a shard secret needs at least 16"),
        (b"  \n", "is empty"),
        (b"short\n", "holds only 5 bytes"),
        (b"x" * 5000, "5000 bytes, but a shard secret is one line"),
    ],
)
def test_a_bad_secret_file_is_a_clear_error(
    tmp_path: Path, content: bytes | None, reason: str
) -> None:
    path = tmp_path / "secret"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=reason) as info:
        read_shard_secret(path)
    assert str(info.value).startswith(f"--shard-secret-file {path}: ")
    assert "openssl rand -hex 32" in str(info.value)
    with pytest.raises(ConfigError, match="a folder, not a file"):
        read_shard_secret(tmp_path)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file of any mode")
def test_an_unreadable_secret_file_is_a_clear_error(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "s", mode=0)
    with pytest.raises(ConfigError, match=r"cannot read it .*check its owner and mode"):
        read_shard_secret(path)


def test_a_secret_file_anyone_can_read_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_secret(tmp_path / "s", mode=0o644)
    with caplog.at_level(logging.WARNING, logger="ps.security"):
        assert read_shard_secret(path) == SECRET
    assert "--shard-secret-file" in caplog.text and "chmod 600" in caplog.text
    assert len(SECRET) >= MIN_SECRET_BYTES


def test_a_secret_on_standard_input(monkeypatch: pytest.MonkeyPatch) -> None:
    def given(data: bytes) -> None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))

    given(b"  " + SECRET + b"\n")
    assert read_shard_secret(Path("-")) == SECRET
    given(b"")
    with pytest.raises(ConfigError, match="standard input is empty; a shard secret needs"):
        read_shard_secret(Path("-"))
    given(b"x" * 5000)
    with pytest.raises(ConfigError, match="more than 4096 bytes, but a shard secret is one line"):
        read_shard_secret(Path("-"))
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(ConfigError, match="no standard input to read it from"):
        read_shard_secret(Path("-"))


# ---- live leaders -----------------------------------------------------------------------


def stranger_says_hello(cluster: Cluster, endpoint: str, message: Register) -> Error:
    """A hand-built follower's REGISTER over a plain DEALER: the leader's answer."""
    context = zmq.Context()
    try:
        client = RawClient(context, endpoint, timeout_s=30)
        reply = client.request(message)
        client.close()
    finally:
        context.destroy(linger=0)
    assert isinstance(reply, Error), f"{reply}\n{cluster.describe_all()}"
    assert reply.code == "bad-shard", reply
    return reply


def start_follower(
    cluster: Cluster, endpoint: str, *args: str, name: str = "follower", stdin: bytes | None = None
) -> Proc:
    return cluster.start_follower(
        endpoint, "--leader-timeout", "60", "--threads", "1", *args, name=name, stdin=stdin
    )


def test_a_stranger_cannot_join_before_the_followers_a_leader_started(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leader starts its follower with a secret of its own making; a stranger that says
    REGISTER as shard 1 first, without it, is refused, and the follower joins after it."""
    temporary = tmp_path / "tmp"  # where the leader writes the follower's copy of the secret
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    leader, endpoint = cluster.start_server(*SHORT_JOB, "--num-shards", "2")
    refusal = stranger_says_hello(cluster, endpoint, hello(endpoint="tcp://127.0.0.1:9"))
    assert "proves no shard secret" in refusal.message
    assert "all 2 shards have joined" not in leader.stderr()  # the stranger was first
    worker = cluster.start_worker(endpoint)
    cluster.wait(leader, timeout=120)
    cluster.wait(worker, timeout=30)
    stderr = leader.stderr()
    assert "all 2 shards have joined" in stderr and "rejected a request (bad-shard)" in stderr
    assert "any host that reaches" not in stderr  # it has a secret: nothing to warn about
    assert list(temporary.iterdir()) == []  # the secret went down a pipe, not into a file


def test_a_killed_leader_leaves_no_secret_behind(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The followers a leader starts get its secret on their standard input: a SIGKILLed
    leader used to leave a copy of it in a 0700 folder under $TMPDIR, one per job."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    leader, _ = cluster.start_server(*SHORT_JOB, "--num-shards", "2")
    wait_for_log(leader, "all 2 shards have joined", timeout=60)
    kill(leader)
    cluster.wait(leader, timeout=30, expect_code=-9)
    assert list(temporary.iterdir()) == []


def test_a_stranger_and_a_follower_with_another_secret_are_refused_the_right_one_joins(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Followers started by hand: the leader takes the one with its --shard-secret-file."""
    secret = write_secret(tmp_path / "shard.secret")
    wrong = write_secret(tmp_path / "wrong.secret", b"another secret, also long enough")
    leader, endpoint = cluster.start_server(
        *SHORT_JOB, "--shard", "0", "--num-shards", "2", "--shard-secret-file", str(secret)
    )
    forged = shard_proof(b"a guess at the secret, 32 bytes.", 1, 2, "tcp://127.0.0.1:9")
    refusal = stranger_says_hello(cluster, endpoint, hello(proof=forged))
    assert "not this leader's" in refusal.message
    # Followers started by hand with the wrong file, or none: each says why it was refused
    # and what to do, in one line, and exits 1.
    wrong_one = start_follower(cluster, endpoint, "--shard-secret-file", str(wrong), name="wrong")
    forgot = start_follower(cluster, endpoint, name="forgot")
    for impostor, told in [
        (wrong_one, "proves a shard secret that is not this leader's"),
        (forgot, "proves no shard secret, and this leader has one"),
    ]:
        cluster.wait(impostor, timeout=60, expect_code=1)
        errors = [line for line in impostor.stderr().splitlines() if line.startswith("Error:")]
        assert errors == [
            f"Error: shard 1: the leader refused it: a REGISTER as shard 1 {told}: start the "
            "follower with the same --shard-secret-file as the leader, or let the leader start "
            "its followers (ps-server --num-shards K without --shard)"
        ], impostor.stderr()
        assert "Traceback" not in impostor.stderr()
    # The right one, on standard input (`-`) rather than in the file: the same secret.
    start_follower(cluster, endpoint, "--shard-secret-file", "-", stdin=secret.read_bytes())
    worker = cluster.start_worker(endpoint)
    cluster.wait(leader, timeout=120)
    cluster.wait(worker, timeout=30)
    assert "all 2 shards have joined" in leader.stderr()
    assert leader.stderr().count("rejected a request (bad-shard)") == 3, leader.stderr()
    assert SECRET.decode() not in leader.stderr() + wrong_one.stderr()


def test_a_worker_key_cannot_join_as_a_shard(cluster: Cluster, curve_keys: Path) -> None:
    """With CURVE, a worker's authorized key connects, but its REGISTER as a shard is refused; the
    follower with the server's key pair joins."""
    curve = [
        "--curve-secret-key", str(curve_keys / "server.key_secret"),
        "--curve-authorized-clients", str(curve_keys / "authorized_clients"),
    ]  # fmt: skip
    leader, endpoint = cluster.start_server(*SHORT_JOB, "--shard", "0", "--num-shards", "2", *curve)
    worker_keys = ClientSecurity(curve_keys / "client-1.key_secret", curve_keys / "server.key")
    context = zmq.Context()
    try:
        link = context.socket(zmq.DEALER)
        link.linger = 0
        secure_client_socket(link, worker_keys)
        link.connect(endpoint)
        link.send_multipart(encode(hello(endpoint="tcp://127.0.0.1:9")))
        answered = link.poll(30_000)
        assert answered, f"no answer to a shard's REGISTER in 30 s\n{cluster.describe_all()}"
        reply = decode(link.recv_multipart())
        link.close(linger=0)
    finally:
        context.destroy(linger=0)
    assert isinstance(reply, Error) and reply.code == "bad-shard", reply
    worker_key = (curve_keys / "authorized_clients" / "client-1.key").read_text()
    assert "not the job's server key: a worker's key connects but cannot join" in reply.message
    assert reply.message.split("CURVE key ")[1][:40] in worker_key  # it names the key
    assert "--curve-secret-key (server.key_secret)" in reply.message
    server_key = ServerSecurity(
        curve_keys / "server.key_secret", curve_keys / "authorized_clients"
    ).public_key()
    assert server_key not in reply.message
    start_follower(cluster, endpoint, *curve)
    wait_for_log(leader, "all 2 shards have joined", timeout=60)
    assert "rejected a request (bad-shard)" in leader.stderr()
    assert "any host that reaches" not in leader.stderr()
    kill(leader)


def test_a_server_without_shards_does_not_read_a_secret_from_stdin(cluster: Cluster) -> None:
    """`--shard-secret-file -` (PS_SHARD_SECRET_FILE=- in a shared environment, say) on a
    server with one shard: ignored with a warning, and stdin is not read. It used to wait on
    a terminal, or fail on an empty stdin, for a secret it would not use."""
    server, _ = cluster.start_server(*SHORT_JOB, "--shard-secret-file", "-")
    wait_for_log(server, "--shard-secret-file is for a sharded job", timeout=30)
    assert "Error" not in server.stderr()
    kill(server)
