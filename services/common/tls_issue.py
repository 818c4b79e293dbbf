"""Issuing the cluster's certificates: the CA and one certificate per role, written under tls.dir.

Issuing never replaces a valid file: `ensure_cluster_certs` keeps what is there, issues what is
missing, and refuses (TlsError) on anything it would have to overwrite unless `force` is given.
`tessera certs` and `tessera up` issue; the roles only load (services/common/tls.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.config import TesseraConfig
from services.common.tls import (FORCE_HINT, ROLES, TlsError, TlsPaths, load_ca, read_pem, role_common_name,
                                 role_names, role_problem, same_key, tls_paths)

CA_VALIDITY = datetime.timedelta(days=3650)
ROLE_VALIDITY = datetime.timedelta(days=730)
CLOCK_SKEW = datetime.timedelta(minutes=5)  # certificates are valid from a little before issue


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _new_ca(now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    # A random suffix: two clusters' CAs never share a name.
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tessera"),
                      x509.NameAttribute(NameOID.COMMON_NAME, f"Tessera cluster CA {secrets.token_hex(4)}")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + CA_VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key


def _new_role_cert(role: str, names: Sequence[str], ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
                   now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Tessera"),
                         x509.NameAttribute(NameOID.COMMON_NAME, role_common_name(role))])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - CLOCK_SKEW).not_valid_after(min(now + ROLE_VALIDITY, ca_cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            # Every role is a server to some and a client to others (the registry only serves).
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(_san(names), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def _private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _write_private(path: Path, data: bytes) -> None:
    """0600 from the first byte; readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _issue_role(paths: TlsPaths, role: str, names: Sequence[str], ca_cert: x509.Certificate,
                ca_key: ec.EllipticCurvePrivateKey, now: datetime.datetime) -> str:
    cert, key = _new_role_cert(role, names, ca_cert, ca_key, now)
    _write_private(paths.key(role), _key_pem(key))
    _write_private(paths.cert(role), cert.public_bytes(serialization.Encoding.PEM))
    return f"issued {paths.cert(role)} ({', '.join(names)})"


def _load_ca_key(paths: TlsPaths, ca_cert: x509.Certificate) -> ec.EllipticCurvePrivateKey | None:
    """The CA's key, None where it is not kept (tls.ca_key elsewhere); TlsError if it is not the CA's."""
    if not paths.ca_key.exists():
        return None
    try:
        key = serialization.load_pem_private_key(read_pem(paths.ca_key), password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"{paths.ca_key} is not an unencrypted PEM private key ({exc}); {FORCE_HINT}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not same_key(key, ca_cert):
        raise TlsError(f"{paths.ca_key} is not the key of {paths.ca}; {FORCE_HINT}")
    return key


def ensure_cluster_certs(config: TesseraConfig, force: bool = False) -> list[str]:
    """Create the CA and each role's certificate where missing; keep every valid file.

    Returns one line per file set (created, issued, kept). Raises TlsError where a file is there but
    unusable (another CA, expired, lacking a name this config needs, unreadable) and `force` is off:
    replacing it would silently cut off every role holding the old one.
    """
    paths = tls_paths(config)
    _private_dir(paths.dir)
    paths.ca_key.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    if force or not any(p.exists() for p in paths.all_files()):
        ca_cert, ca_key = _new_ca(now)
        _write_private(paths.ca_key, _key_pem(ca_key))
        _write_private(paths.ca, ca_cert.public_bytes(serialization.Encoding.PEM))
        report = [f"created the cluster CA {paths.ca} (key {paths.ca_key})"]
        return report + [_issue_role(paths, role, role_names(config, role), ca_cert, ca_key, now) for role in ROLES]

    ca_cert = load_ca(paths, now)
    ca_key = _load_ca_key(paths, ca_cert)
    report = [f"kept the cluster CA {paths.ca}"]
    for role in ROLES:
        names = role_names(config, role)
        if not paths.cert(role).exists() and not paths.key(role).exists():
            if ca_key is None:
                raise TlsError(f"cannot issue {paths.cert(role)}: the CA key {paths.ca_key} is not here "
                               f"(issue certificates where the CA key is)")
            report.append(_issue_role(paths, role, names, ca_cert, ca_key, now))
            continue
        problem = role_problem(paths, role, ca_cert, names, now)
        if problem:
            raise TlsError(f"{problem}; {FORCE_HINT}")
        report.append(f"kept {paths.cert(role)}")
    return report
