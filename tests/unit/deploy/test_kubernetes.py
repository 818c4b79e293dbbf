"""deploy/kubernetes against the Kubernetes API's schemas, and the shape the design asks of it.

Each overlay is rendered by `kubectl kustomize` (CI installs Debian's kubernetes-client, whose
kustomize is v2.0.3; newer ones render the same objects), and every object is validated offline by
kubernetes-validate in strict mode, so an unknown or misplaced field fails as it would on `kubectl
apply --validate=strict`.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, major_minor
from packaging.version import Version

from services.cli import build_parser
from services.common.config import TesseraConfig, load_config
from services.common.tls import ROLES, load_role_credentials
from services.common.tls_issue import ensure_cluster_certs

REPO_ROOT = Path(__file__).resolve().parents[3]
KUBERNETES = REPO_ROOT / "deploy" / "kubernetes"
OVERLAYS = ("cpu-trial", "gpu-production")
NAMESPACE = "tessera"
# The newest Kubernetes whose schemas kubernetes-validate ships, and the one three minors older
# (a cluster about a year behind).
_MINORS = sorted({major_minor(v) for v in all_versions()}, key=Version)
K8S_VERSIONS = (_MINORS[-4], _MINORS[-1])
# What each Secret key the manifests reference holds (docs/kubernetes.md creates them).
SECRET_SAMPLES = {
    ("tessera-database", "url"): "postgresql+psycopg://tessera:pw@tessera-postgres:5432/tessera",
    ("tessera-database", "password"): "pw",
    ("tessera-api-keys", "admin"): "admin-key",
    ("tessera-api-keys", "gateway"): "[client-key]",
}
TLS_FILES = {"ca.pem", *(f"{role}{suffix}" for role in ROLES for suffix in (".pem", "-key.pem"))}
# deploy/Dockerfile's ENV, which every Tessera container starts with.
IMAGE_HOME = re.search(r"^ENV TESSERA_HOME=(\S+)", (REPO_ROOT / "deploy" / "Dockerfile").read_text(),
                       re.MULTILINE)[1]

Objects = dict[tuple[str, str], dict[str, Any]]


def render(overlay: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is not installed: these tests render deploy/kubernetes with `kubectl kustomize`; "
                    "install Debian's kubernetes-client package (apt-get install kubernetes-client)")
    done = subprocess.run([kubectl, "kustomize", str(KUBERNETES / "overlays" / overlay)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, f"kubectl kustomize {overlay} failed:\n{done.stderr}"
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def by_name(docs: list[dict[str, Any]]) -> Objects:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def workloads(objects: Objects) -> dict[str, dict[str, Any]]:
    """Pod templates by the workload's name (Deployments, StatefulSets, Jobs)."""
    return {name: doc["spec"]["template"] for (kind, name), doc in objects.items()
            if kind in ("Deployment", "StatefulSet", "Job")}


def containers(objects: Objects, workload: str) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in workloads(objects)[workload]["spec"]["containers"]}


def is_tessera(container: dict[str, Any]) -> bool:
    return container["image"].split(":")[0].rsplit("/", 1)[-1] == "tessera"


def container_env(container: dict[str, Any], pod_name: str) -> dict[str, str]:
    """The container's environment as its process sees it: Secrets as SECRET_SAMPLES, the downward
    API for a pod named `pod_name`, $(VAR) expanded from the variables above it as kubelet does."""
    fields = {"metadata.name": pod_name, "metadata.namespace": NAMESPACE}
    env: dict[str, str] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = SECRET_SAMPLES[(ref["name"], ref["key"])]
        elif "fieldRef" in source:
            env[var["name"]] = fields[source["fieldRef"]["fieldPath"]]
        else:
            env[var["name"]] = re.sub(r"\$\(([A-Za-z0-9_]+)\)", lambda m: env.get(m[1], m[0]), var["value"])
    return env


def config_of(container: dict[str, Any], pod_name: str, **overrides: str) -> TesseraConfig:
    return load_config(environ={"TESSERA_HOME": IMAGE_HOME, **container_env(container, pod_name), **overrides})


def tessera_containers(objects: Objects) -> list[tuple[str, dict[str, Any]]]:
    """(pod name, container) for every container running the Tessera image."""
    out = []
    for (kind, name), doc in objects.items():
        if kind in ("Deployment", "StatefulSet", "Job"):
            pod = f"{name}-0" if kind == "StatefulSet" else name
            out += [(pod, c) for c in doc["spec"]["template"]["spec"]["containers"] if is_tessera(c)]
    return out


def served_role(container: dict[str, Any]) -> str | None:
    args = container["args"]
    return args[1] if args[0] == "serve" and args[1] in ROLES else None


def mounts(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, tuple[dict[str, Any], bool]]:
    """mount path -> (the volume, mounted read-only)."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return {m["mountPath"]: (volumes[m["name"]], m.get("readOnly", False)) for m in container["volumeMounts"]}


def claim(volume: dict[str, Any]) -> str | None:
    return volume.get("persistentVolumeClaim", {}).get("claimName")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_object_passes_the_kubernetes_schemas_strictly(
        rendered: dict[str, list[dict[str, Any]]], overlay: str, version: str) -> None:
    errors = []
    for doc in rendered[overlay]:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:  # a CRD or a typo in apiVersion/kind
            errors.append(exc.message)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("mistake", ["unknown field", "wrong type"])
def test_the_schemas_would_catch_a_mistake(rendered: dict[str, list[dict[str, Any]]], mistake: str) -> None:
    worker = by_name(rendered["gpu-production"])[("StatefulSet", "tessera-worker")]
    kubernetes_validate.validate(worker, K8S_VERSIONS[-1], strict=True)
    spec = {**worker["spec"], "replicaz": 2} if mistake == "unknown field" else {**worker["spec"], "replicas": "two"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate({**worker, "spec": spec}, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_is_in_the_tessera_namespace_and_labelled_part_of_tessera(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = by_name(rendered[overlay])
    assert not [key for key, doc in objects.items() if doc["kind"] == "Secret"], "Secrets are made by the operator"
    for key, doc in objects.items():
        assert doc["metadata"]["namespace"] == NAMESPACE, key
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tessera", key
    for name, pod in workloads(objects).items():
        assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tessera", name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_tessera_command_parses_and_every_config_loads(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    for pod_name, container in tessera_containers(by_name(rendered[overlay])):
        commands = [container["args"]] + [container[p]["exec"]["command"][1:] for p in
                                          ("startupProbe", "readinessProbe", "livenessProbe") if p in container]
        for args in commands:
            try:
                build_parser().parse_args(args)
            except SystemExit:
                pytest.fail(f"{pod_name}/{container['name']}: `tessera {' '.join(args)}` is not a tessera command")
        config_of(container, pod_name)  # unknown keys and wrong types raise ConfigError


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_roles_bind_every_interface_and_are_probed_and_scraped_as_their_role(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = by_name(rendered[overlay])
    probed = set()
    for name, pod in workloads(objects).items():
        for container in pod["spec"]["containers"]:
            role = served_role(container) if is_tessera(container) else None
            if role is None:
                continue
            config = config_of(container, f"{name}-0")
            section = getattr(config, role)
            assert section.host == "0.0.0.0", (name, role)
            health = ["tessera", "health", "--role", role, f"127.0.0.1:{section.grpc_port}"]
            probes = ("startupProbe", "readinessProbe", "livenessProbe") if role == "worker" else (
                "readinessProbe", "livenessProbe")
            for probe in probes:
                assert container[probe]["exec"]["command"] == health, (name, probe)
            ports = {p["containerPort"] for p in container["ports"]}
            assert {section.grpc_port, section.metrics_port} <= ports, name
            annotations = pod["metadata"]["annotations"]
            assert annotations["prometheus.io/scrape"] == "true", name
            assert annotations["prometheus.io/port"] == str(section.metrics_port), name
            assert annotations["prometheus.io/path"] == "/metrics", name
            probed.add(role)
    assert probed == set(ROLES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_certificates_issued_with_tessera_certs_yaml_name_every_host_the_roles_reach_each_other_by(
        rendered: dict[str, list[dict[str, Any]]], overlay: str, tmp_path: Path) -> None:
    certs = load_config(KUBERNETES / "tessera-certs.yaml", environ={"TESSERA_HOME": str(tmp_path)})
    ensure_cluster_certs(certs)
    tls_dir = str(tmp_path / "tls")
    for pod_name, container in tessera_containers(by_name(rendered[overlay])):
        config = config_of(container, pod_name, TESSERA_TLS__DIR=tls_dir)
        # Each role's certificate names every host this container binds or dials that role at (a
        # worker's advertised pod name, the registry's Service), so the role starts and peers verify.
        for role in ROLES:
            assert load_role_credentials(config, role).role == role, (pod_name, role)
    worker = containers(by_name(rendered[overlay]), "tessera-worker")["worker"]
    assert config_of(worker, "tessera-worker-3").worker.advertise_address == (
        "tessera-worker-3.tessera-worker.tessera.svc:50061")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_roles_mount_only_their_own_certificate_from_the_tls_secret_read_only(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = by_name(rendered[overlay])
    for name, pod in workloads(objects).items():
        for container in pod["spec"]["containers"]:
            role = served_role(container) if is_tessera(container) else None
            if role is None:
                continue
            volume, read_only = mounts(pod, container)[config_of(container, f"{name}-0").tls.dir]
            assert read_only and volume["secret"]["secretName"] == "tessera-tls", name
            assert {i["key"] for i in volume["secret"]["items"]} == {"ca.pem", f"{role}.pem", f"{role}-key.pem"}
    referenced = {i["key"] for pod in workloads(objects).values() for v in pod["spec"]["volumes"]
                  if v.get("secret", {}).get("secretName") == "tessera-tls" for i in v["secret"]["items"]}
    assert referenced == TLS_FILES, "the CA key stays out of the cluster"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_are_referenced_never_inlined_and_documented(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    for name, pod in workloads(by_name(rendered[overlay])).items():
        for container in pod["spec"]["containers"]:
            for var in container.get("env", []):
                if re.search(r"KEY|PASSWORD|DATABASE_URL", var["name"]):
                    ref = var["valueFrom"]["secretKeyRef"]
                    assert (ref["name"], ref["key"]) in SECRET_SAMPLES, (name, var["name"])
    for secret, key in [*SECRET_SAMPLES, *(("tessera-tls", f) for f in TLS_FILES)]:
        assert secret in docs and key in docs, f"docs/kubernetes.md does not say how to create {secret}'s {key}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_adapter_store_and_models_are_shared_volumes_at_the_paths_the_registry_records(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = by_name(rendered[overlay])
    pods = workloads(objects)
    registry = containers(objects, "tessera-registry")["registry"]
    registry_config = config_of(registry, "tessera-registry")
    registry_mounts = mounts(pods["tessera-registry"], registry)
    store = str(registry_config.adapter_store_path)
    assert claim(registry_mounts[store][0]) == "tessera-adapters" and not registry_mounts[store][1]
    roots = [str(r) for r in registry_config.import_root_paths]
    assert [claim(registry_mounts[r][0]) for r in roots] == ["tessera-models"]
    worker = containers(objects, "tessera-worker")["worker"]
    worker_mounts = mounts(pods["tessera-worker"], worker)
    # A worker reads an adapter, and its base model, where the registry recorded it: the same paths.
    assert str(config_of(worker, "tessera-worker-0").worker_adapter_store_path) == store
    assert claim(worker_mounts[store][0]) == "tessera-adapters" and worker_mounts[store][1]
    assert claim(worker_mounts[roots[0]][0]) == "tessera-models" and worker_mounts[roots[0]][1]
    for key, doc in objects.items():
        if key in (("PersistentVolumeClaim", "tessera-adapters"), ("PersistentVolumeClaim", "tessera-models")):
            modes = doc["spec"]["accessModes"]
            assert modes == (["ReadWriteOnce"] if overlay == "cpu-trial" else ["ReadWriteMany"]), key


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_cpu_lora_sidecar_shares_an_in_memory_dev_shm_and_every_worker_container_is_guaranteed(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = by_name(rendered[overlay])
    pod = workloads(objects)["tessera-worker"]
    pair = containers(objects, "tessera-worker")
    assert set(pair) == {"worker", "cpu-lora"} and pair["cpu-lora"]["args"] == ["serve", "cpu-lora"]
    configs = {name: config_of(c, "tessera-worker-0") for name, c in pair.items()}
    for name, container in pair.items():
        worker = configs[name].worker
        assert worker.cpu_lora_launch == "sidecar", name
        volume, read_only = mounts(pod, container)[worker.cpu_lora_shm_dir]
        assert worker.cpu_lora_shm_dir == "/dev/shm" and not read_only, name
        assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"], name
        # Guaranteed QoS in whole CPUs: the static CPU manager gives the container exclusive cores.
        resources = container["resources"]
        for resource in ("cpu", "memory"):
            assert resources["requests"][resource] == resources["limits"][resource], (name, resource)
        assert re.fullmatch(r"[1-9][0-9]*", str(resources["limits"]["cpu"])), (name, resources["limits"]["cpu"])
    assert configs["worker"].worker.cpu_lora_workers == configs["cpu-lora"].worker.cpu_lora_workers
    assert configs["worker"].worker.cpu_lora_cores_each == configs["cpu-lora"].worker.cpu_lora_cores_each
    cores = configs["cpu-lora"].worker.cpu_lora_workers * configs["cpu-lora"].worker.cpu_lora_cores_each
    assert int(pair["cpu-lora"]["resources"]["limits"]["cpu"]) == cores
    assert not pod["spec"].get("initContainers")


def test_the_gpu_overlay_gives_each_worker_one_gpu_on_gpu_nodes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = by_name(rendered["gpu-production"])
    pod = workloads(objects)["tessera-worker"]
    pair = containers(objects, "tessera-worker")
    assert pair["worker"]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in pair["cpu-lora"]["resources"]["limits"]
    assert config_of(pair["worker"], "tessera-worker-0").worker.device == "cuda"
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"]["tolerations"]
    assert {c["image"] for c in pair.values()} == {"tessera:gpu"}
    assert {c["image"] for name in ("tessera-registry", "tessera-gateway")
            for c in containers(objects, name).values()} == {"tessera:cpu"}
    assert objects[("Deployment", "tessera-registry")]["spec"]["replicas"] == 2


def test_the_cpu_trial_runs_postgresql_and_builds_the_demo_assets(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = by_name(rendered["cpu-trial"])
    postgres = objects[("StatefulSet", "tessera-postgres")]
    assert postgres["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (container,) = postgres["spec"]["template"]["spec"]["containers"]
    password = {v["name"]: v for v in container["env"]}["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert (password["name"], password["key"]) == ("tessera-database", "password")
    registry = config_of(containers(objects, "tessera-registry")["registry"], "tessera-registry")
    assert "@tessera-postgres:5432/" in registry.database_url
    for pod_name, container in tessera_containers(objects):
        assert config_of(container, pod_name).worker.device == "cpu"
    job = containers(objects, "tessera-demo-assets")["demo-assets"]
    job_config = config_of(job, "tessera-demo-assets")
    assert job["args"] == ["demo-assets"]
    # It writes the models and registers them in the registry's database, store and import roots.
    assert job_config.database_url == registry.database_url
    assert job_config.adapter_store_path == registry.adapter_store_path
    assert job_config.import_root_paths == registry.import_root_paths
    assert any(job_config.models_path.is_relative_to(root) for root in registry.import_root_paths)
    job_mounts = mounts(workloads(objects)["tessera-demo-assets"], job)
    assert claim(job_mounts[str(job_config.models_path)][0]) == "tessera-models"
    assert claim(job_mounts[str(job_config.adapter_store_path)][0]) == "tessera-adapters"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_scales_out_behind_its_service_with_a_disruption_budget(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = by_name(rendered[overlay])
    gateway = objects[("Deployment", "tessera-gateway")]
    assert "replicas" not in gateway["spec"], "the HorizontalPodAutoscaler owns the gateway's replica count"
    hpa = objects[("HorizontalPodAutoscaler", "tessera-gateway")]
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tessera-gateway"}
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert "cpu" in containers(objects, "tessera-gateway")["gateway"]["resources"]["requests"]
    pdb = objects[("PodDisruptionBudget", "tessera-gateway")]
    assert pdb["apiVersion"] == "policy/v1" and pdb["spec"]["minAvailable"] == 1
    pod_labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert {p["port"] for p in objects[("Service", "tessera-gateway")]["spec"]["ports"]} == {8080, 50052}


def admitting_peers(objects: Objects, pod_labels: dict[str, str], port: int) -> list[list[dict[str, Any]] | None]:
    """The `from` list of every NetworkPolicy ingress rule admitting traffic to these pods on `port`
    (None: from anywhere)."""
    peers = []
    for (kind, _), policy in objects.items():
        selector = policy["spec"]["podSelector"].get("matchLabels", {}) if kind == "NetworkPolicy" else None
        if selector is None or not selector.items() <= pod_labels.items():
            continue
        for rule in policy["spec"].get("ingress", []):
            if port in [p["port"] for p in rule.get("ports", [{"port": port}])]:
                peers.append(rule.get("from"))
    return peers


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_let_only_the_gateway_reach_workers_and_only_roles_reach_the_registry(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    objects = by_name(rendered[overlay])
    assert any(doc["kind"] == "NetworkPolicy" and doc["spec"]["podSelector"] == {} and doc["spec"]["policyTypes"] ==
               ["Ingress"] and not doc["spec"].get("ingress") for doc in objects.values()), "no default deny"
    pods = workloads(objects)
    only = {("tessera-worker", 50061): {"gateway"}, ("tessera-registry", 50051): {"gateway", "worker"}}
    if overlay == "cpu-trial":
        only[("tessera-postgres", 5432)] = {"registry", "demo-assets"}
    for (workload, port), components in only.items():
        rules = admitting_peers(objects, pods[workload]["metadata"]["labels"], port)
        assert rules and None not in rules, (workload, port)
        peers = [peer for rule in rules for peer in rule]
        assert all(set(peer) == {"podSelector"} for peer in peers), (workload, port, peers)
        assert {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in peers} == components
    # Every other port a pod serves is open to someone: nothing is cut off by the default deny.
    for name, pod in pods.items():
        for container in pod["spec"]["containers"]:
            for port in container.get("ports", []):
                assert admitting_peers(objects, pod["metadata"]["labels"], port["containerPort"]), (name, port)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_unprivileged_on_a_read_only_root_without_a_service_account_token(
        rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    for name, pod in workloads(by_name(rendered[overlay])).items():
        spec = pod["spec"]
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        if all(is_tessera(c) for c in spec["containers"]):
            # The image's user; fsGroup: it reads the TLS keys (0440) and writes the volumes.
            assert spec["securityContext"]["runAsUser"] == spec["securityContext"]["fsGroup"] == 10001, name
        for container in spec["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, (name, container["name"])
            assert context["readOnlyRootFilesystem"] is True, (name, container["name"])
            assert context["capabilities"]["drop"] == ["ALL"], (name, container["name"])
