"""Resolving the MODEL argument of `flare export`: a local checkpoint directory, a GGUF file (or a
directory holding exactly one), a recipe alias, or a Hugging Face repository id (downloaded into
the configured hub cache)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from flare_core.contract import Recipe
from flare_core.plugins import Registry
from flare_core.prepare.checkpoint import GGUF_SUFFIX

# Only what export reads: configs, tokenizer and template files, safetensors weights.
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
_REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


class ModelNotFound(LookupError):
    pass


@dataclass(frozen=True)
class ModelSource:
    path: Path  # the checkpoint directory or GGUF file
    kind: str  # "local", "gguf", "alias" or "repo"
    served_names: tuple[str, ...]  # names `flare run` accepts for this model
    repo: str | None = None
    revision: str | None = None
    recipe: Recipe | None = None  # set when the alias named the recipe


def resolve_model(model: str, registry: Registry, hub_cache: Path, offline: bool) -> ModelSource:
    local = Path(model).expanduser()
    gguf = _gguf_file(local)
    if gguf is not None:
        return ModelSource(gguf, "gguf", (gguf.stem.lower(),))
    if local.is_dir():
        return ModelSource(local.resolve(), "local", (local.resolve().name.lower(),))
    found = registry.recipe_for_alias(model)
    if found is not None:
        recipe, alias = found
        directory = _download(alias.repo, alias.revision, hub_cache, offline)
        return ModelSource(directory, "alias", (alias.name, alias.repo.lower()), alias.repo, alias.revision, recipe)
    if _REPO_ID.match(model) and not local.exists():
        directory = _download(model, None, hub_cache, offline)
        matches = [(r, a) for r in registry.recipes.values() for a in r.aliases if a.repo.lower() == model.lower()]
        # A repo some recipe names in an alias is prepared by that recipe (checkpoints of one
        # architecture, e.g. DeepSeek V3 and V3.1, can need different templates and defaults).
        recipe = matches[0][0] if len({r.name for r, _ in matches}) == 1 else None
        return ModelSource(directory, "repo", tuple(a.name for _, a in matches) + (model.lower(),), model, None,
                           recipe)
    known = sorted(a.name for r in registry.recipes.values() for a in r.aliases)
    raise ModelNotFound(
        f"unknown model {model!r}: not a checkpoint directory, not a recipe alias and not a Hugging Face "
        f"repo id (owner/name). Known aliases: {', '.join(known) or 'none (no recipes installed)'}")


def _gguf_file(local: Path) -> Path | None:
    """The GGUF file MODEL names: the file itself, or the one *.gguf in a directory without a
    config.json (a Hugging Face checkpoint directory is read as one even if it holds GGUF files)."""
    if local.is_file():
        if local.suffix.lower() != GGUF_SUFFIX:
            raise ModelNotFound(f"{local} is a file but not a GGUF file (*.gguf); a Hugging Face checkpoint is "
                                f"given as its directory")
        return local.resolve()
    if not local.is_dir() or (local / "config.json").exists():
        return None
    files = sorted(p for p in local.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        raise ModelNotFound(f"{local} holds {len(files)} GGUF files ({', '.join(p.name for p in files)}); "
                            f"export one by its path")
    return files[0].resolve() if files else None


def _download(repo: str, revision: str | None, hub_cache: Path, offline: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(repo, revision=revision, cache_dir=str(Path(hub_cache).expanduser()),
                                 local_files_only=offline, allow_patterns=DOWNLOAD_PATTERNS)
    except LocalEntryNotFoundError as exc:
        if offline:
            raise ModelNotFound(f"{repo} is not in the hub cache {hub_cache} (--offline uses the cache only; "
                                f"run without --offline to download it)") from exc
        raise ModelNotFound(f"cannot download {repo}: {exc}") from exc
    except Exception as exc:  # repository not found, gated, network errors: all end the export
        raise ModelNotFound(f"cannot download {repo}: {exc}") from exc
    return Path(path)
