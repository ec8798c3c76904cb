"""One command starting another: every spec turned into arguments reads back, through the
child's own command, as the values it holds (common.roles.command_args over the options of
common.options). And ps-bench stays apart: nothing of the product imports it.

Unit tests: no process is started.
"""

import ast
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import pytest

from common.errors import ConfigError
from common.options import WORKER_OPTIONS, Option
from common.roles import SERVER, WORKER, Role, WorkerSpec, command_args
from psserver.bench import ddp, floor
from psserver.bench.synthetic import SYNTHETIC
from psserver.cli.server import command as ps_server
from psserver.shards.joining import FollowerConfig
from psserver.shards.launch import FollowerLaunch
from psworker.cli import command as ps_worker
from tests.harness import REPO


def read_back(command: click.Command, args: list[str]) -> dict[str, Any]:
    """The values `command` (a group's, for a role with a subcommand) reads from `args`."""
    if isinstance(command, click.Group):
        command, args = command.commands[args[0]], args[1:]
    with command.make_context("child", list(args)) as ctx:
        return dict(ctx.params)


def test_a_worker_spec_reads_back_as_itself(tmp_path: Path) -> None:
    spec = WorkerSpec(
        server="tcp://ps-0:5555", device="cpu", data_dir=tmp_path / "data", name="w 0",
        timeout=2.5, retries=0, step_delay=0.25, threads=3, progress="none", overlap=False,
        curve_secret_key=tmp_path / "client-1.key_secret", log_level="warning",
    )  # fmt: skip
    assert read_back(ps_worker, command_args(WORKER, spec)) == dataclasses.asdict(spec)
    # Every value is written, defaults too: the child's PS_ variables change none of them.
    assert "--overlap" in command_args(WORKER, WorkerSpec()) and "--no-download" in command_args(
        WORKER, WorkerSpec()
    )


def test_a_worker_specs_defaults_are_its_options_defaults() -> None:
    defaults = {option.dest: option.default for option in WORKER_OPTIONS}
    fields = {field.name: field.default for field in dataclasses.fields(WorkerSpec)}
    assert fields == defaults


def test_a_follower_reads_back_its_config_and_what_the_leader_tells_it(tmp_path: Path) -> None:
    config = FollowerConfig(
        2, 4, "tcp://[::1]:5555", bind="tcp://0.0.0.0:5557", advertise_host="ps-2",
        leader_timeout=7.5, threads=2, endpoint_file=tmp_path / "ep",
    )  # fmt: skip
    told = FollowerLaunch("debug", tmp_path / "server.key_secret", tmp_path / "clients")
    params = read_back(ps_server, command_args(SERVER, config, told))
    assert {name: params[name] for name in dataclasses.asdict(config)} == dataclasses.asdict(config)
    assert {name: params[name] for name in dataclasses.asdict(told)} == dataclasses.asdict(told)


def test_a_server_is_given_only_what_the_parent_chose(tmp_path: Path) -> None:
    """ps-local hands its server the options the person gave and no others, so that the
    server can tell them (it warns of one its mode does not read); ps-bench's server takes
    the PS_ variables the person exported for what the bench leaves to it."""
    chosen = {"mode": "ssp", "staleness_lr": False, "bucket_mb": 0.0, "summary": tmp_path / "s"}
    args = command_args(SERVER, chosen, {"threads": None})
    assert args == [
        "--mode", "ssp", "--no-staleness-lr", "--bucket-mb", "0.0", "--summary", str(tmp_path / "s")
    ]  # fmt: skip
    params = read_back(ps_server, args)
    assert {name: params[name] for name in chosen} == chosen


@pytest.mark.parametrize(
    ("role", "command", "spec"),
    [
        (
            floor.SERVER, floor.command,
            {"bind": "tcp://127.0.0.1:*", "clients": 2, "nbytes": 9, "rounds": 5,
             "endpoint_file": Path("ep"), "out": Path("s.json")},
        ),
        (
            floor.CLIENT, floor.command,
            {"endpoint": "tcp://127.0.0.1:9", "nbytes": 9, "rounds": 5, "out": Path("c.json")},
        ),
        (
            SYNTHETIC, None,
            {"endpoint": "tcp://127.0.0.1:9", "rounds": 3, "out": Path("w.json"),
             "server_cpu": True},
        ),
        (
            ddp.RANK, ddp.command,
            {"model": "lenet", "batch_size": 8, "steps": 4, "threads": 1, "device": "cpu",
             "out": Path("d.json"), "rank": 1, "world_size": 2, "master_addr": "10.0.0.1",
             "master_port": 29500, "no_sync": True},
        ),
        (
            ddp.SINGLE, ddp.command,
            {"model": "lenet", "batch_size": 8, "steps": 4, "threads": 2, "device": "cpu",
             "out": Path("d.json")},
        ),
    ],
)  # fmt: skip
def test_the_benchmarks_own_children_read_back_their_specs(
    role: Role, command: click.Command | None, spec: Mapping[str, Any]
) -> None:
    from psserver.bench.synthetic import command as synthetic

    assert read_back(command or synthetic, command_args(role, spec)) == spec


def test_a_name_the_role_lacks_or_given_twice_is_a_mistake() -> None:
    with pytest.raises(ValueError, match=r"psworker.cli has no option 'lr'"):
        command_args(WORKER, {"lr": 0.1})
    with pytest.raises(ValueError, match=r"'threads' is given twice"):
        command_args(WORKER, {"threads": 1}, {"threads": 2})
    with pytest.raises(TypeError, match=r"--overlap takes True or False, got 'yes'"):
        command_args(WORKER, {"overlap": "yes"})


def test_a_command_may_take_its_own_help_and_default_for_a_shared_option() -> None:
    threads = Option("--threads", type=click.IntRange(min=1), help="Threads.")
    own = threads.but(default=1, help="Torch threads each.")
    assert (own.flag, own.type, own.default, own.help) == (
        "--threads", threads.type, 1, "Torch threads each."
    )  # fmt: skip
    assert threads.default is None  # the declaration itself is unchanged


def test_a_worker_spec_refuses_what_its_options_would() -> None:
    with pytest.raises(ConfigError, match=r"^--server tcp://ps-0:70000: the port must be"):
        WorkerSpec(server="tcp://ps-0:70000")
    with pytest.raises(ConfigError, match="give either --gpu or --device, not both"):
        WorkerSpec(gpu=0, device="cpu")
    with pytest.raises(ConfigError, match=r"--progress must be one of auto, bar, log, none"):
        WorkerSpec(progress="loud")
    with pytest.raises(ConfigError, match=r"--step-delay must be 0 or more seconds, got nan"):
        WorkerSpec(step_delay=float("nan"))


# ---- ps-bench apart from the product --------------------------------------------------------

PRODUCT = ("common", "psserver", "psworker")
BENCH = "psserver.bench"


def imported_modules(path: Path, by_name: bool = False) -> set[str]:
    """Every module `path` imports, at any depth of its code (late imports too); `by_name`:
    and every string that names one (a module started as `python -m psserver.bench.floor`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif by_name and isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)  # a module's name, if it is one
    return found


def test_nothing_of_the_product_imports_ps_bench() -> None:
    """ps-server and ps-worker run without the benchmark; only ps-bench's own modules (and
    the tests) import psserver.bench. It starts the product's roles as ps-local does."""
    offenders = {}
    for package in PRODUCT:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.is_relative_to(REPO / "psserver" / "bench"):
                continue
            modules = imported_modules(path, by_name=True)
            found = [m for m in modules if m.split(".")[:2] == BENCH.split(".")]
            if found:
                offenders[str(path.relative_to(REPO))] = sorted(found)
    assert offenders == {}
    # The scan does find such an import where there is one.
    assert BENCH in imported_modules(REPO / "psserver" / "bench" / "clients.py", by_name=True)


def test_common_imports_neither_the_server_nor_the_worker() -> None:
    offenders = {
        str(path.relative_to(REPO)): sorted(
            m for m in imported_modules(path) if m.split(".")[0] in ("psserver", "psworker")
        )
        for path in sorted((REPO / "common").rglob("*.py"))
    }
    assert {path: found for path, found in offenders.items() if found} == {}
