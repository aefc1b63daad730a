"""The `flare` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from flare_core.config import Config, ConfigError, load_config


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
    for name in sorted(registry.recipes):
        recipe = registry.recipes[name]
        owner = registry.owners[name]
        click.echo(f"{name} {recipe.version}  [{owner.distribution} {owner.version}]  "
                   f"architectures: {', '.join(recipe.architectures)}")
        for alias in recipe.aliases:
            click.echo(f"    {alias.name:<24} {alias.repo}")


@main.command()
@click.argument("model")
@click.option("--dtype", default=None, help="Weight dtype: bfloat16 (default), float16, float32.")
@click.option("--max-concurrency", type=int, help="Live requests the core is prepared for.")
@click.option("--prefill-chunk-size", type=int, help="Prompt tokens per prefill step (multiple of 64).")
@click.option("--context-length", type=int, help="Longest prompt + generation, in tokens.")
@click.option("--page-tokens", type=int, help="Tokens per KV page (multiple of 16).")
@click.option("--recipe", "recipe_name", help="Use this recipe instead of choosing by alias/architecture.")
@click.option("--offline", is_flag=True, help="Use the hub cache only; never download.")
@click.option("--no-progress", is_flag=True, help="No progress bars.")
@click.pass_context
def export(ctx, model, dtype, max_concurrency, prefill_chunk_size, context_length, page_tokens, recipe_name,
           offline, no_progress) -> None:
    """Prepare MODEL (alias, Hugging Face repo id or checkpoint dir) into a runtime core."""
    from flare_core.prepare import ExportRequest, export_model
    from flare_core.prepare.plan import CapacityRequest

    config = _config(ctx)
    defaults = config.defaults
    request = ExportRequest(
        model=model, dtype=dtype or defaults.dtype,
        capacities=CapacityRequest(max_concurrency or defaults.max_concurrency,
                                   prefill_chunk_size or defaults.prefill_chunk_size,
                                   context_length or defaults.context_length, page_tokens),
        offline=offline, recipe=recipe_name, progress=not no_progress)
    try:
        result = export_model(request, config, _registry(), echo=click.echo)
    except (ValueError, LookupError, OSError) as exc:
        raise FlareCommandError(f"export failed: {exc}") from exc
    click.echo(str(result.path))


def resolve_core_path(config: Config, core: str) -> Path:
    """CORE is a core file/directory, or a served model name whose latest export is in the cache."""
    from flare_core.core import CoreStore

    path = Path(core).expanduser()
    if path.exists():
        return path
    found = CoreStore(config.paths.core_cache).default_core(core.lower())
    if found is None:
        raise FlareCommandError(f"no core {core!r}: not a path, and no export of a model named {core!r} in "
                                f"{config.paths.core_cache} (run `flare export {core}` first)")
    return found


def open_verified_core(config: Config, core: str, trust_publisher: bool):
    """Open a core and verify signature, publisher trust and every payload hash."""
    from flare_core.core import CoreError, TrustStore, open_core

    path = resolve_core_path(config, core)
    try:
        runtime_core = open_core(path)
        runtime_core.verify(TrustStore(config.paths.trust_store), accept_new=_acceptor(trust_publisher))
    except CoreError as exc:
        raise FlareCommandError(f"{path}: {exc}") from exc
    return runtime_core


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
        click.echo(f"capacities    " + " ".join(f"{k}={v}" for k, v in caps.items()))
        click.echo(f"cache scheme  {m['cache_scheme']['name']}")
        click.echo(f"sampling      " + " ".join(f"{k}={v}" for k, v in m["sampling"]["defaults"].items()))
        click.echo(f"template      {m['frontend']['chat_template']} (patch {m['frontend']['template_patch']})")
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
        click.echo(f"{entry.name:<40} {entry.recipe:<12} {entry.size_bytes / 2**30:8.2f} GiB  "
                   f"{', '.join(entry.served_names)}")
