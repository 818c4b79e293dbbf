import hashlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import text

from registry.db import alembic_config, make_engine, upgrade_schema
from registry.models import Base
from registry.store import RegistryStore


def test_migrated_schema_matches_models(empty_database_url: str) -> None:
    url = empty_database_url
    upgrade_schema(url)
    upgrade_schema(url)  # idempotent: a second run at head changes nothing
    engine = make_engine(url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
        if engine.dialect.name == "sqlite":
            assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()


def test_replicas_starting_together_migrate_once(empty_database_url: str) -> None:
    """Registry replicas on one database run their migrations at the same moment: one runs them, the
    others find the schema at head (PostgreSQL: an advisory lock; SQLite: its write lock)."""
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: upgrade_schema(empty_database_url), range(4)))
    engine = make_engine(empty_database_url)
    with engine.connect() as connection:
        assert compare_metadata(MigrationContext.configure(connection), Base.metadata) == []
    engine.dispose()


def _migrate(url: str, revision: str, down: bool = False) -> None:
    engine = make_engine(url)
    with engine.begin() as connection:
        config = alembic_config()
        config.attributes["connection"] = connection
        (command.downgrade if down else command.upgrade)(config, revision)
    engine.dispose()


def test_0002_gives_old_rows_the_digest_of_both_stored_files_and_keeps_their_directories(
        tmp_path: Path, imports: Path, empty_database_url: str) -> None:
    """Before 0002 an adapter's sha256 was its weights' alone, and its directory was named by it."""
    url = empty_database_url
    _migrate(url, "0001")
    store_root = tmp_path / "store"
    weights_sha = hashlib.sha256((imports / "attn-qv" / "adapter_model.safetensors").read_bytes()).hexdigest()
    old_dir = store_root / weights_sha
    shutil.copytree(imports / "attn-qv", old_dir)
    lost_dir = store_root / ("f" * 64)  # an old row whose stored config went missing
    lost_dir.mkdir()
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO base_models (name, architecture, path, max_context, vocab_size, hidden_size, num_layers, "
            "module_shapes, created_ms) VALUES ('tiny', 'LlamaForCausalLM', '/m', 256, 128, 64, 2, '{}', 0)"))
        for name, sha, directory in (("old", weights_sha, old_dir), ("lost", "f" * 64, lost_dir)):
            connection.execute(text(
                "INSERT INTO adapters (name, base_model, rank, alpha, target_modules, size_bytes, sha256, "
                "storage_path, created_ms) VALUES (:name, 'tiny', 2, 4.0, '[\"q_proj\", \"v_proj\"]', 1, :sha, "
                ":path, 0)"), {"name": name, "sha": sha, "path": str(directory)})
    engine.dispose()

    upgrade_schema(url)
    store = RegistryStore(url, store_root, [imports], worker_timeout_s=10.0, deleted_files_grace_s=0.0)
    old = store.get_adapter("old")
    config_sha = hashlib.sha256((old_dir / "adapter_config.json").read_bytes()).hexdigest()
    manifest = f"tessera-adapter-v1\nadapter_config.json {config_sha}\nadapter_model.safetensors {weights_sha}\n"
    assert old.sha256 == hashlib.sha256(manifest.encode()).hexdigest()
    assert old.storage_path == str(old_dir)
    assert store.get_adapter("lost").sha256 == "f" * 64  # matches no files: the worker refuses it

    _migrate(url, "0001", down=True)  # back to the weights' sha256, for files that still match
    engine = make_engine(url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT sha256 FROM adapters WHERE name = 'old'")).scalar() == weights_sha
    engine.dispose()
    _migrate(url, "head")

    store.delete_adapter("old")  # deletes by path: the directory named by the weights' sha256 goes
    assert store.sweep_deleted_files() == [old_dir] and not old_dir.exists()  # no grace here
    store.close()


def test_0006_clears_the_free_form_task_heads_of_old_rows(imports: Path, empty_database_url: str) -> None:
    """Before 0006 task_head was metadata given to the admin API; heads now come from the files."""
    url = empty_database_url
    _migrate(url, "0005")
    engine = make_engine(url)
    with engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO base_models (name, architecture, path, max_context, vocab_size, hidden_size, num_layers, "
            "module_shapes, created_ms) VALUES ('tiny', 'LlamaForCausalLM', '/m', 256, 128, 64, 2, '{}', 0)"))
        connection.execute(text(
            "INSERT INTO adapters (name, base_model, rank, alpha, target_modules, size_bytes, sha256, storage_path, "
            "created_ms, task_head) VALUES ('old', 'tiny', 2, 4.0, '[\"q_proj\"]', 1, :sha, '/s', 0, :head)"),
            {"sha": "a" * 64, "head": '{"classes": 3}'})
    engine.dispose()
    upgrade_schema(url)
    engine = make_engine(url)
    with engine.connect() as connection:
        assert connection.execute(text("SELECT task_head FROM adapters WHERE name = 'old'")).scalar() is None
    engine.dispose()
