"""Logging setup shared by every role: one line per record, tagged with the role."""

from __future__ import annotations

import logging
import sys


def setup_logging(role: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s %(levelname)-5s [{role}] %(name)s: %(message)s", datefmt="%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Alembic's plugin chatter is noise at INFO.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, root.level))
