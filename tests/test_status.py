"""Live status: `ps-status` against a real CURVE-secured server while it waits for workers and
while it trains, the Prometheus endpoint, and a clear error when nobody answers."""

import json
import os
import select
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from prometheus_client.core import Metric

from psserver.cli.keys import command as ps_keys
from psserver.cli.status import checkpoints_line, format_status
from psserver.cli.status import command as ps_status
from psserver.status.live import (
    SAMPLE_EVERY_S,
    StatusCounters,
    followers_cpu_seconds,
    process_cpu_seconds,
)
from psserver.status.prometheus import MetricsExporter, StatusCollector, metrics_address
from tests.harness import Cluster, free_port

WAIT_S = 60.0


def run_status(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(ps_status, list(args))
    assert "Traceback" not in result.output, result.output
    return result.exit_code, result.output


def wait_for_status(
    cluster: Cluster, args: list[str], what: str, ok: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """Ask until `ok(status)` holds; fail with the last status and the children's output."""
    deadline = time.monotonic() + WAIT_S
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        code, output = run_status(*args, "--json")
        assert code == 0, f"ps-status failed: {output}\n{cluster.describe_all()}"
        status = json.loads(output)
        if ok(status):
            return status
        time.sleep(0.05)
    raise AssertionError(
        f"no status showed {what} within {WAIT_S} s; last: {status}\n{cluster.describe_all()}"
    )


def fetch_metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_status_while_waiting_and_training(cluster: Cluster, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert CliRunner().invoke(ps_keys, [str(keys), "--clients", "3"]).exit_code == 0
    metrics_port = free_port()
    server, endpoint = cluster.start_server(
        "--mode", "sync", "--model", "lenet", "--workers", "2", "--train-limit", "1280",
        "--batch-size", "16", "--test-limit", "100", "--metrics-port", str(metrics_port),
        "--curve-secret-key", str(keys / "server.key_secret"),
        "--curve-authorized-clients", str(keys / "authorized_clients"),
        "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "3",
        "--keep-checkpoints", "2",
    )  # fmt: skip
    client = ["--curve-server-key", str(keys / "server.key")]
    asker = ["--server", endpoint, "--curve-secret-key", str(keys / "client-3.key_secret")]
    asker += client

    # Before any worker: waiting, nobody listed, no epoch yet.
    status = wait_for_status(cluster, asker, "the waiting phase", lambda s: True)
    assert status["phase"] == "waiting" and status["mode"] == "sync"
    assert status["model"] == "lenet" and status["step"] == 0
    assert status["epoch"] == {"completed": 0, "abandoned": 0, "total": 1, "current": None}
    assert status["waiting_for"] == "workers, 0 of the 2 needed ready"
    assert "epoch 0 of 1 done (waiting for workers, 0 of the 2 needed ready)" in (
        format_status(status)
    )
    assert status["workers"] == [] and status["workers_expected"] == 2
    assert status["staleness"] is None and status["last_evaluation"] is None
    assert status["checkpoints"] == {
        "dir": str(tmp_path / "ck"), "every": 3, "step": None, "age_s": None, "kept": 0,
    }  # fmt: skip

    # A plain client gets nothing from a CURVE server: a clear error that names the keys,
    # as soon as the handshake is refused (not after its 120 s timeout), not a hang.
    started = time.monotonic()
    code, output = run_status("--server", endpoint, "--timeout", "120")
    assert code == 1 and output.count("\n") == 1, output
    assert output.startswith(f"Error: the server at {endpoint} refused every handshake: it uses")
    assert "--curve-server-key" in output
    assert time.monotonic() - started < 60

    def worker(i: int) -> None:
        key = str(keys / f"client-{i}.key_secret")
        cluster.start_worker(
            endpoint, "--name", f"w{i}", "--step-delay", "0.1", "--curve-secret-key", key, *client
        )

    worker(1)
    status = wait_for_status(
        cluster,
        asker,
        "worker w1 waiting",
        lambda s: [w["state"] for w in s["workers"]] == ["waiting"],
    )
    assert status["phase"] == "waiting"
    (w1,) = status["workers"]
    assert w1["name"] == "w1" and w1["device"] == "cpu" and w1["pushes"] == 0
    assert set(w1) == {
        "id", "name", "device", "state", "pushes", "samples", "late_dropped", "rejected",
        "last_seen_s",
    }  # fmt: skip
    assert status["worker_states"]["waiting"] == 1

    worker(2)
    status = wait_for_status(
        cluster,
        asker,
        "both workers training after a few steps",
        lambda s: s["phase"] == "training" and s["step"] >= 2 and s["epoch"]["current"] is not None
        and s["checkpoints"]["step"] is not None,
    )  # fmt: skip
    assert sorted(w["name"] for w in status["workers"]) == ["w1", "w2"]
    assert {w["state"] for w in status["workers"]} == {"training"}
    current = status["epoch"]["current"]
    assert sorted(current["roster"]) == sorted(w["id"] for w in status["workers"])
    assert current["steps_per_shard"] == 1280 // (2 * 16)
    assert status["throughput"]["samples"] >= 2 * 16 * 2
    assert status["throughput"]["overall_images_per_second"] > 0
    assert all(w["last_seen_s"] < 30 for w in status["workers"])
    # The server has been loading data and serving: it has used CPU, and at most all cores.
    assert status["server_cpu"]["seconds"] > 0
    assert 0 <= status["server_cpu"]["busy"] <= (os.cpu_count() or 1) + 0.5
    assert status["server_cpu"]["followers_seconds"] is None  # one server, no shards
    checkpoints = status["checkpoints"]
    assert checkpoints["step"] % 3 == 0 and 0 <= checkpoints["age_s"] < WAIT_S, checkpoints
    assert checkpoints["kept"] in (1, 2), checkpoints

    code, table = run_status(*asker)
    assert code == 0, table
    lines = table.splitlines()
    assert lines[0].startswith("training: sync lenet"), table
    assert any(line.startswith("server CPU: ") for line in lines), table
    assert any(line.startswith("checkpoints: latest.pt at step ") for line in lines), table
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["ID", "NAME"])
    rows = [line.split() for line in lines[header + 1 :]]
    assert {row[1] for row in rows} == {"w1", "w2"}, table
    assert all(row[2] == "cpu" and row[3] == "training" for row in rows), table

    # The metrics follow the status at most SAMPLE_EVERY_S later.
    deadline = time.monotonic() + WAIT_S
    wanted = ('ps_workers{state="training"} 2.0', "\nps_checkpoint_step ")
    while not all(text in (metrics := fetch_metrics(metrics_port)) for text in wanted):
        assert time.monotonic() < deadline, f"no training workers or checkpoint:\n{metrics}"
        time.sleep(0.1)
    names = ("ps_step", "ps_epoch", "ps_images_per_second", "ps_updates_total")
    for name in (*names, "ps_server_cpu_seconds_total", "ps_server_cpu_busy", "ps_checkpoint_step"):
        assert f"\n{name} " in metrics, metrics
    assert "ps_rejected_requests_total 0.0" in metrics, metrics

    cluster.wait_all(timeout=WAIT_S)
    assert "Traceback" not in server.stderr(), server.stderr()[-4000:]


def test_no_server_is_one_clear_error() -> None:
    port = free_port()
    started = time.monotonic()
    code, output = run_status("--server", f"tcp://127.0.0.1:{port}", "--timeout", "1")
    assert code == 1
    assert output.startswith(f"Error: no answer from tcp://127.0.0.1:{port} within 1 s")
    assert output.count("\n") == 1
    # A guard against a hang, not a measure: the message says it waited its 1 s, and most of
    # this is the command's start (torch), which a loaded machine can stretch many times.
    assert time.monotonic() - started < 60
    code, output = run_status("--server", "nonsense", "--timeout", "1")
    assert code == 1 and "is not a valid endpoint" in output


def test_throughput_and_cpu_windows_are_exact() -> None:
    counters = StatusCounters(started=100.0)
    assert counters.images_per_second() == 0.0 and counters.cpu_busy() == 0.0
    assert counters.observe(100.0, 0, 5.0)
    assert not counters.observe(100.0 + SAMPLE_EVERY_S / 2, 999, 99.0)  # too soon: not kept
    assert counters.observe(102.0, 64, 6.0)
    assert counters.images_per_second() == 32.0 and counters.cpu_busy() == 0.5
    for t in range(3, 30):  # 10 images/s and 1.5 cores from here on; the window forgets the start
        counters.observe(100.0 + t, 64 + 10 * (t - 2), 6.0 + 1.5 * (t - 2))
    assert counters.images_per_second() == 10.0 and counters.cpu_busy() == 1.5


@pytest.mark.integration
def test_follower_cpu_is_read_from_proc_and_never_half_counted() -> None:
    # A stand-in follower: it spins for 0.6 s of its own CPU time, then waits to be killed.
    burn = subprocess.Popen(
        [sys.executable, "-c", "import time\nt = time.process_time()\n"
         "while time.process_time() - t < 0.6: pass\ntime.sleep(60)"]
    )  # fmt: skip
    try:
        # /proc counts in 10 ms ticks and the kernel's split into user and system time is
        # sampled, so a read may fall a little short of the exact figure (CI once read 0.29
        # after a 0.3 s spin): wait for a read of 0.5 s, well short of the spin.
        deadline = time.monotonic() + 30
        while (process_cpu_seconds(burn.pid) or 0) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
        spent = process_cpu_seconds(burn.pid)
        assert spent is not None and 0.5 <= spent < 10
        ours = process_cpu_seconds(os.getpid())
        assert ours is not None and ours > 0
        both = followers_cpu_seconds([burn.pid, burn.pid])
        assert both is not None and both >= 2 * 0.5
    finally:
        burn.kill()
        burn.wait()
    assert process_cpu_seconds(burn.pid) is None  # gone
    assert followers_cpu_seconds([os.getpid(), burn.pid]) is None, "a partial sum is no sum"
    assert followers_cpu_seconds([]) is None  # no followers of its own


def training_status(
    mode: str, gradients: int, followers_seconds: float | None, staleness: dict[str, Any] | None
) -> dict[str, Any]:
    """A server's STATUS in its first epoch of lenet, 2 workers, 16 images a gradient."""
    return {
        "phase": "training", "mode": mode, "model": "lenet", "dataset": "embedded",
        "step": gradients, "max_steps": None, "uptime_s": 10.0, "training_s": 8.0,
        "epoch": {"completed": 0, "total": 1, "current": None}, "workers_expected": 2,
        "min_workers": 1, "rejected_requests": 0, "late_gradients": 0,
        "throughput": {"images_per_second": 5.0, "window_s": 10.0,
                       "overall_images_per_second": 4.0, "samples": 16 * gradients,
                       "gradients": gradients},
        "server_cpu": {"seconds": 4.0, "busy": 0.5, "followers_seconds": followers_seconds},
        "staleness": staleness, "last_evaluation": None, "workers": [],
        "worker_states": {"training": 2, "waiting": 0, "registered": 0},
        "workers_omitted": 0,
    }  # fmt: skip


def test_status_reader_and_metrics_show_the_followers_cpu_when_the_server_started_them() -> None:
    status = training_status("sync", gradients=2, followers_seconds=2.5, staleness=None)
    assert "4.0 s in all; its follower shards 2.5 s" in format_status(status)
    collector = StatusCollector()
    collector.status = status
    metrics = {m.samples[0].name: m.samples[0].value for m in collector.collect()}
    assert metrics["ps_follower_cpu_seconds_total"] == 2.5
    status["server_cpu"]["followers_seconds"] = None
    assert "follower" not in format_status(status)
    assert "ps_follower_cpu_seconds_total" not in {m.samples[0].name for m in collector.collect()}
    # Past the listed ones, active or finished: not "finished workers", as it used to say.
    status["workers_omitted"] = 300
    assert format_status(status).endswith("... and 300 more workers not listed")
    # An evaluation's epoch counts the epochs ended: not "epoch 1" for the log's epoch 0.
    status["last_evaluation"] = {"epoch": 1, "step": 3, "accuracy": 0.5, "loss": 1.25}
    status["epoch"] = {"completed": 1, "abandoned": 1, "total": 2, "current": None}
    text = format_status(status)
    assert "last evaluation: accuracy 0.5000, loss 1.2500 at step 3 (1 epoch ended)" in text
    assert "epoch 1 of 2 done, 1 abandoned (between epochs)" in text


def test_the_status_reader_prints_no_control_characters_whatever_the_server_sends() -> None:
    """An older or hostile server may send raw newlines and terminal escapes: the table shows
    them escaped, one line of text per field, its columns still lined up."""
    status = training_status("sync", gradients=2, followers_seconds=None, staleness=None)
    status["phase"] = "training\x1b[2J\x1b[H"
    status["workers"] = [
        {
            "id": 1, "name": "evil\n13:44:00 server INFO done\x1b[31m", "device": "cpu\x00",
            "state": "training\u2028", "pushes": 1, "samples": 16, "late_dropped": 0,
            "rejected": 0, "last_seen_s": 0.5,
        },
        {
            "id": 2, "name": "good", "device": "cpu", "state": "training", "pushes": 1,
            "samples": 16, "late_dropped": 0, "rejected": 0, "last_seen_s": 0.5,
        },
    ]  # fmt: skip
    text = format_status(status)
    assert text.isprintable() is False  # the lines are joined by newlines ...
    lines = text.splitlines()
    assert all(line.isprintable() for line in lines), text  # ... and hold nothing else
    assert lines[0].startswith("training\\x1b[2J\\x1b[H: sync lenet"), lines[0]
    evil, good = lines[-2:]
    assert evil.startswith(" 1  evil\\n13:44:00 server INFO done\\x1b[31m  cpu\\x00"), evil
    assert evil.index("cpu") == good.index("cpu"), text


def test_status_says_the_ssp_bound_counts_steps_ahead_not_versions_behind() -> None:
    """`staleness: mean 0.50, max 2 over 44 gradients, bound 1` read as a bound broken; but
    staleness counts versions, and 2 workers at --staleness 1 may reach (1 + 1)(2 - 1) = 2."""
    staleness = {"count": 44, "mean": 0.5, "max": 2, "histogram": {}, "steps_ahead_bound": 1}
    status = training_status("ssp", gradients=44, followers_seconds=None, staleness=staleness)
    text = format_status(status)
    line = "staleness (versions behind): mean 0.50, max 2 over 44 gradients; steps ahead bound 1"
    assert line in text.splitlines(), text
    status["staleness"]["steps_ahead_bound"] = None  # async: no bound
    text = format_status(status)
    assert "staleness (versions behind): mean 0.50, max 2 over 44 gradients" in text
    assert "bound" not in text


def test_a_scrape_can_ask_for_some_metrics_by_name() -> None:
    """`/metrics?name[]=...` is prometheus_client's filter: it needs every metric's name
    up front (StatusCollector.describe), and used to answer nothing at all."""
    status = {
        "step": 7, "epoch": {"completed": 1}, "late_gradients": 1, "rejected_requests": 2,
        "throughput": {"images_per_second": 5.0, "window_s": 10.0, "gradients": 14},
        "server_cpu": {"seconds": 4.0, "busy": 0.5, "followers_seconds": 2.5},
        "worker_states": {"training": 2, "waiting": 0},
        "last_evaluation": {"accuracy": 0.75}, "staleness": {"max": 3},
        "checkpoints": {"step": 6},
    }  # fmt: skip
    collector = StatusCollector()
    collector.status = status  # every metric there is
    described = {sample_name(m) for m in collector.describe()}
    collected = {sample_name(m) for m in collector.collect()}
    assert described == collected, described ^ collected
    port = free_port()
    exporter = MetricsExporter(port, "tcp://127.0.0.1:5555")
    try:
        exporter.publish(status)
        url = f"http://127.0.0.1:{port}/metrics?name[]=ps_step&name[]=ps_updates_total"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = reply.read().decode()
        samples = [line for line in body.splitlines() if not line.startswith("#")]
        assert samples == ["ps_step 7.0", "ps_updates_total 7.0"], body
        url = f"http://127.0.0.1:{port}/metrics?name[]=ps_workers"
        with urllib.request.urlopen(url, timeout=10) as reply:
            body = reply.read().decode()
        assert 'ps_workers{state="training"} 2.0' in body and "ps_step" not in body, body
    finally:
        exporter.stop()


def sample_name(metric: Metric) -> str:
    """What a scrape names the metric: counters carry _total."""
    return metric.name + ("_total" if metric.type == "counter" else "")


@pytest.mark.parametrize(
    ("bind", "address"),
    [
        ("tcp://127.0.0.1:*", "127.0.0.1"),
        ("tcp://localhost:5555", "127.0.0.1"),
        ("ipc:///tmp/ps", "127.0.0.1"),
        ("tcp://0.0.0.0:5555", "0.0.0.0"),
        ("tcp://*:5555", "0.0.0.0"),
        ("tcp://10.1.2.3:5555", "0.0.0.0"),
    ],
)
def test_metrics_bind_loopback_unless_the_server_is_public(bind: str, address: str) -> None:
    assert metrics_address(bind) == address


def test_idle_connections_cannot_use_up_the_metrics_endpoint() -> None:
    """prometheus_client's server kept every idle connection open for ever, a thread and a
    file descriptor each, until the training server could not write its checkpoint. Now at
    most max_connections are served, the rest are closed at once, and a silent one is
    dropped after read_timeout_s; a scrape then gets through again."""
    port = free_port()
    exporter = MetricsExporter(port, "tcp://127.0.0.1:5555", max_connections=2, read_timeout_s=3)
    idle = []
    try:
        for _ in range(6):
            client = socket.create_connection(("127.0.0.1", port), timeout=10)
            client.sendall(b"GET /metrics HTTP/1.1\r\n")  # and never the rest
            idle.append(client)
        started, closed, waiting = time.monotonic(), [], list(idle)
        while waiting and time.monotonic() - started < 60:
            readable, _, _ = select.select(waiting, [], [], 0.05)
            for client in readable:  # closed by the server (or told why, then closed)
                client.recv(1024)
                closed.append(idle.index(client))
                waiting.remove(client)
        assert not waiting, "connections the server never closed"
        # The server takes connections in the order they came: the first two got the slots
        # and were dropped after the read timeout, the other four were closed at once. The
        # order says so (no slot freed up for 3 s), not a clock that load could stretch.
        assert sorted(closed[:4]) == [2, 3, 4, 5] and sorted(closed[4:]) == [0, 1], closed
        # A slot comes back as its handler's thread ends, just after the connection closes: a
        # scrape in between is closed at once too, and asks again (a wait on the slots, not a
        # pass for a server that never frees them: 30 s is far past any such moment).
        deadline = time.monotonic() + 30
        while True:
            try:
                scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
                break
            except (ConnectionError, urllib.error.URLError):  # closed while sent, or read
                assert time.monotonic() < deadline, "no slot came back for a scrape"
                time.sleep(0.1)
        with scrape:
            assert scrape.status == 200
    finally:
        for client in idle:
            client.close()
        exporter.stop()


def test_the_status_reader_says_where_the_checkpoints_stand() -> None:
    every = {"dir": "runs/a", "every": 100, "step": None, "age_s": None, "kept": 0}
    assert checkpoints_line(None) == "checkpoints: none (no --checkpoint-dir)"
    assert checkpoints_line(every) == (
        "checkpoints: none yet (every 100 steps and at the end, to runs/a)"
    )
    written = {**every, "step": 300, "age_s": 12.4, "kept": 3}
    assert checkpoints_line(written) == (
        "checkpoints: latest.pt at step 300, written 12 s ago, 3 kept as step-N.pt (every 100 "
        "steps and at the end, in runs/a)"
    )
    resumed = {**every, "every": 0, "step": 40}
    assert checkpoints_line(resumed) == (
        "checkpoints: latest.pt at step 40, which this run resumed from (at the end, in runs/a)"
    )


def test_a_long_worker_name_shows_its_real_length_in_the_status_table() -> None:
    """Membership keeps a name cut to MAX_LABEL with its length said; the status reply used to
    cut it again, so the table said "(120 characters)" of a 500-character name."""
    from common.wire.protocol import Register
    from psserver.coordinator.membership import MAX_LABEL, Membership
    from psserver.status.live import _worker_status

    record = Membership(max_workers=2, worker_timeout=10).register(
        b"id", Register("n" * 500 + "\n", "host", "cpu", 1, "p1", {})
    )
    status = training_status("sync", gradients=2, followers_seconds=None, staleness=None)
    status["workers"] = [_worker_status(record, time.monotonic())]
    name = status["workers"][0]["name"]
    assert len(name) == MAX_LABEL and name.endswith("... (501 characters)"), name
    assert name in format_status(status)
