"""A worker's shared-memory files outlive it only until the next worker starts beside them.

A GPU worker's host tier and CPU LoRA work area are files in worker.cpu_lora_shm_dir (/dev/shm: memory).
A clean stop removes them; `kill -9`, the OOM killer or a crash cannot, and each restart made new ones
(185 MB with the demo model) until /dev/shm filled. So each worker holds a claim on its files — an flock
on `<tag>.claim`, held while its engine runs and dropped by the kernel however the process ends —
and a worker that starts removes every Tessera file in the directory whose claim nobody holds:

    tessera-4242-9f3a01bc.claim   flock held by worker 4242 while its engine runs
    tessera-4242-9f3a01bc-host    its host tier
    tessera-4242-9f3a01bc-lora    its CPU LoRA work area

An flock, not a pid check: pids are reused, and containers sharing one memory volume (a pod's worker
and its CPU LoRA sidecar) see different pid namespaces. A claim file is created under a temporary name,
locked, then renamed into place, so no other worker ever sees it unlocked.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import secrets
import weakref
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

CLAIMED = re.compile(r"(tessera-\d+-[0-9a-f]{8})(?:-[a-z]+|\.claim)")


@dataclass
class ShmClaim:
    directory: Path
    tag: str
    _fd: int

    def __post_init__(self) -> None:
        # Released at the latest when the claim is dropped or the process exits cleanly.
        self._finalizer = weakref.finalize(self, _release, self.directory / f"{self.tag}.claim", self._fd)

    def path(self, role: str) -> Path:
        """The file of `role` ("host", "lora") under this claim."""
        assert re.fullmatch(r"[a-z]+", role), role
        return self.directory / f"{self.tag}-{role}"

    def release(self) -> None:
        """Its files are closed (or about to be): another worker may reclaim what is left of them."""
        self._finalizer()


def claim(directory: Path) -> ShmClaim:
    """A new claim in `directory`, held until `release` (or the process's end, however it ends)."""
    tag = f"tessera-{os.getpid()}-{secrets.token_hex(4)}"
    claiming, claimed = directory / f"{tag}.claiming", directory / f"{tag}.claim"
    fd = os.open(claiming, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(claiming, claimed)
    return ShmClaim(directory, tag, fd)


def _release(path: Path, fd: int) -> None:
    path.unlink(missing_ok=True)
    os.close(fd)


def reclaim_orphans(directory: Path) -> list[Path]:
    """Remove the Tessera files in `directory` whose claim no live process holds (or that have none: left
    by a worker older than claims); the paths removed, each logged."""
    by_tag: dict[str, list[Path]] = {}
    for entry in os.scandir(directory):
        if (match := CLAIMED.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False):
            by_tag.setdefault(match.group(1), []).append(Path(entry.path))
    removed = []
    for tag, paths in by_tag.items():
        if _held(directory / f"{tag}.claim"):
            continue
        for path in sorted(paths):
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:  # another starting worker reclaimed it first
                continue
            log.info("reclaimed %s (%.1f MB), left by a worker that is gone", path, size / 2**20)
            removed.append(path)
    return removed


def _held(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops the lock if it was ours to take
    return False
