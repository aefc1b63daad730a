"""The absorbed multi-head latent attention op over the paged latent cache (flare_core.ops.mla)
and the "mla-latent" cache scheme.

The reference is checked against the plain definition: every cached latent expanded into
per-head keys [W_UK_h c ; k_pe] and values W_UV_h c, then ordinary causal softmax attention.
Three requests of different lengths are prefilled in chunks that share steps, then decoded
together, on shuffled (non-contiguous) pages.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import DeepseekV3Config

from flare_core.executor.storage import allocate_cache_storage
from flare_core.ops.attention import AttentionBatch, ForwardContext
from flare_core.ops.mla import MLAPagedAttention, mla_attention_reference
from flare_core.plugins import load_registry

HEADS, RANK, ROPE, NOPE, V = 4, 32, 8, 16, 16
SCALE = (NOPE + ROPE) ** -0.5
PAGE_TOKENS = 16
LENGTHS = (5, 37, 72)
# Per step, (request, new tokens): chunked prefill sharing steps, then two batched decode steps.
STEPS = [[(0, 3), (1, 20), (2, 30)], [(0, 2), (1, 15), (2, 40)], [(1, 1), (2, 1)], [(1, 1), (2, 1)]]


def scheme(dtype: str = "float32"):
    config = DeepseekV3Config(num_hidden_layers=2, kv_lora_rank=RANK, qk_rope_head_dim=ROPE)
    return load_registry().cache_schemes["mla-latent"].build(config, dtype)


def request_data(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    return [{"q_nope": draw(n, HEADS, NOPE), "q_rope": draw(n, HEADS, ROPE), "latent": draw(n, RANK),
             "k_rope": draw(n, ROPE)} for n in LENGTHS]


def expanded_attention(data: dict[str, torch.Tensor], w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """Causal attention with per-head keys and values expanded from the latents: [L, HEADS, V]."""
    length = data["latent"].shape[0]
    keys = torch.cat([torch.einsum("hnr,kr->khn", w_uk, data["latent"]),
                      data["k_rope"][:, None, :].expand(length, HEADS, ROPE)], dim=-1)
    values = torch.einsum("hrv,kr->khv", w_uv, data["latent"])
    queries = torch.cat([data["q_nope"], data["q_rope"]], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", queries, keys) * SCALE
    causal = torch.ones(length, length, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khv->qhv", probs, values)


def run_steps(attention: MLAPagedAttention, data, w_uk, storage, pages, backend=None):
    """Feed STEPS through `attention`; return each request's outputs [L, HEADS, V] in token order."""
    consumed = [0] * len(LENGTHS)
    outputs = [[] for _ in LENGTHS]
    for step in STEPS:
        batch = AttentionBatch.build([(n, consumed[r], pages[r]) for r, n in step], PAGE_TOKENS, "cpu")
        pick = lambda key: torch.cat([data[r][key][consumed[r]:consumed[r] + n] for r, n in step])  # noqa: E731
        q_latent = torch.einsum("thn,hnr->thr", pick("q_nope"), w_uk)
        context = ForwardContext(batch, storage, backend(batch) if backend else None)
        out_latent = attention(q_latent, pick("q_rope"), pick("latent"), pick("k_rope"), context)
        assert out_latent.shape == (batch.num_tokens, HEADS, RANK)
        for (r, n), start in zip(step, batch.query_start_host):
            outputs[r].append(out_latent[start:start + n])
            consumed[r] += n
    assert consumed == list(LENGTHS)
    return [torch.cat(o) for o in outputs]


def shuffled_pages() -> tuple[int, list[list[int]]]:
    needed = [-(-n // PAGE_TOKENS) for n in LENGTHS]
    ids = list(range(sum(needed) + 2))
    random.Random(3).shuffle(ids)
    pages, start = [], 0
    for n in needed:
        pages.append(ids[start:start + n])
        start += n
    return len(ids), pages


@pytest.fixture
def setup():
    generator = torch.Generator().manual_seed(7)
    w_uk = torch.randn(HEADS, NOPE, RANK, generator=generator) / RANK ** 0.5
    w_uv = torch.randn(HEADS, RANK, V, generator=generator) / RANK ** 0.5
    num_pages, pages = shuffled_pages()
    storage = allocate_cache_storage(scheme(), num_pages, PAGE_TOKENS, "cpu")
    return request_data(), w_uk, w_uv, storage, pages


def test_absorbed_reference_matches_expanded_per_head_attention(setup):
    data, w_uk, w_uv, storage, pages = setup
    attention = MLAPagedAttention(HEADS, RANK, ROPE, SCALE, layer_idx=1)
    outputs = run_steps(attention, data, w_uk, storage, pages)
    for r, out_latent in enumerate(outputs):
        out = torch.einsum("thr,hrv->thv", out_latent, w_uv)
        torch.testing.assert_close(out, expanded_attention(data[r], w_uk, w_uv), atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"request {r}: {m}")


def test_latent_records_land_in_the_request_pages(setup):
    data, w_uk, _, storage, pages = setup
    run_steps(MLAPagedAttention(HEADS, RANK, ROPE, SCALE, layer_idx=1), data, w_uk, storage, pages)
    for r, n in enumerate(LENGTHS):
        table = torch.tensor(pages[r])
        ckv = storage["ckv"][1][table].reshape(-1, RANK)[:n]
        kpe = storage["kpe"][1][table].reshape(-1, ROPE)[:n]
        assert torch.equal(ckv, data[r]["latent"]) and torch.equal(kpe, data[r]["k_rope"])
    assert not storage["ckv"][0].any()  # layer 0 was never written


class ReferenceBackend:
    """A planned backend as the GPU path provides one per step: here the plain-torch reference,
    recording what each layer call sees."""

    def __init__(self, batch: AttentionBatch):
        self.batch, self.calls = batch, []

    def run_mla(self, q_latent, q_rope, ckv_layer, kpe_layer, scale):
        self.calls.append(ckv_layer[self.batch.slot_mapping // PAGE_TOKENS, self.batch.slot_mapping % PAGE_TOKENS])
        return mla_attention_reference(q_latent, q_rope, ckv_layer, kpe_layer, self.batch, scale)


def test_a_planned_backend_runs_after_the_records_are_written(setup):
    data, w_uk, w_uv, storage, pages = setup
    backends = []

    def plan(batch):
        backends.append(ReferenceBackend(batch))
        return backends[-1]

    outputs = run_steps(MLAPagedAttention(HEADS, RANK, ROPE, SCALE, layer_idx=0), data, w_uk, storage, pages, plan)
    assert [len(b.calls) for b in backends] == [1] * len(STEPS)
    first_step_latents = torch.cat([data[r]["latent"][:n] for r, n in STEPS[0]])
    assert torch.equal(backends[0].calls[0], first_step_latents)
    out = torch.einsum("thr,hrv->thv", outputs[2], w_uv)
    torch.testing.assert_close(out, expanded_attention(data[2], w_uk, w_uv), atol=1e-5, rtol=1e-5)


def test_cache_scheme_is_latent_records_per_token():
    bf16 = scheme("bfloat16")
    assert bf16.name == "mla-latent"
    assert [(s.name, s.record_shape, s.dtype, s.layers) for s in bf16.paged] == [
        ("ckv", (RANK,), "bfloat16", 2), ("kpe", (ROPE,), "bfloat16", 2)]
    assert bf16.state == ()
    # One page holds page_tokens latent records per layer, not per-head keys and values.
    assert bf16.page_bytes(64) == 64 * (RANK + ROPE) * 2 * 2
    storage = allocate_cache_storage(bf16, 3, 64, "cpu")
    assert storage["ckv"][1].shape == (3, 64, RANK) and storage["kpe"][0].shape == (3, 64, ROPE)


def test_cache_narrower_than_the_model_is_an_error(setup):
    data, w_uk, _, storage, pages = setup
    attention = MLAPagedAttention(HEADS, RANK * 2, ROPE, SCALE, layer_idx=0)
    batch = AttentionBatch.build([(2, 0, pages[0])], PAGE_TOKENS, "cpu")
    with pytest.raises(ValueError, match=r"kv_lora_rank 64 \+ rope dim 8"):
        attention(torch.zeros(2, HEADS, RANK * 2), torch.zeros(2, HEADS, ROPE), torch.zeros(2, RANK * 2),
                  torch.zeros(2, ROPE), ForwardContext(batch, storage))


@pytest.mark.parametrize("shape, limit", [
    ({"num_heads": 96}, "96 attention heads.*power of two up to 128"),
    ({"num_heads": 256}, "256 attention heads"),
    ({"kv_lora_rank": RANK}, f"kv_lora_rank {RANK} .*multiple of 128"),
    ({"rope_dim": ROPE}, f"rope dim {ROPE} .*multiple of 64"),
    ({"dtype": torch.float32}, "float32 .*bfloat16 or float16"),
])
def test_flashinfer_mla_names_the_shape_limit_before_touching_the_gpu(shape, limit):
    # Checked before FlashInfer is imported: the tiny test geometry here is one the kernels refuse.
    from flare_core.kernels.flashinfer_mla import FlashInferMLA

    real = {"num_heads": 128, "kv_lora_rank": 512, "rope_dim": 64, "page_tokens": 64, "dtype": torch.bfloat16}
    with pytest.raises(ValueError, match=limit):
        FlashInferMLA(torch.zeros(8, dtype=torch.uint8), None, None, use_cuda_graph=False, **{**real, **shape})
    with pytest.raises(ValueError, match="positive capacity and max_pages"):
        FlashInferMLA(torch.zeros(8, dtype=torch.uint8), None, None, use_cuda_graph=True, **real)
