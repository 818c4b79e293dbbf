"""The lock the registry holds around each write to the adapter store with the check before it (see
RegistryStore), across the threads of this registry and every other replica sharing the store.

Replicas share the adapter store's filesystem (a ReadWriteMany volume in Kubernetes), so the lock is an
flock on a file in it (on NFS, Linux carries flock over as a POSIX lock the server arbitrates), taken
after a thread lock: flock is held per open file, which this registry's threads share.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from types import TracebackType

LOCK_FILE = ".lock"


class StoreLock:
    def __init__(self, store_root: Path) -> None:
        store_root.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(store_root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._threads = threading.Lock()

    def __enter__(self) -> None:
        self._threads.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._threads.release()
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def close(self) -> None:
        os.close(self._fd)
