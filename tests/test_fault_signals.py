"""Signals at any moment, to a server, its follower shards and its workers. A server that gets
SIGTERM ends with one line and an exit code that says which signal, stops the processes it
started, and leaves nothing behind in the temporary folder; a signal that comes once a command
has ended, in Python's teardown, ends it without a traceback. A server stopped for a while
keeps its workers, and one stopped again and again still declares a gone worker dead; workers
SIGKILLed in a crash loop are told why the next one must wait; a worker paused past the end of
its job says that its server stopped answering, and one paused until its server forgot it
registers again and counts once in the summary; a command Ctrl-C'd while it still imports
torch exits 130 in one line. A follower shard killed or stopped (--num-shards 2): what the
leader says and does, and its workers, which end on the leader's STOP or on a SIGTERM while
they wait for the silent follower. Run with the rest of the fault suite: `pytest -m fault`."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from common.wire.protocol import Error, Welcome
from tests.harness import (
    REPO,
    Cluster,
    Proc,
    all_exit,
    error_after_pausing_to_the_end,
    free_port,
    wait_for_log,
    wait_for_state,
)
from tests.raw_peers import Heartbeats, RawClient

pytestmark = [pytest.mark.fault, pytest.mark.timeout(180)]
LENET = ["--model", "lenet", "--train-limit", "640", "--test-limit", "100"]


def children_of(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_leader_stops_its_followers_and_leaves_nothing_behind(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: int
) -> None:
    """kill (or ps-local stopping its server) sent the leader SIGTERM, which killed it at
    once, and it said nothing. It now unwinds as on Ctrl-C: its followers stop on its STOP,
    and nothing is left in the temporary folder (the followers' secret goes to them on a
    pipe)."""
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    leader, _ = cluster.start_server(*LENET, "--workers", "1", "--num-shards", "2")
    # The follower's own line: it has the leader's welcome. The leader's "shard 1 of 2
    # joined" comes before it sends that, and a follower still waiting for its welcome hears
    # no STOP (it is SIGTERMed after the grace, and says so).
    wait_for_log(leader, "shard 1 of 2: parameters", timeout=60)
    followers = children_of(leader.process.pid)
    assert len(followers) == 1, followers
    leader.process.send_signal(signum)
    cluster.wait(leader, timeout=30, expect_code=128 + signum)
    assert all_exit(followers, timeout=10), "the follower outlived its leader"
    assert not list(temporary.iterdir()), "the leader left files in the temporary folder"
    stderr = leader.stderr()
    assert "Traceback" not in stderr, stderr
    assert f"server WARNING stopped by {signal.Signals(signum).name}" in stderr, stderr
    # The follower ends on the leader's STOP, given a moment to: it used to be SIGTERMed at
    # once, and logged that it was stopped by a signal too.
    assert "shard 1 stops at step 0" in stderr, stderr
    assert stderr.count("stopped by") == 1, stderr


def run_with_a_signal_at_exit(
    tmp_path: Path, program: str, signum: int = signal.SIGTERM
) -> "subprocess.CompletedProcess[str]":
    """Run `program` in a Python whose atexit callback sends it `signum` (and then waits for
    it), so that the signal surely comes during the interpreter's teardown."""
    script = (
        "import atexit, os, signal, time\n"
        # As started from a terminal, even where this test runs with SIGINT ignored (a
        # background job of a script), which the child would inherit and keep.
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        f"atexit.register(lambda: (os.kill(os.getpid(), {int(signum)}), time.sleep(30)))\n"
        + program
    )
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60,
    )  # fmt: skip


@pytest.mark.integration
def test_a_signal_in_the_teardown_of_a_finished_command_ends_it_without_a_traceback(
    tmp_path: Path,
) -> None:
    """SIGTERM once the command has ended, while Python runs its atexit callbacks: a follower
    shard that had stopped on its leader's STOP got the leader's SIGTERM a moment later, and
    about one time in ten it came in torch's atexit callback, which printed "Exception ignored
    in atexit callback" and a traceback of Terminated into the leader's output. The signal
    now ends the process at once, as it would one without handlers, and silently. Here the
    callback sends the signal itself, so that it surely comes there."""
    done = run_with_a_signal_at_exit(
        tmp_path,
        "from common.cli import unwinding_on_termination\n"
        "with unwinding_on_termination():\n"
        "    pass  # the command, done\n",
    )
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)
    assert done.stderr == "", done.stderr


@pytest.mark.integration
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_in_the_teardown_of_a_finished_worker_ends_it_silently(
    tmp_path: Path, signum: int
) -> None:
    """ps-worker handles SIGTERM and SIGINT only while it trains. One that came once it had
    given up (here: nobody answers its REGISTER) was logged as "leaving the job after the
    current step", and a second raised SystemExit inside an atexit callback (a traceback).
    SIGINT then went back to Python's KeyboardInterrupt only when training ended well; a
    worker that gave up printed one from its atexit callback."""
    done = run_with_a_signal_at_exit(
        tmp_path,
        "import sys\n"
        "from psworker.cli import main\n"
        f"sys.argv = ['ps-worker', '--server', 'tcp://127.0.0.1:{free_port()}',\n"
        "            '--device', 'cpu', '--timeout', '0.3', '--join-timeout', '0.3']\n"
        "main()\n",
        signum,
    )
    assert done.returncode == -signum, (done.returncode, done.stderr)
    assert "nothing answered" in done.stderr, done.stderr  # it gave up first, as it should
    assert "got signal" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.integration
def test_a_worker_started_with_ctrl_c_ignored_still_ignores_it_once_it_has_failed(
    tmp_path: Path,
) -> None:
    """A background job of a script starts with SIGINT ignored, so that a Ctrl-C meant for
    the script's foreground leaves it alone; a worker that had failed made it deadly again
    for its teardown."""
    script = (
        "import signal, sys\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "from psworker.cli import main\n"
        f"sys.argv = ['ps-worker', '--server', 'tcp://127.0.0.1:{free_port()}',\n"
        "            '--device', 'cpu', '--timeout', '0.3', '--join-timeout', '0.3']\n"
        "try:\n"
        "    main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60,
    )  # fmt: skip
    assert "nothing answered" in done.stderr, done.stderr  # it failed, as it should here
    assert done.stdout.strip() == "True", (done.stdout, done.stderr)


def test_a_command_under_nohup_keeps_ignoring_sighup_and_gets_its_handlers_back() -> None:
    """nohup ignores SIGHUP so that a closed terminal does not stop the command: unwinding
    on SIGHUP would undo that. Whatever handlers there were come back when the command ends."""
    from common.cli import exit_on_signal, unwinding_on_termination

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    try:
        with unwinding_on_termination():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == exit_on_signal
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) == before[1]
    finally:
        signal.signal(signal.SIGHUP, before[0])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_server_stopped_for_longer_than_the_worker_timeout_keeps_its_workers(
    cluster: Cluster, mode: str
) -> None:
    """SIGSTOP (or a host that swaps, a VM paused for migration) holds the server's loop for
    longer than --worker-timeout. The heartbeats wait in its socket meanwhile; it used to
    declare its workers dead before reading them, and async mode abandoned the epoch and
    trained a third one."""
    summary_path = cluster.workdir / "summary.json"
    server, endpoint = cluster.start_server(
        *LENET, "--mode", mode, "--workers", "2", "--train-limit", "1280", "--batch-size",
        "16", "--epochs", "2", "--worker-timeout", "2", "--summary", str(summary_path),
    )  # fmt: skip
    workers = [
        cluster.start_worker(endpoint, "--step-delay", "0.05", "--timeout", "3", name=f"w{i}")
        for i in range(2)
    ]
    wait_for_state(server, endpoint, "a step trained", lambda status: status["step"] >= 1)
    server.process.send_signal(signal.SIGSTOP)
    time.sleep(5)  # 2.5 worker timeouts
    server.process.send_signal(signal.SIGCONT)
    for worker in workers:
        cluster.wait(worker, timeout=120)
    cluster.wait(server, timeout=60)
    summary = json.loads(summary_path.read_text())
    assert "declared dead" not in server.stderr(), server.stderr()
    assert [w["state"] for w in summary["per_worker"]] == ["stopped", "stopped"], summary
    assert (summary["epochs"], summary["abandoned_epochs"]) == (2, 0), summary
    assert "heard nobody for" in server.stderr(), server.stderr()


def test_a_server_whose_every_tick_is_slow_still_declares_a_gone_worker_dead(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """A server stopped for 1.2 s in every 1.3 s: every gap between two ticks of its loop is
    longer than a second, and each used to excuse every worker's silence, so a worker that
    was gone was never declared dead. A silence is excused once now: the gone worker is
    declared dead within about twice --worker-timeout, the one that sends heartbeats never."""
    timeout_s = 4
    server, endpoint = cluster.start_server(
        *LENET, "--workers", "3", "--worker-timeout", str(timeout_s)
    )
    kept, gone = RawClient(zmq_context, endpoint, 30), RawClient(zmq_context, endpoint, 30)
    welcome = kept.register("kept")
    assert isinstance(welcome, Welcome), welcome
    assert isinstance(gone.register("gone"), Welcome)
    gone_since = time.monotonic()  # it says nothing more
    beats = Heartbeats(endpoint)
    beats.add(welcome.worker_id, kept.token)
    declared = None
    try:
        while time.monotonic() - gone_since < 10 * timeout_s:
            server.process.send_signal(signal.SIGSTOP)
            time.sleep(1.2)
            server.process.send_signal(signal.SIGCONT)
            time.sleep(0.1)
            if "(gone) declared dead" in server.stderr():
                declared = time.monotonic() - gone_since
                break
    finally:
        server.process.send_signal(signal.SIGCONT)
        beats.stop()
        kept.close()
        gone.close()
    assert declared is not None, f"not declared dead in {10 * timeout_s} s\n{server.stderr()}"
    # About twice --worker-timeout by the rule, which test_deafness checks on a fake clock;
    # here, where the server runs 0.1 s in every 1.3 s and a loaded machine may skip its
    # turn, 5 times leaves room. A silence excused at every tick would never end.
    assert declared < 5 * timeout_s, declared
    assert "(kept) declared dead" not in server.stderr(), server.stderr()


def test_a_worker_paused_past_the_end_of_the_job_says_the_server_stopped_answering(
    cluster: Cluster,
) -> None:
    """A worker stopped (SIGSTOP, a laptop's lid closed) until its server had finished and
    gone, then continued, exited with "no reply from the server ... check that ps-server runs
    there", as if it had never reached one. It says now that the server it trained with
    stopped answering, that the job probably ended or the server died, and what to do."""
    server, endpoint = cluster.start_server(
        *LENET, "--workers", "2", "--epochs", "1", "--worker-timeout", "2"
    )
    kept, paused = (
        cluster.start_worker(endpoint, "--timeout", "1", "--retries", "1", name=name)
        for name in ("kept", "paused")
    )
    wait_for_log(server, "training starts", timeout=60)
    wait_for_log(paused, "registered as worker", timeout=30)
    error = error_after_pausing_to_the_end(cluster, paused, kept, server)
    assert f"the server at {endpoint} stopped answering" in error, error
    assert "finished the job or died" in error, error
    assert "check that ps-server runs there" not in error, error


def test_a_worker_paused_until_the_server_forgot_it_trains_on_and_counts_once(
    cluster: Cluster,
) -> None:
    """A worker stopped (SIGSTOP) until the server declares it dead hears "unknown-worker" when
    it continues, registers again and trains in a later epoch: two rows in per_worker, both
    with pushes, from one process. `workers_trained` used to count it twice."""
    summary_path = cluster.workdir / "summary.json"
    server, endpoint = cluster.start_server(
        *LENET, "--workers", "2", "--batch-size", "16", "--epochs", "4", "--worker-timeout",
        "2", "--summary", str(summary_path),
    )  # fmt: skip
    kept, paused = (
        cluster.start_worker(endpoint, "--step-delay", "0.1", name=name)
        for name in ("kept", "paused")
    )
    wait_for_log(paused, "registered as worker", timeout=60)
    paused_id = int(paused.stderr().split("registered as worker ")[1].split(":")[0])
    # Its first registration pushes before it is paused.
    wait_for_state(
        server, endpoint, f"a push of worker {paused_id}",
        lambda status: any(w["id"] == paused_id and w["pushes"] for w in status["workers"]),
    )  # fmt: skip
    paused.process.send_signal(signal.SIGSTOP)
    try:
        wait_for_log(server, "declared dead", timeout=30)
    finally:
        paused.process.send_signal(signal.SIGCONT)
    wait_for_log(paused, "registering again", timeout=30)
    for worker in (kept, paused):
        cluster.wait(worker, timeout=120)
    cluster.wait(server, timeout=60)
    summary = json.loads(summary_path.read_text())
    rows = [w for w in summary["per_worker"] if w["pid"] == paused.process.pid]
    assert [w["state"] for w in rows] == ["dead", "stopped"], summary["per_worker"]
    assert rows[0]["process"] == rows[1]["process"], rows  # one process, registered twice
    assert all(w["pushes"] > 0 for w in rows), summary["per_worker"]
    assert len(summary["per_worker"]) == 3, summary["per_worker"]
    assert summary["workers_trained"] == 2, summary


def test_a_worker_refused_for_its_own_dead_predecessors_is_told_when_to_come_back(
    cluster: Cluster, zmq_context: zmq.Context
) -> None:
    """A worker that crashes right after registering, twice (a crash loop, a pod restarted at
    once), fills --max-workers with records the server has not declared dead yet. The third
    start was refused with "raise --max-workers", which is not the fix: it only has to wait
    out --worker-timeout."""
    server, endpoint = cluster.start_server(
        *LENET, "--workers", "1", "--max-workers", "2", "--worker-timeout", "9"
    )
    crashed = [RawClient(zmq_context, endpoint, timeout_s=30) for _ in range(2)]
    for client in crashed:  # registered, then never heard from again: no heartbeat
        assert isinstance(client.register("crashed"), Welcome)
    # Silent for two heartbeats (a third of --worker-timeout), and 6 s from being declared
    # dead: the REGISTER below takes milliseconds.
    wait_for_state(
        server, endpoint, "both workers silent for two heartbeats",
        lambda status: [w["last_seen_s"] > 3.5 for w in status["workers"]] == [True, True],
    )  # fmt: skip
    third = RawClient(zmq_context, endpoint, timeout_s=30)
    refusal = third.register("restarted")
    assert isinstance(refusal, Error) and refusal.code == "job-full", refusal
    assert re.search(r"2 of them silent for \d+ s", refusal.message), refusal.message
    assert "--worker-timeout 9 s" in refusal.message, refusal.message
    for client in [*crashed, third]:
        client.close()


def console_scripts() -> dict[str, str]:
    """[project.scripts] of pyproject.toml: command name -> "module:function"."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(REPO / "pyproject.toml", "rb") as file:
        return dict(tomllib.load(file)["project"]["scripts"])


def wait_for_torch(name: str, process: "subprocess.Popen[str]", timeout: float) -> None:
    """Wait until the process has begun to import torch: its shared libraries are mapped."""
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"{name} exited before it imported torch"
        with contextlib.suppress(OSError):
            if "libtorch" in Path(f"/proc/{process.pid}/maps").read_text():
                return
        assert time.monotonic() < deadline, f"{name} did not import torch within {timeout} s"
        time.sleep(0.01)


@pytest.mark.integration
def test_ctrl_c_while_a_command_starts_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C in the first second or two of any command, while it imports torch, printed a
    KeyboardInterrupt traceback of forty lines into torch's internals. It now ends as a Ctrl-C
    later does: exit 130 and at most one line. Each command is started as the script that pip
    installs for it starts it (import the module, call the function)."""
    scripts = console_scripts()
    started: dict[str, subprocess.Popen[str]] = {}
    try:
        for name, target in scripts.items():
            module, function = target.split(":")
            launcher = f"import sys; from {module} import {function}; sys.exit({function}())"
            started[name] = subprocess.Popen(
                [sys.executable, "-c", launcher, "--help"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
            )  # fmt: skip
        for name, process in started.items():
            # In run_command's import (the entry modules import nothing heavy), more than a
            # second before that import ends: the signal lands there however slow the start.
            wait_for_torch(name, process, timeout=60)
            process.send_signal(signal.SIGINT)
        for name, process in started.items():
            _, stderr = process.communicate(timeout=60)
            assert "Traceback" not in stderr, f"{name}:\n{stderr}"
            assert process.returncode == 130, f"{name} exited {process.returncode}:\n{stderr}"
            assert len(stderr.splitlines()) <= 1, f"{name}:\n{stderr}"
    finally:
        for process in started.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# ---- a follower shard killed or stopped (--num-shards 2) -----------------------------------

# The sharded tests' job: 80 batches of 16 an epoch, long enough to stop a shard mid-epoch.
SHARD_JOB = ["--model", "lenet", "--train-limit", "1280", "--test-limit", "100",
             "--batch-size", "16"]  # fmt: skip
STEP_1_DONE = "step 1/"  # a worker's --progress log line


def sleeping_before_step_2s_push(worker: Proc) -> None:
    """Wait until the worker (--log-level debug) has step 2's slices from the follower: it
    sleeps its --step-delay before its push from here."""
    wait_for_log(worker, STEP_1_DONE, timeout=90)
    slices = "answered Pull (shard 1) with Weights (shard 1)"
    wait_for_log(worker, slices, timeout=60, after=STEP_1_DONE)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_workers_that_heard_stop_by_heartbeat_are_not_declared_dead(cluster: Cluster) -> None:
    """A follower dies while the workers wait for its answer. The leader stops the job; each
    worker hears STOP on its heartbeat and ends at once, and never asks the leader again. The
    leader used to wait for their next request until it declared them dead ("declared dead
    after 3.0 s of silence"), or, past --stop-grace, warned that they would time out."""
    leader, endpoint = cluster.start_server(
        *SHARD_JOB, "--workers", "2", "--epochs", "50", "--worker-timeout", "3", "--num-shards", "2"
    )
    workers = [
        cluster.start_worker(endpoint, "--timeout", "3", "--retries", "3", name=f"w{i}")
        for i in range(2)
    ]
    wait_for_log(leader, "training starts", timeout=60)
    (follower,) = children_of(leader.process.pid)
    os.kill(follower, signal.SIGKILL)
    cluster.wait(leader, timeout=60, expect_code=1)
    for worker in workers:
        cluster.wait(worker, timeout=30, expect_code=None)
        assert "a server shard was lost" in worker.stderr(), worker.describe()
    after_stop = leader.stderr().partition("stopping the job")[2]
    assert after_stop, leader.describe()
    assert "declared dead" not in after_stop, leader.describe()
    assert "did not ask again" not in after_stop, leader.describe()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_a_worker_of_a_job_stopped_by_a_lost_shard_exits_1(cluster: Cluster) -> None:
    """The leader exits 1 when a follower is lost, and says to restart every shard with
    --resume. Its workers used to exit 0 on the STOP that said so: a supervisor (a Kubernetes
    Job) counted them complete, and the restarted server waited for ever for workers."""
    leader, endpoint = cluster.start_server(
        *SHARD_JOB, "--workers", "1", "--epochs", "50", "--worker-timeout", "3", "--num-shards", "2"
    )
    worker = cluster.start_worker(endpoint, "--timeout", "3", "--retries", "3")
    wait_for_log(leader, "training starts", timeout=60)
    (follower,) = children_of(leader.process.pid)
    os.kill(follower, signal.SIGKILL)
    cluster.wait(leader, timeout=60, expect_code=1)
    cluster.wait(worker, timeout=30, expect_code=1)
    last = worker.stderr().strip().splitlines()[-1]
    assert last.startswith("Error: the server stopped the job: a server shard was lost"), last
    assert "Traceback" not in worker.stderr(), worker.describe()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_a_worker_mid_step_at_the_end_of_a_sharded_job_takes_the_leaders_stop(
    cluster: Cluster,
) -> None:
    """A straggler pushes after the job has ended: the leader answers its PUSH with STOP and
    exits, stopping its follower, which never answers the straggler's slice. The worker used
    to wait for that answer first, and the heartbeat's STOP never came from a leader that was
    gone: it ignored SIGTERM and ended after --timeout x (retries + 1), exiting 1 with "no reply
    from shard 1". It now reads the leader's STOP and exits 0. (The follower is stopped here
    so that it surely never answers; in real jobs it was a race the follower often lost.)"""
    leader, endpoint = cluster.start_server(
        *SHARD_JOB, "--workers", "2", "--mode", "async", "--max-steps", "8", "--num-shards", "2",
        "--stop-grace", "20",
    )  # fmt: skip
    fast = cluster.start_worker(endpoint, name="fast")
    slow = cluster.start_worker(
        endpoint, "--step-delay", "4", "--timeout", "20", "--retries", "2", name="slow"
    )
    wait_for_log(leader, "started 1 follower shard", timeout=60)  # a child of the leader now
    (follower,) = children_of(leader.process.pid)
    cluster.wait(fast, timeout=60)  # the job's 8 updates are done; the slow one still sleeps
    assert slow.process.poll() is None, slow.describe()
    os.kill(follower, signal.SIGSTOP)
    cluster.wait(slow, timeout=15)
    assert "no reply" not in slow.stderr(), slow.describe()
    # The follower, stopped, cannot exit when told; the leader kills it and says so.
    cluster.wait(leader, timeout=60, expect_code=1)
    assert "a follower shard failed while stopping" in leader.stderr(), leader.describe()


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads children from /proc")
def test_sigterm_ends_a_worker_whose_push_waits_for_a_silent_follower(cluster: Cluster) -> None:
    """A follower stops answering (SIGSTOP here; a hung host) while a worker waits for it to
    take the slices of its push. SIGTERM must still end the worker at once, with LEAVE and
    143, as it does while the server holds its pull: it used to wait out --timeout x
    (--retries + 1), a minute here, since no heartbeat speaks for a follower."""
    # The leader would stop the job after --worker-timeout of its follower's silence.
    leader, endpoint = cluster.start_server(
        *SHARD_JOB, "--workers", "1", "--epochs", "50", "--worker-timeout", "300", "--num-shards",
        "2",
    )  # fmt: skip
    # Each step: the pull, 8 s asleep, the push. Its debug log names each request as it
    # goes out and as it is answered.
    worker = cluster.start_worker(
        endpoint, "--step-delay", "8", "--timeout", "100", "--retries", "2", "--log-level",
        "debug",
    )  # fmt: skip
    sleeping_before_step_2s_push(worker)
    (follower,) = children_of(leader.process.pid)
    # The fixture's killpg ends it in teardown: a follower is in its leader's process group.
    os.kill(follower, signal.SIGSTOP)
    # It waits for the answer:
    wait_for_log(worker, ": Push (shard 1)", timeout=60, after=STEP_1_DONE)
    assert "answered Push (shard 1)" not in worker.stderr().partition(STEP_1_DONE)[2], (
        "the follower took step 2's push before it was stopped: the test missed the 8 s sleep"
    )
    worker.process.send_signal(signal.SIGTERM)
    # 143 and Interrupted's words: the signal ended the wait, not its --timeout (5 minutes
    # in all), which would end it with "no reply from shard 1" and 1.
    cluster.wait(worker, timeout=60, expect_code=128 + signal.SIGTERM)
    stderr = worker.stderr()
    assert "stopped waiting for the answer to Push (shard 1)" in stderr, worker.describe()
    assert "left the job after a shutdown signal" in stderr, worker.describe()
    wait_for_log(leader, "left: shut down by a signal", timeout=30)


def test_a_worker_paused_past_the_end_of_a_sharded_job_says_the_job_is_gone(
    cluster: Cluster,
) -> None:
    """A worker stopped (SIGSTOP) in the pause before its push until its sharded job had
    ended, then continued: it waits for the follower's answer to its slice first, and exited
    with "no reply from shard 1 ... check that its port is reachable from this host", advice
    for a firewall, about a follower that had answered it all along and had ended with its
    leader. It says now that both stopped answering, that the job probably ended or the
    server died, and what to do."""
    leader, endpoint = cluster.start_server(
        *SHARD_JOB, "--workers", "2", "--epochs", "1", "--worker-timeout", "2", "--num-shards",
        "2", "--push-credits", "0",
    )  # fmt: skip
    kept = cluster.start_worker(endpoint, name="kept")
    # Nearly all of its step is the --step-delay before the push: that is where it stops.
    paused = cluster.start_worker(
        endpoint, "--step-delay", "6", "--no-overlap", "--timeout", "1", "--retries", "1",
        "--progress", "log", "--log-level", "debug", name="paused",
    )  # fmt: skip
    sleeping_before_step_2s_push(paused)
    error = error_after_pausing_to_the_end(cluster, paused, kept, leader)
    assert "stopped answering" in error, error
    assert "finished the job or died" in error or "finished or the server died" in error
    assert "check that its port is reachable" not in error, error
