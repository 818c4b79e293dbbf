"""TESSERA_HOME holds the registry database, stored adapters, the admin key, certificates and run
state: only the service user may read it.

A role makes the directory 0700 and sets the process umask to 0o077 before it writes anything, so
every file it creates there (SQLite's database and WAL files, adapter copies, launcher state,
certificates) is 0600 and every directory 0700, whichever library creates it.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PRIVATE_UMASK = 0o077


def make_home_private(home: Path) -> None:
    os.umask(PRIVATE_UMASK)
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    mode = stat.S_IMODE(home.stat().st_mode)
    if mode & 0o077:
        try:
            home.chmod(0o700)
        except PermissionError:
            log.warning("TESSERA_HOME %s is mode %o and not ours to change: others may read it", home, mode)
