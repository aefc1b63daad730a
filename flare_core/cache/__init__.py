"""Prefix history hashing, the checkpoint tree, and page / state-row allocators."""

from flare_core.cache.pages import (
    AllocatorExhausted,
    PageAllocator,
    PagesExhausted,
    RowsExhausted,
    StateRowAllocator,
    pages_for_tokens,
    request_page_need,
)
from flare_core.cache.prefix import (
    BLOCK_HASH_BYTES,
    IDENTITY_BYTES,
    NO_HIT,
    ResumePoint,
    ResumeStorage,
    PrefixCache,
    PrefixCacheStats,
    PrefixHit,
    block_hash,
    extend_block_hashes,
)

__all__ = [
    "AllocatorExhausted", "PageAllocator", "PagesExhausted", "RowsExhausted", "StateRowAllocator",
    "pages_for_tokens", "request_page_need",
    "BLOCK_HASH_BYTES", "IDENTITY_BYTES", "NO_HIT", "ResumePoint", "ResumeStorage", "PrefixCache",
    "PrefixCacheStats", "PrefixHit", "block_hash", "extend_block_hashes",
]
