"""The one rule for paths a manifest or a data file names: relative, and inside the directory they are
relative to, after symbolic links are resolved.

    resolve_inside(Path("/fuse"), "data/shape.train.jsonl") -> Path("/fuse/data/shape.train.jsonl")
    resolve_inside(Path("/fuse"), "../etc/passwd")          -> PathRefused("path '../etc/passwd' holds '..'")
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

MAX_PATH_CHARS = 4096  # Linux's PATH_MAX: a longer path cannot name a file


class PathRefused(ValueError):
    """A path that is not relative, leaves its directory or names no regular file; callers add file:line."""


def resolve_inside(root: Path, relative: str) -> Path:
    """`root / relative` with symbolic links resolved; PathRefused unless it is a regular file under `root`."""
    if not relative or len(relative) > MAX_PATH_CHARS or "\x00" in relative:
        raise PathRefused(f"path {relative[:80]!r} is empty, longer than {MAX_PATH_CHARS} characters or holds NUL")
    parts = PurePosixPath(relative)
    if parts.is_absolute():
        raise PathRefused(f"path {relative!r} is absolute; paths are relative to {root}")
    # Refused even when it would come back inside: the doc's rule is simply "no '..'".
    if ".." in parts.parts:
        raise PathRefused(f"path {relative!r} holds '..'")
    base = root.resolve()
    try:
        target = (base / parts).resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symbolic link loop on Python < 3.13
        raise PathRefused(f"path {relative!r} does not exist under {base}") from exc
    if not target.is_relative_to(base):
        raise PathRefused(f"path {relative!r} leaves {base} (a symbolic link to {target})")
    if not stat.S_ISREG(os.stat(target).st_mode):
        raise PathRefused(f"path {relative!r} is not a regular file")
    return target
