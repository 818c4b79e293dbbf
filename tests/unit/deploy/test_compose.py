"""docker-compose.yml against the Compose Specification schema (no Docker engine runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from services.common.config import TesseraConfig, load_config
from services.common.tls import ROLES as ROLES_WITH_CERTIFICATES
from services.common.tls import load_role_credentials, tls_paths
from services.common.tls_issue import ensure_cluster_certs

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEMA = REPO_ROOT / "tests" / "data" / "compose-spec.json"  # provenance: tests/data/README.md
ROLES = ("registry", "gateway", "worker", "demo-assets", "certs")
ONE_SHOT = ("certs", "demo-assets")
# The schema's "$schema" is the http:// spelling of draft 2019-09, which jsonschema does not
# look up by name; name the draft explicitly.
Validator = jsonschema.Draft201909Validator


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())


def test_compose_file_matches_the_compose_spec_schema(compose: dict) -> None:
    schema = json.loads(SCHEMA.read_text())
    Validator.check_schema(schema)
    errors = sorted(Validator(schema).iter_errors(compose), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_the_schema_would_catch_a_mistake(compose: dict) -> None:
    schema = json.loads(SCHEMA.read_text())
    broken = {**compose, "services": {**compose["services"], "gateway": {**compose["services"]["gateway"],
                                                                         "helthcheck": {}}}}
    assert not Validator(schema).is_valid(broken)


def test_every_role_runs_in_the_cpu_profile(compose: dict) -> None:
    in_cpu = {name for name, service in compose["services"].items() if "cpu" in service.get("profiles", [])}
    assert set(ROLES) <= in_cpu


def test_the_gpu_profile_has_a_worker_reserving_an_nvidia_gpu(compose: dict) -> None:
    in_gpu = {name: s for name, s in compose["services"].items() if "gpu" in s.get("profiles", [])}
    assert {"registry", "gateway", "demo-assets", "worker-gpu"} <= set(in_gpu)
    worker = in_gpu["worker-gpu"]
    assert worker["environment"]["TESSERA_WORKER__DEVICE"] == "cuda"
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_every_service_builds_the_one_image_from_deploy_dockerfile(compose: dict) -> None:
    for name, service in compose["services"].items():
        assert service["build"]["context"] == ".", name
        assert service["build"]["dockerfile"] == "deploy/Dockerfile", name
    assert (REPO_ROOT / "deploy" / "Dockerfile").is_file()


def long_running(compose: dict) -> dict[str, tuple[str, dict]]:
    """service name -> (the role it serves, the service)."""
    return {name: (s["command"][1], s) for name, s in compose["services"].items() if s["command"][0] == "serve"}


def test_long_running_roles_wait_for_the_one_shot_setup_and_are_health_checked_as_their_role(compose: dict) -> None:
    assert {name for name, s in compose["services"].items() if s["command"][0] != "serve"} == set(ONE_SHOT)
    for name in ONE_SHOT:
        assert compose["services"][name]["restart"] == "no", name
    for name, (role, service) in long_running(compose).items():
        for setup in ONE_SHOT:
            assert service["depends_on"][setup]["condition"] == "service_completed_successfully", name
        # --role: the registry and workers are probed with their own cluster certificate.
        assert service["healthcheck"]["test"][:5] == ["CMD", "tessera", "health", "--role", role], name


def config_of(service: dict, home: Path) -> TesseraConfig:
    """The configuration the service's container runs with, TESSERA_HOME (the volume) at `home`."""
    env = {k: str(v) for k, v in service.get("environment", {}).items()}
    if "TESSERA_TLS__CA_KEY" in env:  # the tessera-ca volume's mount point
        env["TESSERA_TLS__CA_KEY"] = str(home.parent / "ca-volume" / Path(env["TESSERA_TLS__CA_KEY"]).name)
    return load_config(environ={**env, "TESSERA_HOME": str(home)})


def test_the_certs_service_issues_certificates_naming_every_host_the_roles_reach_each_other_by(
        compose: dict, tmp_path: Path) -> None:
    home = tmp_path / "data"
    ensure_cluster_certs(config_of(compose["services"]["certs"], home))
    assert not tls_paths(config_of({}, home)).ca_key.exists(), "the CA key stays out of the shared volume"
    for name, (_, service) in long_running(compose).items():
        config = config_of(service, home)
        # Each role's certificate, issued by the CA, names every host this container binds or dials
        # that role at (the registry as registry:50051, a worker as its advertised address), so the
        # role starts and its peers' hostname checks pass.
        for role in ROLES_WITH_CERTIFICATES:
            assert load_role_credentials(config, role).role == role, (name, role)
    # Not vacuous: the roles do reach each other by service names, beyond loopback.
    workers = [s for role, s in long_running(compose).values() if role == "worker"]
    assert {s["environment"]["TESSERA_WORKER__ADVERTISE_ADDRESS"].split(":")[0] for s in workers} == {
        "worker", "worker-llava", "worker-qwen2vl", "worker-gpu"}
    assert {s["environment"].get("TESSERA_GATEWAY__REGISTRY_ADDRESS", s["environment"].get(
        "TESSERA_WORKER__REGISTRY_ADDRESS")) for role, s in long_running(compose).values() if role != "registry"} == {
        "registry:50051"}


def test_only_the_certs_service_mounts_the_ca_key(compose: dict) -> None:
    mounts = {name: [v.split(":")[0] for v in s.get("volumes", [])] for name, s in compose["services"].items()}
    assert [name for name, volumes in mounts.items() if "tessera-ca" in volumes] == ["certs"]
    assert all("tessera-home" in volumes for volumes in mounts.values())


def test_no_service_turns_tls_off(compose: dict) -> None:
    for name, service in compose["services"].items():
        assert "TESSERA_TLS__ENABLED" not in service.get("environment", {}), name


def test_only_the_gateway_is_published_beyond_the_hosts_loopback(compose: dict) -> None:
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            if name != "gateway":
                assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every host interface"
            assert port.split(":")[-1] not in ("50051", "50061"), f"{name} publishes internal gRPC ({port})"


def test_the_cpu_profile_runs_a_worker_for_each_demo_base_model(compose: dict) -> None:
    from services.demo_assets import DEMO_BASE_MODEL, DEMO_QWEN2VL_BASE_MODEL, DEMO_VISION_BASE_MODEL

    workers = [s for s in compose["services"].values()
               if "cpu" in s.get("profiles", []) and s.get("command") == ["serve", "worker"]]
    assert sorted(s["environment"]["TESSERA_WORKER__BASE_MODEL"] for s in workers) == sorted(
        (DEMO_BASE_MODEL, DEMO_VISION_BASE_MODEL, DEMO_QWEN2VL_BASE_MODEL))
