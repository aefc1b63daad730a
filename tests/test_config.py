from pathlib import Path

import pytest

from flare_core.config import ConfigError, load_config, with_overrides


def test_config_file_sections_and_relative_paths(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('[paths]\ncore_cache = "cores"\nhub_cache = "/srv/hub"\n'
                   '[server]\nport = 9001\nallowed_hosts = ["llm.lan", " box "]\n[defaults]\ndevice = "cpu"\n[memory]\nmemory_limit = "-30G"\n')
    config = load_config(cfg)
    assert config.paths.core_cache == tmp_path / "cores"
    assert config.paths.hub_cache == Path("/srv/hub")
    assert config.server.port == 9001 and config.server.host == "127.0.0.1"
    assert config.server.allowed_hosts == ("llm.lan", "box") and config.server.allowed_origins == ()
    assert config.defaults.device == "cpu"
    assert config.memory.memory_limit == "-30G"
    assert with_overrides(config.server, port=None, host="0.0.0.0").host == "0.0.0.0"


@pytest.mark.parametrize("text, message", [
    ("[paths\n", "invalid TOML"),
    ("[nope]\n", r"unknown section \[nope\]"),
    ("[server]\nprot = 1\n", r"unknown key server\.prot"),
    ('[server]\nport = "80"\n', r"server\.port must be int"),
    ("[server]\nfrontend_workers = 0\n", r"server\.frontend_workers must be a positive integer"),
    ("[server]\nmax_body_bytes = -5\n", r"server\.max_body_bytes must be a positive integer"),
    ('[server]\nmax_body_bytes = "8M"\n', r"server\.max_body_bytes must be a positive integer"),
    ("[server]\nbody_timeout_s = 0\n", r"server\.body_timeout_s must be a number of seconds"),
    ("[server]\nidle_timeout_s = nan\n", r"server\.idle_timeout_s must be a number of seconds"),
    ('[server]\nallowed_hosts = "llm.lan"\n', r"server\.allowed_hosts must be a list of non-empty strings"),
    ('[server]\nallowed_origins = ["https://a", 3]\n', r"server\.allowed_origins must be a list of non-empty strings"),
])
def test_config_errors_name_the_key(tmp_path, text, message):
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)


def test_explicit_missing_config_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.toml")


def test_home_in_paths_is_expanded(tmp_path):
    from pathlib import Path

    from flare_core.config import Config, ServerConfig, with_overrides

    defaults = Config().paths
    for path in (defaults.hub_cache, defaults.core_cache, defaults.keys, defaults.trust_store):
        assert path.is_absolute() and "~" not in path.parts, path
    server = with_overrides(ServerConfig(), api_key_file=Path("~/key"))
    assert server.api_key_file == Path.home() / "key"


def test_body_limit_follows_the_context_unless_set(tmp_path):
    from flare_core.config import BODY_BYTES_BASE, BODY_BYTES_PER_CONTEXT_TOKEN, ServerConfig

    assert ServerConfig().body_limit(32768) == BODY_BYTES_BASE + BODY_BYTES_PER_CONTEXT_TOKEN * 32768
    assert ServerConfig(max_body_bytes=4096).body_limit(32768) == 4096
    cfg = tmp_path / "config.toml"
    cfg.write_text("[server]\nmax_body_bytes = 65536\nidle_timeout_s = 5\nfrontend_workers = 4\n")
    server = load_config(cfg).server
    assert (server.max_body_bytes, server.idle_timeout_s, server.frontend_workers) == (65536, 5, 4)
