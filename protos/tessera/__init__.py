"""Tessera gRPC contracts; the generated stubs live in tessera.v1."""
