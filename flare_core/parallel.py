"""Tensor parallelism: a serving model split over the ranks of one torch.distributed group, as
its recipe's `TensorParallelSpec` declares (flare_core.contract).

Every rank builds the recipe's model from `rank_config`: the config with the declared head
counts and intermediate sizes divided by the number of ranks. Its attention then holds 1/size of
the query and KV heads (column-parallel QKV, a row-parallel output projection, 1/size of the KV
cache), its MLPs and routed experts 1/size of the intermediate features (column-parallel gate/up,
row-parallel down); embeddings, norms, routers and the head are whole on every rank. Which
dimension of which tensor a rank holds a slice of is not declared anywhere: it is the one
dimension where the full model's shape and the rank's model's shape differ, and
`rank_checkpoint` slices the checkpoint tensors each such tensor is built from (every part of a
fused projection, every expert of a packed tensor) before the recipe's own `map_weights` fuses
them, so each rank's fused QKV holds its own q, k and v heads. A tensor the recipe computes from
another checkpoint tensor (the spec's `derived`) has that one sliced as declared. The row-parallel outputs are each
rank's share of a sum: `join_group` all-reduces the outputs of the decoder-layer
submodules the spec names, and every rank then carries the same residual stream.

Expert parallelism (`Ranks.experts`, for a spec that names `routed_experts`): the spec's
`expert_features` are not divided, and each routed experts module (a packed `gate_up_proj` of
every expert) holds only the rank's 1/size of the experts, whole: rank r experts
[r * E / size, (r + 1) * E / size), numbered from 0 in the module, which also says
`num_experts` (its count) and `first_expert`. Every rank routes every token as the whole model
does; a route to another rank's expert becomes the sentinel id `num_experts` with weight 0, whose
output is zero (flare_core.ops.moe; Transformers' experts forwards read the same sentinel when
`_is_expert_parallel` is set), and the experts module's output is the partial sum all-reduced, in
place of the MLP block's: shared experts are whole on every rank. The all-reduce scheme of
Transformers 5.23's `AllReduceEP` (transformers/distributed/expert_parallel.py): no tokens move,
every shape is fixed, so it captures in graphs. The recipe maps whole experts (the checkpoint is
not sliced for them); `hold_weights` cuts the rank's out of them (`RankCheckpoint.held` says which).

The head (an untied `lm_head` of a vocabulary that divides over the ranks) is vocabulary-parallel:
rank r holds rows [r * V / size, (r + 1) * V / size) and the logits rows are gathered from every
rank's slice before sampling. A tied head reads the embedding matrix, which every rank holds
whole, and stays replicated.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from flare_core.contract import Recipe, TensorParallelSpec
from flare_core.ops.weights import packed_experts, source_names


@dataclass(frozen=True)
class Ranks:
    """This process's place in a tensor-parallel group: `rank` of `size`, all-reducing over
    `group` (a torch.distributed process group; None: the default group); `experts`: the routed
    experts expert-parallel (whole experts, 1/size of them on each rank)."""

    rank: int
    size: int
    group: Any = None
    experts: bool = False


def rank_tensor_name(rank: int, name: str) -> str:
    """A core's name for rank `rank`'s slice of prepared tensor `name` (replicated tensors are
    stored once under their own name)."""
    return f"rank{rank}.{name}"


def rank_view(names: Iterable[str], rank: int, size: int) -> list[str]:
    """A split core's tensor names as rank `rank` of `size` holds them: its slices under the
    prepared names, and the replicated tensors."""
    prefixes = tuple(rank_tensor_name(r, "") for r in range(size))
    mine = rank_tensor_name(rank, "")
    return [name.removeprefix(mine) for name in names if name.startswith(mine) or not name.startswith(prefixes)]


def spec_of(recipe: Recipe) -> TensorParallelSpec:
    if recipe.tensor_parallel is None:
        raise ValueError(f"recipe {recipe.name} declares no tensor parallelism: its models run on one device")
    return recipe.tensor_parallel


def rank_config(config: Any, spec: TensorParallelSpec, size: int, experts: bool = False) -> Any:
    """A copy of `config` with each `spec.divided` field divided by `size` (`experts`: expert
    parallel, the `spec.expert_features` kept whole). A config that derives head_dim from
    hidden_size / num_attention_heads gets it set explicitly first, so that dividing the heads does
    not change it. ValueError naming a field that is missing or does not divide, or the recipe's
    lack of expert parallelism."""
    local = copy.deepcopy(config)
    if getattr(config, "head_dim", None) is None and getattr(config, "num_attention_heads", None):
        local.head_dim = config.hidden_size // config.num_attention_heads
    if experts:
        expert_count(config, spec, size)
    for name in spec.divided:
        if experts and name in spec.expert_features:
            continue
        value = getattr(config, name, None)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"config.{name}: tensor parallelism divides it, but the config has {value!r}")
        if value % size:
            raise ValueError(f"config.{name} = {value} does not divide over {size} tensor-parallel ranks")
        setattr(local, name, value // size)
    return local


def expert_count(config: Any, spec: TensorParallelSpec, size: int) -> int:
    """The routed experts of `config` that expert parallelism spreads over `size` ranks; ValueError
    where the recipe declares none or they do not divide."""
    if spec.routed_experts is None:
        raise ValueError("the recipe declares no expert parallelism (TensorParallelSpec.routed_experts)")
    count = getattr(config, spec.routed_experts, None)
    if not isinstance(count, int) or count <= 0:
        raise ValueError(f"config.{spec.routed_experts}: expert parallelism divides it, but the config has {count!r}")
    if count % size:
        raise ValueError(f"config.{spec.routed_experts} = {count} does not divide over {size} expert-parallel ranks")
    return count


def build_rank_model(recipe: Recipe, config: Any, dtype: torch.dtype, ranks: Ranks) -> nn.Module:
    """Rank `ranks.rank`'s model (parameters on the meta device): the recipe's model of
    `rank_config`, its routed experts narrowed to the rank's (`ranks.experts`), its head split over
    the vocabulary where `splits_head` says it can be."""
    spec, size = spec_of(recipe), ranks.size
    model = recipe.build_model(rank_config(config, spec, size, ranks.experts), dtype)
    if ranks.experts:
        count = expert_count(config, spec, size)
        if not hold_experts(model, count, ranks):
            raise ValueError(f"expert parallelism: recipe {recipe.name}'s model has no routed experts module packing "
                             f"config.{spec.routed_experts} = {count} experts")
    if splits_head(model, size):
        head = model.lm_head
        with torch.device("meta"):
            model.lm_head = HeadSlice(head.in_features, head.out_features // size, bias=False,
                                      dtype=head.weight.dtype)
    return model


def hold_experts(model: nn.Module, count: int, ranks: Ranks) -> int:
    """Narrow every routed experts module of `model` (one whose `gate_up_proj` packs `count`
    experts along dim 0) to rank `ranks.rank`'s experts: its per-expert parameters hold
    count / size experts (meta), `num_experts` says so, `first_expert` is the first one's global
    id, `_is_expert_parallel` is set (Transformers' experts forwards then skip sentinel ids).
    Returns how many modules it narrowed."""
    held = count // ranks.size
    narrowed = 0
    for module in model.modules():
        packed = getattr(module, "gate_up_proj", None)
        if not (isinstance(packed, nn.Parameter) and packed.dim() == 3 and packed.shape[0] == count):
            continue
        for name, whole in list(module.named_parameters(recurse=False)):
            if whole.dim() and whole.shape[0] == count:
                setattr(module, name, nn.Parameter(torch.empty((held, *whole.shape[1:]), dtype=whole.dtype,
                                                               device="meta"), requires_grad=whole.requires_grad))
        module.num_experts = held
        module.first_expert = ranks.rank * held
        module._is_expert_parallel = True
        narrowed += 1
    return narrowed


def held_experts(model: nn.Module) -> dict[str, slice]:
    """Prepared tensor name -> the slice of experts (dim 0 of the recipe's whole tensor) rank's
    `model` (`build_rank_model` with `Ranks.experts`) holds of it."""
    shares = {}
    for path, module in model.named_modules():
        first = getattr(module, "first_expert", None)
        if first is None:
            continue
        for name, tensor in module.named_parameters(recurse=False):
            shares[f"{path}.{name}"] = slice(first, first + module.num_experts)
    return shares


def hold_weights(named: Iterable[tuple[str, Tensor]], shares: Mapping[str, slice]) -> Iterator[tuple[str, Tensor]]:
    """A recipe's prepared tensors (`map_weights` over the rank's config and checkpoint) as the
    rank holds them: the routed experts' tensors cut to the rank's experts (`held_experts`,
    `RankCheckpoint.held`)."""
    for name, tensor in named:
        share = shares.get(name)
        yield name, tensor if share is None else tensor[share].contiguous()


class HeadSlice(nn.Linear):
    """A rank's rows of a vocabulary-parallel head (`join_group` gathers its logits)."""


def splits_head(model: nn.Module, size: int) -> bool:
    """Whether `model`'s head splits over `size` ranks: an untied, bias-free `lm_head` whose
    vocabulary divides."""
    head = getattr(model, "lm_head", None)
    return (hasattr(model, "gather_logits") and isinstance(head, nn.Linear) and head.bias is None
            and head.out_features % size == 0)


def rank_checkpoint(recipe: Recipe, config: Any, checkpoint: Mapping[str, Tensor], ranks: Ranks) -> RankCheckpoint:
    """`checkpoint` as rank `ranks.rank` reads it: the tensors its sharded tensors are built from
    sliced to the rank's share, the others whole. Hand it to the recipe's `map_weights` with
    `rank_config(config, ...)`, and what it maps to `hold_weights` with its `held`. ValueError
    naming a tensor whose shapes do not split evenly."""
    spec = spec_of(recipe)
    full = recipe.build_model(config, torch.float32).state_dict()  # meta tensors: shapes only
    local_model = build_rank_model(recipe, config, torch.float32, ranks)
    local, held = local_model.state_dict(), held_experts(local_model)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None) or 0
    dims: dict[str, int] = {}
    for name, target in local.items():
        if name in held:
            continue  # whole experts: the recipe maps every one, `hold_weights` keeps the rank's
        whole = full[name].shape
        differing = [d for d, (a, b) in enumerate(zip(whole, target.shape)) if a != b]
        if not differing:
            continue
        dim = differing[0]
        if len(differing) > 1 or whole[dim] != target.shape[dim] * ranks.size:
            raise ValueError(f"{name}: the full model's {tuple(whole)} and a rank's {tuple(target.shape)} are no even "
                             f"split over {ranks.size} ranks along one dimension")
        derived = [d for d in spec.derived if name.endswith("." + d.prepared)]
        for shard in derived:  # each checkpoint tensor the recipe builds this one from
            dims[name[:-len(shard.prepared)] + shard.source] = shard.dim
        if derived:
            continue
        packed = packed_experts(name, num_experts)
        for group in source_names(name, num_experts):
            for part in group:
                dims[part] = dim - 1 if packed else dim  # a packed tensor stacks its parts along dim 0
    if spec.checkpoint_names is not None:  # the checkpoint names the parts otherwise
        renamed = spec.checkpoint_names(iter(checkpoint))
        dims = {renamed.get(part, part): dim for part, dim in dims.items()}
    return RankCheckpoint(checkpoint, dims, ranks, held)


class RankCheckpoint(Mapping):
    """A checkpoint as one rank reads it (`rank_checkpoint`). `held`: the prepared tensors of the
    routed experts it holds whole (expert parallel), each with the experts it keeps of them."""

    def __init__(self, checkpoint: Mapping[str, Tensor], dims: Mapping[str, int], ranks: Ranks,
                 held: Mapping[str, slice]):
        self._checkpoint, self._dims, self._ranks, self.held = checkpoint, dims, ranks, held

    def __getitem__(self, name: str) -> Tensor:
        tensor = self._checkpoint[name]
        dim = self._dims.get(name)
        if dim is None:
            return tensor
        if tensor.shape[dim] % self._ranks.size:
            raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)}: dimension {dim} does not split over "
                             f"{self._ranks.size} tensor-parallel ranks")
        return tensor.chunk(self._ranks.size, dim=dim)[self._ranks.rank]

    def __iter__(self) -> Iterator[str]:
        return iter(self._checkpoint)

    def __len__(self) -> int:
        return len(self._checkpoint)

    def __contains__(self, name: object) -> bool:
        return name in self._checkpoint


def join_group(model: nn.Module, spec: TensorParallelSpec, ranks: Ranks) -> int:
    """Make rank `ranks.rank`'s model (built by `build_rank_model`) compute with the others: the
    output of every decoder layer's submodules named in `spec.partial_sums` is all-reduced (summed
    over the group) in place through forward hooks (parameter names do not change; a tuple output,
    attention's (output, weights), has its first element reduced), and a split head's logits are
    gathered from every rank's slice of the vocabulary. Returns how many modules were hooked."""
    import torch.distributed as dist

    def hook(module: nn.Module, args: Any, output: Any) -> Any:
        dist.all_reduce(output[0] if isinstance(output, tuple) else output, group=ranks.group)
        return output

    hooked = 0
    for layer in model.model.layers:
        for name in spec.partial_sums:
            module = getattr(layer, name, None)
            if module is None:
                continue
            # Expert parallel: a MoE block's routed experts are the partial sum (its shared experts are whole).
            held = [m for m in module.modules() if getattr(m, "first_expert", None) is not None]
            for partial in held or [module]:
                partial.register_forward_hook(hook)
                hooked += 1
    if not hooked:  # else every rank would add up only its own share: wrong logits, no error
        raise ValueError(f"tensor parallelism: no decoder layer of the model has the submodules {spec.partial_sums} "
                         f"whose outputs the recipe declares partial sums (TensorParallelSpec.partial_sums)")
    if isinstance(getattr(model, "lm_head", None), HeadSlice):
        def gather_logits(logits: Tensor) -> Tensor:
            slices = [torch.empty_like(logits) for _ in range(ranks.size)]
            dist.all_gather(slices, logits.contiguous(), group=ranks.group)
            return torch.cat(slices, dim=-1)

        model.gather_logits = gather_logits
    return hooked
