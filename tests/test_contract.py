import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flare_core.contract import (Alias, CacheScheme, Capacities, ContractError, FrontendSpec, PagedStore, Range,
                                 SamplingPolicy, StateTensor)
from flare_core.contract.schema import render

DOCS_SCHEMA = Path(__file__).resolve().parents[1] / "docs" / "contract.schema.json"


def test_capacities_validate_and_plan_graph_catalog():
    caps = Capacities(max_concurrency=12, prefill_chunk_size=512, context_length=4096)
    decode = [g.capacity for g in caps.graph_catalog() if g.kind == "decode"]
    prefill = [g.capacity for g in caps.graph_catalog() if g.kind == "prefill"]
    assert decode == [1, 2, 4, 8, 12]
    assert prefill == [64, 128, 256, 512]
    with pytest.raises(ContractError, match=r"Capacities\.prefill_chunk_size: must be a multiple of 64"):
        replace(caps, prefill_chunk_size=100)
    with pytest.raises(ContractError, match=r"Capacities\.max_concurrency"):
        Capacities(max_concurrency=0)


def test_sampling_policy_clamps_and_reports():
    policy = SamplingPolicy({"temperature": 0.6, "top_p": 0.95, "top_k": 20},
                            ranges={"temperature": Range(0.0, 1.5)}, source="card")
    values, clamped = policy.resolve({"temperature": 1.9, "top_p": None, "min_p": 0.1})
    assert values["temperature"] == 1.5 and values["top_p"] == 0.95 and values["min_p"] == 0.1
    assert values["repetition_penalty"] == 1.0
    assert clamped == {"temperature": 1.9}
    with pytest.raises(ContractError, match=r"defaults\.temperature: 1\.8 is outside its range"):
        SamplingPolicy({"temperature": 1.8}, ranges={"temperature": Range(0.0, 1.5)})
    with pytest.raises(ContractError, match=r"defaults\.warmth: unknown sampling parameter"):
        SamplingPolicy({"warmth": 1.0})


def test_cache_scheme_sizes():
    scheme = CacheScheme("attention-kv", paged=(PagedStore("k", (8, 128), "bfloat16", 36),
                                                PagedStore("v", (8, 128), "bfloat16", 36)))
    # Qwen3-8B geometry: 2 stores x 36 layers x 8 heads x 128 dims x 2 bytes per token.
    assert scheme.page_bytes(64) == 64 * 2 * 36 * 8 * 128 * 2
    assert scheme.state_row_bytes() == 0
    with pytest.raises(ContractError, match=r"PagedStore\(k\)\.dtype"):
        PagedStore("k", (8, 128), "bf16", 36)


def test_stores_may_cover_some_layers_and_the_forward_context_hands_each_layer_its_own():
    from flare_core.ops.attention import AttentionBatch, ForwardContext

    scheme = CacheScheme("hybrid", paged=(PagedStore("k", (2, 4), "float32", 1, layer_ids=(3,)),),
                         state=(StateTensor("s", (5,), "float32", 3, layer_ids=(0, 1, 2)),))
    assert scheme.layer_map() == {"k": {3: 0}, "s": {0: 0, 1: 1, 2: 2}}
    assert CacheScheme("plain", paged=(PagedStore("k", (2, 4), "float32", 2),)).layer_map() == {}
    for bad in ((3, 1), (1,), (0, 0)):
        with pytest.raises(ContractError, match=r"StateTensor\(s\)\.layer_ids"):
            StateTensor("s", (5,), "float32", 2, layer_ids=bad)
    cache = {"k": [torch.zeros(1)], "s": [torch.full((1,), float(i)) for i in range(3)]}
    context = ForwardContext(AttentionBatch.build([(1, 0, [0])], 16, "cpu", state_rows=[2]), cache,
                             layer_map=scheme.layer_map())
    assert context.batch.state_rows_host == (2,)
    assert set(context.for_layer(3).layer) == {"k"} and context.for_layer(3).layer["k"] is cache["k"][0]
    assert set(context.for_layer(1).layer) == {"s"} and context.for_layer(1).layer["s"] is cache["s"][1]


def test_frontend_and_alias_validation():
    from flare_core.contract import PromptEncoder

    with pytest.raises(ContractError, match=r"FrontendSpec\.stop_tokens"):
        FrontendSpec(stop_tokens=())
    with pytest.raises(ContractError, match=r"FrontendSpec\.template_patches: patch chat templates, which a "
                                            r"frontend with a prompt_encoder does not use"):
        FrontendSpec(stop_tokens=("</s>",), prompt_encoder="native", template_patches=("some-patch",))
    with pytest.raises(ContractError, match=r"PromptEncoder\(native\)\.factory: must be callable as factory\(\)"):
        PromptEncoder("native", lambda options: None, "a format")
    with pytest.raises(ContractError, match=r"PromptEncoder\(native\)\.description: must say what format"):
        PromptEncoder("native", object, " ")
    with pytest.raises(ContractError, match=r"Alias\(qwen3-8b\)\.repo"):
        Alias("qwen3-8b", "not a repo")


def test_recipe_and_parser_callables_must_accept_the_calls_flare_makes():
    """A callable whose signature cannot take Flare's call is refused when the object is built
    (so when its plugin loads), naming the field and the call, not during an export or a request."""
    from flare_core.contract import Parser, Recipe
    from flare_recipe_llama.plugin import LLAMA

    with pytest.raises(ContractError, match=r"Recipe\('llama'\)\.map_weights: must be callable as "
                                            r"map_weights\(config, checkpoint, dtype\)"):
        replace(LLAMA, map_weights=lambda config, checkpoint: iter(()))
    with pytest.raises(ContractError, match=r"\.build_model: must be callable as build_model\(config, dtype\)"):
        replace(LLAMA, build_model=lambda config: None)
    with pytest.raises(ContractError, match=r"\.check_config: must be callable as check_config\(config\)"):
        replace(LLAMA, check_config=lambda: None)
    with pytest.raises(ContractError, match=r"\.tokenizer_tensors: must be callable as "
                                            r"tokenizer_tensors\(config, tokenizer_json\)"):
        replace(LLAMA, tokenizer_tensors=lambda config: {})
    assert isinstance(replace(LLAMA, build_model=lambda *args, **kwargs: None), Recipe)

    class Reasoning:
        def __init__(self) -> None:  # takes no starts_in_reasoning
            pass

    with pytest.raises(ContractError, match=r"Parser\(think2\)\.factory: must be callable as "
                                            r"factory\(starts_in_reasoning=bool\)"):
        Parser("think2", "reasoning", Reasoning)
    assert Parser("tools2", "tool", Reasoning).factory is Reasoning
    with pytest.raises(ContractError, match=r"Parser\(tools3\)\.factory: must be callable as factory\(\)"):
        Parser("tools3", "tool", lambda required: None)


def test_committed_json_schema_is_current():
    assert DOCS_SCHEMA.read_text() == render(), \
        "docs/contract.schema.json is stale: python -m flare_core.contract.schema > docs/contract.schema.json"
    schema = json.loads(DOCS_SCHEMA.read_text())
    recipe = schema["$defs"]["Recipe"]
    assert {"name", "version", "architectures", "aliases", "sampling", "frontend", "cache_scheme",
            "capacities"} <= set(recipe["required"])
    assert recipe["properties"]["build_model"] == {"x-python-callable": True}


def test_parser_closing_and_call_format_are_checked():
    from flare_core.contract import Parser, ToolCallFormat
    from flare_core.frontend.parsers import HermesToolParser, ThinkParser

    hermes = ToolCallFormat(call_begin='<tool_call>\n{"name": "{name}", "arguments": ', call_end="}\n</tool_call>")
    assert hermes.around("f") == ('<tool_call>\n{"name": "f", "arguments": ', "}\n</tool_call>")
    with pytest.raises(ContractError, match=r"ToolCallFormat\.call_begin: call_begin or call_end must hold \{name\}"):
        ToolCallFormat(call_begin="<call>", call_end="</call>")
    with pytest.raises(ContractError, match=r"ToolCallFormat\.call_end: \{index\} .* belongs in call_begin only"):
        ToolCallFormat(call_begin="<call {name}>", call_end="</call {index}>")
    with pytest.raises(ContractError, match=r"ToolCallFormat\.section_begin: section_begin and section_end are both"):
        ToolCallFormat(call_begin="<call {name}>", call_end="</call>", section_begin="<calls>")
    with pytest.raises(ContractError, match=r"Parser\(think\)\.call_format: is a ToolCallFormat, for tool parsers"):
        Parser("think", "reasoning", ThinkParser, call_format=hermes)
    with pytest.raises(ContractError, match=r"Parser\(hermes\)\.closing: is for reasoning parsers only"):
        Parser("hermes", "tool", HermesToolParser, closing="</think>")
    with pytest.raises(ContractError, match=r"Parser\(think\)\.closing: must be None or a non-empty string"):
        Parser("think", "reasoning", ThinkParser, closing=" ")
