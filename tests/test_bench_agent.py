"""`ps-bench agent` and `ps-bench comm --agent`: the workers run on other hosts' agents.

Real agent processes on loopback (and, where the machine allows, in network namespaces of
their own); a raw DEALER plays a coordinator that sends what a real one never would.
"""

import functools
import itertools
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import pytest
import zmq
from click.testing import CliRunner

from common.errors import PSError
from psserver.bench import agentlink
from psserver.bench.agentjob import follower_args
from psserver.bench.agentlink import agent_endpoint
from psserver.bench.agentwire import AGENT_PROTOCOL, MAX_TIMEOUT_S, BadRequest, check_target
from psserver.bench.cli import command
from psserver.bench.clients import ClientJob
from psserver.bench.cputally import CpuTally, clients_cpu
from psserver.bench.procs import ProcessGroup
from psserver.bench.remote import REPLY_GRACE_S, RemoteClients
from tests.harness import free_port, free_port_pair

if TYPE_CHECKING:
    from psserver.bench.netns import LinkLab

STARTUP_S = 60.0


class AgentProcess:
    """`ps-bench agent` in a process of its own, optionally under a command prefix. It is
    started at once and waited for at the first use of its endpoint, so that several
    start side by side (each takes seconds to import torch)."""

    def __init__(self, scratch: Path, name: str, bind: str, prefix: tuple[str, ...] = ()) -> None:
        self.log = scratch / f"{name}.log"
        self.endpoint_file = scratch / f"{name}.endpoint"
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "psserver.bench.cli", "agent", "--bind", bind,
             "--endpoint-file", str(self.endpoint_file)],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.deadline = time.monotonic() + STARTUP_S

    @functools.cached_property
    def endpoint(self) -> str:
        """Where it listens, once it does."""
        while not (self.endpoint_file.exists() and self.endpoint_file.read_text()):
            assert self.process.poll() is None, self.log.read_text()
            assert time.monotonic() < self.deadline, "the agent did not start"
            time.sleep(0.05)
        return self.endpoint_file.read_text().strip()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[list[AgentProcess]]:
    started = [AgentProcess(tmp_path, f"agent{i}", "tcp://127.0.0.1:*") for i in range(3)]
    try:
        for agent in started:
            assert agent.endpoint  # all three listen before the test begins
        yield started
    finally:
        for agent in started:
            agent.stop()


class RawCoordinator:
    """A DEALER that sends whatever frames a test wants and reads the agent's replies."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(endpoint)
        self.ids = itertools.count(1)

    def send_frames(self, *frames: bytes, wait_s: float = 10.0) -> dict[str, Any]:
        self.socket.send_multipart(list(frames))
        assert self.socket.poll(int(1000 * wait_s)), "the agent did not answer"
        reply = msgpack.unpackb(self.socket.recv(), raw=False)
        assert isinstance(reply, dict)
        return reply

    def request(self, op: str, wait_s: float = 10.0, **fields: Any) -> dict[str, Any]:
        message = {"v": AGENT_PROTOCOL, "id": next(self.ids), "op": op, **fields}
        return self.send_frames(msgpack.packb(message), wait_s=wait_s)

    def close(self) -> None:
        self.socket.close()
        self.context.term()


def run_fields(**overrides: Any) -> dict[str, Any]:
    fields = {"role": "synthetic", "endpoint": f"tcp://127.0.0.1:{free_port()}", "rounds": 3,
              "nbytes": 0, "indices": [0], "timeout_s": 60}  # fmt: skip
    return {**fields, **overrides}


@pytest.mark.timeout(240)
def test_comm_runs_its_workers_on_the_agents(agents: list[AgentProcess], tmp_path: Path) -> None:
    json_path = tmp_path / "comm.json"
    port = free_port_pair()
    result = CliRunner().invoke(
        command,
        ["comm", "--workers", "3", "--model", "lenet", "--rounds", "3", "--bucket-mb", "0.05",
         "--num-shards", "2", "--agent", agents[0].endpoint, "--agent", agents[1].endpoint,
         "--port", str(port), "--json", str(json_path)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads(json_path.read_text())
    # Worker i ran on agent i mod 2, against servers that listened where the agents reach.
    hosts = results["client_hosts"]
    assert [(h["agent"], h["clients"]) for h in hosts] == [
        (agents[0].endpoint, [0, 2]),
        (agents[1].endpoint, [1]),
    ]
    assert all(h["host"] == socket.gethostname() and h["cores"] >= 1 for h in hosts)
    assert results["server_host"] == "127.0.0.1"
    # The workers really pulled and pushed: every pull after each one's first found its
    # buckets streamed back (2 warm-up and 3 timed rounds).
    assert results["sync_streamed_pulls"] == 3 * (2 + 3 - 1)
    assert results["sync_round_ms"] > 0 and results["floor_round_ms"]["median_ms"] > 0
    assert results["sync_sharded_round_ms"] > 0 and results["async_updates_per_second"] > 0
    for use in results["cpu_ms_per_round"].values():
        assert use["server"] > 0 and use["each_worker"] > 0
    # Each agent ran its share of every phase: the floor's clients and four server runs.
    # Every run's server listened on --port, one after the other.
    first, second = (agent.log.read_text() for agent in agents[:2])
    assert first.count(f"running 2 floor clients against tcp://127.0.0.1:{port} ") == 1
    assert first.count(f"running 2 synthetic workers against tcp://127.0.0.1:{port} ") == 4
    assert second.count("running 1 floor client against") == 1
    assert second.count("running 1 synthetic worker against") == 4
    assert first.count("done: ") == 5 and second.count("done: ") == 5
    assert f"workers [0, 2] on {socket.gethostname()}" in result.output
    assert "the busiest host's" in result.output
    # The agents are free for the next benchmark.
    for agent in agents:
        coordinator = RawCoordinator(agent.endpoint)
        assert coordinator.request("hello")["busy"] is False
        coordinator.close()


@pytest.mark.timeout(120)
def test_an_agent_refuses_bad_requests_and_keeps_serving(agents: list[AgentProcess]) -> None:
    coordinator = RawCoordinator(agents[0].endpoint)
    try:
        refusals = [
            (coordinator.send_frames(b"\xc1not msgpack"), "the request is not valid msgpack"),
            (coordinator.send_frames(msgpack.packb([1, 2])), "a request is a msgpack map"),
            (coordinator.send_frames(b"a", b"b"), "a request is one frame, not 2"),
            (coordinator.send_frames(msgpack.packb({"v": 99, "id": 1, "op": "hello"})),
             "agent protocol 99, this agent speaks 1: run the same release"),
            (coordinator.send_frames(b"x" * 70_000), "a request of 70000 bytes"),
            (coordinator.request("reboot"), "unknown op 'reboot'"),
            (coordinator.request("run", **run_fields(role="shell")), "role must be one of"),
            (coordinator.request("run", **run_fields(rounds=-1)), "rounds must be an integer"),
            (coordinator.request("run", **run_fields(indices=[0, 0])), "indices must be a list of"),
            (coordinator.request("run", **run_fields(timeout_s="soon")), "timeout_s must be"),
            (coordinator.request("run", **run_fields(timeout_s=True)), "timeout_s must be"),
            (coordinator.send_frames(msgpack.packb({1: 2})), "the request is not valid msgpack"),
            (coordinator.request("run", **run_fields(role="floor")), "nbytes must be an integer"),
            (coordinator.request("run", **run_fields(endpoint="ipc:///tmp/x")),
             "endpoint must be tcp://IP:PORT"),
            (coordinator.request("run", **run_fields(endpoint="tcp://192.0.2.7:5555")),
             "only sends traffic to the host that asks it"),
        ]  # fmt: skip
        for reply, expected in refusals:
            assert reply["ok"] is False and expected in reply["error"], (expected, reply)
        hello = coordinator.request("hello")
        assert hello["ok"] is True and hello["busy"] is False
        assert hello["host"] == socket.gethostname()
    finally:
        coordinator.close()
    assert agents[0].process.poll() is None


@pytest.mark.timeout(120)
def test_a_running_job_is_the_only_one_and_its_peer_can_cancel_it(
    agents: list[AgentProcess],
) -> None:
    owner, other = RawCoordinator(agents[0].endpoint), RawCoordinator(agents[0].endpoint)
    try:
        # No server listens there: the worker would wait for it for minutes.
        owner.socket.send(
            msgpack.packb({"v": AGENT_PROTOCOL, "id": 7, "op": "run", **run_fields()})
        )
        deadline = time.monotonic() + 30
        while not other.request("hello")["busy"]:
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.1)
        busy = other.request("run", **run_fields())
        assert busy["ok"] is False and "busy with 1 synthetic worker" in busy["error"]
        assert other.request("cancel")["cancelled"] is False  # not its job
        assert owner.request("cancel")["cancelled"] is True
        assert owner.request("hello")["busy"] is False
    finally:
        owner.close()
        other.close()
    assert "cancelled: 1 synthetic worker" in agents[0].log.read_text()


@pytest.mark.timeout(120)
def test_a_failed_server_cancels_the_agents_clients(agents: list[AgentProcess]) -> None:
    with RemoteClients([agents[0].endpoint], None) as clients, ProcessGroup() as group:
        assert clients.server_host == "127.0.0.1"
        group.start("server", "psserver.bench.floor", "no-such-command")  # exits 2 at once
        job = ClientJob("synthetic", f"tcp://127.0.0.1:{free_port()}", 3)
        started = time.monotonic()
        with pytest.raises(PSError, match="ps sync: server exited with code 2"):
            clients.run(group, "ps sync", job, 1)
        assert time.monotonic() - started < 30  # not the agents' deadline
    coordinator = RawCoordinator(agents[0].endpoint)
    deadline = time.monotonic() + 10
    while coordinator.request("hello")["busy"]:  # the cancel went out on close
        assert time.monotonic() < deadline, "the agent's job was not cancelled"
        time.sleep(0.1)
    coordinator.close()


@pytest.mark.timeout(120)
def test_an_agent_that_stops_answering_mid_run_is_named_within_seconds(
    agents: list[AgentProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent stopped mid-phase left the coordinator waiting, silent, for the whole
    --timeout (30 minutes by default), and then blaming "the agents". The agent is frozen
    (SIGSTOP) rather than killed, so that its client is cancelled when it wakes."""
    monkeypatch.setattr(agentlink, "AGENT_SILENCE_S", 3.0)
    monkeypatch.setattr(agentlink, "PING_INTERVAL_S", 0.5)
    frozen = agents[0]
    freeze = threading.Timer(2.0, frozen.process.send_signal, (signal.SIGSTOP,))
    try:
        with RemoteClients([frozen.endpoint], None) as clients, ProcessGroup() as group:
            job = ClientJob("synthetic", f"tcp://127.0.0.1:{free_port()}", 3)  # nobody there
            started = time.monotonic()
            freeze.start()
            with pytest.raises(PSError) as failed:
                clients.run(group, "ps sync", job, 1)
            assert time.monotonic() - started < 20  # not the agents' deadline
    finally:
        freeze.join()
        frozen.process.send_signal(signal.SIGCONT)
    assert str(failed.value).startswith(
        f"ps sync: the agent at {frozen.endpoint} has not answered for 3 s: it stopped, or "
        "its host cannot be reached"
    ), failed.value
    coordinator = RawCoordinator(frozen.endpoint)
    deadline = time.monotonic() + 10
    while coordinator.request("hello")["busy"]:  # the cancel sent on the way out came in
        assert time.monotonic() < deadline, "the agent's job was not cancelled"
        time.sleep(0.1)
    coordinator.close()


@pytest.mark.timeout(60)
def test_an_agent_nobody_runs_is_one_clear_error() -> None:
    port = free_port()
    result = CliRunner().invoke(
        command, ["comm", "--model", "lenet", "--agent", f"127.0.0.1:{port}"]
    )
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        f"Error: no ps-bench agent answered at tcp://127.0.0.1:{port} within 10 s: start one "
        "there with `ps-bench agent`, and check that this host can reach it"
    )


def test_host_without_agents_is_a_usage_error() -> None:
    result = CliRunner().invoke(command, ["comm", "--host", "10.0.0.1"])
    assert result.exit_code == 2 and "--host is the address agents reach" in result.output


def test_train_refuses_a_port_it_would_not_use() -> None:
    result = CliRunner().invoke(command, ["train", "--port", "5555"])
    assert result.exit_code == 2 and "uses --port only for runs with --agent" in result.output


@pytest.mark.parametrize(
    ("given", "endpoint"),
    [
        ("node7", "tcp://node7:5600"),
        ("node7:6000", "tcp://node7:6000"),
        ("tcp://10.0.0.2:6000", "tcp://10.0.0.2:6000"),
        ("[fd00::2]", "tcp://[fd00::2]:5600"),
        ("[fd00::2]:6000", "tcp://[fd00::2]:6000"),
    ],
)
def test_agent_addresses_take_a_default_port(given: str, endpoint: str) -> None:
    assert agent_endpoint(given) == endpoint


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("ipc:///tmp/agent", "expected HOST, HOST:PORT or tcp://HOST:PORT"),
        (":6000", "expected HOST, HOST:PORT or tcp://HOST:PORT"),
        ("node7:port", "the port must be a number from 1 to 65535, not 'port'"),
        ("node7:99999", "the port must be a number from 1 to 65535, not '99999'"),
    ],
)
def test_a_malformed_agent_address_is_refused(given: str, why: str) -> None:
    with pytest.raises(PSError, match=f"--agent '{re.escape(given)}': {re.escape(why)}"):
        agent_endpoint(given)


@pytest.mark.parametrize(
    ("endpoint", "peer", "allowed"),
    [
        ("tcp://10.0.0.1:5555", "10.0.0.1", True),
        ("tcp://10.0.0.9:5555", "10.0.0.1", False),  # a third host
        ("tcp://127.0.0.1:5555", "127.0.0.1", True),
        ("tcp://127.0.0.2:5555", "127.0.0.1", True),  # loopback is loopback
        ("tcp://127.0.0.1:5555", "10.0.0.1", False),  # the agent's own host, for a remote peer
        ("tcp://127.0.0.1:5555", None, True),  # peer unknown (not TCP): loopback only
        ("tcp://10.0.0.1:5555", None, False),
        ("tcp://[::1]:5555", "::1", True),
    ],
)
def test_clients_only_dial_the_host_that_asked(
    endpoint: str, peer: str | None, allowed: bool
) -> None:
    if allowed:
        check_target(endpoint, peer)
    else:
        with pytest.raises(BadRequest):
            check_target(endpoint, peer)


def test_the_cpu_bound_is_the_busiest_hosts() -> None:
    here = socket.gethostname()
    results = [
        {"host": here, "cores": 2, "cpu_seconds": 1.0},
        {"host": "gpu-a", "cores": 4, "cpu_seconds": 6.0},
        {"host": "gpu-a", "cores": 4, "cpu_seconds": 2.0},
        {"host": "gpu-b", "cores": 1, "cpu_seconds": 3.0},
    ]
    tally = clients_cpu(server_s=3.0, results=results, rounds=10, followers_s=1.0)
    assert tally.workers_s == 12.0
    assert sorted(tally.elsewhere) == [("gpu-a", 4, 8.0), ("gpu-b", 1, 3.0)]
    # Here: server 3 + followers 1 + a worker's 1 over 2 cores = 2.5 s; gpu-a 8 / 4 = 2;
    # gpu-b 3 / 1 = 3: the busiest, over 10 rounds.
    assert tally.bound_ms(2) == pytest.approx(300.0)
    both = tally + tally  # two runs of a phase: each host's seconds add up
    assert sorted(both.elsewhere) == [("gpu-a", 4, 16.0), ("gpu-b", 1, 6.0)]
    assert both.bound_ms(2) == pytest.approx(300.0)
    alone = CpuTally(server_s=3.0, workers_s=1.0, rounds=10, followers_s=1.0)
    assert alone.bound_ms(2) == pytest.approx(250.0)  # all on one host: as before


def run_with_lab_agents(
    lab: "LinkLab", scratch: Path, hosts: list[int], args: list[str]
) -> tuple["subprocess.CompletedProcess[str]", list[AgentProcess]]:
    """`ps-bench ARGS` on lab host 0 while an agent listens on port 5600 of each of `hosts`;
    the agents are stopped afterwards, and their logs stay to be read."""
    agents = [
        AgentProcess(scratch, f"agent{h}", f"tcp://{lab.address(h)}:5600", lab.prefix_for(h))
        for h in hosts
    ]
    try:
        for agent in agents:
            assert agent.endpoint  # listening before the coordinator dials it
        coordinator = subprocess.run(
            [*lab.prefix_for(0), sys.executable, "-m", "psserver.bench.cli", *args],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
    finally:
        for agent in agents:
            agent.stop()
    return coordinator, agents


@pytest.mark.timeout(300)
def test_comm_across_network_namespaces_dials_back_the_coordinators_address(
    tmp_path: Path,
) -> None:
    """Four hosts of their own: the coordinator and its servers on one, a worker agent on
    each of two others, and a shard agent on the last; the servers listen on the address of
    the coordinator's route to the agents, the follower shard on its own host's."""
    from psserver.bench.netns import LinkLab
    from tests.test_multihost import skip_without_link_lab

    skip_without_link_lab()
    json_path = tmp_path / "comm.json"
    with LinkLab(4, mbit=1000) as lab:
        coordinator, agents = run_with_lab_agents(
            lab, tmp_path, [1, 2, 3],
            ["comm", "--workers", "2", "--model", "lenet", "--rounds", "3", "--bucket-mb", "0.05",
             "--agent", lab.address(1), "--agent", f"{lab.address(2)}:5600",
             "--num-shards", "2", "--shard-agent", lab.address(3), "--json", str(json_path)],
        )  # fmt: skip
    assert coordinator.returncode == 0, coordinator.stderr
    results = json.loads(json_path.read_text())
    assert results["server_host"] == lab.address(0)
    assert [(h["agent"], h["clients"]) for h in results["client_hosts"]] == [
        (f"tcp://{lab.address(1)}:5600", [0]),
        (f"tcp://{lab.address(2)}:5600", [1]),
    ]
    assert results["follower_hosts"] == [
        {"agent": f"tcp://{lab.address(3)}:5600", "host": socket.gethostname(),
         "cores": results["client_hosts"][0]["cores"], "gpus": 0, "shards": [1]},
    ]  # fmt: skip
    assert results["sync_streamed_pulls"] == 2 * (2 + 3 - 1)
    assert results["sync_sharded_round_ms"] > 0
    for agent in agents[:2]:
        log = agent.log.read_text()
        assert f"synthetic worker against tcp://{lab.address(0)}:" in log
        assert f"for {lab.address(0)}" in log and log.count("done: ") == 5
    shard_log = agents[2].log.read_text()
    assert f"running follower shard 1 against tcp://{lab.address(0)}:" in shard_log
    assert shard_log.count("cancelled: follower shard 1") == 1


@pytest.mark.timeout(240)
def test_a_sharded_run_puts_its_followers_on_the_shard_agents(
    agents: list[AgentProcess], tmp_path: Path
) -> None:
    json_path = tmp_path / "comm.json"
    worker_agent, *shard_agents = agents
    result = CliRunner().invoke(
        command,
        ["comm", "--workers", "2", "--model", "lenet", "--rounds", "3", "--bucket-mb", "0.05",
         "--num-shards", "3", "--agent", worker_agent.endpoint,
         "--shard-agent", shard_agents[0].endpoint, "--shard-agent", shard_agents[1].endpoint,
         "--json", str(json_path)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads(json_path.read_text())
    # Follower shard i on shard agent i - 1; the leader here, and both workers on one agent.
    assert [(h["agent"], h["shards"]) for h in results["follower_hosts"]] == [
        (shard_agents[0].endpoint, [1]),
        (shard_agents[1].endpoint, [2]),
    ]
    assert [(h["agent"], h["clients"]) for h in results["client_hosts"]] == [
        (worker_agent.endpoint, [0, 1])
    ]
    assert results["sync_sharded_round_ms"] > 0
    # The followers' CPU time is on other hosts and not counted: no bound, rather than a
    # wrong one.
    assert results["cpu_ms_per_round"]["sharded"]["followers"] is None
    assert results["cpu_bound_round_ms"]["sharded"] is None
    assert results["cpu_bound_round_ms"]["sync"] > 0
    for shard, agent in enumerate(shard_agents, start=1):
        log = agent.log.read_text()
        assert log.count(f"running follower shard {shard} against tcp://127.0.0.1:") == 1
        assert log.count(f"cancelled: follower shard {shard}") == 1  # once the workers were done
    assert "its followers ran elsewhere" in result.output
    assert f"follower shards [1] on {socket.gethostname()}" in result.output


@pytest.mark.timeout(120)
def test_a_follower_that_cannot_start_is_reported_and_the_agent_goes_on(
    agents: list[AgentProcess],
) -> None:
    coordinator = RawCoordinator(agents[0].endpoint)
    serve = {"leader": f"tcp://127.0.0.1:{free_port()}", "shards": [1], "num_shards": 2,
             "bind_host": "192.0.2.1", "port": 0, "timeout_s": 60}  # fmt: skip
    try:
        refusals = [
            (coordinator.request("serve", **{**serve, "leader": "tcp://192.0.2.7:5555"}),
             "only sends traffic to the host that asks it"),
            (coordinator.request("serve", **{**serve, "shards": [0]}), "shards must be a list"),
            (coordinator.request("serve", **{**serve, "num_shards": 1}), "num_shards must be"),
            (coordinator.request("serve", **{**serve, "bind_host": "ps-1"}),
             "bind_host must be an IP address"),
            (coordinator.request("serve", **{**serve, "threads": 0}), "threads must be"),
            (coordinator.request("serve", **{**serve, "shard_secret": "short"}),
             "shard_secret must be a string of 16 to 4096 characters"),
            # Values of the wrong type that Python's own checks would take (an int is an IP
            # address to ipaddress), or choke on (a list is unhashable): refused, and answered.
            (coordinator.request("serve", **{**serve, "bind_host": 2130706433}),
             "bind_host must be an IP address"),
            (coordinator.request("run", **run_fields(role="ps-worker", model=[1])),
             "model must be one of"),
        ]  # fmt: skip
        for reply, expected in refusals:
            assert reply["ok"] is False and expected in reply["error"], (expected, reply)
        # 192.0.2.1 is no address of this host: the follower cannot listen there and exits,
        # and the agent says so in its answer to the request.
        failed = coordinator.request("serve", **serve)
        assert failed["ok"] is False
        assert "follower shard 1" in failed["error"] and "exited with code" in failed["error"]
        assert coordinator.request("hello")["busy"] is False
    finally:
        coordinator.close()


def test_follower_shards_get_the_threads_asked_for_and_one_by_default() -> None:
    serve = {"leader": "tcp://10.0.0.1:5555", "shards": [1, 2], "num_shards": 3,
             "bind_host": "10.0.0.2", "port": 6000, "timeout_s": 60}  # fmt: skip
    assert follower_args({**serve, "threads": 4}, 2) == [
        "--shard", "2", "--num-shards", "3", "--leader", "tcp://10.0.0.1:5555",
        "--bind", "tcp://10.0.0.2:6002", "--threads", "4", "--log-level", "warning",
    ]  # fmt: skip
    assert follower_args(serve, 1)[-4:] == ["--threads", "1", "--log-level", "warning"]
    # The shard secret's file, written where only the agent's user looks; never the secret.
    assert follower_args(serve, 1, Path("/scratch/shard.secret"))[-2:] == [
        "--shard-secret-file", "/scratch/shard.secret",
    ]  # fmt: skip


def test_follower_requests_carry_the_threads_and_a_lifetime_as_long_as_the_run(
    agents: list[AgentProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    worker_agent, shard_agent, _ = agents
    sent: list[dict[str, Any]] = []
    with RemoteClients([worker_agent.endpoint], None, None, [shard_agent.endpoint]) as clients:
        link = clients.shards.links[0]
        monkeypatch.setattr(link, "send", lambda op, **fields: sent.append(fields) or 1)
        with clients.followers("tcp://127.0.0.1:5555", 2, threads=3, timeout=3600):
            pass
        with clients.followers("tcp://127.0.0.1:5555", 2, timeout=10**9, shard_secret=b"s" * 64):
            pass
    serve, cancel, long_serve, _ = sent
    assert (serve["threads"], serve["timeout_s"]) == (3, 3600 + REPLY_GRACE_S)
    assert "shard_secret" not in serve and long_serve["shard_secret"] == "s" * 64
    assert cancel == {}
    assert (long_serve["threads"], long_serve["timeout_s"]) == (1, MAX_TIMEOUT_S)  # the cap


@pytest.mark.parametrize("benchmark", ["comm", "train"])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        # Addresses that resolve: a name that does not is refused first (test_bench_usage).
        (["--shard-agent", "127.0.0.2", "--num-shards", "2"],
         "--shard-agent places follower shards"),
        (["--agent", "127.0.0.1", "--shard-agent", "127.0.0.2", "--shard-agent", "127.0.0.3",
          "--num-shards", "2"],
         "--num-shards 2 has 1 follower shards, too few for 2 --shard-agent hosts"),
        (["--agent", "127.0.0.1", "--shard-agent", "tcp://127.0.0.1:5600", "--num-shards", "2"],
         "tcp://127.0.0.1:5600 is both --agent and --shard-agent"),
    ],
)  # fmt: skip
def test_shard_agent_options_are_checked_before_anything_runs(
    benchmark: str, options: list[str], message: str
) -> None:
    result = CliRunner().invoke(command, [benchmark, *options])
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.timeout(120)
def test_a_follower_that_dies_mid_run_ends_the_run_with_its_agents_word(
    agents: list[AgentProcess],
) -> None:
    worker_agent, shard_agent, _ = agents
    leader = f"tcp://127.0.0.1:{free_port()}"  # nobody listens: everyone waits
    with (
        RemoteClients([worker_agent.endpoint], None, None, [shard_agent.endpoint]) as clients,
        ProcessGroup() as group,
        clients.followers(leader, 2),
    ):
        pattern = f"psserver.cli.server --shard 1 --num-shards 2 --leader {leader}"
        deadline = time.monotonic() + 30
        while subprocess.run(["pkill", "-9", "-f", pattern]).returncode != 0:
            assert time.monotonic() < deadline, "the follower shard did not start"
            time.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(PSError, match=r"follower shard 1.* was killed by SIGKILL"):
            clients.run(group, "ps sync", ClientJob("synthetic", leader, 3), 1)
        assert time.monotonic() - started < 30
    coordinator = RawCoordinator(worker_agent.endpoint)  # its worker was cancelled
    deadline = time.monotonic() + 10
    while coordinator.request("hello")["busy"]:
        assert time.monotonic() < deadline, "the worker agent's job was not cancelled"
        time.sleep(0.1)
    coordinator.close()


@pytest.mark.timeout(60)
def test_a_second_agent_on_a_taken_port_says_what_to_do(agents: list[AgentProcess]) -> None:
    taken = agents[0].endpoint
    second = subprocess.run(
        [sys.executable, "-m", "psserver.bench.cli", "agent", "--bind", taken],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert second.returncode == 1
    assert second.stderr.strip().splitlines()[-1] == (
        f"Error: cannot listen on {taken} (Address already in use): another agent or "
        "program has that port: stop it or give this agent another with "
        "--bind tcp://0.0.0.0:PORT"
    )
    assert agents[0].process.poll() is None
