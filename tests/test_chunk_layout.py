"""The request layout a prefill graph hands its recurrent layers (flare_core.executor.graphs
._ChunkLayout): built on the host, uploaded into buffers of the captured size. Its tensors are
plain tensors, so the CPU checks what the CUDA graphs read."""

from __future__ import annotations

import torch

from flare_core.executor.graphs import _ChunkLayout
from flare_core.ops.attention import LINEAR_CHUNK_TOKENS, linear_chunks


def test_chunks_then_padding_then_empty_requests_with_the_index_padded_by_the_last_one():
    capacity, requests = 256, 6
    layout = _ChunkLayout(capacity, requests, torch.device("cpu"), scratch_row=9)
    rows = capacity // LINEAR_CHUNK_TOKENS + requests  # every chunk the graph's tokens can make
    assert layout.chunk_indices.shape == (rows, 2)

    # Two chunks of 130 and 5 tokens (state rows 3 and 0), then the padding request with the remaining 121.
    layout.upload([130, 5, 121], [3, 0])
    assert layout.query_start.tolist() == [0, 130, 135, 256, 256, 256, 256]
    assert layout.state_rows.tolist() == [3, 0, 9, 9, 9, 9]  # padding and empty requests: the scratch row
    index = [tuple(r) for r in layout.chunk_indices.tolist()]
    real = linear_chunks([130, 5, 121])
    assert index[:len(real)] == real == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (2, 1)]
    # The rest names chunk 0 of the last request, which holds no tokens.
    assert set(index[len(real):]) == {(requests - 1, 0)}
    assert layout.query_start[-1] == layout.query_start[-2]


def test_the_captured_layout_puts_every_token_in_the_first_request():
    layout = _ChunkLayout(128, 4, torch.device("cpu"), scratch_row=2)
    assert layout.query_start.tolist() == [0, 128, 128, 128, 128]
    assert layout.state_rows.tolist() == [2, 2, 2, 2]
    assert [tuple(r) for r in layout.chunk_indices.tolist()] == [(0, 0), (0, 1)] + [(3, 0)] * 4


def test_a_decode_graphs_page_table_input_holds_each_rows_pages_and_padding_the_scratch_page():
    """The decode "backend" of BatchAttention models (flare_core.executor.backends.PageTableInput)
    fills the page table the graph's batch reads, from the step's decode layout (graphs.
    decode_step_inputs): live rows their pages so far, padding rows the scratch page, the rest 0;
    a later, smaller step leaves nothing of the earlier one behind."""
    from flare_core.executor.backends import PageTableInput
    from flare_core.executor.graphs import decode_step_inputs
    from flare_core.scheduler import DecodeEntry, RequestHandle

    def entry(row: int, position: int, pages: list[int]) -> DecodeEntry:
        return DecodeEntry(RequestHandle(f"r{row}", row, 0), position, 7, tuple(pages))

    capacity, pages_per_context, scratch_page, page_tokens = 4, 3, 99, 16
    table = PageTableInput(capacity, capacity * (pages_per_context + 1), torch.device("cpu"))
    assert table.page_table.shape == (capacity, pages_per_context + 1)
    _, layout = decode_step_inputs([entry(0, 40, [5, 2, 8]), entry(1, 3, [4, 6])], capacity, page_tokens,
                                   scratch_page, scratch_row=9)
    table.plan(layout, 1.0)
    assert table.page_table.tolist() == [[5, 2, 8, 0], [4, 0, 0, 0], [99, 0, 0, 0], [99, 0, 0, 0]]
    _, layout = decode_step_inputs([entry(2, 0, [1])], capacity, page_tokens, scratch_page, scratch_row=9)
    table.plan(layout, 1.0)
    assert table.page_table.tolist() == [[1, 0, 0, 0], [99, 0, 0, 0], [99, 0, 0, 0], [99, 0, 0, 0]]


def test_page_table_models_decode_at_widths_by_fours_up_to_the_whole_context():
    """The page-table widths a BatchAttention model's decode graphs are captured at
    (flare_core.executor.graphs.decode_widths): from the narrowest, four times wider while at most
    half the whole context's, then the whole context's; a context within twice the narrowest has
    one width."""
    from flare_core.executor.graphs import decode_widths

    assert decode_widths(8193, 32) == (32, 128, 512, 2048, 8193)  # 1M tokens in pages of 128, from 4,096 tokens
    assert decode_widths(1025, 32) == (32, 128, 512, 1025)
    assert decode_widths(33, 1) == (1, 4, 16, 33)
    assert decode_widths(63, 32) == (63,)
