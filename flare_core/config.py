"""User configuration: `~/.config/flare/config.toml` (or `--config PATH`), overridden by flags.

No environment variable selects behaviour; every setting lives here or in a flag.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from flare_core.contract import BUILTIN_SPEC_METHODS, NAME_PATTERN

DEFAULT_CONFIG_PATH = Path("~/.config/flare/config.toml")


class ConfigError(ValueError):
    pass


def _expand_paths(obj: Any) -> None:
    """`~` in a path means the user's home, wherever the path came from (default, file, flag)."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, Path):
            object.__setattr__(obj, f.name, value.expanduser())


@dataclass(frozen=True)
class PathsConfig:
    hub_cache: Path = Path("~/.cache/huggingface/hub")
    core_cache: Path = Path("~/.cache/flare/cores")
    # Checkpoints Flare writes itself (the random-weight demo models), kept for tools to reuse.
    checkpoint_cache: Path = Path("~/.cache/flare/checkpoints")
    # Kernels `flare run` compiles on a GPU, per core, GPU model and library versions (see
    # flare_core.engine.compile_cache), so that the next start of a core skips compiling.
    compile_cache: Path = Path("~/.cache/flare/compiled")
    keys: Path = Path("~/.config/flare/keys")
    trust_store: Path = Path("~/.config/flare/trusted_publishers.json")

    def __post_init__(self) -> None:
        _expand_paths(self)


@dataclass(frozen=True)
class MemoryConfig:
    # Occupied size ("30G"), free reserve ("-30G") or fraction of device memory ("0.8").
    memory_limit: str = "0.9"
    # Bytes ("20G") or "context": enough pages for max_concurrency full contexts, no more.
    kv_cache_limit: str | None = None
    # Where a core's embedding tables (flare_core.engine.tables) live: "disk" (rows read from the
    # core file through a host row cache) or "ram" (whole tables in host memory).
    embedding_table_storage: str = "disk"
    # The disk storage's row cache in host memory, per table ("1G"; "0" reads every row from disk).
    embedding_table_cache_size: str = "1G"


# Request body bytes allowed per token of the core's context when `max_body_bytes` is not set:
# room for JSON escapes (6 bytes per escaped character) of long tokens, plus a fixed allowance
# for everything besides the prompt (tool schemas, sampling fields).
BODY_BYTES_PER_CONTEXT_TOKEN = 32
BODY_BYTES_BASE = 1 << 20


# The most draft tokens a decode row checks (`flare run --spec-draft-tokens`): past a few, a draft's
# chance of being kept is small and the row's cost grows. The ways of proposing them
# (`--spec-method`) are Flare's own (flare_core.contract.BUILTIN_SPEC_METHODS) and those plugins
# add: a name is checked against them when the server starts.
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: Path | None = None
    queue_capacity: int = 64
    # None: derived from the core's context length (see `body_limit`).
    max_body_bytes: int | None = None
    shutdown_grace_s: float = 5.0
    # A connection that has not sent a complete request head this long after it opened, or after
    # its previous response, is closed: idle keep-alive connections and slowly sent headers alike.
    idle_timeout_s: float = 15.0
    # Time to receive a request's whole body once its head has arrived (408 past it).
    body_timeout_s: float = 30.0
    # After this long, a body must keep arriving at body_min_bytes_per_s on average (408 otherwise),
    # so a stalled upload gives its slot back within seconds (flare_core.server.uploads).
    body_grace_s: float = 5.0
    body_min_bytes_per_s: int = 16384
    # Bodies arriving at once from one client address; None: a quarter of the server's upload slots.
    uploads_per_client: int | None = None
    # Live requests (holding a state row) one client address may have at once; None: no cap. The
    # scheduler's service prices already share the engine fairly between requests; this caps
    # what one address can hold besides (flare_core.scheduler).
    max_live_per_client: int | None = None
    # Speculative decoding: how draft tokens are proposed ("prompt-lookup"; "draft": a draft core's
    # greedy guesses; "mtp": the core's draft head's; None: off) and at most how many a decode row
    # checks (flare_core.scheduler.proposals, flare_core.engine.drafting, flare_core.engine.draft_heads).
    spec_method: str | None = None
    spec_draft_tokens: int = 4
    # The draft core of spec_method "draft": a core path, or a model name in the core cache.
    spec_draft_core: str | None = None
    # A streaming client that accepts no bytes for this long is treated as gone (its request is cancelled).
    send_timeout_s: float = 30.0
    # Threads that render chat templates and tokenize prompts, off the event loop.
    frontend_workers: int = 2
    # Host names served besides the loopback ones ("*": any); with none, a server bound to a
    # loopback address answers loopback names only (flare_core.server.access: DNS rebinding).
    allowed_hosts: tuple[str, ...] = ()
    # Browser origins (scheme://host[:port]) served besides loopback ones ("*": any), with CORS.
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _expand_paths(self)
        for name in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in value):
                raise ConfigError(f"server.{name} must be a list of non-empty strings, got {value!r}")
            object.__setattr__(self, name, tuple(v.strip() for v in value))
        if self.spec_method is not None and not (isinstance(self.spec_method, str)
                                                 and NAME_PATTERN.match(self.spec_method)):
            raise ConfigError(f"server.spec_method must be a method name ({', '.join(BUILTIN_SPEC_METHODS)}, or one "
                              f"a plugin adds), got {self.spec_method!r}")
        if (self.spec_method == "draft") != (self.spec_draft_core is not None):
            raise ConfigError("server.spec_draft_core names the draft core of spec_method = \"draft\" and is read with "
                              f"it only; got spec_method {self.spec_method!r}, spec_draft_core {self.spec_draft_core!r}")
        tokens = self.spec_draft_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_DRAFT_TOKENS:
            raise ConfigError(f"server.spec_draft_tokens must be an integer in [0, {MAX_DRAFT_TOKENS}] (0: off), "
                              f"got {tokens!r}")
        for name in ("queue_capacity", "max_body_bytes", "frontend_workers", "body_min_bytes_per_s",
                     "uploads_per_client", "max_live_per_client"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"server.{name} must be a positive integer, got {value!r}")
        for name in ("shutdown_grace_s", "idle_timeout_s", "body_timeout_s", "body_grace_s", "send_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 86_400:
                raise ConfigError(f"server.{name} must be a number of seconds in (0, 86400), got {value!r}")

    def body_limit(self, context_length: int) -> int:
        """Largest request body accepted: `max_body_bytes`, or what a prompt filling the context
        could take (BODY_BYTES_PER_CONTEXT_TOKEN per token + BODY_BYTES_BASE)."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return BODY_BYTES_BASE + BODY_BYTES_PER_CONTEXT_TOKEN * context_length


@dataclass(frozen=True)
class DefaultsConfig:
    device: str = "auto"  # cuda when a CUDA device and FlashInfer are there, else cpu
    dtype: str = "bfloat16"
    max_concurrency: int | None = None
    prefill_chunk_size: int | None = None
    context_length: int | None = None


@dataclass(frozen=True)
class Config:
    paths: PathsConfig = field(default_factory=PathsConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    defaults: DefaultsConfig = field(default_factory=DefaultsConfig)
    source: Path | None = None


_SECTIONS = {"paths": PathsConfig, "memory": MemoryConfig, "server": ServerConfig, "defaults": DefaultsConfig}


def load_config(path: Path | None = None) -> Config:
    """Read the config file. An explicit `path` must exist; the default path may be absent."""
    explicit = path is not None
    path = Path(path if explicit else DEFAULT_CONFIG_PATH).expanduser()
    if not path.exists():
        if explicit:
            raise ConfigError(f"config file {path} does not exist")
        return Config()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from exc
    sections: dict[str, Any] = {}
    for name, value in data.items():
        if name not in _SECTIONS:
            raise ConfigError(f"{path}: unknown section [{name}] (known: {', '.join(_SECTIONS)})")
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: [{name}] must be a table")
        sections[name] = _build_section(path, name, _SECTIONS[name], value, base_dir=path.parent)
    return Config(**sections, source=path)


def _build_section(path: Path, name: str, cls: type, values: dict, base_dir: Path) -> Any:
    known = {f.name: f for f in fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(f"{path}: unknown key {name}.{key} (known: {', '.join(known)})")
        default = getattr(cls(), key)
        if isinstance(default, Path) or (default is None and key.endswith(("_file", "_path"))):
            if not isinstance(value, str):
                raise ConfigError(f"{path}: {name}.{key} must be a path string")
            value = Path(value).expanduser()
            if not value.is_absolute():
                value = base_dir / value  # relative paths are relative to the config file
        elif isinstance(default, tuple):
            pass  # lists: the section checks their items
        elif isinstance(default, bool) or (default is not None and not isinstance(value, type(default))
                                           and not (isinstance(default, float) and isinstance(value, int))):
            raise ConfigError(f"{path}: {name}.{key} must be {type(default).__name__}, got {value!r}")
        kwargs[key] = value
    return cls(**kwargs)


def with_overrides(section: Any, **overrides: Any) -> Any:
    """Apply command-line flags that were given (None means 'not given')."""
    return replace(section, **{k: v for k, v in overrides.items() if v is not None})
