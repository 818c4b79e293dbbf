"""A worker killed with SIGKILL leaves its shared-memory files; the next worker to start in the same
directory removes them, and nothing a live worker holds or that is not Tessera's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from services.common.shm_claims import claim, reclaim_orphans

REPO_ROOT = Path(__file__).resolve().parents[4]

# A process that claims files as a worker does, says so, then waits to be killed.
HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from services.common.shm_claims import claim
    held = claim(Path(sys.argv[1]))
    for role in ("host", "lora"):
        held.path(role).write_bytes(b"x" * 4096)
    print("claimed", flush=True)
    time.sleep(600)
""")


def _holder(directory: Path) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               text=True)
    assert process.stdout is not None and process.stdout.readline() == "claimed\n"
    return process


def _tessera_files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith("tessera-")}


def test_the_files_of_a_killed_worker_are_reclaimed_and_a_live_ones_kept(tmp_path: Path) -> None:
    alive, killed = _holder(tmp_path), _holder(tmp_path)
    try:
        alive_files = {n for n in _tessera_files(tmp_path) if n.startswith(f"tessera-{alive.pid}-")}
        killed_files = {n for n in _tessera_files(tmp_path) if n.startswith(f"tessera-{killed.pid}-")}
        assert len(alive_files) == len(killed_files) == 3  # a claim and two files each
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait()
        (tmp_path / "tessera-77-0123abcd-host").write_bytes(b"left by a worker older than claims")
        (tmp_path / "someone-elses-file").write_bytes(b"")

        removed = reclaim_orphans(tmp_path)

        assert {p.name for p in removed} == killed_files | {"tessera-77-0123abcd-host"}
        assert _tessera_files(tmp_path) == alive_files
        assert (tmp_path / "someone-elses-file").exists()
    finally:
        alive.kill()
        alive.wait()


def test_a_released_claim_leaves_nothing_and_a_held_one_keeps_its_files(tmp_path: Path) -> None:
    held = claim(tmp_path)
    held.path("host").write_bytes(b"")
    assert reclaim_orphans(tmp_path) == []  # this process holds the claim
    assert (tmp_path / f"{held.tag}.claim").stat().st_mode & 0o777 == 0o600
    held.path("host").unlink()  # its owner closes its files, then lets go
    held.release()
    assert _tessera_files(tmp_path) == set()
