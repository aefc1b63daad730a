"""Frontend assets a core carries: tokenizer.json and the `{% mark %}`-annotated chat template
(none when the recipe names a prompt encoder: its code renders conversations).

The checkpoint's own files win; a recipe's shipped assets fill what a checkpoint lacks.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flare_core.contract import FrontendSpec, Recipe
from flare_core.plugins import Registry
from flare_core.prepare.checkpoint import Checkpoint

TOKENIZER_ASSET = "tokenizer.json"
TEMPLATE_ASSET = "chat_template.jinja"


class AssetError(ValueError):
    pass


@dataclass(frozen=True)
class FrontendAssets:
    files: dict[str, bytes]  # asset name -> bytes, stored in the core
    tokenizer_description: str
    template_description: str
    template_patch: str | None
    special_tokens: dict[str, str | None]
    stop_token_ids: tuple[int, ...]
    notes: tuple[str, ...] = field(default=())

    def manifest_entry(self, spec: FrontendSpec) -> dict[str, Any]:
        return {
            "tokenizer": TOKENIZER_ASSET,
            "chat_template": TEMPLATE_ASSET if TEMPLATE_ASSET in self.files else None,
            "template_patch": self.template_patch,
            "prompt_encoder": spec.prompt_encoder,
            "reasoning_parser": spec.reasoning_parser,
            "tool_parser": spec.tool_parser,
            "template_options": dict(spec.template_options),
            "stop_tokens": list(spec.stop_tokens),
            "stop_token_ids": list(self.stop_token_ids),
            "special_tokens": self.special_tokens,
        }


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _tokenizer_json(checkpoint: Checkpoint, recipe: Recipe) -> tuple[str, str]:
    from flare_core.frontend import build_tokenizer_json

    directory = checkpoint.directory
    own = checkpoint.read(TOKENIZER_ASSET)
    if own is not None:
        return own.decode("utf-8"), checkpoint.where(TOKENIZER_ASSET)
    if recipe.tokenizer_builder is not None:
        try:
            return recipe.tokenizer_builder(directory), f"built by recipe {recipe.name} from {directory}"
        except FileNotFoundError:
            pass  # the checkpoint lacks what this recipe builds from: try the generic routes
    if (directory / "vocab.json").exists() and (directory / "merges.txt").exists():
        return build_tokenizer_json(directory), f"built from vocab.json + merges.txt in {directory}"
    if TOKENIZER_ASSET in recipe.assets:
        return recipe.assets[TOKENIZER_ASSET]().decode("utf-8"), f"recipe {recipe.name} asset"
    if all(n in recipe.assets for n in ("vocab.json", "merges.txt")):
        with tempfile.TemporaryDirectory() as tmp:
            for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
                if name in recipe.assets:
                    Path(tmp, name).write_bytes(recipe.assets[name]())
            return build_tokenizer_json(Path(tmp)), f"built from recipe {recipe.name} vocab.json + merges.txt"
    raise AssetError(f"{directory}: no tokenizer.json (nor vocab.json + merges.txt), and recipe {recipe.name} "
                     f"ships no tokenizer")


def _chat_template(checkpoint: Checkpoint, recipe: Recipe, tokenizer_config: dict) -> tuple[str | None, str]:
    own = checkpoint.read(TEMPLATE_ASSET)
    if own is not None:
        return own.decode("utf-8"), checkpoint.where(TEMPLATE_ASSET)
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    if isinstance(template, str):
        return template, f"{checkpoint.where('tokenizer_config.json')} chat_template"
    if TEMPLATE_ASSET in recipe.assets:
        return recipe.assets[TEMPLATE_ASSET]().decode("utf-8"), f"recipe {recipe.name} asset"
    return None, "none"


def collect_frontend_assets(checkpoint: Checkpoint, recipe: Recipe, registry: Registry) -> FrontendAssets:
    from flare_core.frontend import Tokenizer, apply_template_patch

    notes: list[str] = []
    tokenizer_config = checkpoint.read_json("tokenizer_config.json")
    if tokenizer_config is None:
        tokenizer_config = (json.loads(recipe.assets["tokenizer_config.json"]())
                            if "tokenizer_config.json" in recipe.assets else {})
    tokenizer_text, tokenizer_description = _tokenizer_json(checkpoint, recipe)
    tokenizer = Tokenizer.from_str(tokenizer_text)

    spec = recipe.frontend
    for token in spec.required_tokens + spec.stop_tokens:
        if tokenizer.token_to_id(token) is None:
            raise AssetError(f"tokenizer ({tokenizer_description}) has no token {token!r}, which recipe "
                             f"{recipe.name} requires")
    vocab = getattr(checkpoint.config, "vocab_size", None)
    if vocab is not None and tokenizer.vocab_size > vocab:
        raise AssetError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {vocab}")
    stop_ids = [tokenizer.token_to_id(t) for t in spec.stop_tokens]
    # The checkpoint's own end-of-sequence tokens end generation too: the EOS its tokenizer
    # settings name (what a GGUF file's tokenizer.ggml.eos_token_id becomes) and those of
    # generation_config.json.
    eos_ids = [tokenizer.token_to_id(t) for t in [_token_text(tokenizer_config.get("eos_token"))] if t]
    eos = (checkpoint.read_json("generation_config.json") or {}).get("eos_token_id")
    eos_ids += eos if isinstance(eos, list) else [eos] if eos is not None else []
    for token_id in eos_ids:
        if token_id is not None and int(token_id) not in stop_ids:
            stop_ids.append(int(token_id))

    files = {TOKENIZER_ASSET: tokenizer_text.encode("utf-8")}
    patch_id = None
    if spec.prompt_encoder is not None:  # the recipe's code renders conversations: no template
        template = None
        template_description = (f"none: prompt encoder {spec.prompt_encoder} "
                                f"({registry.prompt_encoders[spec.prompt_encoder].description})")
    else:
        template, template_description = _chat_template(checkpoint, recipe, tokenizer_config)
        if template is None:
            notes.append("no chat template: chat endpoints will be unavailable, completions only")
    if template is not None:
        digest = hashlib.sha256(template.encode("utf-8")).hexdigest()
        patch = next((registry.template_patches[p] for p in spec.template_patches
                      if registry.template_patches[p].source_sha256 == digest), None)
        if patch is None:
            notes.append(f"chat template sha256 {digest[:12]} matches none of recipe {recipe.name}'s template "
                         f"patches: prefix reuse only at prompt ends, not at message boundaries")
        else:
            template = apply_template_patch(template, patch)
            patch_id = patch.id
            template_description += f" + patch {patch.id}"
        files[TEMPLATE_ASSET] = template.encode("utf-8")

    special = {name: _token_text(tokenizer_config.get(name)) for name in ("bos_token", "eos_token", "pad_token")}
    return FrontendAssets(files, tokenizer_description, template_description, patch_id, special,
                          tuple(stop_ids), tuple(notes))
