"""`tessera up` with fake roles (fake_role.py), so launcher tests need no model or database.

The config comes from the environment (TESSERA_HOME, ports); FAKE_FAIL_ROLE=<role> makes that
role exit with code 3 during startup.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from services.common.config import load_config
from services.launcher.plan import RoleSpec
from services.launcher.supervisor import launch
from services.common.logs import setup_logging

FAKE_ROLE = str(Path(__file__).with_name("fake_role.py"))


def main() -> int:
    config = load_config()
    setup_logging("launcher", "INFO")
    fail_role = os.environ.get("FAKE_FAIL_ROLE")

    def command(spec: RoleSpec) -> list[str]:
        port = spec.health_address.rsplit(":", 1)[1]
        return [sys.executable, FAKE_ROLE, *(["--exit", "3"] if spec.role == fail_role else [port, spec.role])]

    # Fake roles need no database: the models the config names count as registered.
    return launch(config, command, lambda c: [*c.launcher.worker_models, c.worker.base_model])


if __name__ == "__main__":
    sys.exit(main())
