"""The paged-attention reference, batch layout, cache allocation and strict weight loading."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from flare_core.contract import CacheScheme, PagedStore, StateTensor
from flare_core.executor.storage import allocate_cache_storage
from flare_core.ops.attention import AttentionBatch, ForwardContext, PagedAttention, paged_attention_reference
from flare_core.ops.loading import load_prepared_weights

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8


@pytest.mark.parametrize("page_tokens", [16, 64])
def test_reference_equals_causal_sdpa_over_cached_and_new_tokens(page_tokens):
    """Each request has `cached` tokens written by an earlier step and `new` ones in this step;
    its new queries must see exactly what causal SDPA over the whole sequence gives them."""
    requests = [(0, 7), (40, 1), (100, 37), (3, 64)]  # (cached, new)
    generator = torch.Generator().manual_seed(0)
    full = [tuple(torch.randn(c + n, h, HEAD_DIM, generator=generator) for h in (HEADS, KV_HEADS, KV_HEADS))
            for c, n in requests]
    pages_needed = [-(-(c + n) // page_tokens) for c, n in requests]
    order = torch.randperm(sum(pages_needed) + 2, generator=generator).tolist()  # non-contiguous pages
    pages = [order[sum(pages_needed[:r]):sum(pages_needed[:r + 1])] for r in range(len(requests))]
    scheme = CacheScheme("kv", (PagedStore("k", (KV_HEADS, HEAD_DIM), "float32", 1),
                                PagedStore("v", (KV_HEADS, HEAD_DIM), "float32", 1)))
    cache = allocate_cache_storage(scheme, len(order), page_tokens, "cpu")
    attention = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, layer_idx=0)

    earlier = [r for r, (c, _) in enumerate(requests) if c > 0]
    first = AttentionBatch.build([(requests[r][0], 0, pages[r]) for r in earlier], page_tokens, "cpu")
    attention(*(torch.cat([full[r][i][:requests[r][0]] for r in earlier]) for i in range(3)),
              ForwardContext(first, cache))

    batch = AttentionBatch.build([(n, c, pages[r]) for r, (c, n) in enumerate(requests)], page_tokens, "cpu")
    out = attention(*(torch.cat([full[r][i][c:] for r, (c, _) in enumerate(requests)]) for i in range(3)),
                    ForwardContext(batch, cache))

    for r, (c, n) in enumerate(requests):
        q, k, v = (t.transpose(0, 1)[None] for t in full[r])
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        start = batch.query_start_host[r]
        torch.testing.assert_close(out[start:start + n], expected[c:], atol=1e-5, rtol=1e-5)


def test_reference_keeps_query_dtype():
    batch = AttentionBatch.build([(3, 0, [0])], 16, "cpu")
    k_layer = torch.randn(1, 16, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    out = paged_attention_reference(torch.randn(3, HEADS, HEAD_DIM, dtype=torch.bfloat16), k_layer, k_layer,
                                    batch, 1.0)
    assert out.dtype == torch.bfloat16 and out.shape == (3, HEADS, HEAD_DIM)


def test_batch_layout():
    batch = AttentionBatch.build([(3, 14, [5, 2]), (1, 0, [7])], 16, "cpu")
    assert batch.query_start.tolist() == [0, 3, 4] and batch.kv_lens.tolist() == [17, 1]
    assert batch.slot_mapping.tolist() == [5 * 16 + 14, 5 * 16 + 15, 2 * 16 + 0, 7 * 16 + 0]
    assert batch.logits_indices.tolist() == [2, 3]
    assert batch.page_table.tolist() == [[5, 2], [7, 0]]
    assert batch.positions().tolist() == [14, 15, 16, 0]
    assert batch.query_start.dtype == torch.int32 and batch.slot_mapping.dtype == torch.int64


def test_batch_of_state_rows_indexes_each_requests_linear_attention_chunks():
    """(request, chunk) per 64-token chunk, what flash-linear-attention's chunked kernels take
    (its prepare_chunk_indices of the same lengths); none where no request brings several tokens
    or the scheme has no state."""
    pages = [[0], [1, 2, 3], [4]]
    batch = AttentionBatch.build([(1, 5, pages[0]), (130, 0, pages[1]), (64, 0, pages[2])], 64, "cpu",
                                 state_rows=[4, 0, 2])
    assert batch.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0]]
    assert batch.chunk_indices.dtype == torch.int64
    assert AttentionBatch.build([(1, 5, [0]), (1, 0, [1])], 64, "cpu", state_rows=[0, 1]).chunk_indices is None
    assert AttentionBatch.build([(100, 0, [1, 2])], 64, "cpu").chunk_indices is None


def test_batch_rejects_too_few_pages():
    with pytest.raises(ValueError, match="request 1 holds 17 tokens, which needs 2 pages"):
        AttentionBatch.build([(1, 0, [0]), (2, 15, [3])], 16, "cpu")


def test_cache_storage_shapes():
    scheme = CacheScheme("mixed", (PagedStore("latent", (12,), "bfloat16", 3, tokens_per_record=4),),
                         (StateTensor("ring", (5, 2), "float32", 2),))
    storage = allocate_cache_storage(scheme, num_pages=7, page_tokens=16, device="cpu", num_rows=4)
    assert [t.shape for t in storage["latent"]] == [(7, 4, 12)] * 3
    assert storage["latent"][0].dtype == torch.bfloat16
    assert [t.shape for t in storage["ring"]] == [(4, 5, 2)] * 2
    with pytest.raises(ValueError, match="num_rows must be positive"):
        allocate_cache_storage(scheme, 7, 16, "cpu")
    with pytest.raises(ValueError, match="not a multiple of paged store 'latent' tokens_per_record 4"):
        allocate_cache_storage(scheme, 7, 18, "cpu", num_rows=1)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        with torch.device("meta"):
            self.proj = nn.Linear(4, 3)
        self.register_buffer("table", torch.arange(3.0), persistent=False)


def _tiny_weights() -> dict[str, torch.Tensor]:
    return {"proj.weight": torch.ones(3, 4), "proj.bias": torch.zeros(3)}


def test_loading_fills_meta_parameters_and_moves_buffers():
    model = load_prepared_weights(_Tiny(), _tiny_weights(), "cpu")
    assert torch.equal(model.proj(torch.ones(1, 4)), torch.full((1, 3), 4.0))
    assert not model.training and not model.proj.weight.requires_grad
    assert torch.equal(model.table, torch.arange(3.0))


@pytest.mark.parametrize("change, message", [
    (lambda w: w.pop("proj.bias"), "lack 1 tensor.*'proj.bias'"),
    (lambda w: w.update(extra=torch.zeros(1)), "does not have.*'extra'"),
    (lambda w: w.update({"proj.weight": torch.ones(4, 3)}), r"'proj.weight' has shape \(4, 3\).*\(3, 4\)"),
    (lambda w: w.update({"proj.bias": torch.zeros(3, dtype=torch.bfloat16)}), "'proj.bias' has dtype torch.bfloat16"),
])
def test_loading_is_strict(change, message):
    weights = _tiny_weights()
    change(weights)
    with pytest.raises(ValueError, match=message):
        load_prepared_weights(_Tiny(), weights, "cpu")


def test_loading_rejects_meta_buffers_and_shared_parameters():
    model = _Tiny()
    model.table = torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="non-persistent buffer 'table' is on the meta device"):
        load_prepared_weights(model, _tiny_weights(), "cpu")
    tied = _Tiny()
    tied.head = nn.Linear(4, 3, device="meta")
    tied.head.weight = tied.proj.weight
    with pytest.raises(ValueError, match="'proj.weight' and 'head.weight' are one shared tensor"):
        load_prepared_weights(tied, _tiny_weights(), "cpu")
