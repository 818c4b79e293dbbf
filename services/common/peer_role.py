"""Which role of the cluster is calling an internal gRPC method, from its client certificate.

Every role's certificate names it in its common name (tessera-<role>, services/common/tls.py), and
the internal servers take only certificates of the cluster's CA (mutual TLS), so the name is as
trustworthy as the CA key. A method only some roles may call checks it first:

    async def RegisterWorker(self, request, context):
        require_peer_role(context, "worker")   # the gateway's certificate: PERMISSION_DENIED

With tls.enabled false the server is plaintext and no caller has an identity: every caller passes,
as that setting documents (services/common/tls.py: cluster_credentials). Any other transport
without a role certificate is refused.
"""

from __future__ import annotations

import grpc

from services.common.errors import PermissionDenied
from services.common.tls import ROLES, role_common_name

_ROLE_BY_COMMON_NAME = {role_common_name(role): role for role in ROLES}


def peer_common_name(context: grpc.aio.ServicerContext) -> str | None:
    """The common name of the caller's verified certificate; None without one."""
    names = context.auth_context().get("x509_common_name", [])
    return names[0].decode(errors="replace") if len(names) == 1 else None


def require_peer_role(context: grpc.aio.ServicerContext, *allowed: str) -> None:
    """Raise PermissionDenied unless the caller presents the certificate of a role in `allowed`
    (on a plaintext server, tls.enabled false, every caller passes)."""
    assert allowed and set(allowed) <= set(ROLES), allowed
    if context.auth_context().get("transport_security_type") == [b"insecure"]:
        return
    name = peer_common_name(context)
    if _ROLE_BY_COMMON_NAME.get(name or "") in allowed:
        return
    wanted = " or ".join(f"the {role}'s ({role_common_name(role)})" for role in allowed)
    presented = f"a certificate named {name!r}" if name else "no role certificate"
    raise PermissionDenied(f"only {wanted} cluster certificate may call this method; the caller presents {presented}")
