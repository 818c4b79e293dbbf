"""make_home_private: an existing world-readable TESSERA_HOME becomes 0700 and what is written after is 0600."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]

# In a child process: make_home_private sets the process-wide umask.
PROBE = """
import json, sqlite3, stat, sys
from pathlib import Path
from services.common.private_home import make_home_private
home = Path(sys.argv[1])
make_home_private(home)
(home / "run").mkdir()
(home / "run" / "state.json").write_text("{}")
connection = sqlite3.connect(home / "registry.db")
connection.execute("pragma journal_mode=wal")
connection.execute("create table t (x)")
connection.commit()
# while the connection is open, so SQLite's -wal and -shm files are there
print(json.dumps({str(p.relative_to(home)): stat.S_IMODE(p.stat().st_mode) for p in [home, *home.rglob("*")]}))
"""


def _modes_after_probe(home: Path) -> dict[str, int]:
    probe = subprocess.run([sys.executable, "-c", PROBE, str(home)], cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(probe.stdout)


def test_an_open_home_is_closed_and_files_written_after_are_private(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir(mode=0o755)
    home.chmod(0o755)
    modes = _modes_after_probe(home)
    assert modes == {".": 0o700, "run": 0o700, "run/state.json": 0o600, "registry.db": 0o600,
                     "registry.db-wal": 0o600, "registry.db-shm": 0o600}


def test_a_missing_home_is_created_private(tmp_path: Path) -> None:
    home = tmp_path / "deep" / "home"
    assert _modes_after_probe(home)["."] == 0o700
