"""docker-compose.yml against the Compose Specification schema (no Docker engine runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
SCHEMA = REPO_ROOT / "tests" / "data" / "compose-spec.json"  # provenance: tests/data/README.md
ROLES = ("registry", "gateway", "worker", "demo-assets")
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


def test_long_running_roles_wait_for_demo_assets_and_are_health_checked(compose: dict) -> None:
    for name, service in compose["services"].items():
        if name == "demo-assets":
            continue
        assert service["depends_on"]["demo-assets"]["condition"] == "service_completed_successfully", name
        assert service["healthcheck"]["test"][:3] == ["CMD", "tessera", "health"], name
