"""Helpers for recipe authors' parity tests: drive a serving model over a paged cache the way
the runtime does, without a scheduler or a server."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import torch

from flare_core.contract import CacheScheme
from flare_core.executor.storage import allocate_cache_storage
from flare_core.ops.attention import AttentionBatch, ForwardContext


def serve_paged(model: torch.nn.Module, scheme: CacheScheme, sequences: Sequence[Sequence[int]],
                prompt_lens: Sequence[int], page_tokens: int, step_tokens: int = 64,
                device: torch.device | str = "cpu", seed: int = 1) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Feed each request's tokens through `model`: prompts in chunks that share flattened steps of
    at most `step_tokens` tokens, then one token per step with all requests batched. Pages are
    shuffled (non-contiguous page tables). Yields (request index, tokens consumed so far, logits
    of the last consumed token) for every logits row the model produces."""
    lengths = [len(s) for s in sequences]
    pages_needed = [-(-n // page_tokens) for n in lengths]
    page_ids = list(range(sum(pages_needed) + 3))
    random.Random(seed).shuffle(page_ids)
    pages, start = [], 0
    for n in pages_needed:
        pages.append(page_ids[start:start + n])
        start += n
    # Request r keeps its continuation state (schemes with state tensors) in row r.
    storage = allocate_cache_storage(scheme, len(page_ids), page_tokens, device,
                                     num_rows=len(sequences) if scheme.state else 0)
    layer_map = scheme.layer_map()
    consumed = [0] * len(sequences)
    while any(c < n for c, n in zip(consumed, lengths)):
        budget, step = step_tokens, []
        for r, n in enumerate(lengths):
            if consumed[r] == n or budget == 0:
                continue
            take = min(prompt_lens[r] - consumed[r], budget) if consumed[r] < prompt_lens[r] else 1
            step.append((r, take))
            budget -= take
        batch = AttentionBatch.build([(take, consumed[r], pages[r]) for r, take in step], page_tokens, device,
                                     state_rows=[r for r, _ in step] if scheme.state else ())
        input_ids = torch.tensor([t for r, take in step for t in sequences[r][consumed[r]:consumed[r] + take]],
                                 device=device)
        with torch.no_grad():
            logits = model(input_ids, batch.positions(), ForwardContext(batch, storage, layer_map=layer_map))
        if logits.shape[0] != len(step) or logits.dtype != torch.float32:
            raise AssertionError(f"the model returned {tuple(logits.shape)} {logits.dtype} logits for a step of "
                                 f"{len(step)} requests; the protocol wants float32 [{len(step)}, vocab]")
        for row, (r, take) in enumerate(step):
            consumed[r] += take
            yield r, consumed[r], logits[row]


def assert_logits_parity(recipe, reference: torch.nn.Module, checkpoint, config, *, page_tokens: int,
                         prompt_lens: Sequence[int] = (5, 70, 131), decode_steps: int = 4, seed: int = 2,
                         step_tokens: int = 64, atol: float = 1e-4, ranks=None) -> None:
    """Build `recipe`'s model from `checkpoint` (on-disk tensors) in float32, serve random
    requests of `prompt_lens` tokens plus `decode_steps` decode tokens through `serve_paged`,
    and require every logits row to match the Transformers `reference` forward on the full
    sequence. With `ranks` (flare_core.parallel.Ranks, in a process of an initialised
    torch.distributed group), this process's tensor-parallel share of the model, its cache and
    its all-reduces; every rank must produce the full model's logits."""
    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_core.plugins import load_registry

    if recipe.check_config is not None:
        recipe.check_config(config)
    model = serving_model(recipe, config, torch.float32, ServingOptions(ranks=ranks))
    if ranks is not None:
        from flare_core.parallel import rank_checkpoint, rank_config, spec_of

        checkpoint = rank_checkpoint(recipe, config, checkpoint, ranks)
        config = rank_config(config, spec_of(recipe), ranks.size)
    model = load_prepared_weights(model, dict(recipe.map_weights(config, checkpoint, torch.float32)), "cpu")
    scheme = load_registry().cache_schemes[recipe.cache_scheme].build(config, "float32")
    generator = torch.Generator().manual_seed(seed)
    sequences = [torch.randint(0, config.vocab_size, (n + decode_steps,), generator=generator).tolist()
                 for n in prompt_lens]
    with torch.no_grad():
        expected = [reference(torch.tensor([s])).logits[0] for s in sequences]
    rows = 0
    for r, consumed, logits in serve_paged(model, scheme, sequences, prompt_lens, page_tokens, step_tokens):
        torch.testing.assert_close(logits, expected[r][consumed - 1], atol=atol, rtol=atol,
                                   msg=lambda m: f"request {r} after {consumed} tokens: {m}")
        rows += 1
    if rows < len(prompt_lens) * (decode_steps + 1):
        raise AssertionError(f"only {rows} logits rows were produced for {len(prompt_lens)} requests")


def drive_greedy(scheduler, executor, max_tokens: int) -> tuple[dict[str, list[torch.Tensor]], int]:
    """Run a scheduler's requests on `executor` greedily to `max_tokens` each, one step at a time
    with the step's logits read back (what the parity tests compare): per request, the logits
    rows it sampled from, and how many restores the steps made."""
    from flare_core.scheduler import StepResult

    rows: dict[str, list[torch.Tensor]] = {}
    restores = 0
    while not scheduler.is_idle():
        plan = scheduler.schedule()
        if plan is None:
            break
        restores += len(plan.restores)
        logits = executor.run(plan)
        tokens = logits.argmax(-1)
        executor.record_sampled([h.state_row for h in plan.samples], tokens)
        for handle, row in zip(plan.samples, logits):
            rows.setdefault(handle.request_id, []).append(row)
        for sampled in scheduler.complete(plan, StepResult(tokens.tolist(), plan.estimated_s)):
            if len(rows[sampled.handle.request_id]) == max_tokens:
                scheduler.finish(sampled.handle.request_id, "length")
    return rows, restores
