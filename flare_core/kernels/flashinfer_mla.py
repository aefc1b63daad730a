"""Absorbed multi-head latent attention (flare_core.ops.mla) on the GPU through FlashInfer's
`flashinfer.mla.BatchMLAPagedAttentionWrapper`, reading the "ckv" and "kpe" paged stores in
place: each layer's `[num_pages, page_tokens, dim]` tensors are FlashInfer's split paged MLA
layout, so nothing is copied or packed.

Why it is set up this way (FlashInfer 0.7.2.post1, flashinfer/mla/_batch_mla/):

* The backend is named, not "auto": FlashInfer's generated FA kernels ("fa3" on Hopper, "fa2"
  on other SM80+ devices). Only those may be planned again once a CUDA graph was captured over
  them (`supports_cuda_graph_replan`); the others refuse a second plan of a graph wrapper, and
  "auto" picks one of them on Blackwell.
* A graph captured over `run_mla` stays valid after any later plan of the same batch capacity:
  one cooperative kernel does the split-KV attention and its merge, its launch shape depends
  only on the head count for one-token decode rows, and a plan rewrites buffer contents only
  (the metadata buffers handed to the wrapper here, and the wrapper's integer workspace).
  FlashInfer requires qo_indptr / kv_indptr / kv_len_arr of exactly the planned batch's shape,
  so a graph wrapper is planned with exactly `capacity` rows (the executor pads).
* The softmax scale is the model's (DeepSeek: 1/sqrt(qk_nope + qk_rope) times YaRN mscale^2),
  not one derived from the latent width; FlashInfer keeps the plan's scale for every run.
* Shapes are checked when the backend is built, because FlashInfer checks some of them per plan,
  depending on the batch: a head count that does not divide the kernel's 64/128-row
  (token x head) query tile makes some causal prompt chunks unplannable.
* A plan holds at most 16384 work items: about one per new token at 128 heads (plus one per
  KV split), so a step's prompt chunks must stay well below 16k tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flare_core.kernels.flashinfer_attention import PagedLayout

# Powers of two up to 128 divide the kernel's query tile or, at 128, always get the 128-row tile
# (flashinfer/mla/_batch_mla/_backends/_fa_common.py, _validate_fa_causal_tile_bound).
SUPPORTED_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def check_mla_shape(*, num_heads: int, kv_lora_rank: int, rope_dim: int, page_tokens: int,
                    dtype: torch.dtype) -> None:
    """Raise ValueError naming the limit when FlashInfer's MLA kernels cannot serve this shape."""
    if num_heads not in SUPPORTED_HEADS:
        raise ValueError(f"FlashInfer MLA: {num_heads} attention heads (per GPU) are not supported; the kernels "
                         f"need a power of two up to 128 ({', '.join(map(str, SUPPORTED_HEADS))}), otherwise "
                         "causal prompt chunks can split one token's heads across query tiles")
    if kv_lora_rank <= 0 or kv_lora_rank % 128:
        raise ValueError(f"FlashInfer MLA: kv_lora_rank {kv_lora_rank} is not supported; it must be a positive "
                         "multiple of 128 (512 on DeepSeek-V2/V3 and Kimi K2)")
    if rope_dim <= 0 or rope_dim % 64:
        raise ValueError(f"FlashInfer MLA: rope dim {rope_dim} is not supported; it must be a positive multiple "
                         "of 64 (qk_rope_head_dim 64 on DeepSeek-V2/V3)")
    if page_tokens <= 0:
        raise ValueError(f"FlashInfer MLA: page_tokens must be positive, got {page_tokens}")
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"FlashInfer MLA: cache and query dtype {dtype} is not supported; use bfloat16 or "
                         "float16 (the same for the model and its cache)")


class FlashInferMLA:
    """One planned MLA kernel: causal attention of each request's new tokens over its cached
    latent records. With `use_cuda_graph`, a fixed batch of `capacity` one-token decode rows over
    at most `max_pages` pages, whose buffers stay put so a captured graph replays after each plan;
    without, ragged batches of prompt chunks and decode rows (`capacity` and `max_pages` None)."""

    def __init__(self, workspace: Tensor, capacity: int | None, max_pages: int | None, *, num_heads: int,
                 kv_lora_rank: int, rope_dim: int, page_tokens: int, dtype: torch.dtype, use_cuda_graph: bool):
        check_mla_shape(num_heads=num_heads, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim,
                        page_tokens=page_tokens, dtype=dtype)
        if use_cuda_graph and not (capacity and capacity > 0 and max_pages and max_pages > 0):
            raise ValueError(f"FlashInferMLA with use_cuda_graph needs a positive capacity and max_pages, got "
                             f"{capacity} and {max_pages}")
        import flashinfer
        from flashinfer.utils import is_sm90a_supported

        device = workspace.device
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:
            raise ValueError(f"FlashInfer MLA needs an SM80 or newer GPU, this one is SM{major}{minor}")
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.page_tokens, self.dtype = page_tokens, dtype
        self.capacity = capacity if use_cuda_graph else None
        self.max_pages = max_pages if use_cuda_graph else None
        self.backend = "fa3" if is_sm90a_supported(device) and kv_lora_rank in (128, 256, 512) else "fa2"
        buffers = {}
        if use_cuda_graph:
            def zeros(n: int) -> Tensor:
                return torch.zeros(n, dtype=torch.int32, device=device)

            buffers = dict(qo_indptr=zeros(capacity + 1), kv_indptr=zeros(capacity + 1),
                           kv_indices=zeros(max_pages), kv_len_arr=zeros(capacity))
        self._metadata = flashinfer.mla.MLAPlanMetadata
        self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            workspace, use_cuda_graph=use_cuda_graph, backend=self.backend, **buffers)
        self._scale: float | None = None

    def plan(self, layout: PagedLayout, scale: float) -> None:
        """Plan the next step on the host (the layout's int32 CPU tensors); FlashInfer copies the
        metadata to the device in stream order, into the graph buffers when there are any."""
        if self.capacity is not None:
            rows, pages = layout.kv_lens.numel(), layout.indices.numel()
            if rows != self.capacity or int(layout.qo_indptr[-1]) != rows:
                raise ValueError(f"FlashInferMLA graph backend of capacity {self.capacity}: the layout has {rows} "
                                 f"requests and {int(layout.qo_indptr[-1])} tokens; it needs exactly "
                                 f"{self.capacity} one-token rows (pad the batch)")
            if pages > self.max_pages:
                raise ValueError(f"FlashInferMLA graph backend: the layout uses {pages} pages, more than the "
                                 f"{self.max_pages} its buffers hold")
        self.wrapper.plan(
            metadata=self._metadata.csr(layout.qo_indptr, layout.indptr, layout.indices, layout.kv_lens),
            num_heads=self.num_heads, head_dim_ckv=self.kv_lora_rank, head_dim_kpe=self.rope_dim,
            page_size=self.page_tokens, causal=True, sm_scale=scale, q_data_type=self.dtype,
            kv_data_type=self.dtype, query_layout="split", kv_cache_layout="split")
        self._scale = scale

    def run_mla(self, q_latent: Tensor, q_rope: Tensor, ckv_layer: Tensor, kpe_layer: Tensor,
                scale: float) -> Tensor:
        """q_latent [T, num_heads, kv_lora_rank], q_rope [T, num_heads, rope_dim] (last dims
        contiguous, other strides free); ckv_layer / kpe_layer [num_pages, page_tokens, dim].
        Returns the latent output [T, num_heads, kv_lora_rank] in the query dtype."""
        if scale != self._scale:
            raise ValueError(f"FlashInferMLA: run with softmax scale {scale}, but the plan has {self._scale}")
        return self.wrapper.run(query=(q_latent, q_rope), kv_cache=(ckv_layer, kpe_layer))
