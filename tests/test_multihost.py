"""Multi-host fault tests: the server and two workers run as separate hosts in Linux network
namespaces that the test builds itself, and the faults are injected into the network between
them, not into the processes.

    ps<pid>-srv  eth0 10.213.7.1  ─┐
    ps<pid>-w0   eth0 10.213.7.10 ─┼─ br0 in ps<pid>-br (a bridge in a namespace of its own)
    ps<pid>-w1   eth0 10.213.7.11 ─┘

Nothing is attached to the root namespace's network and there are no default routes, so no
packet can leave these namespaces. A partition is an nftables drop rule inside one worker's
namespace; a slow link is a tbf rate limit on one worker's veth. (netem is not available on
every kernel, so it is not used.) The tests need root, `ip`, `nft` and `tc`, and a kernel that
lets them create namespaces, veth pairs and bridges; they skip with the reason otherwise.

What this is not: a performance test. Timings are printed; the one asserted is a lower bound
that the rate limit itself imposes.
"""

import contextlib
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from common.catalog import build_model
from common.errors import PSError
from common.roles import SERVER, WORKER, command_args
from psserver.bench.netns import COMMAND_TIMEOUT_S, LinkLab, run_command
from tests.harness import Cluster, Proc, wait_for_log

pytestmark = [pytest.mark.fault, pytest.mark.timeout(300)]

SUBNET = "10.213.7"
SERVER_ADDRESS = f"{SUBNET}.1"
ENDPOINT = f"tcp://{SERVER_ADDRESS}:5555"
LENET = ["--model", "lenet", "--test-limit", "100", "--lr", "0.05", "--momentum", "0.9"]


def in_netns(namespace: str, *args: str) -> str:
    return run_command("ip", "netns", "exec", namespace, *args)


def netns_names() -> set[str]:
    # `ip netns list` prints "NAME" or "NAME (id: N)" per line.
    return {line.split()[0] for line in run_command("ip", "netns", "list").splitlines() if line}


@functools.cache
def skip_without_link_lab() -> None:
    """Skip the calling test unless `ps-bench link`'s lab of network namespaces can be built
    here."""
    reason = LinkLab.why_not() or why_no_namespaces()
    if reason is not None:
        pytest.skip(reason)


def why_no_namespaces() -> str | None:
    """None when this machine can run the tests, else the reason to skip them."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    missing = [tool for tool in ("ip", "nft", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} on PATH (iproute2, nftables)"
    probe = f"ps{os.getpid()}-probe"
    try:
        run_command("ip", "netns", "add", probe)
    except (PSError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a network namespace here (a sandbox?): {exc}"
    try:
        for step in (
            ("ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"),
            ("ip", "-n", probe, "link", "add", "pbr", "type", "bridge"),
            ("ip", "netns", "exec", probe, "nft", "add", "table", "inet", "probe"),
            ("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "pa", "root", "tbf",
             "rate", "10mbit", "burst", "32kbit", "latency", "400ms"),
        ):  # fmt: skip
            run_command(*step)
    except (PSError, OSError, subprocess.TimeoutExpired) as exc:
        return f"the kernel lacks veth, bridge, nftables or tbf support: {exc}"
    finally:
        run_command("ip", "netns", "del", probe)
    return None


@dataclass
class Hosts:
    """Three hosts on one bridge: the server and two workers, each in its own namespace."""

    cluster: Cluster
    server: str
    workers: list[str]
    bridge: str

    def namespaces(self) -> list[str]:
        return [self.server, *self.workers, self.bridge]

    def start(self, namespace: str, role: str, module: str, *args: str) -> Proc:
        """Start `python -m module args` inside a namespace, as Cluster.start does on the host."""
        index = len(self.cluster.procs)
        stdout_path = self.cluster.workdir / f"{index}-{role}.out"
        stderr_path = self.cluster.workdir / f"{index}-{role}.err"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            # `ip netns exec` execs the command, so the pid (and process group) is Python's.
            process = subprocess.Popen(
                ["ip", "netns", "exec", namespace, sys.executable, "-m", module, *args],
                stdout=out,
                stderr=err,
                cwd=self.cluster.workdir,
                env=env,
                start_new_session=True,
            )
        proc = Proc(role, process, stdout_path, stderr_path)
        self.cluster.procs.append(proc)
        return proc

    def start_server(self, *args: str) -> Proc:
        endpoint_file = self.cluster.workdir / "server.endpoint"
        told = {
            "bind": ENDPOINT, "endpoint_file": endpoint_file, "threads": 1, "stop_grace": 5.0,
            "summary": self.cluster.workdir / "summary.json",
        }  # fmt: skip
        proc = self.start(
            self.server, "server", SERVER.module, *command_args(SERVER, told), *LENET, *args
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if endpoint_file.exists() and endpoint_file.read_text().strip():
                return proc
            if proc.process.poll() is not None:
                raise AssertionError(f"server exited before listening\n{proc.describe()}")
            time.sleep(0.05)
        raise AssertionError(f"server did not write its endpoint in 60 s\n{proc.describe()}")

    def start_worker(self, index: int, *args: str) -> Proc:
        told = {
            "server": ENDPOINT, "device": "cpu", "threads": 1, "progress": "log",
            "name": f"host-w{index}",
        }  # fmt: skip
        return self.start(
            self.workers[index], f"w{index}", WORKER.module, *command_args(WORKER, told), *args
        )

    def summary(self) -> dict:
        return json.loads((self.cluster.workdir / "summary.json").read_text())


def build_hosts(hosts: Hosts) -> None:
    bridge = hosts.bridge
    run_command("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
    run_command("ip", "-n", bridge, "link", "set", "lo", "up")
    run_command("ip", "-n", bridge, "link", "set", "br0", "up")
    addresses = {hosts.server: f"{SERVER_ADDRESS}/24"}
    addresses |= {ns: f"{SUBNET}.{10 + i}/24" for i, ns in enumerate(hosts.workers)}
    for port, (namespace, address) in enumerate(addresses.items()):
        # Both ends are created straight inside their namespaces: never in the root one.
        peer = f"port{port}"
        run_command(
            "ip", "-n", bridge, "link", "add", peer, "type", "veth",
            "peer", "name", "eth0", "netns", namespace,
        )  # fmt: skip
        run_command("ip", "-n", bridge, "link", "set", peer, "master", "br0", "up")
        run_command("ip", "-n", namespace, "link", "set", "lo", "up")
        run_command("ip", "-n", namespace, "addr", "add", address, "dev", "eth0")
        run_command("ip", "-n", namespace, "link", "set", "eth0", "up")


@pytest.fixture
def hosts(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Hosts]:
    reason = why_no_namespaces()
    if reason is not None:
        pytest.skip(reason)
    prefix = f"ps{os.getpid()}"
    made = Hosts(cluster, f"{prefix}-srv", [f"{prefix}-w0", f"{prefix}-w1"], f"{prefix}-br")
    created: list[str] = []
    try:
        for namespace in made.namespaces():
            run_command("ip", "netns", "add", namespace)
            created.append(namespace)
        build_hosts(made)
        failed_before = request.session.testsfailed
        yield made
        if request.session.testsfailed > failed_before:  # pytest shows this output on failure
            print(f"every child's output:\n{cluster.describe_all()}")
    finally:
        # Processes first: a namespace lives on, unnamed, while a process is still inside it.
        cluster.kill_all()
        problems = []
        for namespace in created:
            with contextlib.suppress(PSError, subprocess.TimeoutExpired):
                if pids := run_command("ip", "netns", "pids", namespace).split():
                    problems.append(f"processes {pids} still run in {namespace}")
            try:
                run_command("ip", "netns", "del", namespace)
            except (PSError, subprocess.TimeoutExpired) as exc:
                problems.append(str(exc))
        left = set(created) & netns_names()
        assert not left and not problems, f"namespaces left behind: {left}; {problems}"


def partition(namespace: str) -> None:
    """Drop every packet between this host and the server, both ways (no RST, no ICMP)."""
    hook = "type filter hook {0} priority 0; ip {1} " + SERVER_ADDRESS + " drop;"
    ruleset = (
        "table inet pstest {\n"
        f"  chain output {{ {hook.format('output', 'daddr')} }}\n"
        f"  chain input {{ {hook.format('input', 'saddr')} }}\n"
        "}\n"
    )
    result = subprocess.run(
        ["ip", "netns", "exec", namespace, "nft", "-f", "-"],
        input=ruleset,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert result.returncode == 0, f"nft -f failed: {result.stderr}"


def heal(namespace: str) -> None:
    in_netns(namespace, "nft", "delete", "table", "inet", "pstest")


def worker_id_of(worker: Proc, after: int = 0) -> int:
    """The id in the worker's first 'registered as worker N' line after offset `after`."""
    log = worker.stderr()[after:]
    assert "registered as worker " in log, worker.describe()
    return int(log.split("registered as worker ")[1].split(":")[0])


def test_partitioned_worker_is_declared_dead_and_rejoins_after_healing(hosts: Hosts) -> None:
    # 960 images, batch 16, 2 workers: 30 steps per shard. The step delay stretches epoch 0 to
    # ~14 s, so that the partitioned worker (~6 s away) is back before epoch 1 begins.
    server = hosts.start_server(
        "--workers", "2", "--train-limit", "960", "--batch-size", "16", "--epochs", "2",
        "--worker-timeout", "2",
    )  # fmt: skip
    # Enough retries to outlast the partition: 2 s of silence each, backoff 0.5 s, 1 s, ...
    survivor, victim = (
        hosts.start_worker(i, "--timeout", "2", "--retries", "10", "--step-delay", "0.4")
        for i in range(2)
    )
    started = wait_for_log(server, "training starts", timeout=60)
    wait_for_log(victim, "step 1/", timeout=60)  # it has trained before the cut (pushes > 0)
    victim_id = worker_id_of(victim)
    survivor_id = worker_id_of(survivor)
    cut_at = time.monotonic()
    partition(hosts.workers[1])
    try:
        dead_at = wait_for_log(server, f"worker {victim_id} (host-w1) declared dead", timeout=15)
        time.sleep(max(0.0, cut_at + 4.0 - time.monotonic()))  # hold it longer than the timeout
    finally:
        heal(hosts.workers[1])
    healed_at = time.monotonic()
    back_at = wait_for_log(victim, "registering again", timeout=30)
    wait_for_log(server, "epoch 1 begins", timeout=60)
    for proc in (survivor, victim):
        hosts.cluster.wait(proc, timeout=90)
    hosts.cluster.wait(server, timeout=60)
    print(
        f"\npartition: declared dead {dead_at - cut_at:.1f} s after the cut (--worker-timeout 2),"
        f" healed after {healed_at - cut_at:.1f} s, registering again"
        f" {back_at - healed_at:.1f} s after healing; the run took"
        f" {time.monotonic() - started:.1f} s from training start"
    )

    assert "unknown-worker" in victim.stderr()
    log = server.stderr()
    assert log.index("declared dead") < log.index("epoch 1 begins")
    new_id = worker_id_of(victim, after=victim.stderr().index("registering again"))
    # The rejoined worker took a shard at the epoch boundary, not in the middle of epoch 0.
    assert f"epoch 1 begins: 2 workers {sorted([survivor_id, new_id])}" in log, log[-4000:]

    summary = hosts.summary()
    assert summary["epochs"] == 2
    # Every step waited for the survivor, which pushed its whole shard in both epochs.
    assert summary["global_steps"] == 60
    by_id = {w["worker_id"]: w for w in summary["per_worker"]}
    assert set(by_id) == {victim_id, survivor_id, new_id}
    assert by_id[victim_id]["state"] == "dead"
    assert 0 < by_id[victim_id]["pushes"] < 30  # it trained until the cut, then went quiet
    assert by_id[survivor_id]["state"] == by_id[new_id]["state"] == "stopped"
    assert by_id[survivor_id]["pushes"] == 60
    assert by_id[new_id]["pushes"] == 30


def qdisc_stats(namespace: str, device: str) -> dict:
    (root,) = json.loads(in_netns(namespace, "tc", "-s", "-j", "qdisc", "show", "dev", device))
    return root


def test_rate_limited_worker_finishes_the_job(hosts: Hosts) -> None:
    rate_bits = 10_000_000
    push_bytes = 4 * sum(p.numel() for p in build_model("lenet").parameters())  # 516 kB
    # 320 images, batch 16, 2 workers: 10 steps per epoch, 20 pushes from each worker; at
    # 10 Mbit/s each of w0's pushes spends at least 0.41 s in its shaper.
    hosts.start_server(
        "--workers", "2", "--train-limit", "320", "--batch-size", "16", "--epochs", "2"
    )  # fmt: skip
    in_netns(
        hosts.workers[0], "tc", "qdisc", "add", "dev", "eth0", "root",
        "tbf", "rate", "10mbit", "burst", "32kbit", "latency", "400ms",
    )  # fmt: skip
    workers = [hosts.start_worker(i, "--timeout", "30") for i in range(2)]
    hosts.cluster.wait_all(timeout=120)

    summary = hosts.summary()
    assert summary["epochs"] == 2
    assert summary["global_steps"] == 20
    per_worker = summary["per_worker"]
    assert [w["state"] for w in per_worker] == ["stopped", "stopped"]
    assert [w["pushes"] for w in per_worker] == [20, 20]
    for worker in workers:
        assert "stopped after 20 steps" in worker.stderr(), worker.describe()
    throttled = qdisc_stats(hosts.workers[0], "eth0")
    assert throttled["kind"] == "tbf"
    # The shaper carried every push of w0 and had to hold packets back to keep to its rate...
    assert throttled["bytes"] > 20 * push_bytes
    assert throttled["overlimits"] > 0
    # ...so the run cannot have been faster than the pushes' bytes at 10 Mbit/s: a lower
    # bound that only a shaper that was not in the path could break (headers only add to it).
    least = 20 * push_bytes * 8 / rate_bits
    print(
        f"\nrate limit: {summary['wall_seconds']:.1f} s of training for 20 steps (at least"
        f" {least:.1f} s at 10 Mbit/s), {summary['images_per_second']:.0f} img/s; tbf sent"
        f" {throttled['bytes'] / 1e6:.1f} MB, {throttled['overlimits']} overlimits,"
        f" {throttled['drops']} drops"
    )
    assert summary["wall_seconds"] > 0.9 * least
