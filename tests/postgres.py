"""A throwaway PostgreSQL server for tests: `initdb` into a private temporary directory, started on a free
loopback port, one fresh database per test, removed at the end of the session.

The server programs come from Debian's `postgresql` package (scripts/system_packages.sh installs it).
PostgreSQL refuses to run as root, so under root the cluster belongs to the `postgres` user the package
creates. Durability is traded for speed (fsync off): nothing here outlives the session.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

SUPERUSER = "tessera"
MIGRATED_TEMPLATE = "tessera_migrated"


class PostgresUnavailable(RuntimeError):
    pass


def server_programs() -> Path:
    """The directory holding initdb and pg_ctl: on PATH, else the newest /usr/lib/postgresql/<version>/bin."""
    on_path = shutil.which("pg_ctl")
    if on_path and shutil.which("initdb"):
        return Path(on_path).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    if versions:
        return Path(versions[-1]).parent
    raise PostgresUnavailable(
        "PostgreSQL's server programs (initdb, pg_ctl) are not installed: run scripts/system_packages.sh "
        "(Debian's postgresql), or deselect these tests with -m 'not postgres'")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    def __init__(self) -> None:
        self._bin = server_programs()
        self._root = Path(tempfile.mkdtemp(prefix="tessera-pg-"))
        self._data = self._root / "data"
        self.port = _free_port()
        self._names = itertools.count()
        self._owner = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        if self._owner is not None:  # initdb refuses root: the cluster is the postgres user's
            os.chown(self._root, self._owner.pw_uid, self._owner.pw_gid)
        self._run("initdb", "-D", str(self._data), "-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--no-locale")
        options = (f"-p {self.port} -k {self._root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self._data), "-l", str(self._root / "server.log"), "-o", options, "-w", "start")
        self._migrated = False

    def _run(self, program: str, *args: str) -> None:
        command = [str(self._bin / program), *args]
        if self._owner is not None:
            command = ["runuser", "-u", self._owner.pw_name, "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if result.returncode:
            raise PostgresUnavailable(f"{program} failed ({result.returncode}): {result.stderr.strip()}")

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://{SUPERUSER}@127.0.0.1:{self.port}/{database}"

    def _admin(self, sql: str) -> None:
        import psycopg

        with psycopg.connect(f"host=127.0.0.1 port={self.port} user={SUPERUSER} dbname=postgres",
                             autocommit=True) as connection:
            connection.execute(sql)

    def new_database(self, migrated: bool = True) -> str:
        """The URL of a new, empty database; `migrated`: with the registry's schema at head already (a copy of a
        template migrated once per session)."""
        if migrated and not self._migrated:
            from registry.db import upgrade_schema

            self._admin(f"CREATE DATABASE {MIGRATED_TEMPLATE}")
            upgrade_schema(self.url(MIGRATED_TEMPLATE))
            self._migrated = True
        name = f"test_{next(self._names)}"
        self._admin(f"CREATE DATABASE {name} TEMPLATE {MIGRATED_TEMPLATE if migrated else 'template0'}")
        return self.url(name)

    def terminate_connections(self) -> None:
        """Drop every client's connection, as a database restart does."""
        self._admin("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self._data), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self._root, ignore_errors=True)
