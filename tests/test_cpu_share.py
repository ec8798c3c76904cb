"""A role's CPU threads without --threads: its share of the host's cores among the ps-server
and ps-worker processes on it (common.cpu_share)."""

import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common import cpu_share
from common.cpu_share import CpuShare, cgroup_cpu_limit, count_roles, is_role, share_of
from common.roles import SERVER, WORKER, WorkerSpec, command_args
from common.startup import command_line


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """The test's torch.set_num_threads calls, undone."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_the_command_lines_of_a_server_and_a_worker_are_roles_and_others_are_not() -> None:
    python = sys.executable
    roles = [
        [python, "/venv/bin/ps-worker", "--server", "tcp://ps-0:5555"],  # the console script
        ["/venv/bin/ps-server", "--workers", "2"],  # as `ps` may show an exec'd script
        [python, "-m", "psworker.cli", "--server", "tcp://127.0.0.1:5555"],
        [python, "-u", "-m", "psserver.cli.server"],
        # ps-local's server and workers; a follower its leader started
        [python, "-m", SERVER.module, *command_args(SERVER, {"workers": 2})],
        [python, "-m", WORKER.module, *command_args(WORKER, WorkerSpec(device="cpu"))],
        [*command_line(SERVER.module, "ps-server"), "--shard", "1"],
    ]
    others = [
        [python, "/venv/bin/ps-local", "--workers", "2"],  # a supervisor: it computes nothing
        [python, "-m", "pytest", "tests/test_cli.py", "-k", "psworker.cli"],
        ["vim", "psworker/cli.py"],
        ["tail", "-f", "ps-worker.log"],
        [python, "script.py", "-m", "psworker.cli"],  # the script's arguments, not Python's
        [python, "-c", "print('ps-worker')"],
        command_line("psserver.cli.local", "ps-local"),
        [],
    ]
    assert [is_role(argv) for argv in roles] == [True] * len(roles)
    assert [is_role(argv) for argv in others] == [False] * len(others)


@pytest.mark.parametrize(
    ("cores", "roles", "threads"),
    [(2, 1, 2), (2, 3, 1), (16, 3, 5), (16, 1, 16), (64, 9, 7), (1, 4, 1), (4, 0, 4)],
)
def test_a_share_never_asks_for_more_threads_than_cores(
    cores: int, roles: int, threads: int
) -> None:
    assert share_of(cores, roles) == threads
    assert share_of(cores, roles) * max(1, roles) <= max(cores, roles)


@pytest.mark.integration
@pytest.mark.integration  # it starts two processes
def test_processes_on_this_host_that_run_a_role_are_counted() -> None:
    """Two processes whose command line is `ps-worker` (exec -a names them so) count two
    more roles than before they started, and none once they are gone."""
    before = count_roles()
    fakes = [subprocess.Popen(["bash", "-c", "exec -a ps-worker sleep 30"]) for _ in range(2)]
    try:
        deadline = time.monotonic() + 10
        while count_roles() < before + 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # until bash has exec'd
        assert count_roles() >= before + 2  # others' tests may start roles meanwhile
    finally:
        for fake in fakes:
            fake.kill()
            fake.wait(timeout=10)


def test_count_roles_reads_a_proc_folder(tmp_path: Path) -> None:
    def process(pid: int, *argv: str) -> None:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in argv))

    process(10, "python", "-m", "psworker.cli", "--server", "tcp://x:1")
    process(11, "python", "/venv/bin/ps-server")
    process(12, "sleep", "9")
    (tmp_path / "13").mkdir()  # a process gone meanwhile: no cmdline left
    (tmp_path / "self").mkdir()
    assert count_roles(tmp_path) == 3  # these two and this process
    assert count_roles(tmp_path / "none") == 1  # no /proc (not Linux): only itself


@pytest.mark.parametrize(
    ("cpu_max", "limit"), [("200000 100000", 2), ("150000 100000", 2), ("max 100000", None)]
)
def test_a_cgroup_cpu_limit_caps_the_cores(tmp_path: Path, cpu_max: str, limit: int | None) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/kubepods/pod1\n")
    (cgroup / "kubepods" / "pod1").mkdir(parents=True)
    (cgroup / "kubepods" / "pod1" / "cpu.max").write_text(cpu_max + "\n")
    assert cgroup_cpu_limit(proc, cgroup) == limit
    assert cgroup_cpu_limit(tmp_path / "nothing", cgroup) is None


def test_a_role_without_threads_takes_its_share_and_follows_the_count(
    torch_threads: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A server started before its workers sees only itself; once they run, it gives
    threads back at its next count (RECOUNT_S later), and takes them again when they end."""
    roles, now = [1], [0.0]
    caplog.set_level(logging.INFO, logger="ps")
    share = CpuShare(None, count=lambda: roles[0], cores=lambda: 16, clock=lambda: now[0])
    assert share.threads == torch.get_num_threads() == 16
    assert "using 16 CPU threads: 16 cores shared by 1 ps-server/ps-worker process" in caplog.text
    roles[0] = 3
    share.recount()  # too soon: nothing counted
    assert torch.get_num_threads() == 16
    now[0] = cpu_share.RECOUNT_S
    share.recount()
    assert share.threads == torch.get_num_threads() == 5
    assert (
        "3 ps-server/ps-worker processes on this host now: using 5 CPU threads instead of 16"
        in (caplog.text)
    )
    roles[0], now[0] = 1, 2 * cpu_share.RECOUNT_S
    share.recount()
    assert torch.get_num_threads() == 16


def test_threads_given_are_kept_whatever_the_count(torch_threads: None) -> None:
    counts = []
    share = CpuShare(3, count=lambda: counts.append(1) or 99, clock=lambda: 1e9)
    share.recount()
    assert share.threads == torch.get_num_threads() == 3 and counts == []
