"""Paths from users are never trusted: they must resolve inside an import root.

Resolution follows every symlink (realpath), so a link inside a root that
points outside it is refused like the outside path itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from services.common.errors import InvalidArgument, PermissionDenied
from services.common.text_fields import check_path_text


def resolve_inside_roots(path: str | Path, roots: Sequence[Path], what: str) -> Path:
    """The real path of `path` (absolute, symlinks followed); PermissionDenied if outside every root.
    InvalidArgument if it is relative or holds what no path can (a NUL, a lone surrogate)."""
    check_path_text(str(path), f"{what} path")
    if not os.path.isabs(path):
        raise InvalidArgument(f"{what} path {str(path)!r} must be absolute")
    resolved = Path(os.path.realpath(path))
    if not any(resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise PermissionDenied(
            f"{what} {str(path)!r} resolves to {str(resolved)!r}, outside the allowed import roots ({allowed})")
    return resolved


def real_roots(roots: Sequence[Path]) -> list[Path]:
    """Import roots with their own symlinks resolved, so comparisons are between real paths."""
    return [Path(os.path.realpath(root)) for root in roots]
