"""`ps-bench train --agent`: ps-workers, DDP ranks and the single process on agents' hosts.

Real agents on loopback and, where the machine allows, in network namespaces of their own,
so that the DDP ranks meet at the coordinator's store and then reach each other across
hosts.
"""

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from common.errors import PSError
from psserver.bench.addresses import interface_towards
from psserver.bench.cli import command
from psserver.bench.remote import RemoteClients
from psserver.cli.devices import choose_devices
from tests.test_bench_agent import (
    AgentProcess,
    RawCoordinator,
    agents,
    free_port,
    run_with_lab_agents,
)

__all__ = ["agents"]  # the fixture, shared with test_bench_agent

SHARDED = ("sync_sharded", "sync_sharded_no_overlap")


def train_fields(**overrides: Any) -> dict[str, Any]:
    fields = {"role": "ps-worker", "endpoint": f"tcp://127.0.0.1:{free_port()}",
              "model": "lenet", "batch_size": 8, "steps": 4, "threads": 1, "world_size": 2,
              "overlap": True, "indices": [0], "devices": ["cpu"], "timeout_s": 60}  # fmt: skip
    return {**fields, **overrides}


@pytest.mark.timeout(300)
def test_train_runs_every_kind_of_process_on_the_agents(
    agents: list[AgentProcess], tmp_path: Path
) -> None:
    """ps-workers with and without overlap, the single process, DDP ranks and ranks apart.
    The other phases differ only on the server's side (async), or have a test of their own
    (sharded: below), and test_bench runs all eight on one host."""
    json_path = tmp_path / "train.json"
    first, second, idle = agents
    phases = ("sync", "sync_no_overlap", "single_process", "ddp", "compute_bound")
    result = CliRunner().invoke(
        command,
        ["train", "--workers", "2", "--model", "lenet", "--batch-size", "8", "--steps", "4",
         "--agent", first.endpoint, "--agent", second.endpoint, "--json", str(json_path),
         "--phases", ",".join(phases)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads(json_path.read_text())
    assert list(results["images_per_second"]) == list(phases) == results["phases"]
    assert all(rate > 0 for rate in results["images_per_second"].values())
    assert results["server_host"] == "127.0.0.1"
    assert results["devices"] == ["cpu", "cpu"]
    assert [(h["agent"], h["clients"], h["gpus"]) for h in results["client_hosts"]] == [
        (first.endpoint, [0], 0),
        (second.endpoint, [1], 0),
    ]
    for agent in (first, second):
        log = agent.log.read_text()
        # sync and no overlap: one ps-worker each, against the server here; then one DDP
        # rank against the store here.
        assert log.count("running 1 ps-worker (lenet) against tcp://127.0.0.1:") == 2
        assert log.count("running 1 DDP rank (lenet) against tcp://127.0.0.1:") == 1
        assert log.count("running 1 rank training apart (lenet) against tcp://127.0.0.1:") == 1
    assert first.log.read_text().count("running the single process (lenet) for 127.0.0.1") == 1
    assert "single process" not in second.log.read_text()
    assert first.log.read_text().count("done: ") == 5
    assert second.log.read_text().count("done: ") == 4
    assert "running" not in idle.log.read_text()
    coordinator = RawCoordinator(first.endpoint)
    try:
        assert coordinator.request("hello")["busy"] is False
    finally:
        coordinator.close()


@pytest.mark.timeout(300)
def test_train_runs_its_follower_shards_on_the_shard_agent(
    agents: list[AgentProcess], tmp_path: Path
) -> None:
    json_path = tmp_path / "train.json"
    first, second, shard_host = agents
    result = CliRunner().invoke(
        command,
        ["train", "--workers", "2", "--model", "lenet", "--batch-size", "8", "--steps", "4",
         "--num-shards", "2", "--agent", first.endpoint, "--agent", second.endpoint,
         "--shard-agent", shard_host.endpoint, "--json", str(json_path),
         "--phases", ",".join((*SHARDED, "ddp"))],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    results = json.loads(json_path.read_text())
    assert set(results["images_per_second"]) == {*SHARDED, "ddp"}
    assert all(rate > 0 for rate in results["images_per_second"].values())
    assert [(h["agent"], h["shards"]) for h in results["follower_hosts"]] == [
        (shard_host.endpoint, [1])
    ]
    assert f"follower shards [1] on {socket.gethostname()}" in result.output
    log = shard_host.log.read_text()
    # Both sharded runs (with and without overlap) ran their follower there, against the
    # leader here; each ended when its leader stopped it, or was cancelled after the run.
    assert log.count("running follower shard 1 against tcp://127.0.0.1:") == 2
    ended = log.count("done: follower shard 1, stopped by their leader")
    assert ended + log.count("cancelled: follower shard 1") == 2
    assert "failed" not in log


@pytest.mark.timeout(300)
def test_train_across_network_namespaces_meets_at_the_coordinators_store(
    tmp_path: Path,
) -> None:
    """Three hosts of their own: the coordinator with its servers and the DDP store on one,
    an agent on each of the others. The DDP ranks rendezvous at the coordinator's address,
    then connect to each other through their own hosts' interfaces."""
    from psserver.bench.netns import LinkLab
    from tests.test_multihost import skip_without_link_lab

    skip_without_link_lab()
    json_path = tmp_path / "train.json"
    with LinkLab(3, mbit=1000) as lab:
        coordinator, hosts = run_with_lab_agents(
            lab, tmp_path, [1, 2],
            ["train", "--workers", "2", "--model", "lenet", "--batch-size", "8", "--steps", "4",
             "--agent", lab.address(1), "--agent", lab.address(2), "--json", str(json_path),
             "--phases", "sync,ddp"],
        )  # fmt: skip
    assert coordinator.returncode == 0, coordinator.stderr
    results = json.loads(json_path.read_text())
    assert results["server_host"] == lab.address(0)
    assert [h["clients"] for h in results["client_hosts"]] == [[0], [1]]
    assert all(rate > 0 for rate in results["images_per_second"].values())
    for agent in hosts:
        log = agent.log.read_text()
        assert log.count(f"ps-worker (lenet) against tcp://{lab.address(0)}:") == 1
        assert log.count(f"DDP rank (lenet) against tcp://{lab.address(0)}:") == 1
        assert f"for {lab.address(0)}" in log


BAD_TRAINING_REQUESTS = [  # what a request changes, and what the refusal says
    ({"model": "vgg"}, "model must be one of"),
    ({"steps": 2}, "steps must be an integer from 3"),
    ({"threads": 0}, "threads must be an integer from 1"),
    ({"indices": [2]}, "indices must be a list of distinct integers from 0 to 1"),
    ({"devices": []}, "devices must list one device"),
    ({"devices": ["gpu0"]}, "devices must list one device"),
    ({"overlap": 1}, "overlap must be true or false"),
    ({"role": "single", "world_size": 1}, "the single process dials nothing"),
    ({"endpoint": "tcp://10.9.8.7:5555"}, "only sends traffic to the host that asks"),
    ({"role": "ddp-rank", "endpoint": "tcp://10.9.8.7:29500"}, "only sends traffic"),
    ({"role": "shell"}, "role must be one of floor, synthetic, ps-worker"),
]


def test_an_agent_refuses_bad_training_requests(agents: list[AgentProcess]) -> None:
    coordinator = RawCoordinator(agents[0].endpoint)
    try:
        for overrides, says in BAD_TRAINING_REQUESTS:
            reply = coordinator.request("run", **train_fields(**overrides))
            assert reply["ok"] is False and says in reply["error"], (overrides, reply)
        assert coordinator.request("hello")["busy"] is False  # nothing started
        # And it still runs a good one: one single process, which dials nothing.
        single = train_fields(role="single", endpoint="", world_size=1, timeout_s=120)
        reply = coordinator.request("run", wait_s=120, **single)  # the reply: when it is done
        assert reply["ok"] is True and reply["results"][0]["images_per_second"] > 0
    finally:
        coordinator.close()


def test_each_agents_workers_get_its_own_gpus(
    agents: list[AgentProcess], capsys: pytest.CaptureFixture[str]
) -> None:
    with RemoteClients([agents[0].endpoint, agents[1].endpoint], None) as remote:
        assert [host["gpus"] for host in remote.hosts] == [0, 0]  # this machine has none
        remote.hosts[0]["gpus"] = 3  # as if the hosts had GPUs
        remote.hosts[1]["gpus"] = 2
        # Workers 0 and 2 on the first host, 1 and 3 on the second.
        assert remote.devices(4, "auto") == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
        # A host short of GPUs puts every client on the CPU: DDP ranks on NCCL and on gloo
        # in one group would wait for each other for ever.
        remote.hosts[0]["gpus"] = 1
        capsys.readouterr()
        assert remote.devices(4, "auto") == ["cpu"] * 4
        assert "cannot give each of its clients a GPU" in capsys.readouterr().err
        assert remote.devices(4, "cpu") == ["cpu"] * 4
        with pytest.raises(PSError, match=f"on {socket.gethostname()} .*needs 2 GPUs"):
            remote.devices(4, "cuda")


def test_devices_are_chosen_as_ps_local_chooses_them() -> None:
    assert choose_devices(2, "auto", 2) == ["cuda:0", "cuda:1"]
    assert choose_devices(3, "auto", 2) == ["cpu"] * 3
    assert choose_devices(2, "cpu", 8) == ["cpu", "cpu"]
    with pytest.raises(PSError, match="has 2; use --device cpu or fewer --workers"):
        choose_devices(3, "cuda", 2)
    with pytest.raises(PSError, match=r"has 0; use --device cpu$"):  # fewer would not help
        choose_devices(2, "cuda", 0)


def test_ddp_ranks_use_the_interface_on_their_route_to_the_store() -> None:
    assert interface_towards("tcp://127.0.0.1:29500") == "lo"
    assert interface_towards("tcp://[::1]:29500") is None  # IPv6: left to gloo
    assert interface_towards("tcp://not-an-address:1") is None


def test_train_host_without_agents_is_a_usage_error() -> None:
    result = CliRunner().invoke(command, ["train", "--host", "10.0.0.1"])
    assert result.exit_code == 2 and "add --agent" in result.output


@pytest.mark.timeout(240)
def test_a_worker_that_fails_on_its_agent_ends_the_phase_with_its_words(
    agents: list[AgentProcess],
) -> None:
    """Worker 1 is sent to a GPU its host does not have: its agent says so, the phase ends
    with that, and worker 0 on the other agent is cancelled rather than left waiting."""
    from psserver.bench.train import run_phase
    from psserver.bench.trainbench import TrainBench

    bench = TrainBench(2, "lenet", 8, 4, 1, "cpu", timeout=120)
    endpoints = [agents[0].endpoint, agents[1].endpoint]
    with RemoteClients(endpoints, None) as remote, pytest.raises(PSError) as failure:
        run_phase("sync", bench, ["cpu", "cuda:0"], remote)
    message = str(failure.value)
    assert message.startswith(f"agent {agents[1].endpoint}: on {socket.gethostname()}: ")
    assert "1 ps-worker (lenet): worker1 exited with code" in message
    assert "CUDA" in message or "cuda" in message
    coordinator = RawCoordinator(agents[0].endpoint)
    try:  # the cancel reached worker 0's agent
        deadline = time.monotonic() + 30
        while coordinator.request("hello")["busy"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert coordinator.request("hello")["busy"] is False
    finally:
        coordinator.close()
    assert "cancelled: 1 ps-worker (lenet)" in agents[0].log.read_text()
