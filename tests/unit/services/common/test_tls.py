"""The cluster's certificates: `tessera certs` creates, keeps, refuses and rotates them; roles load them."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509

from services.cli import main
from services.common.config import TesseraConfig, load_config
from services.common.tls import ROLES, TlsError, cluster_credentials, load_role_credentials, tls_paths
from services.common.tls_issue import ensure_cluster_certs

REPO_ROOT = Path(__file__).resolve().parents[4]


def config_for(home: Path, **env: str) -> TesseraConfig:
    return load_config(environ={"TESSERA_HOME": str(home), **{f"TESSERA_{k}": v for k, v in env.items()}})


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def sans(cert_path: Path) -> set[str]:
    san = x509.load_pem_x509_certificate(cert_path.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    return {*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))}


def test_certs_creates_a_ca_and_a_certificate_per_role_readable_only_by_the_owner(tmp_path: Path, monkeypatch,
                                                                                    capsys) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    assert main(["certs"]) == 0
    directory = tmp_path / "tls"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    expected = {"ca.pem", "ca-key.pem", *(f"{role}{suffix}.pem" for role in ROLES for suffix in ("", "-key"))}
    assert {p.name for p in directory.iterdir()} == expected
    for path in directory.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    for role in ROLES:
        cert = x509.load_pem_x509_certificate((directory / f"{role}.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {u.dotted_string for u in usages} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}  # server, client
    assert "created the cluster CA" in capsys.readouterr().out


def test_each_certificate_names_every_host_its_role_is_reached_by(tmp_path: Path) -> None:
    # As in docker-compose.yml: others dial the registry and the worker by service name.
    config = config_for(tmp_path, GATEWAY__REGISTRY_ADDRESS="registry:50051",
                        WORKER__ADVERTISE_ADDRESS="worker:50061", WORKER__HOST="0.0.0.0",
                        TLS__WORKER_HOSTS="[worker-gpu, '*.workers.tessera.svc']", TLS__GATEWAY_HOSTS="[gateway]")
    ensure_cluster_certs(config)
    paths = tls_paths(config)
    loopback = {"localhost", "127.0.0.1", "::1"}
    assert sans(paths.cert("registry")) == loopback | {"registry"}
    assert sans(paths.cert("worker")) == loopback | {"worker", "worker-gpu", "*.workers.tessera.svc"}
    assert sans(paths.cert("gateway")) == loopback | {"gateway"}


def test_a_second_certs_run_keeps_every_file(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    assert main(["certs"]) == 0
    before = snapshot(tmp_path / "tls")
    capsys.readouterr()
    assert main(["certs"]) == 0
    assert snapshot(tmp_path / "tls") == before
    assert capsys.readouterr().out.count("kept") == 1 + len(ROLES)


def test_force_replaces_the_ca_and_every_certificate(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TESSERA_HOME", str(tmp_path))
    assert main(["certs"]) == 0
    before = snapshot(tmp_path / "tls")
    assert main(["certs", "--force"]) == 0
    after = snapshot(tmp_path / "tls")
    assert after.keys() == before.keys()
    assert all(after[name] != before[name] for name in before)
    assert {stat.S_IMODE((tmp_path / "tls" / name).stat().st_mode) for name in after} == {0o600}


def test_a_certificate_lacking_a_name_the_config_needs_is_refused_and_left_alone(tmp_path: Path, capsys) -> None:
    ensure_cluster_certs(config_for(tmp_path))
    before = snapshot(tmp_path / "tls")
    grown = config_for(tmp_path, WORKER__ADVERTISE_ADDRESS="gpu-7.example:50061")
    with pytest.raises(TlsError, match=r"worker.pem does not name gpu-7.example.*tessera certs --force"):
        ensure_cluster_certs(grown)
    with pytest.raises(TlsError, match="does not name gpu-7.example"):
        load_role_credentials(grown, "worker")  # the worker refuses to start with it, too
    assert snapshot(tmp_path / "tls") == before


def test_a_certificate_from_another_ca_is_refused_and_left_alone(tmp_path: Path) -> None:
    ours, theirs = config_for(tmp_path / "ours"), config_for(tmp_path / "theirs")
    ensure_cluster_certs(ours)
    ensure_cluster_certs(theirs)
    for name in ("worker.pem", "worker-key.pem"):
        (tmp_path / "ours" / "tls" / name).write_bytes((tmp_path / "theirs" / "tls" / name).read_bytes())
    before = snapshot(tmp_path / "ours" / "tls")
    with pytest.raises(TlsError, match="worker.pem was not issued by the cluster CA"):
        ensure_cluster_certs(ours)
    with pytest.raises(TlsError, match="worker.pem was not issued by the cluster CA"):
        load_role_credentials(ours, "worker")
    assert snapshot(tmp_path / "ours" / "tls") == before


def test_another_roles_certificate_in_a_roles_place_is_refused(tmp_path: Path) -> None:
    """The common name says which role holds a certificate (peer_role.py checks it): a gateway
    certificate copied in as the worker's would pass TLS and then be refused every registration."""
    config = config_for(tmp_path)
    ensure_cluster_certs(config)
    paths = tls_paths(config)
    for path in (paths.cert, paths.key):
        path("worker").write_bytes(path("gateway").read_bytes())
    with pytest.raises(TlsError, match="worker.pem is named tessera-gateway, not tessera-worker"):
        load_role_credentials(config, "worker")
    with pytest.raises(TlsError, match="not the worker's certificate"):
        ensure_cluster_certs(config)


def test_a_missing_role_certificate_is_issued_from_the_kept_ca(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    ensure_cluster_certs(config)
    paths = tls_paths(config)
    ca_before = paths.ca.read_bytes()
    paths.cert("gateway").unlink()
    paths.key("gateway").unlink()
    assert any(line.startswith("issued") and "gateway.pem" in line for line in ensure_cluster_certs(config))
    assert paths.ca.read_bytes() == ca_before
    x509.load_pem_x509_certificate(paths.cert("gateway").read_bytes()).verify_directly_issued_by(
        x509.load_pem_x509_certificate(ca_before))


def test_the_ca_key_is_needed_only_where_certificates_are_issued(tmp_path: Path) -> None:
    issuing = config_for(tmp_path / "home", TLS__CA_KEY=str(tmp_path / "ca" / "ca-key.pem"))
    ensure_cluster_certs(issuing)
    assert stat.S_IMODE((tmp_path / "ca" / "ca-key.pem").stat().st_mode) == 0o600
    assert not (tmp_path / "home" / "tls" / "ca-key.pem").exists()
    serving = config_for(tmp_path / "home")  # a role's config: no CA key anywhere it looks
    for role in ROLES:
        assert load_role_credentials(serving, role).role == role
    ensure_cluster_certs(serving)  # every certificate valid: nothing to issue, no key needed
    tls_paths(serving).cert("worker").unlink()
    tls_paths(serving).key("worker").unlink()
    with pytest.raises(TlsError, match="CA key .*ca-key.pem is not here"):
        ensure_cluster_certs(serving)


def test_a_role_without_its_certificate_refuses_to_start_naming_the_fix(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | {"TESSERA_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "serve", "registry"], env=env, cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "ca.pem, registry.pem, registry-key.pem are not in" in proc.stderr and "tessera certs" in proc.stderr
    assert not (tmp_path / "registry.db").exists(), "nothing starts before the certificates are checked"


def test_tls_off_is_plaintext_with_a_warning_only_when_set_explicitly(tmp_path: Path, caplog) -> None:
    assert TesseraConfig().tls.enabled
    with caplog.at_level(logging.WARNING, logger="services.common.tls"):
        assert cluster_credentials(config_for(tmp_path, TLS__ENABLED="false"), "worker") is None
    assert "tls.enabled is false" in caplog.text
