"""The forward context that attention custom ops read inside compiled code.

torch.compile keeps a whole decoder layer in one graph only if attention is a single node it
does not look into: Dynamo cannot trace a call into a kernel backend object (a Python wrapper
around FlashInfer launches) and would break the graph there, ending one compiled graph before
attention and starting another after it, with the cache writes left uncompiled in between. So
each attention module calls a custom op (`flare::paged_attention`, `flare::latent_attention`)
while compiling, and keeps its cache writes in traced code, where Inductor stores each new
record from the kernel that computes it (norms, rotary).

An op's arguments can only be tensors and plain values, not the step's planned backend, so the
op reads the step's `ForwardContext` that the model call binds for its duration (`bound(context)`,
in DecoderForServing.run). The binding is a context variable: it belongs to the call that made it
(another thread, another model's call, sees its own or none), not to a shared module-level stack.
Like a CUDA graph replaying plans made on the host before it, the compiled code never sees the
plan itself.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from flare_core.ops.attention import ForwardContext

_context: ContextVar[ForwardContext | None] = ContextVar("flare_forward_context", default=None)


@contextmanager
def bound(context: ForwardContext) -> Iterator[None]:
    """Make `context` the one the attention ops of compiled code read, for the block's duration."""
    token = _context.set(context)
    try:
        yield
    finally:
        _context.reset(token)


def bound_context(op: str) -> ForwardContext:
    context = _context.get()
    if context is None:
        raise RuntimeError(f"flare::{op} ran outside flare_core.ops.opaque.bound(context); compiled models must be "
                           "called inside it (the CUDA executor does)")
    return context
