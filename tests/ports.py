"""The free-port helpers live in benchmarks/harness/ports.py (the live-system launcher's); this name stays
for tests/unit/services/test_launcher.py, which imports free_port_run from here."""

from benchmarks.harness.ports import free_port_run

__all__ = ["free_port_run"]
