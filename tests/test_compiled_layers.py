"""Decoder layers compiled as the CUDA executor compiles them (`CompiledDecoder`): each layer is
one graph with attention as an opaque custom op and the cache writes traced. On the CPU the
op runs the plain-torch reference; the compiled model must give the eager model's logits and
leave the same cache contents, over prompt chunks and decode steps of several requests."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import Qwen3ForCausalLM

from flare_core.ops.attention import AttentionBatch, ForwardContext
from flare_core.ops.linear import GemvLinear
from flare_core.ops.loading import load_prepared_weights
from flare_core.ops.mlp import FusedGatedMLP
from flare_core.ops.model import CompiledDecoder
from flare_core.ops.opaque import bound
from flare_core.ops.serving import ServingOptions, serving_model
from flare_core.plugins import load_registry
from flare_testing.parity import serve_paged
from flare_recipe_qwen.recipes import QWEN3

from flare_testing.qwen import tiny_qwen3_config


def loaded_model(config, seed: int = 0, gemv: bool = False):
    torch.manual_seed(seed)
    reference = Qwen3ForCausalLM(config).eval()
    prepared = dict(QWEN3.map_weights(config, reference.state_dict(), torch.float32))
    return load_prepared_weights(serving_model(QWEN3, config, torch.float32, ServingOptions(gemv=gemv)), prepared,
                                 "cpu")


def served(model, scheme, sequences, prompt_lens):
    logits = []
    for r, consumed, row in serve_paged(model, scheme, sequences, prompt_lens, page_tokens=16, step_tokens=24):
        logits.append((r, consumed, row))
    return logits


@pytest.mark.parametrize("gemv", [False, True], ids=["linear", "gemv-ops"])
def test_compiled_layers_match_eager_logits_and_share_one_compilation(gemv):
    """Built with the GEMV option the matmuls are the flare::linear / flare::gated_linear ops (on the CPU
    they compute F.linear): they must trace into the same single graph per group of layers."""
    config = tiny_qwen3_config(vocab_size=512, num_hidden_layers=8)
    scheme = load_registry().cache_schemes[QWEN3.cache_scheme].build(config, "float32")
    generator = torch.Generator().manual_seed(3)
    prompt_lens = (5, 30, 17)
    sequences = [torch.randint(0, 512, (n + 3,), generator=generator).tolist() for n in prompt_lens]

    eager = served(loaded_model(config), scheme, sequences, prompt_lens)
    compiled_model = CompiledDecoder(loaded_model(config, gemv=gemv))
    torch._dynamo.reset()
    counters.clear()
    compiled = served(compiled_model, scheme, sequences, prompt_lens)
    # All groups of layers share a code (their weights and cache layers are inputs); steps of one
    # token compile separately from steps of several (torch specialises sizes 0 and 1), and with
    # the GEMV ops steps of a few tokens (up to FEW_TOKENS: their few-token kernel) from steps of
    # more. So does the code after the layers (logits): at most 2 graphs each, 3 with the ops.
    assert len(compiled_model.groups) == 2  # 8 layers, LAYERS_PER_GRAPH = 4
    assert counters["stats"]["unique_graphs"] <= (6 if gemv else 4), dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])

    assert [(r, c) for r, c, _ in compiled] == [(r, c) for r, c, _ in eager]
    for (r, consumed, expected), (_, _, got) in zip(eager, compiled):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"request {r} after {consumed} tokens: {m}")


def test_cache_writes_land_in_place():
    """The traced cache writes must update the cache tensors the runtime owns (not a copy)."""
    config = tiny_qwen3_config(vocab_size=512)
    scheme = load_registry().cache_schemes[QWEN3.cache_scheme].build(config, "float32")
    from flare_core.executor.storage import allocate_cache_storage

    results = []
    for compiled in (False, True):
        model = loaded_model(config)
        if compiled:
            model = CompiledDecoder(model)
        storage = allocate_cache_storage(scheme, 4, 16, "cpu")
        batch = AttentionBatch.build([(7, 0, [2]), (3, 0, [1])], 16, "cpu")
        with torch.no_grad():
            model(torch.arange(10), batch.positions(), ForwardContext(batch, storage))
        results.append(storage)
    for name, layers in results[0].items():
        for layer, (eager_layer, compiled_layer) in enumerate(zip(layers, results[1][name])):
            assert compiled_layer.abs().sum() > 0, f"compiled model wrote nothing to {name}[{layer}]"
            torch.testing.assert_close(compiled_layer, eager_layer, atol=1e-5, rtol=1e-5)


def test_attention_op_outside_a_bound_context_says_so():
    q = torch.zeros(1, 4, 16)
    layer = torch.zeros(2, 16, 2, 16)
    with pytest.raises(RuntimeError, match=r"flare::paged_attention ran outside .*bound\(context\)"):
        torch.ops.flare.paged_attention(q, layer, layer, 0.25)
    batch = AttentionBatch.build([(1, 0, [0])], 16, "cpu")
    with bound(ForwardContext(batch, {"k": [layer], "v": [layer]})):
        assert torch.ops.flare.paged_attention(q, layer, layer, 0.25).shape == q.shape


def test_compiled_decoder_needs_a_serving_decoder():
    with pytest.raises(ValueError, match="DecoderForServing"):
        CompiledDecoder(torch.nn.Linear(2, 2))


def test_the_gemv_option_builds_gemv_layers_over_the_same_tensors():
    """Built with the GEMV option, every bias-free linear layer is a GemvLinear, the gated MLPs and
    the head take the kernel, and the state dict keeps its names, shapes and tensors."""
    config = tiny_qwen3_config(vocab_size=512)
    plain, gemv = (serving_model(QWEN3, config, torch.float32, ServingOptions(gemv=g)) for g in (False, True))
    assert {k: v.shape for k, v in gemv.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    assert not any(type(m) is torch.nn.Linear for m in gemv.modules())
    linears = [m for m in gemv.modules() if isinstance(m, GemvLinear)]
    assert len(linears) == sum(type(m) is torch.nn.Linear for m in plain.modules()) >= 4 * config.num_hidden_layers
    assert gemv.gemv_head and all(m.gated_kernel for m in gemv.modules() if isinstance(m, FusedGatedMLP))
    assert not plain.gemv_head

    loaded = loaded_model(config, gemv=True)
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GemvLinear) and qkv.weight.abs().sum() > 0  # the loaded tensor, not a fresh one


def _flare_ops_called(model, scheme, tokens_per_request: list[int]) -> set[str]:
    from torch.profiler import profile

    from flare_core.executor.storage import allocate_cache_storage

    storage = allocate_cache_storage(scheme, 4, 16, "cpu")
    batch = AttentionBatch.build([(n, 0, [1 + r]) for r, n in enumerate(tokens_per_request)], 16, "cpu")
    with torch.no_grad(), profile() as prof:
        model(torch.arange(sum(tokens_per_request)), batch.positions(), ForwardContext(batch, storage))
    return {event.name for event in prof.events() if event.name in ("flare::linear", "flare::gated_linear")}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_gemv_ops_serve_steps_of_a_few_tokens_only(compiled):
    """Built with the GEMV option, a step of one token or of a few (up to FEW_TOKENS: a small decode
    batch, a speculative round) runs its matmuls (the gated MLP and the head included) through the
    GEMV ops; a step of more tokens keeps plain matmuls in its layers, which Inductor fuses with the
    code around them, and its few logits rows take the ops again."""
    from flare_core.kernels.gemv import FEW_TOKENS

    config = tiny_qwen3_config(vocab_size=512)
    scheme = load_registry().cache_schemes[QWEN3.cache_scheme].build(config, "float32")
    model = loaded_model(config, gemv=True)
    if compiled:
        model = CompiledDecoder(model)
    assert _flare_ops_called(model, scheme, [1]) == {"flare::linear", "flare::gated_linear"}
    assert _flare_ops_called(model, scheme, [2, 1]) == {"flare::linear", "flare::gated_linear"}
    assert FEW_TOKENS == 16 and _flare_ops_called(model, scheme, [16, 3]) == {"flare::linear"}  # the head only


def test_each_group_structure_gets_its_own_recompile_budget():
    """All groups share one code object, whose compiled variants Dynamo caps: 10 layers give
    groups of 4, 4 and 2, two structures, so twice the default budget, on top of the variants
    earlier models left on that code (a process that builds several models, as the GPU suite
    does, would otherwise run out). (The limit is restored after every test:
    flare_testing.pytest_plugin.)"""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from flare_core.ops.model import RECOMPILES_PER_STRUCTURE, _LayerGroup

    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = RECOMPILES_PER_STRUCTURE
    config = tiny_qwen3_config(vocab_size=512, num_hidden_layers=10)
    first = CompiledDecoder(loaded_model(config))
    assert torch._dynamo.config.recompile_limit == 2 * RECOMPILES_PER_STRUCTURE
    CompiledDecoder(loaded_model(tiny_qwen3_config(vocab_size=512, num_hidden_layers=8)))  # one structure
    assert torch._dynamo.config.recompile_limit == 2 * RECOMPILES_PER_STRUCTURE  # never lowered

    scheme = load_registry().cache_schemes[QWEN3.cache_scheme].build(config, "float32")
    served(first, scheme, [[1, 2, 3, 4, 5, 6]], (5,))  # compiles its variants
    compiled = len(_debug_get_cache_entry_list(_LayerGroup.forward.__code__))
    assert compiled >= 2
    CompiledDecoder(loaded_model(config))
    assert torch._dynamo.config.recompile_limit == compiled + 2 * RECOMPILES_PER_STRUCTURE
    torch._dynamo.reset()


def test_any_pool_size_reuses_the_compiled_layers():
    """The CUDA executor compiles over a one-page pool and then sizes it (ModelRunner.
    resize_cache): the page count must be no guard of the compiled code. A backed size would be
    (torch specialises a size of 1, and Inductor guards 32-bit indexing on it), so a one-page pool
    after a three-page one would compile again; unbacked, every pool size runs the first code."""
    from flare_core.executor.storage import allocate_cache_storage

    config = tiny_qwen3_config(vocab_size=512)
    scheme = load_registry().cache_schemes[QWEN3.cache_scheme].build(config, "float32")
    model = CompiledDecoder(loaded_model(config))
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for num_pages in (3, 1, 40):
        storage = allocate_cache_storage(scheme, num_pages, 16, "cpu")
        last_page = num_pages - 1
        for tokens, cached in ((5, 0), (1, 5)):  # a prompt chunk, then a decode step on the last page
            batch = AttentionBatch.build([(tokens, cached, [last_page])], 16, "cpu")
            with torch.no_grad():
                model(torch.arange(tokens), batch.positions(), ForwardContext(batch, storage))
        assert storage["k"][0][last_page, :6].abs().sum() > 0, "the compiled layers wrote nothing to the last page"
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == [graphs[0]] * 3, f"graphs compiled after each pool size: {graphs}"
