"""The children a command starts (ps-local its server and workers, a leader its followers):
no signal lost or turned into a traceback between fork and exec, nor during a child's start-up;
a child stopped by the same signal as its parent not reported as a failure; no PS_ variable
of ps-local's passed on to its children; a failure said once, with the signal named.

The fork-to-exec window is a few milliseconds; each test holds it open with an at-fork hook
that waits until the signal has been sent, so that it lands in it every time.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

import pytest

from common.errors import PSError
from common.processes import how_it_ended
from common.startup import command_line
from psserver.cli.children import Child, supervise
from psserver.shards import launch
from tests.harness import REPO, once_reaped, wait_for_signal_handler, writes_its_pid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
# A handler that raises, as common.cli's Terminated does, without importing torch.
PRELUDE = """
import os, signal, subprocess, sys, threading, time
from common.processes import start_child
def stop(signum, frame):
    raise SystemExit(128 + signum)
signal.signal(signal.SIGTERM, stop)
"""


def script(body: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + body], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=ENV, cwd=REPO, start_new_session=True,
    )  # fmt: skip


def held_until(sent: Path) -> str:
    """The body of an at-fork hook that holds the fork until the test has sent its signal
    (it creates `sent`): the signal surely lands in the window, however loaded the machine."""
    return (
        "    deadline = time.monotonic() + 30\n"
        f"    while not os.path.exists({str(sent)!r}) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
    )


def test_a_signal_between_fork_and_exec_ends_the_child_and_is_not_lost(tmp_path: Path) -> None:
    """The child ran the parent's handler in an at-fork hook: `Exception ignored in:
    <function _releaseLock>` with a traceback, and the child ran on without the signal."""
    sent = tmp_path / "sent"
    parent = script(
        "def slow():\n"
        "    print(os.getpid(), flush=True)\n"
        + held_until(sent)
        + "os.register_at_fork(after_in_child=slow)\n"
        "child = start_child([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print('child', child.wait(timeout=20), flush=True)\n"
    )
    assert parent.stdout is not None
    os.kill(int(parent.stdout.readline()), signal.SIGTERM)
    sent.touch()
    out, err = parent.communicate(timeout=60)
    assert parent.returncode == 0, err
    assert out.strip() == f"child {-signal.SIGTERM}", out + err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_a_signal_while_the_parent_forks_is_handled_once_the_child_has_started(
    tmp_path: Path,
) -> None:
    """The parent's own at-fork hook ran its handler and dropped the exception: a leader that
    ps-local stopped went on, and reported its follower, stopped too, as a failure. Another
    thread takes the signal here, as the relay threads of ps-local do."""
    sent = tmp_path / "sent"
    parent = script(
        "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
        "def slow():\n"
        "    print('forked', flush=True)\n"
        + held_until(sent)
        + "os.register_at_fork(after_in_parent=slow)\n"
        "child = start_child([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
        "print('went on', flush=True)\n"
        "child.kill()\n"
    )
    assert parent.stdout is not None
    assert parent.stdout.readline().strip() == "forked"
    parent.send_signal(signal.SIGTERM)
    sent.touch()
    # The child holds the same stdout: this returns once it has died with its parent too.
    out, err = parent.communicate(timeout=60)
    assert parent.returncode == 128 + signal.SIGTERM, out + err
    assert "went on" not in out and "Exception ignored" not in err, out + err


def test_a_ctrl_c_while_a_follower_starts_python_waits_for_run_command() -> None:
    """A Ctrl-C during Python's own start-up, before run_command, ended in "Fatal Python
    error: init_import_site" and a traceback: a follower holds SIGINT until run_command can
    handle it."""
    early = (
        "import os, signal; os.kill(os.getpid(), signal.SIGINT); "  # before run_command
        "from common.startup import run_command; run_command('common.startup', "
        "interrupt_held=True)"
    )
    parent = script(
        f"child = start_child([sys.executable, '-c', {early!r}], hold_interrupt=True)\n"
        "sys.exit(child.wait(timeout=30))\n"
    )
    _, err = parent.communicate(timeout=60)
    assert parent.returncode == 130, err
    assert err.strip() == "interrupted while starting", err
    assert (
        "run_command('psserver.cli.server', interrupt_held=True)"
        in command_line("psserver.cli.server", "ps-server")[-1]
    )


def test_a_ctrl_c_that_an_import_swallowed_is_still_a_ctrl_c(tmp_path: Path) -> None:
    """torch's C code swallowed a KeyboardInterrupt raised in numpy's import, and the next
    `import numpy` failed: "ImportError: cannot load module more than once per process",
    with a traceback, after a Ctrl-C."""
    (tmp_path / "swallows.py").write_text(
        "import os, signal, time\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(5)  # a bound: the SIGINT above ends it at once\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "raise ImportError('cannot load module more than once per process')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", "from common.startup import run_command; run_command('swallows')"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
        env={**ENV, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"},
    )  # fmt: skip
    assert result.returncode == 130, result.stderr
    assert result.stderr.strip() == "interrupted while starting", result.stderr


def test_a_follower_stopped_by_a_signal_is_not_called_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A follower that the leader's own Ctrl-C or SIGTERM stopped was reported as `exited with
    code -15 before joining; see its error above`: there was none. The leader waits a
    moment for its own handler (here, raised from that wait) to stop it; a follower that
    only it lost is named as stopped by a signal, and one killed names the signal."""
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stopped.terminate()
    stopped.wait(timeout=10)

    def leaders_own_handler_runs(seconds: float) -> None:  # in the moment it waits
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(launch.time, "sleep", leaders_own_handler_runs)
        with pytest.raises(KeyboardInterrupt):
            launch.check_launched({1: stopped}, [1])
    with pytest.raises(launch.FollowerExited) as alone:
        launch.check_launched({1: stopped}, [1])
    assert str(alone.value) == (
        "shard 1 (started by this command) was killed by SIGTERM before joining, by a signal "
        "this leader did not get"
    )
    assert how_it_ended(-9) == "was killed by SIGKILL"
    assert how_it_ended(143) == "was stopped by SIGTERM (exit code 143)"
    assert how_it_ended(1) == "exited with code 1"


def test_ps_local_names_the_signal_that_killed_a_child() -> None:
    """`server exited with code -9` said less than which signal it was."""
    child = Child(
        "server",
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        dict(os.environ),
    )
    with pytest.raises(PSError) as failed:
        supervise([child])
    assert str(failed.value).startswith("server was killed by SIGKILL; its last stderr:")


def test_ps_local_gives_its_children_none_of_its_ps_variables(tmp_path: Path) -> None:
    """PS_STEP_DELAY made every worker a straggler, PS_SHARD failed the server with an error
    about --shard, PS_RETRIES=abc failed a worker: ps-local has none of these options, and
    passed the variables on. One of its own (PS_MAX_STEPS) still works."""
    # 10 minutes a step: a run that ends at all within the timeout did not sleep it.
    env = {**ENV, "TMPDIR": str(tmp_path), "PS_SHARD": "1", "PS_RETRIES": "abc",
           "PS_STEP_DELAY": "600", "PS_MAX_STEPS": "2"}  # fmt: skip
    try:
        result = subprocess.run(
            [sys.executable, "-m", "psserver.cli.local", "--model", "lenet", "--workers", "1",
             "--train-limit", "64", "--batch-size", "16", "--threads", "1",
             "--summary", str(tmp_path / "summary.json")],
            capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("ps-local ran past 100 s: a worker slept PS_STEP_DELAY (600 s a step)")
    assert result.returncode == 0, result.stderr[-3000:]
    assert " 2 sync steps with 1 worker" in result.stdout, result.stdout


def sleeper(seconds: float) -> "subprocess.Popen[bytes]":
    """A stand-in follower: ends by itself after `seconds` (as on its leader's STOP), or on
    SIGTERM as a follower does (128 + 15)."""
    return subprocess.Popen(
        [sys.executable, "-c", PRELUDE + f"time.sleep({seconds})"], env=ENV,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def test_followers_that_never_joined_are_stopped_at_once_and_not_called_failures() -> None:
    """A leader stopped before every follower had joined sends STOP only to those that had:
    the others waited out the whole grace for nothing, then their SIGTERM exit was reported
    as a failure. Now they get SIGTERM at once, and the joined one still ends on its STOP."""
    joined, unjoined = sleeper(1.5), sleeper(600)
    wait_for_signal_handler(unjoined, signal.SIGTERM, timeout=60)
    started = time.monotonic()
    assert launch.stop_followers([joined, unjoined], grace_s=600, told={1}) == 0
    # At once, not after the 600 s grace: a bound that far from it cannot fail from load.
    assert time.monotonic() - started < 60, "the follower that never joined waited the grace"
    assert joined.returncode == 0, "the joined follower was not left to end on its STOP"
    assert unjoined.returncode == 128 + signal.SIGTERM  # its handler ran: SIGTERM, not SIGKILL


def test_a_follower_told_to_stop_that_fails_is_still_a_failure() -> None:
    """Only a SIGTERM of the leader's own, to a follower that never joined, is excused."""
    failing = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    assert launch.stop_followers([failing], grace_s=10, told={1}) == 3
    lingering = sleeper(60)
    wait_for_signal_handler(lingering, signal.SIGTERM, timeout=60)
    assert launch.stop_followers([lingering], grace_s=0.5, told={1}) == 128 + signal.SIGTERM


def test_a_leader_stopped_before_its_followers_joined_does_not_wait_for_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The leader's run ended (here by Ctrl-C) with no follower joined, so none was sent
    STOP: they are SIGTERMed at once, not after FOLLOWER_GRACE_AFTER_FAILURE_S."""
    from psserver.cli import server as cli
    from psserver.cli.server import run_with_followers

    # A grace of 10 minutes: "at once" is then far from it, whatever the machine's load.
    monkeypatch.setattr(cli, "FOLLOWER_GRACE_AFTER_FAILURE_S", 600.0)

    class StoppedServer:
        def __init__(self) -> None:
            self.launched_followers: dict[int, subprocess.Popen[bytes]] = {}

        def run(self) -> None:
            raise KeyboardInterrupt

        def followers_told_to_stop(self) -> set[int]:
            return set()

    followers = [sleeper(600), sleeper(600)]
    for follower in followers:
        wait_for_signal_handler(follower, signal.SIGTERM, timeout=60)
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_with_followers(cast(Any, StoppedServer()), lambda secret: followers, b"secret")
    assert time.monotonic() - started < 60, "the followers that never joined waited the grace"
    assert [f.returncode for f in followers] == [128 + signal.SIGTERM] * 2  # handled


def test_a_worker_failing_on_its_servers_failure_is_reported_as_the_servers(
    tmp_path: Path,
) -> None:
    """A server that could not write a checkpoint stops the job, and its workers exit 1 with
    `the server stopped the job` before it has exited itself: ps-local's last line named
    `worker local-1 exited with code 1` instead of the server, whose error is the cause."""
    worker_pid = tmp_path / "worker.pid"
    # The server fails only once ps-local has seen its worker fail (reaped it), as it
    # happened; a server that failed first would be reported as itself without the wait.
    server = Child(
        "server",
        [sys.executable, "-c", once_reaped(worker_pid) + "raise SystemExit('Error: disk full')"],
        dict(os.environ),
    )
    worker = Child(
        "worker local-0",
        [sys.executable, "-c", writes_its_pid(worker_pid)
         + "import sys; sys.exit('Error: the server stopped the job')"],
        dict(os.environ),
    )  # fmt: skip
    with pytest.raises(PSError) as failed:
        supervise([server, worker])
    assert str(failed.value) == "server exited with code 1; see its error above"


def test_a_worker_failing_alone_is_reported_as_itself_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a worker that says its server stopped the job waits for the server to fail: any
    other failure (bad data, a GPU out of memory) stops the rest at once."""
    from psserver.cli import children

    # 10 minutes for the server to fail after its worker: "at once" is then far from it,
    # whatever the machine's load.
    monkeypatch.setattr(children, "SERVER_BEHIND_S", 600.0)
    started = time.monotonic()
    server = Child(
        "server", [sys.executable, "-c", "import time; time.sleep(600)"], dict(os.environ)
    )
    worker = Child(
        "worker local-0", [sys.executable, "-c", "import sys; sys.exit('Error: no data')"],
        dict(os.environ),
    )  # fmt: skip
    with pytest.raises(PSError) as failed:
        supervise([server, worker])
    assert str(failed.value) == "worker local-0 exited with code 1; see its error above"
    assert server.process.returncode is not None, "the server was left running"
    assert time.monotonic() - started < 60, "it waited for the server"
