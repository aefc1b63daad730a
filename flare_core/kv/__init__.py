"""The KV cache's bookkeeping: the manager the scheduler goes through, prefix history hashing,
the resume-point tree, and the page / state-row allocators."""

from flare_core.kv.pages import (
    AllocatorExhausted,
    PageAllocator,
    PagesExhausted,
    RowsExhausted,
    StateRowAllocator,
    pages_for_tokens,
    request_page_need,
)
from flare_core.kv.manager import Admission, KnownTokens, KvCacheManager, KvRecord
from flare_core.kv.prefix import (
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
    "Admission", "KnownTokens", "KvCacheManager", "KvRecord",
    "AllocatorExhausted", "PageAllocator", "PagesExhausted", "RowsExhausted", "StateRowAllocator",
    "pages_for_tokens", "request_page_need",
    "BLOCK_HASH_BYTES", "IDENTITY_BYTES", "NO_HIT", "ResumePoint", "ResumeStorage", "PrefixCache",
    "PrefixCacheStats", "PrefixHit", "block_hash", "extend_block_hashes",
]
