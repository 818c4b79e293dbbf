"""services.common.config: defaults <- YAML file <- environment, with unknown keys and bad types refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import ConfigError, TesseraConfig, load_config


def test_defaults_without_file_or_env() -> None:
    assert load_config(environ={}) == TesseraConfig()


def test_env_overrides_a_section_key_and_a_top_level_key(tmp_path: Path) -> None:
    config = load_config(environ={"TESSERA_GATEWAY__HTTP_PORT": "9000", "TESSERA_HOME": str(tmp_path)})
    assert config.gateway.http_port == 9000
    assert config.home_path == tmp_path.resolve()
    assert config.run_path == tmp_path.resolve() / "run"
    assert config.database_url == f"sqlite:///{tmp_path.resolve() / 'registry.db'}"


def test_env_wins_over_the_yaml_file_named_by_tessera_config(tmp_path: Path) -> None:
    path = tmp_path / "tessera.yaml"
    path.write_text("log_level: DEBUG\ngateway:\n  http_port: 8000\n  grpc_port: 7000\n")
    config = load_config(environ={"TESSERA_CONFIG": str(path), "TESSERA_GATEWAY__HTTP_PORT": "9000"})
    assert (config.log_level, config.gateway.http_port, config.gateway.grpc_port) == ("DEBUG", 9000, 7000)


def test_env_values_are_yaml_so_lists_parse() -> None:
    config = load_config(environ={"TESSERA_REGISTRY__IMPORT_ROOTS": "[/a, /b]"})
    assert config.import_root_paths == [Path("/a"), Path("/b")]


def test_string_keys_take_the_variable_as_written() -> None:
    """A secret like "0123" or "true" is a string, not YAML's 83 or True; lists still parse."""
    config = load_config(environ={"TESSERA_REGISTRY__ADMIN_API_KEY": "0123", "TESSERA_LOG_LEVEL": "true",
                                  "TESSERA_GATEWAY__API_KEYS": "['0123', k2]"})
    assert (config.registry.admin_api_key, config.log_level) == ("0123", "true")
    assert config.gateway.api_keys == ["0123", "k2"]


@pytest.mark.parametrize("environ, message", [
    ({"TESSERA_GATEWAY__HTTP_PROT": "1"}, "unknown config key 'gateway.http_prot'"),
    ({"TESSERA_NOSUCH__KEY": "1"}, "TESSERA_NOSUCH__KEY"),
    ({"TESSERA_GATEWAY__HTTP_PORT": "fast"}, "gateway.http_port: expected int"),
    ({"TESSERA_GATEWAY__HTTP_PORT": "true"}, "gateway.http_port: expected int"),
    ({"TESSERA_REGISTRY__IMPORT_ROOTS": "/a"}, "registry.import_roots: expected a list"),
])
def test_bad_environment_is_an_error_naming_the_key(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(environ=environ)


def test_unknown_yaml_key_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tessera.yaml"
    path.write_text("gateway:\n  htp_port: 1\n")
    with pytest.raises(ConfigError, match="unknown config key 'gateway.htp_port'"):
        load_config(path, environ={})


def test_ints_widen_to_floats_but_not_the_other_way(tmp_path: Path) -> None:
    config = load_config(environ={"TESSERA_LAUNCHER__HEALTH_TIMEOUT_S": "5"})
    assert config.launcher.health_timeout_s == 5.0 and isinstance(config.launcher.health_timeout_s, float)
    with pytest.raises(ConfigError, match="worker.grpc_port: expected int"):
        load_config(environ={"TESSERA_WORKER__GRPC_PORT": "1.5"})


def test_a_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.yaml", environ={})
