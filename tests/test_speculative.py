"""Speculative decoding's parts that stand alone: prompt-lookup proposals (against a plain search,
and measured on SmolLM2's real greedy outputs for copy-heavy prompts) and verification (coupled
sampling equal to plain sampling; rejection sampling keeping the target distribution, by a
chi-square bound)."""

from __future__ import annotations

import random

import pytest
import torch

from flare_core.executor.sampling import sample_rows
from flare_core.executor.verification import verify
from flare_core.scheduler.proposals import PromptLookup, replay


def _plain_lookup(tokens: list[int], width: int, max_ngram: int, min_ngram: int) -> tuple[int, ...]:
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tuple(tokens[start + n:start + n + width])
    return ()


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    assert lookup.propose([1, 2, 3, 4, 9, 9, 1, 2, 3, 7, 8, 2, 3], 3) == (7, 8, 2)  # "2 3": latest of the two
    assert lookup.propose([5, 1, 2, 3, 4, 6, 1, 2, 3], 2) == (4, 6)   # "1 2 3" beats the later "3"
    assert lookup.propose([1, 2, 3], 4) == () and lookup.propose([], 4) == () and lookup.propose([1, 2, 1], 0) == ()
    assert PromptLookup().propose([4, 4, 4, 4], 3) == (4,)  # an occurrence may overlap the suffix
    rng = random.Random(0)
    for _ in range(500):
        # Small alphabets repeat n-grams; ids past 255 and 65,535 put matching bytes across token edges.
        alphabet = rng.choice([[1, 2, 3], [0, 256, 1, 65536, 257], list(range(40))])
        tokens = [rng.choice(alphabet) for _ in range(rng.randrange(0, 30))]
        width, low = rng.randrange(0, 5), rng.randrange(1, 3)
        high = rng.randrange(low, 5)
        assert PromptLookup(high, low).propose(tokens, width) == _plain_lookup(tokens, width, high, low), tokens
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(max_ngram=1, min_ngram=2)


def _rows(batch: int, temperature: float, seeded: bool, top_k: int = 0):
    return dict(temperature=torch.full((batch,), temperature), top_k=torch.full((batch,), top_k, dtype=torch.int64),
                top_p=torch.ones(batch), min_p=torch.zeros(batch), seeds=torch.arange(batch, dtype=torch.int64) * 7 + 1,
                steps=torch.arange(batch, dtype=torch.int64) * 3, seeded=torch.full((batch,), seeded),
                unseeded_seed=torch.tensor(12345, dtype=torch.int64))


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (0.9, 0), (1.0, 5)])
def test_coupled_verification_keeps_the_tokens_plain_sampling_draws(temperature, top_k):
    """Each position's token is the one plain decoding samples there (same key: seed and tokens
    generated before it), and the drafts are kept while they equal those tokens."""
    batch, slots, vocab = 6, 4, 50
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(batch, slots + 1, vocab, generator=generator) * 3
    rows = _rows(batch, temperature, seeded=True, top_k=top_k)
    plain = torch.stack([sample_rows(logits[:, i], rows["temperature"], rows["top_k"], rows["top_p"], rows["min_p"],
                                     rows["seeds"], rows["steps"] + i, rows["seeded"], rows["unseeded_seed"])
                         for i in range(slots + 1)], dim=1)
    drafts = plain[:, :slots].clone()
    keep = torch.tensor([0, 1, 2, 4, 4, 3])  # row b's drafts agree with plain sampling up to keep[b]
    for b, k in enumerate(keep.tolist()):
        if k < slots:
            drafts[b, k] = (plain[b, k] + 1) % vocab
    widths = torch.tensor([4, 4, 4, 4, 2, 4])  # row 4 fills two slots only
    tokens, accepted = verify(logits, drafts, widths, **rows)
    assert accepted.tolist() == [0, 1, 2, 4, 2, 3]
    for b in range(batch):
        assert tokens[b, :accepted[b] + 1].tolist() == plain[b, :accepted[b] + 1].tolist()


def _chi_square(observed: torch.Tensor, probabilities: torch.Tensor) -> float:
    expected = probabilities * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution():
    """Drafts drawn from q, verified against p: every emitted token is distributed as p at its
    position (40,000 unseeded rows; chi-square with 5 degrees of freedom below 25, p ~ 1e-4, on
    a fixed draw), and a draft is kept with probability sum(min(p, q))."""
    batch, slots, vocab = 40_000, 2, 6
    generator = torch.Generator().manual_seed(2)
    target_logits = torch.randn(slots + 1, vocab, generator=generator) * 1.5
    proposal = torch.softmax(torch.randn(slots, vocab, generator=generator) * 1.5, dim=-1)
    drafts = torch.stack([torch.multinomial(proposal[i], batch, replacement=True, generator=generator)
                          for i in range(slots)], dim=1)
    logits = target_logits.expand(batch, -1, -1).contiguous()
    draft_probs = proposal.expand(batch, -1, -1).contiguous()
    tokens, accepted = verify(logits, drafts, torch.full((batch,), slots), **_rows(batch, 1.0, seeded=False),
                              draft_probs=draft_probs)
    target = torch.softmax(target_logits, dim=-1)
    for position in range(slots + 1):
        reached = accepted >= position  # rows whose output has a token at this position
        counts = torch.bincount(tokens[reached, position], minlength=vocab).double()
        assert _chi_square(counts, target[position].double()) < 25, (position, counts)
    kept_first = (accepted >= 1).double().mean().item()
    assert abs(kept_first - torch.minimum(target[0], proposal[0]).sum().item()) < 0.01
    assert torch.equal(tokens[:, 0][accepted >= 1], drafts[:, 0][accepted >= 1])


def test_greedy_rows_keep_drafts_equal_to_the_argmax_under_rejection_sampling():
    batch, slots, vocab = 3, 3, 20
    logits = torch.randn(batch, slots + 1, vocab, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(dim=-1)
    drafts = best[:, :slots].clone()
    drafts[1, 1] = (best[1, 1] + 1) % vocab
    drafts[2, 0] = (best[2, 0] + 1) % vocab
    probs = torch.full((batch, slots, vocab), 1 / vocab)
    tokens, accepted = verify(logits, drafts, torch.full((batch,), slots), **_rows(batch, 0.0, seeded=True),
                              draft_probs=probs)
    assert accepted.tolist() == [3, 1, 0]
    for b in range(batch):
        assert tokens[b, :accepted[b] + 1].tolist() == best[b, :accepted[b] + 1].tolist()


PARAGRAPH = ("The lighthouse stood on a narrow rock at the mouth of the bay. Every evening the keeper climbed the "
             "one hundred and twelve steps, trimmed the wick, polished the great lens and lit the lamp. Ships "
             "coming home from the north saw its beam long before they saw the coast, and the fishermen said "
             "that no boat had been lost on the rocks since the light was built.")


def test_prompt_lookup_accepts_two_drafts_per_round_rewriting_a_paragraph(smollm2_reference,
                                                                          smollm2_reference_tokenizer):
    """SmolLM2's greedy answer (the Transformers reference on the real weights) to a small edit of a
    given paragraph, replayed in rounds of 4 prompt-lookup drafts: greedy verification keeps a draft
    exactly when it is the next token of that answer, so the kept drafts per round are what
    speculation gets. (Asked to edit a code block, this 135M model does not copy it: see
    benchmarks/prompt_lookup_acceptance.py.)"""
    tokenizer = smollm2_reference_tokenizer
    request = "Rewrite this paragraph exactly, changing only 'lighthouse' to 'beacon':\n\n" + PARAGRAPH
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    with torch.no_grad():
        generated = smollm2_reference.generate(torch.tensor([prompt]), max_new_tokens=120, do_sample=False,
                                               pad_token_id=tokenizer.eos_token_id)
    output = generated[0, len(prompt):].tolist()
    kept = replay(PromptLookup(), prompt, output, width=4)
    assert len(output) >= 60 and "the keeper climbed the" in tokenizer.decode(output), tokenizer.decode(output)
    assert sum(kept) / len(kept) >= 2.0, (kept, tokenizer.decode(output))


def test_speculation_settings_are_checked(tmp_path):
    from flare_core.config import ConfigError, load_config
    from flare_core.scheduler import GraphCapacities, SchedulerConfig

    path = tmp_path / "config.toml"
    path.write_text('[server]\nspec_method = "Eagle 3"\n')
    with pytest.raises(ConfigError, match=r"server.spec_method must be a method name \(prompt-lookup, draft, mtp, "
                                          r"or one a plugin adds\), got 'Eagle 3'"):
        load_config(path)
    path.write_text('[server]\nspec_method = "eagle"\n')  # a plugin's (refused at start where none registers it)
    assert load_config(path).server.spec_method == "eagle"
    path.write_text('[server]\nspec_method = "mtp"\n')  # a core's draft head (refused at start by a core without)
    assert load_config(path).server.spec_method == "mtp"
    path.write_text('[server]\nspec_method = "prompt-lookup"\nspec_draft_tokens = 17\n')
    with pytest.raises(ConfigError, match=r"server.spec_draft_tokens must be an integer in \[0, 16\]"):
        load_config(path)
    path.write_text('[server]\nspec_method = "prompt-lookup"\nspec_draft_tokens = 0\n')
    assert load_config(path).server.spec_draft_tokens == 0  # off, as --spec-draft-tokens 0
    capacities = GraphCapacities(decode=(1,), prefill=(64,))
    for proposer, tokens in ((None, 2), (PromptLookup(), 0), (PromptLookup(), -1)):
        with pytest.raises(ValueError, match="draft_tokens"):
            SchedulerConfig(max_concurrency=1, prefill_chunk_size=64, capacities=capacities, proposer=proposer,
                            draft_tokens=tokens)


def test_acceptance_by_depth_censors_what_a_round_did_not_check():
    from flare_core.scheduler.request import Acceptance

    acceptance = Acceptance()
    acceptance.record(4, 4)   # all four kept
    acceptance.record(4, 1)   # the second refused: depths 3 and 4 unchecked
    acceptance.record(2, 2)   # a round cut to two drafts (the request's last tokens): depths 3, 4 unchecked
    assert acceptance.checked == [3, 3, 1, 1] and acceptance.kept == [3, 2, 1, 1]
    chain = [(3 + 1) / (3 + 2), (2 + 1) / (3 + 2), (1 + 1) / (1 + 2), (1 + 1) / (1 + 2)]
    expected = 1 + chain[0] + chain[0] * chain[1] + chain[0] * chain[1] * chain[2] \
        + chain[0] * chain[1] * chain[2] * chain[3]
    assert acceptance.expected_tokens(4) == pytest.approx(expected)
    four = chain[0] * chain[1] * chain[2] * chain[3]  # depths 5 and 6, never checked, count one half each
    assert acceptance.expected_tokens(6) == pytest.approx(expected + four * 0.5 + four * 0.25)
    assert Acceptance().expected_tokens(2) == pytest.approx(1 + 0.5 + 0.25)


def test_each_request_gets_the_width_of_the_most_tokens_per_cost():
    """From its drafts kept by depth and the measured cost of rounds against plain decode steps:
    a request that copies gets the widest round, one whose drafts are refused none; rounds that
    cost more than their drafts bring, or that pass the speculative capacities, are not planned."""
    from flare_core.scheduler import GraphCapacities, StepKind
    from flare_core.scheduler.estimates import StepCostEstimator
    from flare_core.scheduler.request import Request
    from flare_core.scheduler.speculation import Speculation

    capacities = GraphCapacities(decode=(1, 2, 4, 8, 16), prefill=(64,), speculative=(8, 16, 32, 64))
    estimator = StepCostEstimator()
    for capacity in (1, 2, 4, 8, 16):
        estimator.observe(StepKind.DECODE, capacity, 0.006)
    for capacity in (8, 16, 32, 64):
        estimator.observe(StepKind.SPECULATIVE, capacity, 0.007)  # 1.17x a decode step, as on the H100
    speculation = Speculation(PromptLookup(), 8, capacities, estimator)
    copier, refused, fresh = (Request(name, (1, 2), 100, (), 0) for name in ("copier", "refused", "fresh"))
    for _ in range(20):
        copier.acceptance.record(8, 8)
        refused.acceptance.record(8, 0)
    assert speculation.width(copier, speculation.round_costs(1, 8)) == 8
    assert speculation.width(refused, speculation.round_costs(1, 8)) == 0
    assert speculation.width(fresh, speculation.round_costs(1, 8)) >= 1  # untried: its drafts count one half per depth
    # 13 rows of 1 + 3 tokens fill the 64-token graph.
    assert speculation.width(copier, speculation.round_costs(13, 8)) == 3
    assert speculation.width(copier, speculation.round_costs(64, 8)) == 0
    for capacity in (8, 16, 32, 64):
        estimator.observe(StepKind.SPECULATIVE, capacity, 0.1)  # rounds now cost 16x a step
        estimator.observe(StepKind.SPECULATIVE, capacity, 0.1)
    assert speculation.width(copier, speculation.round_costs(1, 8)) == 0


def test_over_continuation_state_a_round_is_priced_with_its_rewind():
    """Where a partly refused round is followed by a rewind (a chunk computing the kept tokens
    again), its price counts the rewind's step beyond a plain one times the chance of it: a
    request that keeps two drafts and never the third narrows its rounds to the two it keeps,
    one that keeps everything keeps its width, and without rewinds neither changes."""
    from flare_core.scheduler import GraphCapacities, StepKind
    from flare_core.scheduler.estimates import StepCostEstimator
    from flare_core.scheduler.request import Request
    from flare_core.scheduler.speculation import Speculation

    capacities = GraphCapacities(decode=(1, 2), prefill=(64,), speculative=(8,))
    estimator = StepCostEstimator()
    estimator.observe(StepKind.DECODE, 1, 0.006)
    estimator.observe(StepKind.SPECULATIVE, 8, 0.007)
    estimator.observe(StepKind.PREFILL, 64, 0.018)  # a rewind's step: 3x a decode step
    plain, rewinding = (Speculation(PromptLookup(), 4, capacities, estimator, rewinds=r) for r in (False, True))
    assert plain.rewind_costs(1, 4) == [] and rewinding.rewind_costs(1, 4) == pytest.approx([2.0] * 4)
    two, copier = Request("two", (1, 2), 100, (), 0), Request("copier", (1, 2), 100, (), 0)
    for _ in range(20):
        two.acceptance.record(4, 2)
        copier.acceptance.record(4, 4)
    assert two.acceptance.chance_kept(2) > 0.9 and two.acceptance.chance_kept(3) < 0.05
    assert plain.width(two, plain.round_costs(1, 4), plain.rewind_costs(1, 4)) == 4  # the fourth costs nothing
    assert rewinding.width(two, rewinding.round_costs(1, 4), rewinding.rewind_costs(1, 4)) == 2
    assert rewinding.width(copier, rewinding.round_costs(1, 4), rewinding.rewind_costs(1, 4)) == 4


def test_a_request_that_stopped_proposing_tries_again_as_its_refusals_fade():
    from flare_core.scheduler import GraphCapacities, StepKind
    from flare_core.scheduler.estimates import StepCostEstimator
    from flare_core.scheduler.request import Request
    from flare_core.scheduler.speculation import Speculation

    estimator = StepCostEstimator()
    estimator.observe(StepKind.DECODE, 1, 0.006)
    estimator.observe(StepKind.SPECULATIVE, 8, 0.007)
    speculation = Speculation(PromptLookup(), 4, GraphCapacities(decode=(1,), prefill=(64,), speculative=(8,)),
                              estimator)
    request = Request("r", (1, 2), 100, (), 0)
    for _ in range(40):
        request.acceptance.record(4, 0)
    stretches = 0
    while speculation.width(request, speculation.round_costs(1, 4)) == 0:
        request.acceptance.fade()  # what each plain stretch does (Speculation.propose)
        stretches += 1
    assert 2 <= stretches <= 6 and request.acceptance.checked[0] <= 5


def test_rounds_are_tried_before_any_was_measured_however_fast_the_device():
    """Before a speculative round has run, its cost is the prior scaled as decode steps measured
    theirs: on a device whose decode steps take 0.3 ms, rounds are not priced at the prior's 8 ms
    (which would keep any from being tried, and so measured)."""
    from flare_core.scheduler import GraphCapacities, StepKind
    from flare_core.scheduler.estimates import StepCostEstimator
    from flare_core.scheduler.request import Request
    from flare_core.scheduler.speculation import Speculation

    estimator = StepCostEstimator()
    for _ in range(3):
        estimator.observe(StepKind.DECODE, 4, 0.0003)
    speculation = Speculation(PromptLookup(), 4, GraphCapacities(decode=(1, 2, 4), prefill=(64,),
                                                                 speculative=(8, 16, 32)), estimator)
    assert speculation.round_costs(4, 4)[3] < 1.2
    assert speculation.width(Request("r", (1, 2), 100, (), 0), speculation.round_costs(4, 4)) >= 1


def test_a_round_is_priced_with_what_its_proposals_take():
    """A proposer that takes time (a draft model) makes rounds dearer: as much as a decode step
    per draft token, and no round pays."""
    from flare_core.scheduler import GraphCapacities, StepKind
    from flare_core.scheduler.estimates import StepCostEstimator
    from flare_core.scheduler.request import Request
    from flare_core.scheduler.speculation import Speculation

    class Slow(PromptLookup):
        def seconds(self, width: int) -> float:
            return width * 0.006

    estimator = StepCostEstimator()
    estimator.observe(StepKind.DECODE, 1, 0.006)
    estimator.observe(StepKind.SPECULATIVE, 8, 0.007)
    capacities = GraphCapacities(decode=(1,), prefill=(64,), speculative=(8,))
    fast, slow = Speculation(PromptLookup(), 4, capacities, estimator), Speculation(Slow(), 4, capacities, estimator)
    assert fast.round_costs(1, 4)[3] == pytest.approx(7 / 6)
    assert slow.round_costs(1, 4)[3] == pytest.approx((0.007 + 4 * 0.006) / 0.006)
    copier = Request("r", (1, 2), 100, (), 0)
    for _ in range(20):
        copier.acceptance.record(4, 4)
    assert fast.width(copier, fast.round_costs(1, 4)) == 4 and slow.width(copier, slow.round_costs(1, 4)) == 0
