"""A worker's shared-memory files outlive it only until the next worker starts beside them.

A GPU worker's host tier and CPU LoRA work area are files in worker.cpu_lora_shm_dir (/dev/shm: memory).
A clean stop removes them; `kill -9`, the OOM killer or a crash cannot, and each restart made new ones
(185 MB with the demo model) until /dev/shm filled. So each worker holds a claim on its files — an flock
on `<tag>.claim`, held for the life of the process and dropped by the kernel however the process ends —
and a worker that starts removes every Tessera file in the directory whose claim nobody holds:

    tessera-4242-9f3a01bc.claim     flock held by worker 4242 while it lives
    tessera-4242-9f3a01bc-1-host    its host tier (1: its first engine; a test process builds several)
    tessera-4242-9f3a01bc-1-lora    its CPU LoRA work area

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

CLAIMED = re.compile(r"(tessera-\d+-[0-9a-f]{8})(?:-\d+-[a-z]+|\.claim)")


@dataclass
class ShmClaim:
    directory: Path
    tag: str
    made: int = 0  # file sets named under it so far

    def new_paths(self, *roles: str) -> tuple[Path, ...]:
        """New file names under this claim, one per role ("host", "lora")."""
        assert all(re.fullmatch(r"[a-z]+", role) for role in roles), roles
        self.made += 1
        return tuple(self.directory / f"{self.tag}-{self.made}-{role}" for role in roles)


def claim(directory: Path) -> ShmClaim:
    """This process's claim in `directory`, made on first use and held until the process ends (its claim
    file removed on a clean exit); the files under it are removed by their owners when closed."""
    if (held := _HELD.get(directory)) is not None:
        return held
    tag = f"tessera-{os.getpid()}-{secrets.token_hex(4)}"
    claiming, claimed = directory / f"{tag}.claiming", directory / f"{tag}.claim"
    fd = os.open(claiming, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(claiming, claimed)
    held = _HELD[directory] = ShmClaim(directory, tag)
    weakref.finalize(held, _release, claimed, fd)  # at exit: _HELD keeps every claim alive until then
    return held


_HELD: dict[Path, ShmClaim] = {}


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
