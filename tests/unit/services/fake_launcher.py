"""`tessera up` with fake roles (fake_role.py), so launcher tests need no model or database.

The config comes from the environment (TESSERA_HOME, ports); FAKE_FAIL_ROLE=<role> makes that
role exit with code 3 during startup.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from services.common.config import load_config
from services.launcher import launch, role_specs
from services.common.logs import setup_logging

FAKE_ROLE = str(Path(__file__).with_name("fake_role.py"))


def main() -> int:
    config = load_config()
    setup_logging("launcher", "INFO")
    ports = {spec.role: spec.health_address.rsplit(":", 1)[1] for spec in role_specs(config)}
    fail_role = os.environ.get("FAKE_FAIL_ROLE")

    def command(role: str) -> list[str]:
        return [sys.executable, FAKE_ROLE, *(["--exit", "3"] if role == fail_role else [ports[role], role])]

    return launch(config, command)


if __name__ == "__main__":
    sys.exit(main())
