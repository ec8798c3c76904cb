import logging
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch
import zmq
from click.testing import CliRunner

from common.wire.handshake import HandshakeLogger
from common.wire.security import ServerSecurity, secure_server_socket
from psserver.cli.keys import command as ps_keys
from tests.harness import Cluster
from tests.raw_peers import CurveServer
from tests.stand_in import StandIn
from tests.tiers import ChildProcessGuard, is_unit, mark_tiers

CHILD_PROCESSES = ChildProcessGuard()

# One thread for what the tests compute in this process, as for every worker they start
# (tests/harness.py): on 2 cores shared with those processes, two of torch's threads spin
# waiting for each other, and a ResNet-18 backward took 5 times as long.
torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before -m unit / -m integration selects by these marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    mark_tiers(items)


def guarded(item: pytest.Item) -> Generator[None, object, object]:
    """Run one phase of a test (setup, call or teardown); a unit test's fails if it starts a
    child process (tests/tiers.py)."""
    if not is_unit(item):
        return (yield)
    with CHILD_PROCESSES.on():
        try:
            result = yield
        finally:
            refused = CHILD_PROCESSES.take()
    if refused is not None:  # from a thread of the test's, whose own error may be lost
        pytest.fail(refused, pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, object, object]:
    return (yield from guarded(item))


@pytest.fixture(scope="session", autouse=True)
def private_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$TMPDIR, for the tests and every process they start, inside pytest's own temporary
    folder (which pytest prunes): what they leave there, such as the logs ps-bench keeps of
    a run that failed, used to pile up in /tmp, a few hundred folders in a day."""
    folder = tmp_path_factory.mktemp("tmpdir")
    patch = pytest.MonkeyPatch()
    patch.setenv("TMPDIR", str(folder))
    patch.setattr(tempfile, "tempdir", None)  # tempfile caches the folder it chose first
    try:
        yield folder
    finally:
        patch.undo()


@pytest.fixture(scope="session")
def starts_processes() -> None:
    """Nothing: a fixture that starts processes asks for this one, which marks every test that
    uses it, directly or through other fixtures, integration (tests/tiers.py)."""


@pytest.fixture
def cluster(tmp_path: Path, starts_processes: None) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.kill_all()


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    try:
        yield context
    finally:
        context.destroy(linger=0)


@pytest.fixture(scope="module")
def curve_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ps-keys DIR --clients 2`: the server's pair, client-1 and client-2, both authorized."""
    directory = tmp_path_factory.mktemp("keys")
    result = CliRunner().invoke(ps_keys, [str(directory), "--clients", "2"])
    assert result.exit_code == 0, result.output
    return directory


@pytest.fixture
def curve_server(curve_keys: Path, zmq_context: zmq.Context) -> Iterator[CurveServer]:
    """A CURVE ROUTER on a random localhost port admitting client-1 and client-2, with the
    log of failed handshakes, as ps-server's."""
    router = zmq_context.socket(zmq.ROUTER)
    router.linger = 0
    security = ServerSecurity(curve_keys / "server.key_secret", curve_keys / "authorized_clients")
    authenticator = secure_server_socket(zmq_context, router, security)
    handshakes = HandshakeLogger.started(router, True, logging.getLogger("ps.server"))
    try:
        router.bind("tcp://127.0.0.1:*")
        yield CurveServer(router, router.last_endpoint.decode())
    finally:
        handshakes.close()
        router.close(linger=0)
        authenticator.stop()  # before the context is destroyed, or term() waits for it


@pytest.fixture
def stand_in(zmq_context: zmq.Context, request: pytest.FixtureRequest) -> Iterator[StandIn]:
    """A stand-in server (tests/stand_in.py); parametrize indirectly to give its scenario."""
    server = StandIn(zmq_context, getattr(request, "param", {}))
    server.start()
    yield server
    server.stopping.set()
    server.join(timeout=5)
