"""Generated tessera.v1 stubs (python -m protos.generate)."""
