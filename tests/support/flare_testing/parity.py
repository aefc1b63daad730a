"""Helpers for recipe authors' parity tests: drive a serving model over a paged cache the way
the runtime does, without a scheduler or a server."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence

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
    held: dict = {}
    if ranks is not None:
        from flare_core.parallel import rank_checkpoint, rank_config, spec_of

        checkpoint = rank_checkpoint(recipe, config, checkpoint, ranks)
        config = rank_config(config, spec_of(recipe), ranks.size, ranks.experts)
        held = checkpoint.held
    from flare_core.parallel import hold_weights

    model = load_prepared_weights(model, dict(hold_weights(recipe.map_weights(config, checkpoint, torch.float32), held)),
                                  "cpu")
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


def drive_greedy(scheduler, executor, max_tokens: int, on_row: Callable[[str], None] | None = None,
                 next_token: Callable[[str, int], int] | None = None) -> tuple[dict[str, list[torch.Tensor]], int]:
    """Run a scheduler's requests on `executor` greedily to `max_tokens` each, one step at a time
    with the step's logits read back (what the parity tests compare): per request, the logits
    rows it sampled from, and how many restores the steps made; `on_row(request_id)` is called
    for each row as it is taken (after the step that computed it). `next_token(request_id, i)`,
    where given, is what a row that samples the request's i-th output token takes instead of its
    argmax (a known continuation fed back)."""
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
        if next_token is not None:
            earlier: dict[str, int] = {}
            for i, handle in enumerate(plan.samples):
                index = len(rows.get(handle.request_id, ())) + earlier.get(handle.request_id, 0)
                earlier[handle.request_id] = earlier.get(handle.request_id, 0) + 1
                tokens[i] = next_token(handle.request_id, index)
        executor.record_sampled([h.state_row for h in plan.samples], tokens)
        # The rows the scheduler keeps (a speculative round's past its first refused draft are not).
        for sampled in scheduler.complete(plan, StepResult(tokens.tolist(), plan.estimated_s)):
            taken = rows.setdefault(sampled.handle.request_id, [])
            # A copy: a graph runner's rows are views of its graph's buffers, which its next
            # replay overwrites.
            taken.append(logits[sampled.row].clone())
            if on_row is not None:
                on_row(sampled.handle.request_id)
            if len(taken) == max_tokens:
                scheduler.finish(sampled.handle.request_id, "length")
    return rows, restores


def assert_greedy_matches(model: torch.nn.Module, prompt: list[int], logits: list[torch.Tensor]) -> None:
    """The logits rows a request sampled from greedily after `prompt` match the Transformers
    `model`'s forward of the whole sequence."""
    sequence = prompt + [int(row.argmax()) for row in logits[:-1]]
    with torch.no_grad():
        expected = model(torch.tensor([sequence])).logits[0, len(prompt) - 1:]
    torch.testing.assert_close(torch.stack(logits), expected, atol=1e-4, rtol=1e-4)


def check_snapshot_resume(model: torch.nn.Module, scheduler, executor, vocab_size: int, shared: int,
                          tails: tuple[int, int], lowest_id: int = 0, seed: int = 3, max_tokens: int = 3) -> None:
    """Two requests share their first `shared` tokens, a message boundary there. The first runs
    alone; the second then resumes from the resume point the first left at that boundary (one
    restore), and both sample what the reference `model` computes for their whole sequences."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randint(lowest_id, vocab_size, (shared,), generator=generator).tolist()
    first, second = (common + torch.randint(lowest_id, vocab_size, (n,), generator=generator).tolist()
                     for n in tails)
    scheduler.submit("first", first, max_tokens, message_ends=(shared,))
    done, _ = drive_greedy(scheduler, executor, max_tokens)
    scheduler.submit("second", second, max_tokens, message_ends=(shared,))
    again, restores = drive_greedy(scheduler, executor, max_tokens)
    assert restores == 1  # the second request resumed at the end of the shared messages
    assert_greedy_matches(model, first, done["first"])
    assert_greedy_matches(model, second, again["second"])


def _serve_random_prompts(scheduler, executor, vocab_size: int, lengths: Sequence[int], lowest_id: int, seed: int,
                          max_tokens: int) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Random prompts of `lengths` tokens (ids from `lowest_id`), driven greedily to `max_tokens`
    each: the prompts and the rows each request sampled from (`drive_greedy`)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = {f"r{i}": torch.randint(lowest_id, vocab_size, (n,), generator=generator).tolist()
               for i, n in enumerate(lengths)}
    for request_id, prompt in prompts.items():
        scheduler.submit(request_id, prompt, max_tokens)
    return prompts, drive_greedy(scheduler, executor, max_tokens)[0]


def check_preemption_resume(model: torch.nn.Module, scheduler, executor, vocab_size: int, lengths: Sequence[int],
                            lowest_id: int = 0, seed: int = 4, max_tokens: int = 40) -> None:
    """Requests of `lengths` prompt tokens, too many for the scheduler's pages at once: some are
    preempted mid-decode, come back, and every row each samples from matches the reference."""
    prompts, sampled = _serve_random_prompts(scheduler, executor, vocab_size, lengths, lowest_id, seed, max_tokens)
    assert scheduler.preemptions > 0
    for request_id, prompt in prompts.items():
        assert_greedy_matches(model, prompt, sampled[request_id])


class WrongGuesses:
    """A proposer (flare_core.scheduler.proposals.Proposer) for rollback tests: `continuation(tokens,
    width)` guesses what follows (`greedy_continuation`, `recorded_continuation`), one guess wrong
    on purpose — the one at depth len(tokens) % (width + 1), none when that is `width` — so that
    rounds keep all, some and none of their drafts. `widths`: the width of every proposal made."""

    def __init__(self, continuation: Callable[[list[int], int], list[int]], vocab_size: int):
        self.continuation, self.vocab_size = continuation, vocab_size
        self.widths: list[int] = []

    samples = False  # its guesses are the continuation's, whatever a request samples with

    def seconds(self, width: int) -> float:
        return 0.0

    def propose(self, tokens: Sequence[int], width: int, request_id: str = "", draw=None, step: int = 0
                ) -> tuple[int, ...]:
        guesses = list(self.continuation(list(tokens), width))
        wrong = len(tokens) % (width + 1)
        if wrong < len(guesses):
            guesses[wrong] = (guesses[wrong] + 1) % self.vocab_size
        self.widths.append(width)
        return tuple(guesses)


def greedy_continuation(model: torch.nn.Module) -> Callable[[list[int], int], list[int]]:
    """The Transformers `model`'s greedy continuation of a sequence."""
    def continuation(tokens: list[int], width: int) -> list[int]:
        sequence = list(tokens)
        with torch.no_grad():
            for _ in range(width):
                sequence.append(int(model(torch.tensor([sequence])).logits[0, -1].argmax()))
        return sequence[len(tokens):]
    return continuation


def recorded_continuation(sequences: Sequence[Sequence[int]]) -> Callable[[list[int], int], list[int]]:
    """What follows a sequence in the first of `sequences` it begins (none if none does)."""
    def continuation(tokens: list[int], width: int) -> list[int]:
        for sequence in sequences:
            if list(sequence[:len(tokens)]) == tokens:
                return list(sequence[len(tokens):len(tokens) + width])
        return []
    return continuation


def check_speculative_rollback(model: torch.nn.Module, scheduler, executor, vocab_size: int, lengths: Sequence[int],
                               lowest_id: int = 0, seed: int = 6, max_tokens: int = 24) -> None:
    """Requests of `lengths` prompt tokens decode with drafts from a `WrongGuesses` proposer
    (`snapshot_serving(..., proposer=...)`): rounds keep all, some or none of them, and each that
    refuses some is computed again from the state row as the round found it. Every row each
    request samples from matches the reference `model`'s forward of its whole sequence, as plain
    decoding's would, and every state row and page comes back."""
    prompts, sampled = _serve_random_prompts(scheduler, executor, vocab_size, lengths, lowest_id, seed, max_tokens)
    for request_id, prompt in prompts.items():
        assert len(sampled[request_id]) == max_tokens
        assert_greedy_matches(model, prompt, sampled[request_id])
    counts = scheduler.resources()
    assert counts.draft_rounds > 0 and 0 < counts.accepted_drafts < counts.drafts, counts
    assert counts.live == 0 and counts.free_state_rows == counts.state_rows, counts


class ObservedHead:
    """A draft head's proposer (flare_core.engine.draft_heads.HeadProposer) as a scheduler's,
    what it was asked and answered kept (`proposals`). With `steer` (a `WrongGuesses`), the head
    is asked as the scheduler would ask it, but the drafts handed on are `steer`'s, so that rounds
    keep all, some and none of them (a random head's own guesses are almost never kept)."""

    def __init__(self, head, steer: WrongGuesses | None = None):
        self.head, self.steer = head, steer
        self.proposals: list[tuple[list[int], tuple[int, ...]]] = []
        self.samples = head.samples

    def seconds(self, width: int) -> float:
        return self.head.seconds(width) if self.steer is None else 0.0

    def propose(self, tokens: Sequence[int], width: int, request_id: str = "", draw=None, step: int = 0
                ) -> tuple[int, ...]:
        drafts = self.head.propose(tokens, width, request_id, draw, step)
        self.proposals.append((list(tokens), drafts))
        return drafts if self.steer is None else self.steer.propose(tokens, width, request_id)

    def assert_guesses(self, reference_drafts: Callable[[list[int], int], list[int]]) -> None:
        """Every proposal made a guess, and equals `reference_drafts(tokens, width)`."""
        assert self.proposals, "the head was asked nothing"
        for tokens, drafts in self.proposals:
            assert drafts, f"no guess after {len(tokens)} tokens"
            assert list(drafts) == reference_drafts(tokens, len(drafts)), len(tokens)


def snapshot_serving(recipe, config, checkpoint, rows: int, num_pages: int, page_tokens: int, proposer=None,
                     draft_tokens: int = 0, final_hidden=None):
    """(scheduler, executor, prefix cache): `recipe`'s float32 model of `checkpoint` on an eager
    CPU runner, under a scheduler (64-token prompt chunks) whose prefix cache snapshots
    continuation state (two snapshot rows per request row, 8 logits rows); with a `proposer`,
    speculating up to `draft_tokens` drafts per row (`final_hidden`: the runner's, for a draft head)."""
    from flare_core.contract import Capacities
    from flare_core.executor.runner import eager_runner
    from flare_core.kv import KvCacheManager, PageAllocator, PrefixCache
    from flare_core.ops.loading import load_prepared_weights
    from flare_core.plugins import load_registry
    from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig

    model = load_prepared_weights(recipe.build_model(config, torch.float32),
                                  dict(recipe.map_weights(config, checkpoint, torch.float32)), "cpu")
    scheme = load_registry().cache_schemes[recipe.cache_scheme].build(config, "float32")
    executor = eager_runner(model, scheme, num_pages=num_pages, page_tokens=page_tokens, num_rows=rows,
                            num_snapshot_rows=2 * rows, num_logits_rows=8, vocab_size=config.vocab_size,
                            device=torch.device("cpu"), round_saves=proposer is not None,
                            final_hidden=final_hidden)
    pages = PageAllocator(num_pages)
    prefix = PrefixCache(b"\x02" * 32, pages, page_tokens, continuation_state=True, snapshot_rows=2 * rows,
                         logits_rows=8)
    capacities = Capacities(max_concurrency=rows, prefill_chunk_size=64, context_length=512, page_tokens=page_tokens)
    scheduler = Scheduler(SchedulerConfig(rows, 64, GraphCapacities.from_specs(capacities.graph_catalog()),
                                          page_tokens, proposer=proposer, draft_tokens=draft_tokens,
                                          continuation_state=bool(scheme.state)),
                          KvCacheManager(pages, rows, page_tokens, prefix))
    return scheduler, executor, prefix
