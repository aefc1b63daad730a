"""A verified runtime core turned into what serving needs: the model on its device, the
tokenizer, the annotated chat template, and the contract data from the manifest."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from flare_core.contract import (CARRIED_PREFIX, CONTRACT_VERSION, DRAFT_HEAD_PREFIX, CacheScheme, Capacities,
                                 PagedStore, Range, SamplingPolicy, StateTensor)
from flare_core.core import RuntimeCore
from flare_core.frontend import ChatTemplate, ConversationRenderer, Tokenizer
from flare_core.ops.loading import load_prepared_weights
from flare_core.ops.fp4 import fp4_experts
from flare_core.ops.fp8 import quantized_experts, quantized_paths
from flare_core.ops.mla import MLAPagedAttention
from flare_core.ops.serving import ServingOptions, serving_model
from flare_core.ops.tables import bind_tables, embedding_tables
from flare_core.engine.tables import TableError, TableOptions, TableStore, open_tables
from flare_core.parallel import Ranks, rank_tensor_name, rank_view
from flare_core.plugins import Registry

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CoreLoadError(RuntimeError):
    pass


CUDA_DTYPES = (torch.bfloat16, torch.float16)


@dataclass
class LoadedCore:
    core: RuntimeCore
    recipe_name: str
    model_config: Any
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    tokenizer: Tokenizer
    chat_template: ConversationRenderer | None  # a ChatTemplate, or the recipe's prompt encoder
    capacities: Capacities
    cache_scheme: CacheScheme
    sampling_policy: SamplingPolicy
    frontend: dict
    identity: bytes  # 32 bytes naming exactly this core: the root of prefix-cache hashes
    tensor_parallel: int = 1  # ranks the core is split over; this process holds one rank's share
    tables: dict[str, TableStore] = field(default_factory=dict)  # its embedding tables, bound to the model

    @property
    def manifest(self) -> dict:
        return self.core.manifest

    @property
    def parameters(self) -> int:
        """The whole model's parameters (a tensor-parallel rank's model holds a share of them; the
        core holds every rank's slices and the replicated tensors once, buffers such as a router's
        bias among them, which are no parameters)."""
        if self.tensor_parallel == 1:
            return sum(p.numel() for p in self.model.parameters())
        stored = self.core.locations
        total = 0
        for name, _ in self.model.named_parameters():
            shares = [rank_tensor_name(r, name) for r in range(self.tensor_parallel)]
            total += sum(math.prod(stored[share].shape) for share in shares) if shares[0] in stored else \
                math.prod(stored[name].shape)
        return total


def _major(version: str) -> str:
    return version.split(".")[0]


def model_config_from_manifest(manifest: dict):
    from transformers import AutoConfig

    arch = manifest["architecture"]
    values = {k: v for k, v in arch["config"].items() if k != "model_type"}
    return AutoConfig.for_model(arch["model_type"], **values)


def cache_scheme_from_manifest(data: dict) -> CacheScheme:
    return CacheScheme(
        name=data["name"],
        paged=tuple(PagedStore(s["name"], tuple(s["record_shape"]), s["dtype"], s["layers"],
                               s.get("tokens_per_record", 1), tuple(s.get("layer_ids", ()))) for s in data["paged"]),
        state=tuple(StateTensor(s["name"], tuple(s["shape"]), s["dtype"], s["layers"], tuple(s.get("layer_ids", ())))
                    for s in data.get("state", ())),
    )


def sampling_policy_from_manifest(data: dict) -> SamplingPolicy:
    return SamplingPolicy(defaults=data["defaults"],
                          ranges={n: Range(low, high) for n, (low, high) in data["ranges"].items()},
                          source=data.get("source", ""))


def load_core(core: RuntimeCore, registry: Registry, device: torch.device, rank: int = 0,
              tables: TableOptions = TableOptions()) -> LoadedCore:
    """Build the recipe's model from the core's tensors on `device` (the core must be verified).
    A core split over tensor-parallel ranks (flare_core.parallel) gives rank `rank`'s share: its
    model built from the divided config, with its slices of the sharded tensors. The model's
    embedding tables are served from the core as `tables` says (flare_core.engine.tables)."""
    manifest = core.manifest
    if _major(manifest["contract_version"]) != _major(CONTRACT_VERSION):
        raise CoreLoadError(f"core was prepared for contract {manifest['contract_version']}; this flare speaks "
                            f"{CONTRACT_VERSION} (re-export the model)")
    recipe_info = manifest["recipe"]
    recipe = registry.recipes.get(recipe_info["name"])
    if recipe is None:
        raise CoreLoadError(f"core needs recipe {recipe_info['name']!r} from {recipe_info['plugin']}, which is not "
                            f"installed (pip install {recipe_info['plugin']})")
    if _major(recipe.version) != _major(recipe_info["version"]):
        raise CoreLoadError(f"core was prepared by recipe {recipe.name} {recipe_info['version']}; the installed "
                            f"recipe is {recipe.version} (major versions differ: re-export the model)")
    model_config = model_config_from_manifest(manifest)
    dtype = DTYPES[manifest["dtype"]]
    if device.type == "cuda" and dtype not in CUDA_DTYPES:
        # FlashInfer's attention kernels take 16-bit queries and caches only.
        raise CoreLoadError(f"core weights are {manifest['dtype']}, which the CUDA path does not serve (FlashInfer "
                            f"attention is bfloat16 / float16): serve it with --device cpu, or export the model "
                            f"again with --dtype bfloat16")
    quantization = manifest.get("quantization")
    # FP4 experts alone (no FP8 weights) take the Triton experts kernel, which any CUDA device runs.
    if quantization is not None and quantization.get("weights", 0) and device.type == "cuda" \
            and torch.cuda.get_device_capability(device) != (9, 0):
        # cuBLAS's block-scaled FP8 GEMM (1x128 by 128x128 scales) is a Hopper (SM 9.0) kernel.
        major, minor = torch.cuda.get_device_capability(device)
        raise CoreLoadError(f"core keeps {quantization['method']} weights, which the CUDA path serves on Hopper (SM "
                            f"9.0); this device is SM {major}.{minor}: serve it with --device cpu, or export the "
                            f"model without --quantize")
    fp8_stores = [store["name"] for store in manifest["cache_scheme"].get("paged", ())
                  if store.get("dtype") == "float8_e4m3fn"]
    ranks = manifest.get("tensor_parallel", 1)
    if not 0 <= rank < ranks:
        raise CoreLoadError(f"core is split over {ranks} tensor-parallel rank(s); there is no rank {rank}")
    # Tensors the core carries for other features (Recipe.carried_prefixes, the draft head) are not the model's.
    tensor_names = [name for name in core.tensor_names() if not name.startswith((CARRIED_PREFIX, DRAFT_HEAD_PREFIX))]
    held = rank_view(tensor_names, rank, ranks) if ranks > 1 else tensor_names  # which of them are FP8 / FP4
    block = tuple((quantization or {}).get("weight_block_size", (128, 128)))
    options = ServingOptions(gemv=device.type == "cuda", fp8_linears=tuple(quantized_paths(held)), fp8_block=block,
                             fp8_experts=tuple(quantized_experts(held)), fp4_experts=tuple(fp4_experts(held)),
                             ranks=Ranks(rank, ranks, experts=manifest.get("expert_parallel", False)) if ranks > 1
                             else None)
    if ranks > 1 and recipe.tensor_parallel is None:
        raise CoreLoadError(f"core is split over {ranks} tensor-parallel ranks, but the installed recipe "
                            f"{recipe.name} declares no tensor parallelism")
    model = serving_model(recipe, model_config, dtype, options)
    if fp8_stores and device.type == "cuda" and any(isinstance(m, MLAPagedAttention) for m in model.modules()):
        # FlashInfer's MLA kernels take FP8 latent pages only with FP8 queries (and on
        # Blackwell); its paged attention widens FP8 K/V pages under 16-bit queries.
        raise CoreLoadError(f"core keeps its latent KV cache ({', '.join(fp8_stores)}) as float8_e4m3fn, which "
                            f"the CUDA path does not serve (FlashInfer's MLA kernels read latent pages of the "
                            f"queries' dtype): serve it with --device cpu, or export the model without --kv-dtype")
    declared = manifest.get("embedding_tables", [])
    if {entry["name"] for entry in declared} != set(embedding_tables(model)):
        raise CoreLoadError(f"the core declares embedding tables {sorted(e['name'] for e in declared)}; the "
                            f"installed recipe's model reads {sorted(embedding_tables(model))} (re-export the model)")
    try:
        stores = open_tables(declared, core.locations, tables)
    except TableError as exc:
        raise CoreLoadError(str(exc)) from exc
    bind_tables(model, stores)
    if ranks == 1:
        tensors = core.load_tensors(device="cpu", names=[name for name in tensor_names if name not in stores])
    else:  # a rank's model reads its slices of the sharded tensors and the replicated ones
        stored = set(tensor_names)
        names = {name: rank_tensor_name(rank, name) if rank_tensor_name(rank, name) in stored else name
                 for name in model.state_dict()}
        loaded = core.load_tensors(device="cpu", names=names.values())
        tensors = {name: loaded[stored_name] for name, stored_name in names.items()}
    if device.type == "cpu":
        # Private copies: the core file maps into memory, and a mapped page whose file was
        # truncated or rewritten while serving kills the process with SIGBUS at the next step
        # that reads it. (A device copies the weights anyway.)
        tensors = {name: tensor.clone() for name, tensor in tensors.items()}
    load_prepared_weights(model, tensors, device)

    frontend = manifest["frontend"]
    tokenizer = Tokenizer.from_str(core.asset(frontend["tokenizer"]).decode("utf-8"))
    template = None
    if frontend.get("prompt_encoder"):
        encoder = registry.prompt_encoders.get(frontend["prompt_encoder"])
        if encoder is None:
            raise CoreLoadError(f"core renders prompts with encoder {frontend['prompt_encoder']!r}, which no "
                                f"installed plugin registers (pip install {recipe_info['plugin']})")
        template = encoder.factory()
    elif frontend.get("chat_template"):
        template = ChatTemplate(core.asset(frontend["chat_template"]).decode("utf-8"))
    return LoadedCore(
        core=core, recipe_name=recipe.name, model_config=model_config, model=model, device=device, dtype=dtype,
        tokenizer=tokenizer, chat_template=template, capacities=Capacities(**manifest["capacities"]),
        cache_scheme=cache_scheme_from_manifest(manifest["cache_scheme"]),
        sampling_policy=sampling_policy_from_manifest(manifest["sampling"]), frontend=frontend,
        identity=hashlib.sha256(core.manifest_bytes).digest(), tensor_parallel=ranks, tables=stores,
    )


def load_draft_head(loaded: LoadedCore, registry: Registry) -> torch.nn.Module:
    """The core's draft head (`Recipe.draft_head`, stored at export as `draft_head.<name>`) on the
    served model's device. CoreLoadError naming --spec-method mtp where the core carries none."""
    recipe = registry.recipes[loaded.recipe_name]
    names = [name for name in loaded.core.tensor_names() if name.startswith(DRAFT_HEAD_PREFIX)]
    if recipe.draft_head is None or not names:
        raise CoreLoadError(f"--spec-method mtp: the core carries no draft head (recipe {recipe.name} "
                            f"{'declares none' if recipe.draft_head is None else 'found none in the checkpoint'}; "
                            f"a checkpoint that ships a multi-token-prediction module, DeepSeek V3's, Qwen3-Next's "
                            f"or Qwen3.5's, exports one)")
    head = recipe.draft_head.build(loaded.model_config, loaded.dtype)
    tensors = loaded.core.load_tensors(device="cpu", names=names)
    tensors = {name.removeprefix(DRAFT_HEAD_PREFIX): tensor.clone() for name, tensor in tensors.items()}
    return load_prepared_weights(head, tensors, loaded.device)
