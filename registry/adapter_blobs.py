"""The content-addressed adapter store: ``<root>/<content digest>/`` holding both of an adapter's files.

The digest (services/common/adapter_layout.content_digest) covers adapter_config.json and
adapter_model.safetensors together, so two adapters share a directory only when both files are
identical, and a worker that re-hashes both notices a change to either. An import is staged in a
private directory under the root (same filesystem), validated there, and renamed into place
atomically, so a half-written adapter is never visible under its digest and what was validated is
exactly what is stored (the source may change after the copy; the copy cannot).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path

from registry.adapter_files import AdapterSource
from services.common.adapter_layout import CONFIG_FILE, WEIGHTS_FILE, content_digest, directory_digest
from services.common.errors import Internal, InvalidArgument

CHUNK_BYTES = 1024 * 1024
STAGING_PREFIX = ".staging-"
RETIRED = ".retired"  # in a stored directory: when its last adapter was deleted (unix seconds)


@dataclasses.dataclass(frozen=True, slots=True)
class StagedAdapter:
    directory: Path  # <root>/.staging-<uuid>/ with adapter_config.json and adapter_model.safetensors
    sha256: str      # content_digest of both files
    size_bytes: int  # of adapter_model.safetensors


def _open_regular_nofollow(path: Path) -> int:
    # The path was resolved already; O_NOFOLLOW stops a symlink swapped in since then.
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise InvalidArgument(f"cannot open {path.name}: {exc.strerror}") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidArgument(f"{path.name} is not a regular file")
    return fd


def _copy_hashing(source: Path, destination: Path) -> str:
    """Copy source -> destination (fsynced); sha256 of the bytes streamed."""
    digest = hashlib.sha256()
    with os.fdopen(_open_regular_nofollow(source), "rb") as src, destination.open("wb") as dst:
        while chunk := src.read(CHUNK_BYTES):
            digest.update(chunk)
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    return digest.hexdigest()


class AdapterBlobStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        return self.root / sha256

    def stage(self, source: AdapterSource) -> StagedAdapter:
        """Copy the adapter's two files into a fresh staging directory and re-verify the copies."""
        directory = self.root / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
        directory.mkdir()
        try:
            streamed = content_digest(_copy_hashing(source.config_path, directory / CONFIG_FILE),
                                      _copy_hashing(source.weights_path, directory / WEIGHTS_FILE))
            stored = directory_digest(directory)
            if stored != streamed:
                raise Internal(f"adapter copy is corrupt: digest {stored} of the copy != {streamed} of the source")
            return StagedAdapter(directory=directory, sha256=stored,
                                 size_bytes=(directory / WEIGHTS_FILE).stat().st_size)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def commit(self, staged: StagedAdapter) -> Path:
        """Move a staged adapter to <root>/<digest>; an intact existing copy is kept (dedup)."""
        final = self.path_for(staged.sha256)
        if self._intact(final, staged.sha256):
            self.discard(staged)
            (final / RETIRED).unlink(missing_ok=True)  # registered again before it was swept: kept
            return final
        if final.exists():  # a damaged earlier copy: replace it
            shutil.rmtree(final)
        os.rename(staged.directory, final)
        self._fsync_root()
        return final

    def discard(self, staged: StagedAdapter) -> None:
        shutil.rmtree(staged.directory, ignore_errors=True)

    def retire(self, directory: Path, now_s: float) -> None:
        """Mark a stored adapter's directory (a direct child of the root, or nothing) for removal by
        `sweep`: requests a worker took before the adapter was deleted may still have to read it."""
        if self._stored(directory) and directory.is_dir():
            (directory / RETIRED).write_text(repr(now_s))

    def sweep(self, now_s: float, grace_s: float, referenced: Callable[[Path], bool]) -> list[Path]:
        """Remove the directories retired at least `grace_s` ago that nothing references again; -> them."""
        removed = []
        for marker in self.root.glob(f"*/{RETIRED}"):
            directory = marker.parent
            try:
                retired_at = float(marker.read_text())
            except (OSError, ValueError):
                retired_at = 0.0  # unreadable: as old as can be
            if now_s - retired_at >= grace_s and self._stored(directory) and not referenced(directory):
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(directory)
        return removed

    def _stored(self, directory: Path) -> bool:
        return directory.resolve().parent == self.root.resolve() and not directory.name.startswith(STAGING_PREFIX)

    @staticmethod
    def _intact(directory: Path, digest: str) -> bool:
        try:
            return directory.is_dir() and directory_digest(directory) == digest
        except OSError:  # a file missing or unreadable: damaged
            return False

    def _fsync_root(self) -> None:
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
