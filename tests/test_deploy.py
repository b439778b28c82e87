"""The deployment files, checked without a Docker engine or a cluster.

hadolint and kubernetes-validate run through scripts/check-deploy.sh; the rendered manifests are held
to the facts a rollout depends on; the Dockerfile's own ENTRYPOINT/CMD and HEALTHCHECK commands run
here against a real server, with the image's paths mapped onto this checkout.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from minilm_embed.model import host
from minilm_embed.model.host import cgroup_cpus, usable_cores
from minilm_embed.model.repository import CPU_PROVIDER, CUDA_PROVIDER
from minilm_embed.server.app import check_cores, plan_fronts
from minilm_embed.server.config import AUTO_BATCH_LIMITS, ServerConfig, env_name, load_config
from minilm_embed.server.front import SHUTDOWN_NOTICE_S
from minilm_embed.server.health import SERVICE_NAME
from minilm_embed.server.metrics import Metrics
from minilm_embed.server.tracing import FLUSH_S
from tests.server_process import ServerProcess, model_dir

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ("cpu", "gpu")
IMAGE_PYTHON = "/opt/venv/bin/python"  # the runtime image's interpreter: this venv's here
# The container's named ports and the settings whose addresses they serve.
SERVER_PORTS = {"grpc": "address", "http": "http_address", "metrics": "metrics_address"}
Resource = dict[str, Any]


# The Dockerfile, as Docker reads it: comments dropped, continuation lines joined.


def dockerfile() -> list[tuple[str, str]]:
    instructions, pending = [], ""
    for line in (ROOT / "Dockerfile").read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        keyword, _, rest = pending.strip().partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
        pending = ""
    return instructions


def arguments(keyword: str) -> list[str]:
    return [rest for k, rest in dockerfile() if k == keyword]


def exec_form(keyword: str) -> list[str]:
    form = json.loads(arguments(keyword)[-1])
    assert isinstance(form, list), f"{keyword} must be in exec form"
    return form


def healthcheck() -> tuple[dict[str, str], list[str]]:
    options, _, command = arguments("HEALTHCHECK")[-1].partition("CMD ")
    flags = dict(flag.removeprefix("--").split("=", 1) for flag in options.split())
    return flags, json.loads(command)


def image_env() -> dict[str, str]:
    """The runtime stage's ENV, less values that expand others (PATH)."""
    env = [rest for keyword, rest in stages()[-1] if keyword == "ENV"]
    pairs = (item.split("=", 1) for rest in env for item in shlex.split(rest))
    return {key: value for key, value in pairs if "$" not in value}


def image_uid() -> int:
    user = arguments("USER")[-1]
    assert re.fullmatch(r"\d+(:\d+)?", user), f"USER {user!r} is not numeric"
    return int(user.split(":")[0])


def stages() -> list[list[tuple[str, str]]]:
    """Instructions per stage; the ARGs before the first FROM are stage 0."""
    result: list[list[tuple[str, str]]] = [[]]
    for keyword, rest in dockerfile():
        if keyword == "FROM":
            result.append([])
        result[-1].append((keyword, rest))
    return result


def port(address: str) -> int:
    return int(address.rpartition(":")[2])


def local(argv: list[str]) -> list[str]:
    return [sys.executable if arg == IMAGE_PYTHON else arg for arg in argv]


# Rendered manifests.


def render_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_k8s", ROOT / "scripts" / "render-k8s.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def manifests() -> dict[str, list[Resource]]:
    render = render_module().render
    return {name: render(ROOT / "deploy" / "k8s" / "overlays" / name) for name in OVERLAYS}


def one(docs: list[Resource], kind: str, name: str | None = None) -> Resource:
    found = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def pod(docs: list[Resource]) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]


def server_container(docs: list[Resource]) -> dict[str, Any]:
    (container,) = pod(docs)["spec"]["containers"]
    return container


def flags(docs: list[Resource]) -> dict[str, str]:
    """The ConfigMap the server container takes its EMBED_* variables from."""
    (source,) = server_container(docs)["envFrom"]
    return one(docs, "ConfigMap", source["configMapRef"]["name"])["data"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# The tools.


def test_hadolint_and_strict_kubernetes_validation_pass() -> None:
    venv = Path(sys.executable).parent.parent
    result = subprocess.run(
        ["bash", "scripts/check-deploy.sh"],
        cwd=ROOT,
        env={**os.environ, "VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "check-deploy: ok" in result.stdout


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_matches_kubectl_kustomize(overlay: str, manifests: dict[str, list[Resource]]) -> None:
    directory = ROOT / "deploy" / "k8s" / "overlays" / overlay
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert manifests[overlay] == [d for d in yaml.safe_load_all(out) if d]


def test_renderer_refuses_what_it_cannot_render(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\nreplicas: [{name: x, count: 2}]\n")
    module = render_module()
    with pytest.raises(module.KustomizeError, match="replicas"):
        module.render(tmp_path)


# The image.


def build_args() -> dict[str, str]:
    """The global ARGs (before the first FROM) and their defaults."""
    return dict(rest.split("=", 1) for keyword, rest in stages()[0] if keyword == "ARG")


def stage(alias: str) -> list[tuple[str, str]]:
    (found,) = [s for s in stages()[1:] if s[0][1].split()[-1] == alias]
    return found


def variants() -> list[str]:
    """The image variants: the stages named runtime-base-<variant>."""
    aliases = [s[0][1].split()[-1] for s in stages()[1:]]
    return [a.removeprefix("runtime-base-") for a in aliases if a.startswith("runtime-base-")]


def test_every_stage_starts_from_a_pinned_build_argument() -> None:
    defaults = build_args()
    named: set[str] = set()
    for rest in arguments("FROM"):
        image, *alias = rest.split()
        if image not in named:
            # A stage named by a build argument, like runtime-base-${VARIANT}: every variant is a stage.
            if match := re.fullmatch(r"([\w-]+)\$\{(\w+)\}", image):
                assert match.group(1) + defaults[match.group(2)] in named
                assert {match.group(1) + v for v in variants()} <= named
            else:
                match = re.fullmatch(r"\$\{(\w+)\}", image)
                assert match, f"FROM {image} does not come from a build argument"
                assert_pinned(defaults[match.group(1)])
        named.update(alias[-1:])
    assert sorted(variants()) == ["cpu", "gpu"] and defaults["VARIANT"] == "gpu"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    assert compose["services"]["embed"]["build"]["args"]["VARIANT"] == "cpu"
    assert compose["services"]["embed-gpu"]["build"].get("args", {}).get("VARIANT", "gpu") == "gpu"


def assert_pinned(image: str) -> None:
    """A version tag (digits in it, never `latest`), optionally with a digest."""
    name, _, tag = image.split("@")[0].rpartition(":")
    assert name and re.search(r"\d", tag) and "latest" not in tag, f"{image} is not pinned"


def test_runtime_stage_carries_the_server_and_model_but_no_torch() -> None:
    runtime = stages()[-1]
    assert not any("torch" in rest for _, rest in runtime)
    copied = [
        rest.split()[1:-1] for keyword, rest in runtime if keyword == "COPY" and "--from=export" in rest
    ]
    assert sorted(copied) == [["/model"], ["/src/minilm_embed/proto/"]]
    (protoc,) = [rest for _, rest in stage("export") if "grpc_tools.protoc" in rest]
    assert "python -m minilm_embed.export --out /model" in protoc


def lock_pins(variant: str) -> dict[str, str]:
    text = (ROOT / "requirements" / f"runtime-{variant}.txt").read_text(encoding="utf-8")
    entries = [e for e in re.sub(r"\\\n", " ", text).splitlines() if e and not e.lstrip().startswith("#")]
    pins = {}
    for entry in entries:
        requirement = Requirement(entry.split(" --hash")[0].strip())
        assert "--hash=sha256:" in entry, f"{requirement.name} has no hash"
        (spec,) = requirement.specifier
        assert spec.operator == "==", entry
        pins[canonicalize_name(requirement.name)] = spec.version
    return pins


@pytest.mark.parametrize("variant", ["gpu", "cpu"])
def test_runtime_lock_pins_every_dependency_with_hashes(variant: str) -> None:
    """Each variant's lock satisfies pyproject; the CPU one with onnxruntime in place of onnxruntime-gpu.
    Never both: they install the same `onnxruntime` module, and the later one wins half-way."""
    pins = lock_pins(variant)
    assert "torch" not in pins
    runtime = {"gpu": "onnxruntime-gpu", "cpu": "onnxruntime"}[variant]
    other = {"gpu": "onnxruntime", "cpu": "onnxruntime-gpu"}[variant]
    assert runtime in pins and other not in pins
    assert any("requirements/runtime-${VARIANT}.txt" in rest for _, rest in stage("venv"))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    project = pyproject["project"]
    for dependency in project["dependencies"] + project["optional-dependencies"]["server"]:
        wanted = Requirement(dependency)
        name = canonicalize_name(wanted.name).replace("onnxruntime-gpu", runtime)
        pinned = pins.get(name)
        assert pinned and pinned in wanted.specifier, f"lock has {name}=={pinned}, not {wanted}"


def test_image_user_ports_and_build_context() -> None:
    assert image_uid() != 0
    exposed = {int(p) for rest in arguments("EXPOSE") for p in rest.split()}
    env = image_env()
    names = ("address", "http_address", "metrics_address")
    assert exposed == {port(env[env_name(name)]) for name in names}
    assert exposed == {port(getattr(ServerConfig(), name)) for name in names}
    ignored = (ROOT / ".dockerignore").read_text(encoding="utf-8").split()
    assert {"build", ".venv", "tests"} <= set(ignored)


def start_image_command(extra: list[str] | None = None, home: Path | None = None) -> ServerProcess:
    """ENTRYPOINT + CMD as the image runs them, configured through its ENV as Kubernetes does; `home`:
    a writable HOME (the image's is /nonexistent), where anything the server persists would show."""
    argv = exec_form("ENTRYPOINT") + exec_form("CMD") + (extra or [])
    assert argv[0] == IMAGE_PYTHON
    base = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "ORT_DISABLE_TELEMETRY")}
    env = {
        **base,
        **({"HOME": str(home)} if home is not None else {}),
        **image_env(),
        "EMBED_MODEL_DIR": str(model_dir()),
        "EMBED_ADDRESS": "127.0.0.1:0",
        "EMBED_METRICS_ADDRESS": "127.0.0.1:0",
        "EMBED_HTTP_ADDRESS": "127.0.0.1:0",  # never the default :8080 on a shared machine
    }
    # The image's WORKDIR holds minilm_embed/server/, client/, model/ and proto/; the editable install maps
    # the same names to this checkout.
    proc = subprocess.Popen(
        local(argv), cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )
    server = ServerProcess(proc)
    threading.Thread(target=server._pump, daemon=True).start()
    return server


def run_healthcheck(server_port: int, cwd: Path) -> subprocess.CompletedProcess[str]:
    options, command = healthcheck()
    timeout = float(options["timeout"].removesuffix("s"))
    env = {**os.environ, "EMBED_ADDRESS": f"0.0.0.0:{server_port}"}
    return subprocess.run(local(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_image_command_serves_and_healthcheck_follows_it(tmp_path: Path) -> None:
    _, command = healthcheck()
    assert f"service='{SERVICE_NAME}'" in command[-1], "the healthcheck must ask for the service by name"
    home = tmp_path / "home"
    home.mkdir()
    server = start_image_command(home=home).wait_serving()
    assert server.port is not None
    try:
        # onnxruntime 1.31 keeps a device id under ~/.cache/Microsoft for upload unless
        # ORT_DISABLE_TELEMETRY is set before it starts (the server sets it): a serving pod must not
        # call out, nor log a warning about an id it cannot write on a read-only root.
        assert not list(home.rglob("*")), sorted(str(p.relative_to(home)) for p in home.rglob("*"))
        assert not [line for line in server.lines if "telemetry" in line.lower()]
        # From another directory: the one-liner needs only grpcio-health-checking.
        healthy = run_healthcheck(server.port, tmp_path)
        assert healthy.returncode == 0, healthy.stderr
        info = subprocess.run(
            local([*exec_form("ENTRYPOINT"), "minilm_embed.client", "--address", server.address, "info"]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert info.returncode == 0, info.stderr
        manifest = json.loads((model_dir() / "manifest.json").read_text(encoding="utf-8"))
        assert json.loads(info.stdout)["dimensions"] == manifest["dimensions"]
        server.terminate()
        assert server.wait(timeout=60) == 0
    finally:
        server.stop()
    assert run_healthcheck(server.port, tmp_path).returncode == 1


# The manifests.


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_are_native_grpc_and_readiness_names_the_service(
    overlay: str, manifests: dict[str, list[Resource]]
) -> None:
    docs = manifests[overlay]
    container = server_container(docs)
    grpc_port = port(flags(docs)["EMBED_ADDRESS"])
    assert {"name": "grpc", "containerPort": grpc_port, "protocol": "TCP"} in container["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port, probe  # an integer: names are refused
    assert container["startupProbe"]["grpc"]["service"] == SERVICE_NAME
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_termination_grace_outlasts_prestop_and_drain(
    overlay: str, manifests: dict[str, list[Resource]]
) -> None:
    docs = manifests[overlay]
    container = server_container(docs)
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    # After SIGTERM a front says NOT_SERVING, waits SHUTDOWN_NOTICE_S for clients' health watches to
    # move away, and only then gives accepted calls the drain timeout (server/front.py, drain), then,
    # with tracing on, the last export of its spans at most FLUSH_S.
    drain = SHUTDOWN_NOTICE_S + load_config([], flags(docs)).drain_timeout_s + FLUSH_S
    assert pod(docs)["spec"]["terminationGracePeriodSeconds"] > pre_stop + drain
    # Liveness must not kill a pod that says NOT_SERVING because it is draining.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pre_stop + drain


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_runs_as_the_image_user(overlay: str, manifests: dict[str, list[Resource]]) -> None:
    spec = pod(manifests[overlay])["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == image_uid()
    assert server_container(manifests[overlay])["securityContext"]["allowPrivilegeEscalation"] is False


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources_and_gpu_limit(overlay: str, manifests: dict[str, list[Resource]]) -> None:
    resources = server_container(manifests[overlay])["resources"]
    assert resources["requests"]["cpu"] and resources["limits"]["memory"]
    assert ("nvidia.com/gpu" in resources["limits"]) == (overlay == "gpu")
    device = flags(manifests[overlay])["EMBED_DEVICE"]
    assert device == {"cpu": "cpu", "gpu": "cuda"}[overlay]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_flags_configmap_is_a_valid_server_config(overlay: str, manifests: dict[str, list[Resource]]) -> None:
    data = flags(manifests[overlay])
    assert set(data) <= {env_name(f) for f in ServerConfig.__dataclass_fields__}
    config = load_config([], data)
    assert port(config.metrics_address) in [
        p["containerPort"] for p in server_container(manifests[overlay])["ports"]
    ]


def cpus(quantity: str) -> float:
    """A Kubernetes CPU quantity ("2", "500m") in CPUs."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_front_processes_are_set_for_the_cpus_the_pod_requests(
    overlay: str, manifests: dict[str, list[Resource]]
) -> None:
    """Auto sizes the fronts from the cores the server sees: the node's, where the pod has no CPU limit
    (the gpu overlay). Each overlay sets what auto would pick on exactly the CPUs it requests."""
    docs = manifests[overlay]
    config = load_config([], flags(docs))
    assert config.front_processes > 0, "EMBED_FRONT_PROCESSES is auto: it would follow the node's cores"
    requested = int(cpus(server_container(docs)["resources"]["requests"]["cpu"]))
    assert config.front_processes == plan_fronts(dataclasses.replace(config, front_processes=0), requested)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_threads_and_instances_fit_the_cores_the_pod_gets(
    overlay: str, manifests: dict[str, list[Resource]]
) -> None:
    """The server refuses --threads or --model-instances above its usable cores (exit 2) and warns when
    their product is above them. A pod sees its CPU limit (rounded up, cgroup v2 cpu.max), or without
    one a node's cores, at least the CPUs it requests."""
    docs = manifests[overlay]
    config = load_config([], flags(docs))
    resources = server_container(docs)["resources"]
    limit = resources.get("limits", {}).get("cpu")
    cores = math.ceil(cpus(limit)) if limit else int(cpus(resources["requests"]["cpu"]))
    assert config.threads and config.model_instances, "auto would follow the node's cores"
    check_cores(config, cores)
    assert config.threads * config.model_instances <= cores


def fake_cgroup(tmp_path: Path, cpu_max: dict[str, str], own: str = "/kubepods/pod1/server") -> Path:
    """A cgroup v2 tree under tmp_path/cgroup with `cpu.max` files ({directory: content}) and a
    /proc/self/cgroup naming `own`; returns that file."""
    for directory, content in cpu_max.items():
        (tmp_path / "cgroup" / directory).mkdir(parents=True, exist_ok=True)
        (tmp_path / "cgroup" / directory / "cpu.max").write_text(content + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"0::{own}\n")
    return proc


@pytest.mark.parametrize(
    ("cpu_max", "cpus_allowed"),
    [
        ({"kubepods/pod1/server": "200000 100000", "kubepods/pod1": "max 100000"}, 2),  # the container's
        ({"kubepods/pod1/server": "max 100000", "kubepods/pod1": "150000 100000"}, 2),  # the pod's, up
        ({"kubepods/pod1/server": "50000 100000", "kubepods/pod1": "400000 100000"}, 1),  # the tightest
        ({"": "300000 100000"}, 3),  # the root: the container's own cgroup in a cgroup namespace
        ({"kubepods/pod1/server": "max 100000"}, None),  # no limit
        ({"kubepods/pod1/server": "garbage"}, None),
        ({}, None),  # no cpu controller
    ],
)
def test_the_cgroup_cpu_quota_is_read_from_cpu_max(
    tmp_path: Path, cpu_max: dict[str, str], cpus_allowed: int | None
) -> None:
    assert cgroup_cpus(tmp_path / "cgroup", fake_cgroup(tmp_path, cpu_max)) == cpus_allowed


def test_auto_fronts_follow_the_pods_cpu_limit_not_the_nodes_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 64-core node: the pod may run on any core.
    monkeypatch.setattr(host.os, "sched_getaffinity", lambda pid: set(range(64)))
    cuda = ServerConfig(device="cuda")
    limited = fake_cgroup(tmp_path, {"kubepods/pod1/server": "200000 100000"})
    assert plan_fronts(cuda, usable_cores(tmp_path / "cgroup", limited)) == 1
    unlimited = fake_cgroup(tmp_path / "other", {"kubepods/pod1/server": "max 100000"})
    assert plan_fronts(cuda, usable_cores(tmp_path / "other" / "cgroup", unlimited)) == 8
    assert cgroup_cpus(tmp_path / "cgroup", tmp_path / "no-such-file") is None  # no cgroup v2 at all


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_the_pods(overlay: str, manifests: dict[str, list[Resource]]) -> None:
    docs = manifests[overlay]
    labels = pod(docs)["metadata"]["labels"]
    ports = {p["name"] for p in server_container(docs)["ports"]}
    grpc_service = one(docs, "Service", "minilm-embed-grpc")
    assert grpc_service["spec"]["clusterIP"] == "None"  # headless: DNS gives clients every pod
    metrics_service = one(docs, "Service", "minilm-embed-metrics")
    http_service = one(docs, "Service", "minilm-embed-http")
    for service in (grpc_service, metrics_service, http_service):
        assert selects(service["spec"]["selector"], labels)
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
    # Each named container port is the port the server listens on for it.
    config = load_config([], flags(docs))
    listening = {name: port(getattr(config, setting)) for name, setting in SERVER_PORTS.items()}
    assert {p["name"]: p["containerPort"] for p in server_container(docs)["ports"]} == listening
    monitor = one(docs, "ServiceMonitor")["spec"]
    assert selects(monitor["selector"]["matchLabels"], metrics_service["metadata"]["labels"])
    assert not selects(monitor["selector"]["matchLabels"], grpc_service["metadata"]["labels"])
    assert [e["port"] for e in monitor["endpoints"]] == ["metrics"]
    assert selects(one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], labels)
    spread = pod(docs)["spec"]["topologySpreadConstraints"]
    assert "kubernetes.io/hostname" in [c["topologyKey"] for c in spread]
    assert all(selects(c["labelSelector"]["matchLabels"], labels) for c in spread)


def adapter_metrics() -> set[str]:
    values = yaml.safe_load((ROOT / "deploy/k8s/prometheus-adapter/values.yaml").read_text(encoding="utf-8"))
    return {rule["name"]["as"] for rule in values["rules"]["custom"]}


def server_gauges() -> set[str]:
    return {m.name for m in Metrics().registry.collect() if m.type == "gauge"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_scales_on_per_pod_server_gauges(overlay: str, manifests: dict[str, list[Resource]]) -> None:
    docs = manifests[overlay]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", one(docs, "Deployment")["metadata"]["name"])
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert names and names <= adapter_metrics() and names <= server_gauges()
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] > 0
    assert "replicas" not in one(docs, "Deployment")["spec"], "the HPA owns the replica count"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_hpa_queue_target_is_one_full_batch_of_the_overlay(
    overlay: str, manifests: dict[str, list[Resource]]
) -> None:
    """Above one batch waiting on average the model runs back to back (base/hpa.yaml). The gpu overlay
    kept the base's 32 while its batches hold 1,024 rows: pods added with 1/32 of a batch waiting."""
    docs = manifests[overlay]
    config = load_config([], flags(docs))
    provider = CUDA_PROVIDER if config.device == "cuda" else CPU_PROVIDER
    batch = config.max_batch_size or AUTO_BATCH_LIMITS[provider][0]
    (queue,) = [
        m
        for m in one(docs, "HorizontalPodAutoscaler")["spec"]["metrics"]
        if m["pods"]["metric"]["name"] == "embed_queue_interactive_depth"
    ]
    assert int(queue["pods"]["target"]["averageValue"]) == batch


# docker-compose.yml.


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts."""
    pairs = (volume.split(":")[:2] for volume in service.get("volumes", []))
    return {target: ROOT / source for source, target in pairs}


def test_compose_wires_prometheus_rules_and_grafana_dashboard() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
    assert {"embed", "prometheus", "grafana"} <= set(services)
    drain = SHUTDOWN_NOTICE_S + float(services["embed"]["environment"]["EMBED_DRAIN_TIMEOUT_S"])
    assert float(services["embed"]["stop_grace_period"].removesuffix("s")) > drain
    prometheus = mounts(services["prometheus"])
    config = yaml.safe_load(prometheus["/etc/prometheus/prometheus.yml"].read_text(encoding="utf-8"))
    for pattern in config["rule_files"]:
        directory, _, name = pattern.rpartition("/")
        assert glob.glob(str(prometheus[directory] / name)), f"no rule file matches {pattern}"
    (embed_job,) = [job for job in config["scrape_configs"] if job["job_name"] == "embed"]
    assert {n for sd in embed_job["dns_sd_configs"] for n in sd["names"]} <= set(services)
    grafana = mounts(services["grafana"])
    for provider_file in (grafana["/etc/grafana/provisioning"] / "dashboards").glob("*.yml"):
        for provider in yaml.safe_load(provider_file.read_text(encoding="utf-8"))["providers"]:
            assert list(grafana[provider["options"]["path"]].glob("*.json")), provider_file
    for source_file in (grafana["/etc/grafana/provisioning"] / "datasources").glob("*.yml"):
        for source in yaml.safe_load(source_file.read_text(encoding="utf-8"))["datasources"]:
            host = re.match(r"http://([\w-]+):", source["url"])
            assert host and host.group(1) in services, source["url"]


def test_compose_scales_the_cpu_replicas_without_host_port_clashes() -> None:
    """`docker compose up --scale embed=3` starts only if no replica asks for a fixed host port."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))["services"]
    ports = [str(p) for p in services["embed"]["ports"]]
    assert ports and all(":" not in p for p in ports), ports
    config = ServerConfig()
    assert {int(p) for p in ports} == {
        port(config.address),
        port(config.http_address),
        port(config.metrics_address),
    }
