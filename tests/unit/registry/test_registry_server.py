import stat
from pathlib import Path

from registry.server import resolve_admin_api_key
from services.common.config import load_config


def test_admin_api_key_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    config = load_config(environ={"TESSERA_HOME": str(tmp_path / "home")})
    key = resolve_admin_api_key(config)
    path = tmp_path / "home" / "admin_api_key"
    assert len(key) >= 32 and path.read_text().strip() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert resolve_admin_api_key(config) == key


def test_configured_admin_api_key_wins(tmp_path: Path) -> None:
    config = load_config(environ={"TESSERA_HOME": str(tmp_path), "TESSERA_REGISTRY__ADMIN_API_KEY": "configured"})
    assert resolve_admin_api_key(config) == "configured"
    assert not (tmp_path / "admin_api_key").exists()
