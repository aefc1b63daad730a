"""FP8 KV cache (`flare export --kv-dtype fp8_e4m3`): the paged stores hold float8_e4m3fn records
at scale 1, half the bytes of a bfloat16 page, so the same --kv-cache-limit holds twice the pages;
continuation state keeps the weights' dtype. The CPU path serves such a core (logits close to the
16-bit cache's, prefix reuse over FP8 pages, SmolLM2's real weights still answering right); the
CUDA path serves K/V pages (tests/gpu/test_engine_gpu.py, test_graph_executor.py) and refuses
latent (MLA) ones (recipes-deepseek/tests/test_deepseek_fp8.py)."""

from __future__ import annotations

import re

import openai
import pytest
import torch

from flare_core.core import open_core
from flare_core.plugins import load_registry
from flare_core.engine.load import load_core
from flare_testing.parity import serve_paged
from flare_testing.server import ServerProcess

EXPORT = ("--dtype", "bfloat16", "--max-concurrency", "4", "--context-length", "1024", "--prefill-chunk-size", "128")


@pytest.fixture(scope="module")
def cores(session_flare, qwen3_checkpoint):
    """(FP8-cache core, its export plan, the 16-bit-cache core) of the same checkpoint."""
    result = session_flare("export", qwen3_checkpoint, *EXPORT, "--kv-dtype", "fp8_e4m3", "--no-progress")
    return (open_core(result.output.strip().splitlines()[-1]), result.output,
            open_core(session_flare.export(qwen3_checkpoint, *EXPORT)))


def test_the_paged_stores_are_fp8_at_half_the_bytes(cores):
    fp8, plan, whole = cores
    assert "KV cache: paged records as float8_e4m3fn at scale 1" in plan
    assert {s["dtype"] for s in fp8.manifest["cache_scheme"]["paged"]} == {"float8_e4m3fn"}
    assert {s["dtype"] for s in whole.manifest["cache_scheme"]["paged"]} == {"bfloat16"}
    schemes = [load_core(core, load_registry(), torch.device("cpu")).cache_scheme for core in (fp8, whole)]
    assert 2 * schemes[0].page_bytes(64) == schemes[1].page_bytes(64)


def test_logits_stay_close_to_the_16_bit_cache(cores):
    fp8, _, whole = cores
    registry = load_registry()
    loaded = [load_core(core, registry, torch.device("cpu")) for core in (fp8, whole)]
    sequences = [torch.randint(0, 151936, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (12, 90)]
    rows = [list(serve_paged(m.model, m.cache_scheme, sequences, [8, 80], page_tokens=16)) for m in loaded]
    assert len(rows[0]) == len(rows[1]) > 0
    worst = 0.0
    for (_, _, ours), (_, _, reference) in zip(*rows):
        assert torch.isfinite(ours).all()
        worst = max(worst, float((ours - reference).abs().max() / reference.std()))
    print(f"FP8 KV cache logits vs bfloat16 cache: {worst:.4f} standard deviations at most")
    assert worst < 0.25, worst


def kv_pages(server: ServerProcess) -> int:
    match = re.search(r"kv_pages=(\d+)", server.log())
    assert match, server.log()
    return int(match.group(1))


def test_served_with_twice_the_pages_and_prefix_reuse(cores, session_flare, tmp_path):
    fp8, _, whole = cores
    servers = [ServerProcess(session_flare.config_path, core.path, tmp_path / f"{name}.log", "--served-name", "tiny",
                             "--kv-cache-limit", "4MiB") for name, core in (("fp8", fp8), ("whole", whole))]
    try:
        for server in servers:
            server.wait_ready()
        assert kv_pages(servers[0]) == 2 * kv_pages(servers[1])
        client = openai.OpenAI(base_url=servers[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": "You are a terse assistant who answers in one line."},
                    {"role": "user", "content": "Name a river in France."}]
        first, second = (client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                        temperature=0) for _ in range(2))
        assert first.usage.completion_tokens > 0
        assert second.usage.prompt_tokens_details.cached_tokens > 0  # restored from FP8 pages
        assert second.choices[0].message == first.choices[0].message
    finally:
        for server in servers:
            server.stop()


def test_real_weights_answer_over_an_fp8_cache(session_flare, smollm2_gguf, tmp_path):
    core = session_flare.export(smollm2_gguf, "--dtype", "float32", "--kv-dtype", "fp8_e4m3", "--max-concurrency",
                                "4", "--context-length", "2048", "--prefill-chunk-size", "256")
    server = ServerProcess(session_flare.config_path, core, tmp_path / "run.log", "--no-dashboard",
                           "--served-name", "smollm2-fp8-kv").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.chat.completions.create(model="smollm2-fp8-kv", temperature=0, max_tokens=40, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content, reply.choices[0].message.content
    finally:
        server.stop()


def test_an_mla_latent_cache_in_fp8(tmp_path):
    """DeepSeek-V3's latent and rope-key stores in FP8 (as export makes them) give logits close
    to the float32 cache's on most rows, an order of magnitude further than a bfloat16 cache."""
    import dataclasses

    from safetensors.torch import load_file
    from transformers import DeepseekV3Config

    from flare_core.ops.loading import load_prepared_weights
    from flare_recipe_deepseek.recipes import DEEPSEEK_V3
    from flare_testing.deepseek import random_model

    config = DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, max_position_embeddings=512)
    random_model(config).save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    model = load_prepared_weights(DEEPSEEK_V3.build_model(config, torch.float32),
                                  dict(DEEPSEEK_V3.map_weights(config, checkpoint, torch.float32)), "cpu")
    scheme = load_registry().cache_schemes[DEEPSEEK_V3.cache_scheme].build(config, "float32")
    fp8, bf16 = (dataclasses.replace(scheme, paged=tuple(dataclasses.replace(s, dtype=dtype) for s in scheme.paged))
                 for dtype in ("float8_e4m3fn", "bfloat16"))
    sequence = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, half, reference = ([logits for *_, logits in serve_paged(model, s, [sequence], [36], page_tokens=16)]
                             for s in (fp8, bf16, scheme))
    errors = [[float((row - expected).abs().max() / expected.std()) for row, expected in zip(rows, reference)]
              for rows in (ours, half)]
    print(f"MLA latent cache, logits vs float32 cache in standard deviations: FP8 {errors[0]}, bfloat16 {errors[1]}")
    # Measured: FP8 0.05-0.08 on most rows, one row 2.2 (this random model's attention is peaky:
    # e4m3's 3-bit mantissa moves its largest scores); bfloat16 0.003-0.005.
    assert len(errors[0]) == 5 and all(torch.isfinite(row).all() for row in ours)
    assert sorted(errors[0])[len(errors[0]) // 2] < 0.2 and max(errors[1]) < 0.02
