from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from registry.db import make_engine, upgrade_schema
from registry.models import Base


def test_migrated_schema_matches_models(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    upgrade_schema(url)
    upgrade_schema(url)  # idempotent: a second run at head changes nothing
    engine = make_engine(url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()
