"""The Kubernetes manifests and the container image, checked offline (no cluster, no Docker engine).

1. Every overlay under k8s/overlays renders with `kubectl kustomize` and every rendered object
   validates, in strict mode (no unknown fields), against the Kubernetes OpenAPI schemas of
   `kubernetes-validate` for the oldest and the newest Kubernetes version we claim.
2. What a schema cannot see but `kubectl apply` or the pods would trip on: selectors that select,
   references (ConfigMap keys, Secrets, volumes, claims, HPA target) that exist, $(VAR) order,
   the restricted Pod Security Standard, probes, resources, GPUs only where the GPU overlay puts them.
3. The manifests against the code: container args and the SPECDEC_* variables they set are parsed
   by the CLI's own parser, ports agree across args, containers, probes and Services, probes name
   the health services the servers register, the coordinator's addresses and the Redis URL point at
   Services that exist, the models are found where the pods mount them.
4. The NetworkPolicies: only the coordinator reaches draft and target; coordinator, draft and target
   (which read sessions) reach Redis; nothing else does.
5. The Dockerfile basics: pinned base image, non-root numeric USER matching the pods, no secrets,
   it copies exactly the packages pyproject installs, and the .dockerignore is an allowlist.

Needs `kubectl` (with its built-in kustomize) on PATH, or KUBECTL=/path/to/kubectl, and the
`kubernetes-validate` package (pip install -e '.[test]').
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import io
import math
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from coordinator.replicas import parse_replica_address
from specdec import catalog, serving
from specdec.cli import build_parser, parse_command_line

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())

# Oldest Kubernetes the manifests claim (native gRPC probes are GA since 1.27; 1.31 is the
# oldest minor still commonly supported) and the newest the installed schemas know.
OLDEST_K8S = "1.31.0"

NAMESPACE = "specdec"
SERVICES = ("draft", "target", "coordinator")
HEALTH_SERVICE = {
    "coordinator": serving.COORDINATOR_SERVICE,
    "draft": serving.DRAFT_SERVICE,
    "target": serving.TARGET_SERVICE,
}
METRICS_PORT = 9400
REDIS_PORT = 6379
# Secrets an overlay expects the operator to create before `kubectl apply -k` (not rendered).
EXTERNAL_SECRETS = {"cpu-demo": set(), "gpu": {"specdec-redis", "specdec-internal", "specdec-api-tokens"}}
# The Secret (and key) of the API tokens each overlay's coordinator takes; None: an open API.
API_TOKENS = {"cpu-demo": None, "gpu": ("specdec-api-tokens", "tokens")}
GPU = "nvidia.com/gpu"


# ---------------------------------------------------------------- rendering


def kubectl() -> str:
    path = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not path:
        pytest.fail(
            "kubectl not found (set KUBECTL or put it on PATH). It renders the overlays with its "
            "built-in kustomize, which must be v5 (kubectl 1.27 or newer): on Debian/Ubuntu the "
            "`kubectl` package of Kubernetes' own apt repository (Debian's `kubernetes-client` is "
            "1.20, too old), on macOS `brew install kubectl`."
        )
    return path


@functools.cache
def render(path: str) -> tuple[dict, ...]:
    """`kubectl kustomize PATH` as a tuple of objects."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=60, check=False
    )
    if result.returncode != 0:
        pytest.fail(f"kubectl kustomize k8s/{path} failed:\n{result.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


class Render:
    """One rendered overlay, with the lookups the checks need."""

    def __init__(self, overlay: str):
        self.overlay = overlay
        self.objects = render(f"overlays/{overlay}")

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict | None:
        return next((o for o in self.of_kind(kind) if o["metadata"]["name"] == name), None)

    def workloads(self) -> list[dict]:
        return self.of_kind("Deployment") + self.of_kind("StatefulSet")

    def workload(self, component: str) -> dict:
        found = [w for w in self.workloads() if pod_labels(w).get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"{self.overlay}: expected one workload for {component}, found {len(found)}"
        return found[0]

    def container(self, component: str) -> dict:
        containers = self.workload(component)["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1, f"{self.overlay}/{component}: one container expected"
        return containers[0]

    def selected_workloads(self, selector: dict) -> list[dict]:
        return [w for w in self.workloads() if selects(selector, pod_labels(w))]

    def service_for(self, host: str, port: int) -> tuple[dict, dict]:
        """The Service `host` (as DNS resolves it in the namespace) and its port `port`."""
        name = host.split(".")[0]
        service = self.get("Service", name)
        assert service is not None, f"{self.overlay}: no Service {name!r} for address {host}:{port}"
        ports = [p for p in service["spec"]["ports"] if p["port"] == port]
        assert ports, f"{self.overlay}: Service {name} has no port {port}"
        return service, ports[0]


@functools.cache
def rendered(overlay: str) -> Render:
    return Render(overlay)


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"].get("labels", {})


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels / matchExpressions) or a Service's plain map, applied to labels."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        selector = {"matchLabels": selector}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def component_of(workload: dict) -> str:
    return pod_labels(workload)["app.kubernetes.io/component"]


def all_containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def cpu_cores(quantity) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def mebibytes(quantity) -> float:
    """A memory quantity (512Mi, 3Gi) in MiB."""
    text = str(quantity)
    return float(text[:-2]) * {"Mi": 1, "Gi": 1024}[text[-2:]]


# ---------------------------------------------------------------- 1. render + strict schema


def test_overlays_exist():
    assert {"cpu-demo", "gpu"} <= set(OVERLAYS)


def test_base_renders():
    kinds = sorted(o["kind"] for o in render("base"))
    assert kinds.count("Deployment") == 3 and kinds.count("StatefulSet") == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strict(overlay):
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("the kubernetes-validate package is missing: pip install -e '.[test]'")
    versions = sorted({OLDEST_K8S, kubernetes_validate.latest_version()}, key=lambda v: tuple(map(int, v.split("."))))
    errors = []
    for obj in rendered(overlay).objects:
        for version in versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.path)
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}) at {where}: {exc.message}")
            except Exception as exc:  # an apiVersion/kind that release does not know
                message = getattr(exc, "message", exc)
                errors.append(f"{obj['kind']}/{obj['metadata']['name']} (k8s {version}): {message}")
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_has_every_piece(overlay):
    r = rendered(overlay)
    kinds = [o["kind"] for o in r.objects]
    for kind, count in {
        "Namespace": 1, "Deployment": 3, "StatefulSet": 1, "Service": 4, "ConfigMap": 1,
        "PodDisruptionBudget": 4, "HorizontalPodAutoscaler": 1, "NetworkPolicy": 4,
    }.items():  # fmt: skip
        assert kinds.count(kind) == count, f"{overlay}: {kinds.count(kind)} {kind}, expected {count}"
    for component in (*SERVICES, "redis"):
        r.workload(component)
    redis = r.workload("redis")
    assert redis["kind"] == "StatefulSet" and redis["spec"]["volumeClaimTemplates"], "Redis keeps its data on a PVC"


# ---------------------------------------------------------------- 2. Kubernetes semantics


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_namespace_and_pod_security(overlay):
    r = rendered(overlay)
    (namespace,) = r.of_kind("Namespace")
    assert namespace["metadata"]["name"] == NAMESPACE
    assert namespace["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "restricted"
    for obj in r.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workloads_are_restricted_and_bounded(overlay):
    """The `restricted` Pod Security Standard, plus requests/limits and all three probes everywhere."""
    for w in rendered(overlay).workloads():
        name = w["metadata"]["name"]
        pod = w["spec"]["template"]["spec"]
        assert selects(w["spec"]["selector"], pod_labels(w)), f"{name}: selector does not match its pods"
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), name
        assert pod.get("automountServiceAccountToken") is False, f"{name}: mounts an API token it never uses"
        psc = pod.get("securityContext", {})
        assert psc.get("runAsNonRoot") is True and psc.get("runAsUser", 0) > 0, name
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        for volume in pod.get("volumes", []):
            assert "hostPath" not in volume, f"{name}: hostPath volume {volume['name']}"
        for c in all_containers(w):
            where = f"{name}/{c['name']}"
            sc = c.get("securityContext", {})
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
            assert not sc.get("capabilities", {}).get("add"), where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert not sc.get("privileged"), where
            assert sc.get("runAsUser", psc.get("runAsUser", 0)) != 0, where
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c.get("resources", {}).get(kind, {})), f"{where}: {kind}"
            if c in pod["containers"]:
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert probe in c, f"{where}: no {probe}"
            assert ":" in c["image"].rsplit("/", 1)[-1] or "@sha256:" in c["image"], f"{where}: untagged image"
            assert not c["image"].endswith(":latest"), where


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve(overlay):
    """ConfigMap keys, Secrets, volumes and claims named by the pods exist in the render."""
    r = rendered(overlay)
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in r.of_kind("ConfigMap")}
    secrets = {o["metadata"]["name"]: o.get("data", {}) | o.get("stringData", {}) for o in r.of_kind("Secret")}
    claims = {o["metadata"]["name"] for o in r.of_kind("PersistentVolumeClaim")}
    external = EXTERNAL_SECRETS.get(overlay, set())
    for w in r.workloads():
        name = w["metadata"]["name"]
        pod = w["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            sources = [k for k in volume if k != "name"]
            assert len(sources) == 1, f"{name}: volume {volume['name']} has sources {sources} (an overlay left two)"
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims, f"{name}: {volume}"
            if "secret" in volume:
                secret = volume["secret"]["secretName"]
                if secret in external:
                    assert secret not in secrets
                else:
                    keys = [item["key"] for item in volume["secret"].get("items", [])]
                    assert secret in secrets and all(k in secrets[secret] for k in keys), f"{name}: {volume}"
        for c in all_containers(w):
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, f"{name}: mount {mount['name']}"
            for env in c.get("env", []):
                ref = env.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    cm = ref["configMapKeyRef"]
                    assert cm["name"] in configmaps, f"{name}: {env['name']} <- {cm}"
                    assert cm["key"] in configmaps[cm["name"]] or cm.get("optional"), f"{name}: {env['name']} <- {cm}"
                if "secretKeyRef" in ref:
                    sk = ref["secretKeyRef"]
                    if sk["name"] in external:
                        assert sk["name"] not in secrets
                    else:
                        assert sk["key"] in secrets.get(sk["name"], {}), f"{name}: {env['name']} <- {sk}"
            assert_env_order(name, c.get("env", []))
    for hpa in r.of_kind("HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        target = r.get(ref["kind"], ref["name"])
        assert target is not None, f"HPA {hpa['metadata']['name']} scales a missing {ref}"
        assert "replicas" not in target["spec"], f"{ref['name']}: the HPA owns replicas; apply would reset them"
        for c in target["spec"]["template"]["spec"]["containers"]:
            assert "cpu" in c["resources"]["requests"], "CPU utilization needs CPU requests"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    for pdb in r.of_kind("PodDisruptionBudget"):
        assert r.selected_workloads(pdb["spec"]["selector"]), f"PDB {pdb['metadata']['name']} selects no pods"
        # one pod of each kind evicted at a time (README); the coordinator's said minAvailable: 1,
        # which let a drain take all of its pods but one at once
        assert pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"], pdb["metadata"]["name"]


def assert_env_order(where: str, env: list[dict]) -> None:
    """$(VAR) in a value expands only when VAR is defined earlier in the list."""
    seen = set()
    for item in env:
        for ref in re.findall(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", item.get("value", "")):
            assert ref in seen, f"{where}: {item['name']} uses $({ref}) before it is defined"
        seen.add(item["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_select_their_pods(overlay):
    r = rendered(overlay)
    for service in r.of_kind("Service"):
        name = service["metadata"]["name"]
        pods = r.selected_workloads(service["spec"]["selector"])
        assert len(pods) == 1, f"Service {name} selects {len(pods)} workloads"
        ports = {p.get("name"): p["containerPort"] for c in pods[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}  # fmt: skip
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert (target in ports) if isinstance(target, str) else (target in ports.values()), f"{name}: {port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_only_in_the_gpu_overlay(overlay):
    r = rendered(overlay)
    gpus = {}
    for component in SERVICES:
        resources = r.container(component)["resources"]
        gpus[component] = int(resources["limits"].get(GPU, 0))
        assert int(resources["requests"].get(GPU, gpus[component])) == gpus[component], "GPU requests == limits"
    if overlay == "gpu":
        assert gpus["target"] >= 1 and gpus["draft"] >= 1 and gpus["coordinator"] == 0, gpus
    else:
        assert not any(gpus.values()), f"{overlay} must run without GPUs: {gpus}"
    # the target shares tensors through /dev/shm: a memory-backed emptyDir, not the runtime's 64 MiB
    target = r.workload("target")
    volumes = {v["name"]: v for v in target["spec"]["template"]["spec"]["volumes"]}
    (shm,) = [m for m in r.container("target")["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    assert volumes[shm["name"]]["emptyDir"]["medium"] == "Memory"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_rolling_update_replaces_a_model_pod_where_the_overlay_has_room_for_one_copy_only(overlay):
    """A new config value rolls all three Deployments; one that starts a second model pod beside
    the first needs room for both: the gpu overlay's spare GPUs, or cpu-demo's laptop memory
    ("about 4 GiB to spare"), were not there, the new pod stayed Pending and with maxUnavailable 0
    the update never went on. There, a model pod is replaced."""
    r = rendered(overlay)
    for component in ("draft", "target"):
        rolling = r.workload(component)["spec"]["strategy"]["rollingUpdate"]
        surge = (rolling["maxSurge"], rolling["maxUnavailable"])
        assert surge == (0, 1), f"{overlay}/{component}: maxSurge, maxUnavailable = {surge}"


# ---------------------------------------------------------------- 3. manifests <-> code


def resolve_env(r: Render, container: dict) -> dict[str, str]:
    """The container's environment as the kubelet would build it (secrets and fields stubbed)."""
    configmaps = {o["metadata"]["name"]: o.get("data", {}) for o in r.of_kind("ConfigMap")}
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = re.sub(
                r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"]
            )
        elif "configMapKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["configMapKeyRef"]
            if ref.get("optional") and ref["key"] not in configmaps[ref["name"]]:
                continue  # the kubelet leaves the variable unset
            env[item["name"]] = configmaps[ref["name"]][ref["key"]]
        elif "secretKeyRef" in item["valueFrom"]:
            env[item["name"]] = "0123456789abcdef"  # the content is checked in test_redis_url
        else:
            env[item["name"]] = f"<{item['name']}>"
    return env


def service_parser(service: str) -> argparse.ArgumentParser:
    """The `specdec serve SERVICE` subparser (built now, so it reads the current environment)."""
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return next(a for a in serve._actions if isinstance(a, argparse._SubParsersAction)).choices[service]


@functools.cache
def env_names(service: str) -> frozenset[str]:
    """Every SPECDEC_* variable the service reads: those its flags' help names (`[env: ...]`,
    or a secret read directly, e.g. "or set SPECDEC_INTERNAL_TOKEN"), plus the cache folder."""
    names = set()
    for action in service_parser(service)._actions:
        names.update(re.findall(r"\b(SPECDEC_[A-Z0-9_]+)\b", action.help or ""))
    return frozenset(names | {catalog.CACHE_ENV})


def parse_service(monkeypatch, service: str, container: dict, env: dict[str, str]) -> argparse.Namespace:
    """Parse the container's args with the CLI's parser, with its SPECDEC_* environment set."""
    args = container.get("args", [])
    assert container.get("command") is None, "the image's ENTRYPOINT (specdec) must stay"
    assert args[:2] == ["serve", service], f"{service}: args must start with `serve {service}`: {args}"
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("SPECDEC_")]:
            m.delenv(key)
        for key, value in env.items():
            if key.startswith("SPECDEC_"):
                m.setenv(key, value)
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                return parse_command_line(args)  # the environment's values checked as the command runs
        except SystemExit:
            pytest.fail(f"`specdec {' '.join(args)}` with {sorted(env)} is refused by the CLI:\n{stderr.getvalue()}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_match_the_cli(overlay, monkeypatch):
    r = rendered(overlay)
    parsed = {}
    for service in SERVICES:
        container = r.container(service)
        env = resolve_env(r, container)
        unknown = {k for k in env if k.startswith("SPECDEC_")} - env_names(service)
        assert not unknown, f"{overlay}/{service}: {sorted(unknown)} are read by no `specdec serve {service}` flag"
        args = parse_service(monkeypatch, service, container, env)
        parsed[service] = args
        assert args.host == "0.0.0.0", f"{service} must listen on all pod addresses"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports.get("grpc") == args.port, f"{overlay}/{service}: containerPort {ports} vs --port {args.port}"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]["grpc"]
            assert probe["port"] == args.port, f"{service} {kind} probes {probe['port']}, serves {args.port}"
            assert probe["service"] == HEALTH_SERVICE[service], f"{service} {kind}: {probe['service']}"
        # metrics: the port Prometheus is told about is declared, and served once the CLI has the flag
        annotations = r.workload(service)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
        assert int(annotations["prometheus.io/port"]) == ports.get("metrics") == METRICS_PORT
        if hasattr(args, "metrics_port"):
            assert args.metrics_port == METRICS_PORT, f"{service}: pass --metrics-port {METRICS_PORT}"
        assert env.get("OTEL_SERVICE_NAME") == f"specdec-{service}"
        # the SPECDEC_CACHE folder is a mounted volume (the root filesystem is read-only)
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert env[catalog.CACHE_ENV] in mounts, f"{service}: the model cache is not a volume"
        assert "/tmp" in mounts, f"{service}: /tmp must be writable"
        if service != "coordinator":
            check_model_placement(r, service, args, container)

    # the coordinator talks to the Services of the draft and the target, on their ports, each
    # pod a replica: a dns:/// address of a headless Service (a ClusterIP resolves to one address)
    for service, address in (("draft", parsed["coordinator"].draft_address),
                             ("target", parsed["coordinator"].target_address)):  # fmt: skip
        replicas = parse_replica_address(address)
        assert replicas.host, f"--{service}-address {address}: not dns:///, so one pod would get every session"
        svc, svc_port = r.service_for(replicas.host, replicas.port)
        assert svc["spec"].get("clusterIP") == "None", f"Service {svc['metadata']['name']} must be headless"
        (workload,) = r.selected_workloads(svc["spec"]["selector"])
        assert component_of(workload) == service, f"--{service}-address {address} reaches {component_of(workload)}"
        ports = {p["name"]: p["containerPort"] for p in r.container(service)["ports"]}
        assert ports.get(svc_port["targetPort"], svc_port["targetPort"]) == parsed[service].port
    # sampling limits agree: the coordinator never asks for more than the services accept
    coordinator = parsed["coordinator"]
    # a stopping coordinator's preStop wait, drain and close (its last requests' releases) end before
    # the kubelet's SIGKILL: the calls it cancels then fail UNAVAILABLE, which the SDK resumes
    # elsewhere, not with the pod's death
    from coordinator.server import CLOSE_BACKGROUND_S

    pod = r.workload("coordinator")["spec"]["template"]["spec"]
    pre_stop = r.container("coordinator")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep", pre_stop
    assert float(pre_stop[1]) + coordinator.drain_s + CLOSE_BACKGROUND_S + 1 <= pod["terminationGracePeriodSeconds"]
    assert 1 <= coordinator.max_k <= min(parsed["draft"].max_k, parsed["target"].max_k)
    assert coordinator.default_k is None or 1 <= coordinator.default_k <= coordinator.max_k
    assert 1 <= coordinator.default_max_new_tokens <= coordinator.max_new_tokens_limit
    # every service keeps sessions as long as Redis does; a hung device takes a model pod out
    assert parsed["draft"].session_ttl == parsed["target"].session_ttl == coordinator.session_ttl
    assert parsed["draft"].pass_timeout > 0 and parsed["target"].pass_timeout > 0
    # a coordinator waits for the model services as long as its startup probe lets it start (it
    # waited a fixed 10 minutes where the probes allowed 15, and 30 in the gpu overlay)
    probe = r.container("coordinator")["startupProbe"]
    assert coordinator.startup_timeout >= probe["failureThreshold"] * probe["periodSeconds"], coordinator.startup_timeout
    # a per-caller limit is below the pod's, and means something only where callers are told apart
    assert 0 <= coordinator.max_requests_per_caller <= coordinator.max_concurrent_requests
    assert not coordinator.max_requests_per_caller or API_TOKENS[overlay], "a per-caller limit without API tokens"
    # the coordinator loads the tokenizer of the model the target reports: it must see it too
    target_model = parsed["target"].model
    coordinator_mounts = {m["mountPath"] for m in r.container("coordinator")["volumeMounts"]}
    if target_model.startswith("/"):
        assert any(target_model.startswith(p.rstrip("/") + "/") for p in coordinator_mounts), (
            f"the coordinator cannot read the target's tokenizer at {target_model}"
        )


def check_model_placement(r: Render, service: str, args: argparse.Namespace, container: dict) -> None:
    """A model path lives on a mounted volume; a catalog name converts into a writable cache."""
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    gpus = int(container["resources"]["limits"].get(GPU, 0))
    if args.model.startswith("/"):
        assert any(args.model.startswith(p.rstrip("/") + "/") for p in mounts), f"{service}: {args.model} not mounted"
    elif args.model != "ngram":
        names = [*catalog.CATALOG, *(catalog.DRAFT_CATALOG if service == "draft" else [])]
        assert args.model in names, f"{service}: {args.model!r} is no catalog name"
        cache = mounts[resolve_env(r, container)[catalog.CACHE_ENV]]
        assert not cache.get("readOnly"), f"{service}: catalog model {args.model} needs a writable cache"
    if args.model != "ngram" and gpus:
        assert args.device != "cpu", f"{service}: {gpus} GPUs requested but --device cpu"
    elif args.model != "ngram":
        assert args.device in ("cpu", "auto"), f"{service}: --device {args.device} without a GPU"
    cpu_limit = cpu_cores(container["resources"]["limits"]["cpu"])
    assert 1 <= args.threads <= math.ceil(cpu_limit), f"{service}: --threads {args.threads} vs {cpu_limit} CPUs"
    # KV caches fill --max-cache-mb in steady use (finished sessions are kept for prefix reuse): on
    # a CPU pod they share its memory limit with the model, so they may take half of it at most
    if args.model != "ngram" and not gpus:
        memory_limit = mebibytes(container["resources"]["limits"]["memory"])
        assert 0 < args.max_cache_mb <= memory_limit / 2, (
            f"{service}: --max-cache-mb {args.max_cache_mb} in a pod limited to {memory_limit:.0f} MiB"
        )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_redis_url(overlay):
    r = rendered(overlay)
    redis = r.workload("redis")
    redis_port = next(p["containerPort"] for p in redis["spec"]["template"]["spec"]["containers"][0]["ports"])
    for service in SERVICES:
        container = r.container(service)
        env = {e["name"]: e for e in container["env"]}
        url = urlsplit(resolve_env(r, container)["SPECDEC_REDIS_URL"])
        assert url.scheme in ("redis", "rediss") and url.port and url.path == "/0"
        svc, svc_port = r.service_for(url.hostname, url.port)
        assert r.selected_workloads(svc["spec"]["selector"]) == [redis], f"{service}: {url.hostname} is not Redis"
        assert svc_port.get("targetPort") in ("redis", redis_port)
        # the password comes from the Secret the Redis server reads, never from the manifest
        assert "$(REDIS_PASSWORD)" in env["SPECDEC_REDIS_URL"]["value"]
        redis_env = {e["name"]: e for e in redis["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert env["REDIS_PASSWORD"]["valueFrom"] == redis_env["REDIS_PASSWORD"]["valueFrom"]
    for secret in r.of_kind("Secret"):
        if "password" not in secret["data"]:
            continue
        password = base64.b64decode(secret["data"]["password"]).decode()
        assert re.fullmatch(r"[A-Za-z0-9._~-]+", password), "the password goes into a URL: keep it URL-safe"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_services_share_one_internal_token_from_a_secret(overlay):
    """The coordinator sends the token the draft and target require: each reads it from the
    file of the same Secret key, mounted (a file, so the services re-read it when the Secret
    changes), never from a plaintext value."""
    r = rendered(overlay)
    refs = set()
    for service in SERVICES:
        env = resolve_env(r, r.container(service))
        assert "SPECDEC_INTERNAL_TOKEN" not in env, f"{service}: the internal token as a variable is never re-read"
        refs.add(secret_file(r, service, env["SPECDEC_INTERNAL_TOKEN_FILE"]))
    (name, key), = refs
    assert name.startswith("specdec-internal") and key == "token"
    check_secret_key(r, overlay, name, key)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_coordinator_takes_api_tokens_from_a_mounted_secret_where_the_overlay_says(overlay):
    """gpu: bearer tokens from the file of Secret specdec-api-tokens (re-read when it changes);
    the laptop demo's API is open. The model services never take API tokens."""
    r = rendered(overlay)
    env = resolve_env(r, r.container("coordinator"))
    if API_TOKENS[overlay] is None:
        assert "SPECDEC_AUTH_TOKEN_FILE" not in env and "SPECDEC_AUTH_TOKEN" not in env
    else:
        assert "SPECDEC_AUTH_TOKEN" not in env, "a token as a variable is visible to anyone who reads the pod spec"
        name, key = secret_file(r, "coordinator", env["SPECDEC_AUTH_TOKEN_FILE"])
        wanted, wanted_key = API_TOKENS[overlay]
        assert (name == wanted or name.startswith(f"{wanted}-")) and key == wanted_key, (name, key)  # -<hash>: generated
        check_secret_key(r, overlay, name, key)
    for service in ("draft", "target"):
        assert not {"SPECDEC_AUTH_TOKEN_FILE", "SPECDEC_AUTH_TOKEN"} & set(resolve_env(r, r.container(service)))


def secret_file(r: Render, component: str, path: str) -> tuple[str, str]:
    """(Secret, key) of the file `path` that a component's container reads from a mounted,
    read-only Secret volume."""
    pod = r.workload(component)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in r.container(component)["volumeMounts"]:
        folder = mount["mountPath"].rstrip("/") + "/"
        if path.startswith(folder):
            source = volumes[mount["name"]].get("secret")
            assert source and mount.get("readOnly"), f"{component}: {path} is not on a read-only Secret volume"
            file = path[len(folder):]
            items = {item["path"]: item["key"] for item in source.get("items", [])}
            assert not items or file in items, f"{component}: {path} is no file of the Secret volume"
            return source["secretName"], items.get(file, file)
    raise AssertionError(f"{component}: {path} is on no mounted volume")


def check_secret_key(r: Render, overlay: str, name: str, key: str) -> None:
    """The Secret is rendered with the key, or is one the overlay has the operator create."""
    if name in EXTERNAL_SECRETS.get(overlay, set()):
        assert r.get("Secret", name) is None
        return
    secret = r.get("Secret", name)
    assert secret is not None and key in secret.get("data", {}) | secret.get("stringData", {}), (overlay, name, key)


# ---------------------------------------------------------------- 4. network policies


def allowed_sources(r: Render, component: str, port: int) -> set[str]:
    """Components allowed to reach `component` on `port`; "*" when anyone is."""
    target_labels = pod_labels(r.workload(component))
    policies = [p for p in r.of_kind("NetworkPolicy") if selects(p["spec"]["podSelector"], target_labels)]
    assert policies, f"no NetworkPolicy isolates {component}"
    sources = set()
    for policy in policies:
        assert "Ingress" in policy["spec"]["policyTypes"]
        for rule in policy["spec"].get("ingress", []):
            if rule.get("ports") and all(p.get("port") != port for p in rule["ports"]):
                continue
            if not rule.get("from"):
                sources.add("*")
            for peer in rule.get("from", []):
                if "podSelector" not in peer or "namespaceSelector" in peer or "ipBlock" in peer:
                    sources.add("*")
                    continue
                sources.update(component_of(w) for w in r.selected_workloads(peer["podSelector"]))
    return sources


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies(overlay):
    r = rendered(overlay)
    port = {s: next(p["containerPort"] for p in r.container(s)["ports"] if p["name"] == "grpc") for s in SERVICES}
    assert allowed_sources(r, "draft", port["draft"]) == {"coordinator"}
    assert allowed_sources(r, "target", port["target"]) == {"coordinator"}
    assert allowed_sources(r, "redis", REDIS_PORT) == {"coordinator", "draft", "target"}
    assert allowed_sources(r, "coordinator", port["coordinator"]) == {"*"}, "the coordinator is the public API"
    for component in SERVICES:
        assert "*" in allowed_sources(r, component, METRICS_PORT), f"Prometheus cannot scrape {component}"
    for component in ("draft", "target", "redis"):
        assert allowed_sources(r, component, 12345) == set(), f"{component} accepts unlisted ports"


# ---------------------------------------------------------------- 5. Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        logical.append(current)
        current = ""
    return [(text.split(None, 1)[0].upper(), text.split(None, 1)[1] if " " in text else "") for text in logical]


def test_dockerfile_base_images_are_pinned():
    instructions = dockerfile_instructions()
    global_args, stages = {}, set()
    for op, rest in instructions:
        if op == "FROM":
            break
        if op == "ARG" and "=" in rest:
            key, value = rest.split("=", 1)
            global_args[key.strip()] = value.strip().strip('"')
    froms = [rest for op, rest in instructions if op == "FROM"]
    assert froms
    for rest in froms:
        words = rest.split()
        image = re.sub(r"\$\{?(\w+)\}?", lambda m: global_args.get(m.group(1), m.group(0)), words[0])
        if image in stages:
            continue
        if len(words) >= 3 and words[1].upper() == "AS":
            stages.add(words[2])
        name = image.split("@")[0]
        assert "$" not in image, f"FROM {words[0]}: an ARG without a pinned default"
        assert ":" in name.rsplit("/", 1)[-1], f"FROM {image}: no tag"
        assert not name.endswith(":latest"), f"FROM {image}: `latest` is not a pin"
        assert re.search(r"@sha256:[0-9a-f]{64}$", image), f"FROM {image}: pin the digest too"


def test_dockerfile_runs_as_the_pods_user():
    instructions = dockerfile_instructions()
    users = [rest for op, rest in instructions if op == "USER"]
    assert users, "no USER: the image would run as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric and non-zero, so runAsNonRoot can check it"
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    assert any(op == "USER" for op, _ in instructions[last_from:]), "USER must be set in the final stage"
    for overlay in OVERLAYS:
        for service in SERVICES:
            pod_user = rendered(overlay).workload(service)["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
            assert pod_user == int(uid), f"{overlay}/{service} runs as {pod_user}, the image as {uid}"
    entrypoint = next(rest for op, rest in reversed(instructions) if op == "ENTRYPOINT")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert yaml.safe_load(entrypoint)[0] in scripts, f"ENTRYPOINT {entrypoint} is not the console script"
    exposed = {int(p.split("/")[0]) for op, rest in instructions if op == "EXPOSE" for p in rest.split()}
    defaults = {service_parser(s).get_default("port") for s in SERVICES}
    assert defaults | {METRICS_PORT} <= exposed


def test_dockerfile_holds_no_secrets():
    secretish = re.compile(r"(PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|CREDENTIAL|PRIVATE_?KEY|AUTH)", re.I)
    for op, rest in dockerfile_instructions():
        if op in ("ENV", "ARG"):
            for key in re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)(?==|\s|$)", rest):
                assert not secretish.search(key), f"{op} {key}: secrets do not belong in an image"
        if op in ("COPY", "ADD"):
            sources = [w for w in rest.split() if not w.startswith("--")][:-1]
            for source in sources:
                assert not re.search(r"(^|/)(\.env|\.netrc|\.pypirc|id_rsa|id_ed25519)|\.(pem|key|p12)$", source), (
                    f"{op} {source}: a credential file"
                )
        if op == "ADD":
            assert "http://" not in rest and "https://" not in rest, "ADD from a URL is unverified"


def test_image_installs_what_pyproject_packages():
    """COPY brings exactly the packages setuptools installs, and .dockerignore lets only those through."""
    instructions = dockerfile_instructions()
    copied = set()
    for op, rest in instructions:
        if op == "COPY" and "--from" not in rest:
            copied.update(w.rstrip("/") for w in rest.split()[:-1] if not w.startswith("--"))
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    readme = pyproject["project"]["readme"]
    assert copied == packages | {"pyproject.toml", readme}, copied
    for path in copied:
        assert (ROOT / path).exists(), path
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    ignore = [line for line in ignore if line and not line.startswith("#")]
    assert ignore[0] == "*", ".dockerignore should exclude everything, then allow what the image needs"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert allowed == copied, f".dockerignore allows {allowed}, the Dockerfile copies {copied}"
    env = " ".join(rest for op, rest in instructions if op == "ENV")
    cache = catalog.CACHE_ENV
    assert f"{cache}=/models" in env and any(op == "VOLUME" and "/models" in rest for op, rest in instructions)
    args = {rest.split("=")[0].strip() for op, rest in instructions if op == "ARG"}
    assert "TORCH_VARIANT" in args
