"""Offline checks of deploy/k8s: the run as one JobSet, its kustomize components and the rest.

CI has no cluster, so what is checked is what can be without one:
- every built-in object passes `kubernetes-validate --strict` for the oldest Kubernetes the
  manifests need and for the newest schema the package ships, and so does each Job template of
  the JobSet, as a batch/v1 Job;
- every custom object (JobSet, ServiceMonitor, Kueue's queues) passes the schema of its
  published CustomResourceDefinition, vendored under deploy/schemas, made strict (an unknown
  field fails, as the API server's strict field validation would refuse it);
- the structure the restarts rely on, the count written once, the images, the keys, the
  network policy; every PS_ variable is an option of its command with a value it accepts;
- the workers' restart budget outlasts the server's restart time that docs/deployment.md
  gives, figure by figure;
- the server's start-up script; and, where kubectl is installed, `kubectl kustomize` of every
  kustomization, whose output passes the same checks.
"""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import jsonschema
import pytest

from common.cli import ENV_PREFIX
from psserver.cli.server import command as server_command
from psserver.cli.status import command as status_command
from psworker.cli import command as worker_command
from psworker.connection.requests import BACKOFF_BASE_S, BACKOFF_MAX_S

yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra: pip install '.[test]'")

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = REPO / "deploy" / "schemas"
DOCS = REPO / "docs" / "deployment.md"
# What `kubectl apply -k` is given: the run, and a platform's own overlay.
ENTRIES = [K8S, K8S / "overlays" / "example"]
# backoffLimitPerIndex is beta and on from 1.29 (GA in 1.33); 1.30 is the oldest checked.
K8S_OLDEST = "1.30.0"
COMMANDS = {"server": server_command, "worker": worker_command, "status": status_command}
BUILT_IN = {"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1"}

# The server's worst restart, a lost node, step by step: docs/deployment.md ("Restarts") gives
# the same figures, and each that the manifests set is checked against them below.
SERVER_RESTART_S = {
    "node-monitor-grace-period": 50,  # the node is marked unreachable (Kubernetes 1.32+)
    "toleration": 30,  # the server pod's tolerationSeconds for unreachable: it is evicted
    "force-detach": 360,  # the attach-detach controller lets go of the volume (6 minutes)
    "attach": 60,  # the volume attached and mounted on another node
    "pull": 120,  # the CPU image pulled there
    "start": 60,  # ps-server imports torch, builds the model, loads the checkpoint, binds
}
POD_BACKOFF_S = (10, 360)  # the Job controller's delay before a new pod: 10 s doubling to 6 min


def tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return shutil.which(name) or (str(beside) if beside.exists() else None)


def load_all(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def raw_objects() -> list[dict[str, Any]]:
    return [doc for path in manifest_files() for doc in load_all(path)]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def jobset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (only,) = of_kind(objects, "JobSet")
    return only


def replicated(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (job,) = [r for r in jobset(objects)["spec"]["replicatedJobs"] if r["name"] == name]
    return job


def pod_spec(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return replicated(objects, name)["template"]["spec"]["template"]["spec"]


def container(spec: dict[str, Any]) -> dict[str, Any]:
    (only,) = spec["containers"]
    return only


def env_of(spec: dict[str, Any]) -> dict[str, str]:
    """A container's environment as the pod sees it: resourceFieldRef resolved from its own
    requests (a CPU count rounded up, as the kubelet does with divisor 1)."""
    c = container(spec)
    env = {}
    for entry in c["env"]:
        if "value" in entry:
            env[entry["name"]] = entry["value"]
            continue
        field = entry["valueFrom"]["resourceFieldRef"]
        assert field["containerName"] == c["name"], entry
        kind, resource = field["resource"].split(".")
        quantity = str(c["resources"][kind][resource])
        cpus = int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)
        env[entry["name"]] = str(max(1, -int(-cpus // 1)))
    return env


def entry_parameters(entry: Path = K8S) -> dict[str, str]:
    """The ps-train-run literals of a kustomization: the run's parameters."""
    kustomization = yaml.safe_load((entry / "kustomization.yaml").read_text())
    (generator,) = [g for g in kustomization["configMapGenerator"] if g["name"] == "ps-train-run"]
    return dict(literal.split("=", 1) for literal in generator["literals"])


def cron_pod_spec(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (cron,) = [c for c in of_kind(objects, "CronJob") if c["metadata"]["name"] == name]
    return cron["spec"]["jobTemplate"]["spec"]["template"]["spec"]


# --- schemas -------------------------------------------------------------------------------


def vendored_schemas() -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(SCHEMAS.glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def strict(schema: Any) -> Any:
    """A CRD's structural schema made strict: an object with properties takes no others
    (unless it preserves unknown fields), and int-or-string takes either."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if out.get("x-kubernetes-int-or-string"):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def custom_resource_problems(obj: dict[str, Any]) -> list[str]:
    """Every vendored schema of the object's kind, and what each finds wrong with it."""
    matching = [
        s
        for s in vendored_schemas()
        if s["apiVersion"] == obj["apiVersion"] and s["kind"] == obj["kind"]
    ]
    assert matching, f"no vendored schema for {obj['apiVersion']} {obj['kind']}"
    problems = []
    for vendored in matching:
        validator = jsonschema.Draft7Validator(strict(vendored["schema"]))
        for error in validator.iter_errors(obj):
            where = "/".join(str(p) for p in error.absolute_path)
            problems.append(f"{obj['kind']} ({vendored['source']}) at {where}: {error.message}")
    return problems


def as_jobs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each Job template of the JobSet as the batch/v1 Job the JobSet controller makes."""
    return [
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": f"ps-train-{r['name']}-0", **r["template"].get("metadata", {})},
            "spec": r["template"]["spec"],
        }
        for r in jobset(objects)["spec"]["replicatedJobs"]
    ]


def check_objects(objects: list[dict[str, Any]]) -> None:
    validate = pytest.importorskip("kubernetes_validate", reason="pip install '.[test]'")
    versions = [K8S_OLDEST, validate.latest_version()]
    problems = []
    for obj in objects:
        if obj["apiVersion"] not in BUILT_IN:
            problems += custom_resource_problems(obj)
    for obj in [o for o in objects if o["apiVersion"] in BUILT_IN] + as_jobs(objects):
        for version in versions:
            try:
                validate.validate(obj, version, strict=True)
            except validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.absolute_path)
                problems.append(f"{obj['kind']} {obj['metadata']['name']} ({version}) at "
                                f"{where}: {exc.message}")  # fmt: skip
    assert not problems, "\n".join(problems)


def test_manifests_pass_kubernetes_and_their_published_schemas() -> None:
    objects = raw_objects()
    assert {o["kind"] for o in objects} >= {
        "JobSet", "Service", "PersistentVolumeClaim", "NetworkPolicy", "PodDisruptionBudget",
        "CronJob", "Secret", "ServiceMonitor", "LocalQueue", "ClusterQueue", "ResourceFlavor",
    }  # fmt: skip
    check_objects(objects)


def test_a_strict_schema_refuses_what_the_api_server_would() -> None:
    """The checks can fail: a misspelt field, a wrong type, an unknown action."""
    good = jobset(raw_objects())
    assert not custom_resource_problems(good)
    typo = copy.deepcopy(good)
    typo["spec"]["sucessPolicy"] = typo["spec"].pop("successPolicy")
    assert any("sucessPolicy" in p for p in custom_resource_problems(typo))
    action = copy.deepcopy(good)
    action["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartEverything"
    assert custom_resource_problems(action)
    job = copy.deepcopy(good)
    job["spec"]["replicatedJobs"][1]["template"]["spec"]["backoffLimitPerIndx"] = 6
    with pytest.raises(AssertionError, match="backoffLimitPerIndx"):
        check_objects([job])


def test_vendored_schemas_name_their_source() -> None:
    readme = (SCHEMAS / "README.md").read_text()
    for path in sorted(SCHEMAS.glob("*.jsonl")):
        assert f"`{path.name}`" in readme, f"{path.name} is not in deploy/schemas/README.md"
        assert path.stat().st_size < 64_000, f"{path.name}: keep the vendored schemas small"
    for vendored in vendored_schemas():
        assert re.search(r"github\.com/\S+ v[\d.]+ \([0-9a-f]{40}\) \S+\.yaml$", vendored["source"])


# --- the run -------------------------------------------------------------------------------


def check_the_run(objects: list[dict[str, Any]], workers: int) -> None:
    """What the restarts and the end of the run rely on (docs/deployment.md)."""
    spec = jobset(objects)["spec"]
    assert spec["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["workers"]}
    rules = spec["failurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJobSet"
    assert rules[0]["onJobFailureReasons"] == ["PodFailurePolicy"]
    by_target = {tuple(r.get("targetReplicatedJobs", [])): r["action"] for r in rules[1:]}
    assert by_target == {("workers",): "FailJobSet", ("server",): "RestartJobSet"}

    server_job, workers_job = replicated(objects, "server"), replicated(objects, "workers")
    assert server_job["replicas"] == workers_job["replicas"] == 1
    assert workers_job["dependsOn"] == [{"name": "server", "status": "Ready"}]
    server_spec, worker_spec = pod_spec(objects, "server"), pod_spec(objects, "workers")
    # The server: restarted in place; no podFailurePolicy, which would keep a pod on a lost
    # node from being replaced (podReplacementPolicy Failed).
    assert server_spec["restartPolicy"] == "OnFailure"
    assert "podFailurePolicy" not in server_job["template"]["spec"]
    assert server_job["template"]["spec"]["parallelism"] == 1
    # The workers: one index each, restarted per index; disruptions do not count; exit 2
    # (a usage error) fails the run at once.
    job = workers_job["template"]["spec"]
    assert job["completionMode"] == "Indexed" and worker_spec["restartPolicy"] == "Never"
    assert job["parallelism"] == job["completions"] == workers
    assert env_of(server_spec)["PS_WORKERS"] == str(workers)
    assert job["backoffLimitPerIndex"] >= 1 and "backoffLimit" not in job
    first, second = job["podFailurePolicy"]["rules"]
    assert first == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert second["action"] == "FailJob"
    assert second["onExitCodes"] == {"containerName": "worker", "operator": "In", "values": [2]}
    limits = container(worker_spec)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 1

    # One image per role, never the CUDA one for the server; args, so that tini stays PID 1.
    pods = {
        "server": server_spec,
        "workers": worker_spec,
        "ps-status": cron_pod_spec(objects, "ps-status"),
        "ps-train-results": cron_pod_spec(objects, "ps-train-results"),
    }
    for name, pod in pods.items():
        c = container(pod)
        assert "command" not in c, f"{name}: `command` would replace the image's tini"
        flavour = "cuda" if name == "workers" else "cpu"
        assert re.search(rf"(^ps-train-{flavour}$|-{flavour}$|@sha256:[0-9a-f]{{64}}$)", c["image"])
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        context = c["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"] == {"drop": ["ALL"]}
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        if name != "ps-train-results":
            assert "/tmp" in mounts, f"{name}: a read-only root needs a writable /tmp"

    # The Service leads to the server's ports, and the workers dial it.
    (svc,) = [s for s in of_kind(objects, "Service") if s["metadata"]["name"] == "ps-server"]
    labels = replicated(objects, "server")["template"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(server_spec)["ports"]}
    assert {p["targetPort"]: p["port"] for p in svc["spec"]["ports"]} == ports
    assert env_of(worker_spec)["PS_SERVER"] == f"tcp://ps-server:{ports['zmq']}"
    assert env_of(server_spec)["PS_BIND"].endswith(f":{ports['zmq']}")
    assert env_of(server_spec)["PS_METRICS_PORT"] == str(ports["metrics"])
    assert container(server_spec)["readinessProbe"]["tcpSocket"]["port"] == "zmq"

    # The checkpoints: on the claim, where the server writes them and the results Job reads.
    (claim,) = of_kind(objects, "PersistentVolumeClaim")
    for name in ("server", "ps-train-results"):
        pod = pods[name]
        volume = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [m for m in container(pod)["volumeMounts"] if m["mountPath"] == "/checkpoints"]
        claimed = volume[mount["name"]]["persistentVolumeClaim"]["claimName"]
        assert claimed == claim["metadata"]["name"], name
    assert env_of(server_spec)["PS_CHECKPOINT_DIR"] == "/checkpoints"

    # A budget keeps drains from evicting the server; it selects the server pod.
    (budget,) = of_kind(objects, "PodDisruptionBudget")
    assert budget["spec"]["minAvailable"] == 1
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_the_run_as_written() -> None:
    check_the_run(raw_objects(), workers=int(entry_parameters()["workers"]))


@pytest.mark.parametrize(
    ("role", "pod"),
    [("server", "server"), ("worker", "workers"), ("status", "ps-status")],
)
def test_environment_is_real_options(role: str, pod: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = raw_objects()
    spec = cron_pod_spec(objects, pod) if pod == "ps-status" else pod_spec(objects, pod)
    env = env_of(spec)
    command = COMMANDS[role]
    known = {
        p.envvar if isinstance(p.envvar, str) else f"{ENV_PREFIX}_{p.name.upper()}"
        for p in command.params
        if isinstance(p, click.Option) and p.name
    }
    unknown = sorted(set(env) - known)
    assert not unknown, f"{pod}: {unknown} are not options of ps-{role}"
    for name in [n for n in os.environ if n.startswith(f"{ENV_PREFIX}_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        params = command.make_context(f"ps-{role}", [], auto_envvar_prefix=ENV_PREFIX).params
    except click.ClickException as exc:
        pytest.fail(f"{pod}: ps-{role} rejects its environment: {exc.format_message()}")
    assert params["curve_secret_key"] is not None, "CURVE is off"
    if role != "status":
        requested = container(spec)["resources"]["requests"]["cpu"]
        assert params["threads"] == int(requested), "torch threads: the CPUs requested"
    if role == "server":
        assert params["linger"] > 0, "late workers would find the port closed"


def test_curve_keys_come_from_the_secrets_of_curve_secrets_yaml() -> None:
    objects = raw_objects()
    secrets = {s["metadata"]["name"]: s["stringData"] for s in of_kind(objects, "Secret")}
    pods = {
        "server": pod_spec(objects, "server"),
        "workers": pod_spec(objects, "workers"),
        "ps-status": cron_pod_spec(objects, "ps-status"),
    }
    held: dict[str, dict[str, str]] = {}
    for name, pod in pods.items():
        volumes = {v["name"]: v for v in pod["volumes"]}
        (mount,) = [
            m for m in container(pod)["volumeMounts"] if "secret" in volumes.get(m["name"], {})
        ]
        secret = secrets[volumes[mount["name"]]["secret"]["secretName"]]
        env = env_of(pod)
        for variable in ("PS_CURVE_SECRET_KEY", "PS_CURVE_SERVER_KEY"):
            if variable in env:
                folder, key = env[variable].rsplit("/", 1)
                assert folder == mount["mountPath"] and key in secret, (name, variable)
        held[name] = secret
    # The server admits the *.key files of its own Secret: one for the workers, a spare one
    # for ps-status; each client holds the secret half of its own.
    assert env_of(pods["server"])["PS_CURVE_AUTHORIZED_CLIENTS"] == "/etc/ps-train/curve"
    admitted = {k.removesuffix(".key") for k in held["server"] if k.endswith(".key")}
    assert admitted == {"worker", "status"}
    assert "worker.key_secret" in held["workers"] and "status.key_secret" in held["ps-status"]


def test_network_policy_lets_only_the_run_reach_the_server() -> None:
    objects = raw_objects()
    policies = {p["metadata"]["name"]: p["spec"] for p in of_kind(objects, "NetworkPolicy")}
    deny = policies["ps-train-deny-ingress"]
    assert deny["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "ps-train"}
    assert deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    server = policies["ps-server"]
    server_ports = {p["name"] for p in container(pod_spec(objects, "server"))["ports"]}
    (zmq_rule, metrics_rule) = server["ingress"]
    components = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                  for peer in zmq_rule["from"]}  # fmt: skip
    assert components == {"worker", "server", "status"}
    assert {p["port"] for p in zmq_rule["ports"]} == server_ports - {"metrics"}
    assert [p["port"] for p in metrics_rule["ports"]] == ["metrics"]
    assert all("namespaceSelector" in peer for peer in metrics_rule["from"])
    # Every pod that must reach the server carries the label the policy admits.
    status = of_kind(objects, "CronJob")[0]["spec"]["jobTemplate"]["spec"]["template"]
    assert status["metadata"]["labels"]["app.kubernetes.io/component"] == "status"


def test_release_images_are_immutable() -> None:
    """Every image is the release's tag (`0.1.0-cpu`) or a digest, never `cuda` or latest."""
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads pyproject.toml")
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    release = yaml.safe_load((K8S / "components" / "release" / "kustomization.yaml").read_text())
    overlay = yaml.safe_load((K8S / "overlays" / "example" / "kustomization.yaml").read_text())
    for images in (release["images"], overlay["images"]):
        assert {i["name"] for i in images} == {"ps-train-cpu", "ps-train-cuda"}
        for image in images:
            flavour = image["name"].removeprefix("ps-train-")
            assert image.get("newTag") == f"{version}-{flavour}" or re.fullmatch(
                r"sha256:[0-9a-f]{64}", image.get("digest", "")
            ), image


def test_kueue_admits_the_run_whole() -> None:
    kueue = yaml.safe_load((K8S / "components" / "kueue" / "kustomization.yaml").read_text())
    (patch,) = kueue["patches"]
    assert yaml.safe_load(patch["patch"]) == [{"op": "add", "path": "/spec/suspend", "value": True}]
    (replacement,) = kueue["replacements"]
    assert replacement["source"]["fieldPath"] == "data.queue"
    (target,) = replacement["targets"]
    assert target["fieldPaths"] == ["metadata.labels.[kueue.x-k8s.io/queue-name]"]
    # The example queues: a LocalQueue of the default run's name, in a ClusterQueue whose
    # quota covers every resource the run asks for.
    queues = load_all(K8S / "kueue-queues.yaml")
    (local,) = of_kind(queues, "LocalQueue")
    assert local["metadata"]["name"] == entry_parameters()["queue"]
    (cluster,) = of_kind(queues, "ClusterQueue")
    assert local["spec"]["clusterQueue"] == cluster["metadata"]["name"]
    covered = {r for group in cluster["spec"]["resourceGroups"] for r in group["coveredResources"]}
    objects = raw_objects()
    asked = {
        r
        for name in ("server", "workers")
        for kind in ("requests", "limits")
        for r in container(pod_spec(objects, name))["resources"].get(kind, {})
    }
    assert asked <= covered


# --- restarts ------------------------------------------------------------------------------


def worker_wait_s(timeout_s: float, retries: int) -> float:
    """How long one request waits for a silent server before the worker gives up: each of
    its retries + 1 sends waits timeout_s, with the pauses of psworker.connection.requests
    between them."""
    pauses = sum(min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2**k) for k in range(retries))
    return (retries + 1) * timeout_s + pauses


def test_restart_budget_outlasts_the_servers_restart_time() -> None:
    objects = raw_objects()
    env = env_of(pod_spec(objects, "workers"))
    one_pod = worker_wait_s(float(env["PS_TIMEOUT"]), int(env["PS_RETRIES"]))
    # The figures the manifests set are those of the restart time.
    tolerations = {t["key"]: t for t in pod_spec(objects, "server")["tolerations"]}
    for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"):
        assert tolerations[key]["tolerationSeconds"] == SERVER_RESTART_S["toleration"]
    restart = sum(SERVER_RESTART_S.values())
    assert one_pod > restart, (
        f"a worker gives up after {one_pod:g} s of silence, before the server's worst "
        f"restart ({restart} s) is over: raise PS_TIMEOUT or PS_RETRIES"
    )
    # A pod that has not reached the server yet (one restarted during the outage) waits for
    # its first answer up to --join-timeout instead, whose default (60 s) is far shorter.
    joining = float(env["PS_JOIN_TIMEOUT"])
    assert joining >= one_pod, (
        f"a restarted worker pod gives up after {joining:g} s (PS_JOIN_TIMEOUT), before the "
        f"server's worst restart ({restart} s) is over, where a running one waits {one_pod:g} s"
    )
    # Past one pod's wait, the index's restarts: another pod waits as long, each after the
    # Job controller's delay.
    per_index = replicated(objects, "workers")["template"]["spec"]["backoffLimitPerIndex"]
    delays = sum(min(POD_BACKOFF_S[1], POD_BACKOFF_S[0] * 2**k) for k in range(per_index))
    whole = one_pod + per_index * joining + delays
    # The defaults (--timeout 60, --retries 5) gave up after about 6 minutes.
    assert worker_wait_s(60, 5) == 375.5 < restart
    # docs/deployment.md states these figures.
    docs = DOCS.read_text()
    for figure in (f"{restart} s", f"{one_pod:g} s", f"{whole:g} s", "375.5 s"):
        assert figure in docs, f"docs/deployment.md does not give {figure}"
    for seconds in SERVER_RESTART_S.values():
        assert f"| {seconds} s |" in docs, f"docs/deployment.md: no row of {seconds} s"
    # The server lingers (answers late workers with STOP) longer than a late worker takes.
    assert float(env_of(pod_spec(objects, "server"))["PS_LINGER"]) > whole


# --- kustomize ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kubectl() -> str:
    found = tool("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` not tried")
    return found


def build(kubectl: str, entry: Path) -> list[dict[str, Any]]:
    result = subprocess.run(
        [kubectl, "kustomize", str(entry)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.mark.integration
@pytest.mark.parametrize("entry", ENTRIES, ids=lambda p: str(p.relative_to(K8S)))
def test_kustomize_builds_the_run(kubectl: str, entry: Path) -> None:
    objects = build(kubectl, entry)
    kinds = sorted(o["kind"] for o in objects)
    expected = ["CronJob", "CronJob", "JobSet", "NetworkPolicy", "NetworkPolicy",
                "PersistentVolumeClaim", "PodDisruptionBudget", "Service"]  # fmt: skip
    components = yaml.safe_load((entry / "kustomization.yaml").read_text())["components"]
    with_prometheus = any(c.endswith("components/prometheus") for c in components)
    assert kinds == sorted(expected + ["ServiceMonitor"] * with_prometheus)
    assert "ConfigMap" not in kinds, "the run's parameters are not applied"
    parameters = entry_parameters(entry)
    check_the_run(objects, workers=int(parameters["workers"]))
    check_objects(objects)
    js = jobset(objects)
    assert js["spec"]["suspend"] is True
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == parameters["queue"]
    for name in ("server", "workers"):
        image = container(pod_spec(objects, name))["image"]
        assert not image.startswith("ps-train-"), f"{name}: the image was not set"


@pytest.mark.integration
def test_a_parameter_written_once_reaches_every_field(kubectl: str, tmp_path: Path) -> None:
    """The count in one literal sets the server's PS_WORKERS and the Job's parallelism and
    completions; the queue sets the Kueue label."""
    entry = tmp_path / "run"
    entry.mkdir()
    text = (K8S / "kustomization.yaml").read_text()
    here = os.path.relpath(K8S, entry)  # kustomize takes no absolute path
    text = text.replace("- base", f"- {here}/base")
    text = re.sub(r"- components/", f"- {here}/components/", text)
    text = text.replace("workers=2", "workers=5").replace("queue=ps-train", "queue=q5")
    (entry / "kustomization.yaml").write_text(text)
    objects = build(kubectl, entry)
    check_the_run(objects, workers=5)
    assert jobset(objects)["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "q5"


# --- the server's start-up script -----------------------------------------------------------


@pytest.fixture
def startup(tmp_path: Path) -> Iterator[Any]:
    """Run the server container's args with a stand-in ps-server that records PS_RESUME."""
    args = container(pod_spec(raw_objects(), "server"))["args"]
    assert args[:2] == ["/bin/sh", "-c"]
    bin_dir, checkpoints = tmp_path / "bin", tmp_path / "checkpoints"
    bin_dir.mkdir()
    checkpoints.mkdir()
    fake = bin_dir / "ps-server"
    fake.write_text('#!/bin/sh\necho "resume=${PS_RESUME:-no} pid=$$" > "$RECORD"\nexit 3\n')
    fake.chmod(0o755)
    record = tmp_path / "record.txt"

    def run() -> tuple[int, str, int]:
        env = {
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "PS_CHECKPOINT_DIR": str(checkpoints),
            "RECORD": str(record),
        }
        proc = subprocess.Popen(["/bin/sh", "-c", args[2]], env=env)
        code = proc.wait(timeout=30)
        return code, record.read_text().split()[0], proc.pid

    yield run, checkpoints, record


@pytest.mark.integration
def test_startup_resumes_from_a_checkpoint_and_execs_the_server(startup: Any) -> None:
    run, checkpoints, record = startup
    code, resume, pid = run()
    assert (code, resume) == (3, "resume=no"), "a fresh volume starts a new run"
    # exec: ps-server is the shell's process, so tini's SIGTERM reaches it.
    assert record.read_text().split()[1] == f"pid={pid}"
    (checkpoints / "previous.pt").write_bytes(b"x")
    assert run()[:2] == (3, "resume=1")
    (checkpoints / "previous.pt").unlink()
    (checkpoints / "latest.pt").write_bytes(b"x")
    assert run()[:2] == (3, "resume=1")
