"""Everything the roles write under TESSERA_HOME is private to the service user."""

from __future__ import annotations

import stat
from pathlib import Path

from benchmarks.harness.live_system import RunningSystem

# Written by the tests themselves: the fixture's capture of the launcher's output, and the adapter
# directories other tests prepare for registration.
WRITTEN_BY_THE_TESTS = ("launcher.log", "uploads")


def _group_or_other_bits(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode) & 0o077


def test_home_database_run_state_and_stored_adapters_are_private(system: RunningSystem) -> None:
    home = system.home
    written = [p for p in home.rglob("*")
               if p.relative_to(home).parts[0] not in WRITTEN_BY_THE_TESTS and not p.is_symlink()]
    must_exist = [home / "registry.db", home / "run" / "launcher.json", home / "admin_api_key", home / "adapters"]
    assert all(p.exists() for p in must_exist), [p for p in must_exist if not p.exists()]
    assert any(p.is_file() and p.parent.parent == home / "adapters" for p in written), "no stored adapter file"
    exposed = [f"{p.relative_to(home)} {stat.S_IMODE(p.stat().st_mode):o}" for p in [home, *written]
               if _group_or_other_bits(p)]
    assert not exposed, exposed
