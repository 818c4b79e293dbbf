"""Mutual TLS between Tessera's roles: where the cluster's certificates lie, their checks, gRPC credentials.

tls.dir (default {home}/tls; the directory 0700, every file 0600):
  ca.pem                  the cluster CA's certificate: the one CA every role trusts
  ca-key.pem              its key, needed only where certificates are issued (`tessera certs`,
                          `tessera up`); tls.ca_key puts it elsewhere (compose keeps it out of the
                          volume the roles share)
  <role>.pem, -key.pem    registry | gateway | worker: the role's certificate (server and client
                          auth; common name tessera-<role>, which methods only some roles may call
                          check: services/common/peer_role.py; SANs: localhost, 127.0.0.1, ::1, the
                          role's hosts in the config and tls.<role>_hosts) and its key

The registry's and the workers' gRPC servers require a client certificate issued by the CA; every
internal channel (gateway -> registry, gateway -> worker, worker -> registry, health probes)
presents its role's certificate and checks the server's against the CA and the host it dials.
The gateway's public gRPC port asks for no client certificate (clients use API keys): plaintext
like the REST port, or server-side TLS with the gateway's certificate (tls.public_grpc_tls).

Issuing them is services/common/tls_issue.py's (`tessera certs`, `tessera up`); this module finds,
checks and loads them.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import logging
from collections.abc import Sequence
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from services.common.config import ConfigError, TesseraConfig

log = logging.getLogger(__name__)

ROLES = ("registry", "gateway", "worker")
ALWAYS_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")
FORCE_HINT = "run `tessera certs --force` to replace the cluster CA and every certificate (then restart every role)"


class TlsError(ConfigError):
    """The cluster's certificates are missing, invalid, or would have to be overwritten."""


@dataclasses.dataclass(frozen=True, slots=True)
class TlsPaths:
    dir: Path
    ca_key: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.pem"

    def cert(self, role: str) -> Path:
        return self.dir / f"{role}.pem"

    def key(self, role: str) -> Path:
        return self.dir / f"{role}-key.pem"

    def all_files(self) -> list[Path]:
        return [self.ca, self.ca_key, *(p for role in ROLES for p in (self.cert(role), self.key(role)))]


def role_common_name(role: str) -> str:
    """The common name of `role`'s certificate: who the holder is, to the servers it calls."""
    assert role in ROLES, role
    return f"tessera-{role}"


def tls_paths(config: TesseraConfig) -> TlsPaths:
    directory = Path(config.tls.dir).expanduser().resolve() if config.tls.dir else config.home_path / "tls"
    ca_key = Path(config.tls.ca_key).expanduser().resolve() if config.tls.ca_key else directory / "ca-key.pem"
    return TlsPaths(directory, ca_key)


def _host(address: str) -> str:
    """The host part of a gRPC target: registry:50051, [::1]:50051, dns:///registry:50051."""
    return address.rsplit("///", 1)[-1].rsplit(":", 1)[0].strip("[]")


def role_names(config: TesseraConfig, role: str) -> list[str]:
    """The names `role`'s certificate must carry: loopback, the hosts this config binds or dials the
    role at, and tls.<role>_hosts (compose service names, Kubernetes DNS names)."""
    if role == "registry":
        hosts = [config.registry.host, _host(config.gateway.registry_address), _host(config.worker.registry_address)]
    elif role == "worker":
        hosts = [config.worker.host, _host(config.worker.advertise_address)]
    else:
        assert role == "gateway", role
        hosts = [config.gateway.host]
    extra = getattr(config.tls, f"{role}_hosts")
    names = [*ALWAYS_NAMES, *(h for h in hosts if h not in WILDCARD_HOSTS), *extra]
    return list(dict.fromkeys(n.lower() for n in names))


# ---- checking and loading ------------------------------------------------------------------------

def read_pem(path: Path) -> bytes:
    """The file's bytes; TlsError naming it if it cannot be read."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{path} does not exist") from None
    except OSError as exc:
        raise TlsError(f"cannot read {path}: {exc}") from exc


def load_ca(paths: TlsPaths, now: datetime.datetime) -> x509.Certificate:
    """The cluster CA's certificate, valid at `now`; TlsError (with the way out) if it is not."""
    if not paths.ca.exists():
        existing = ", ".join(str(p) for p in paths.all_files() if p.exists())
        raise TlsError(f"{paths.ca} is missing while other TLS files exist ({existing}); {FORCE_HINT}")
    try:
        ca_cert = x509.load_pem_x509_certificate(read_pem(paths.ca))
    except ValueError as exc:
        raise TlsError(f"{paths.ca} is not a PEM certificate ({exc}); {FORCE_HINT}") from exc
    if not ca_cert.not_valid_before_utc <= now <= ca_cert.not_valid_after_utc:
        raise TlsError(f"the cluster CA {paths.ca} is not valid now (valid {ca_cert.not_valid_before_utc:%Y-%m-%d} "
                       f"to {ca_cert.not_valid_after_utc:%Y-%m-%d}); {FORCE_HINT}")
    return ca_cert


def same_key(key: object, cert: x509.Certificate) -> bool:
    """Whether `key` is the private key of `cert`'s public key."""
    public = getattr(key, "public_key", None)
    if public is None:
        return False
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return public().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


def _covers(cert: x509.Certificate, name: str) -> bool:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    try:
        return ipaddress.ip_address(name) in san.get_values_for_type(x509.IPAddress)
    except ValueError:
        pass
    for dns in (d.lower() for d in san.get_values_for_type(x509.DNSName)):
        if dns == name or (dns.startswith("*.") and name.count(".") >= 2 and name.split(".", 1)[1] == dns[2:]):
            return True
    return False


def role_problem(paths: TlsPaths, role: str, ca_cert: x509.Certificate, names: Sequence[str],
                 now: datetime.datetime) -> str | None:
    """Why `role`'s certificate and key cannot serve this config, or None if they can."""
    cert_path, key_path = paths.cert(role), paths.key(role)
    for path in (cert_path, key_path):
        if not path.exists():
            return f"{path} does not exist"
    try:
        cert = x509.load_pem_x509_certificate(read_pem(cert_path))
        key = serialization.load_pem_private_key(read_pem(key_path), password=None)
    except (ValueError, TypeError) as exc:
        return f"{cert_path} or {key_path} is not a PEM certificate / unencrypted key ({exc})"
    try:
        cert.verify_directly_issued_by(ca_cert)
    except (ValueError, TypeError, InvalidSignature):
        return f"{cert_path} was not issued by the cluster CA {paths.ca}"
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        return (f"{cert_path} is not valid now (valid {cert.not_valid_before_utc:%Y-%m-%d} "
                f"to {cert.not_valid_after_utc:%Y-%m-%d})")
    if not same_key(key, cert):
        return f"{key_path} is not the key of {cert_path}"
    common_names = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if common_names != [role_common_name(role)]:
        return (f"{cert_path} is named {', '.join(map(str, common_names)) or 'nothing'}, not "
                f"{role_common_name(role)}: it is not the {role}'s certificate")
    missing = [n for n in names if not _covers(cert, n)]
    if missing:
        return (f"{cert_path} does not name {', '.join(missing)}, by which this config reaches the {role} "
                f"(its host, its address, tls.{role}_hosts)")
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class RoleCredentials:
    """One role's PEM files, loaded and checked: what its gRPC servers and channels present."""

    role: str
    ca: bytes
    cert: bytes
    key: bytes

    def server(self) -> grpc.ServerCredentials:
        """Internal servers (registry, worker): only clients holding a cluster certificate get in."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel(self) -> grpc.ChannelCredentials:
        """Internal channels: present this role's certificate, trust only the cluster CA."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def load_role_credentials(config: TesseraConfig, role: str) -> RoleCredentials:
    """`role`'s certificate, key and the CA certificate, checked (issuer, dates, key, names)."""
    paths = tls_paths(config)
    missing = [path.name for path in (paths.ca, paths.cert(role), paths.key(role)) if not path.exists()]
    if missing:
        raise TlsError(f"TLS is on (tls.enabled) and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                       f"not in {paths.dir}; create the cluster's certificates with `tessera certs` "
                       f"(`tessera up` does it itself), or point tls.dir at them")
    now = datetime.datetime.now(datetime.timezone.utc)
    problem = role_problem(paths, role, load_ca(paths, now), role_names(config, role), now)
    if problem:
        raise TlsError(f"{problem}; {FORCE_HINT}")
    return RoleCredentials(role, read_pem(paths.ca), read_pem(paths.cert(role)), read_pem(paths.key(role)))


def cluster_credentials(config: TesseraConfig, role: str) -> RoleCredentials | None:
    """What `role` presents on internal gRPC, or None (plaintext, with a warning) if tls.enabled is false.

    Called once as each role starts."""
    if config.tls.enabled:
        return load_role_credentials(config, role)
    log.warning("tls.enabled is false: internal gRPC is plaintext and unauthenticated, so anyone who reaches "
                "the registry's or a worker's gRPC port can register a fake worker, read prompts or call "
                "Generate directly; run like this only on a network nobody else reaches")
    return None


def gateway_public_credentials(config: TesseraConfig) -> grpc.ServerCredentials | None:
    """The gateway's public gRPC port: no client certificate asked; TLS if tls.public_grpc_tls."""
    if not config.tls.public_grpc_tls:
        return None
    gateway = load_role_credentials(config, "gateway")
    return grpc.ssl_server_credentials([(gateway.key, gateway.cert)], require_client_auth=False)


def health_probe_credentials(config: TesseraConfig, role: str) -> grpc.ChannelCredentials | None:
    """How a health probe reaches `role`'s gRPC port (`tessera health`, the launcher): the registry and
    workers with the role's own cluster certificate, the gateway's public port as a client would."""
    if role == "gateway":
        if not config.tls.public_grpc_tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=read_pem(tls_paths(config).ca))
    return load_role_credentials(config, role).channel() if config.tls.enabled else None


def aio_channel(address: str, credentials: grpc.ChannelCredentials | None,
                options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """A grpc.aio channel: TLS with `credentials`, plaintext if None (tls.enabled: false)."""
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)
