"""Reference sampler: greedy, filters, seeded reproducibility, distributions, penalties, logprobs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from flare_core.executor.sampling import PenaltyBook, PenaltyState, Sampler, apply_penalties
from flare_core.requests import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_greedy_is_argmax_with_ties_to_the_lowest_id() -> None:
    logits = random_logits(8, 1000, seed=0)
    logits[3, 7] = logits[3, 700] = logits[3].max() + 1.0
    out = Sampler().sample(logits, [GREEDY] * 8, [0] * 8)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[3].item() == 7


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(16, 1000, seed=1, scale=0.5)  # flat: without the cut, sampling would vary
    params = [SamplingParams(temperature=1.3, top_k=1, seed=i if i % 2 else None) for i in range(16)]
    out = Sampler(seed=5).sample(logits, params, list(range(16)))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def test_top_p_zero_keeps_only_the_most_probable_token() -> None:
    logits = random_logits(4, 300, seed=2, scale=0.5)
    out = Sampler().sample(logits, [SamplingParams(top_p=0.0)] * 4, [0] * 4)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))


def sample_sequence(sampler: Sampler, logits_row: torch.Tensor, params: SamplingParams, position: int,
                    others: list[SamplingParams], steps: int = 20) -> list[int]:
    """Sample `params`' row `steps` times, placed at `position` among `others` rows."""
    tokens = []
    for step in range(steps):
        batch_params = list(others)
        batch_params.insert(position, params)
        logits = random_logits(len(batch_params), logits_row.shape[0], seed=100 + step, scale=0.5)
        logits[position] = logits_row
        out = sampler.sample(logits, batch_params, [step if i == position else 7 for i in range(len(batch_params))])
        tokens.append(out.token_ids[position].item())
    return tokens


def test_seeded_rows_do_not_depend_on_batch_composition_or_position() -> None:
    row = random_logits(1, 500, seed=3, scale=0.5)[0]
    request = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    alone = sample_sequence(Sampler(seed=0), row, request, 0, [])
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=7), GREEDY,
              SamplingParams(top_k=5, seed=42 + 1)]
    assert sample_sequence(Sampler(seed=1), row, request, 2, others) == alone
    assert sample_sequence(Sampler(seed=2), row, request, 4, others) == alone
    assert sample_sequence(Sampler(seed=3), row, request, 0, others[1:]) == alone
    assert len(set(alone)) > 5  # the sequence really is random over steps
    other_seed = sample_sequence(Sampler(seed=0), row, SamplingParams(temperature=0.9, top_p=0.95, seed=43), 0, [])
    assert other_seed != alone


def test_unseeded_rows_follow_the_sampler_generator() -> None:
    logits = random_logits(6, 500, seed=4, scale=0.5)
    params = [SamplingParams()] * 6
    first = Sampler(seed=9).sample(logits, params, [0] * 6).token_ids
    again = Sampler(seed=9).sample(logits, params, [0] * 6).token_ids
    different = Sampler(seed=10).sample(logits, params, [0] * 6).token_ids
    assert torch.equal(first, again)
    assert not torch.equal(first, different)


PROBS = torch.tensor([0.30, 0.25, 0.20, 0.10, 0.08, 0.04, 0.02, 0.01])


def normalised(values: list[float], vocab: int = 8) -> torch.Tensor:
    kept = torch.zeros(vocab)
    kept[:len(values)] = torch.tensor(values)
    return kept / kept.sum()


@pytest.mark.parametrize("params, expected", [
    (SamplingParams(), PROBS / PROBS.sum()),
    (SamplingParams(top_k=3), normalised([0.30, 0.25, 0.20])),
    (SamplingParams(top_p=0.5), normalised([0.30, 0.25])),
    (SamplingParams(min_p=0.3), normalised([0.30, 0.25, 0.20, 0.10])),
    (SamplingParams(temperature=2.0, top_k=4), normalised([math.sqrt(p) for p in (0.30, 0.25, 0.20, 0.10)])),
    # top-k leaves 0.93 of the mass; top-p then counts within it (0.3/0.93 + 0.25/0.93 < 0.8 <= + 0.2/0.93)
    (SamplingParams(top_k=5, top_p=0.8, min_p=0.1), normalised([0.30, 0.25, 0.20])),
])
def test_empirical_frequencies_match_the_filtered_distribution(params: SamplingParams,
                                                               expected: torch.Tensor) -> None:
    logits = PROBS.log()
    draws = 20_000
    unseeded = Sampler(seed=11).sample(logits.expand(draws, -1).contiguous(), [params] * draws, [0] * draws)
    seeded_params = [dataclasses.replace(params, seed=seed) for seed in range(5_000)]
    seeded = Sampler().sample(logits.expand(5_000, -1).contiguous(), seeded_params, [3] * 5_000)
    for tokens, tolerance in ((unseeded.token_ids, 0.015), (seeded.token_ids, 0.03)):
        frequencies = torch.bincount(tokens, minlength=8).float() / tokens.numel()
        assert (frequencies[expected == 0] == 0).all(), "a filtered token was sampled"
        assert torch.allclose(frequencies, expected, atol=tolerance), (frequencies, expected)


def test_penalties_on_a_hand_computed_example() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -2.0, 3.0, 0.0]])
    state = PenaltyState(6, prompt_ids=[0, 1])
    state.append(2)
    state.extend([2, 3])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    penalised = apply_penalties(logits, [params], [state])
    expected = torch.tensor([[
        2.0 / 2,                      # prompt token, positive: divided; no output count
        -1.0 * 2,                     # prompt token, negative: multiplied
        0.5 / 2 - 0.5 * 2 - 0.25,     # generated twice
        -2.0 * 2 - 0.5 * 1 - 0.25,    # generated once
        3.0,                          # never seen
        0.0,
    ]])
    assert torch.allclose(penalised, expected)


def test_penalties_steer_greedy_and_leave_other_rows_alone() -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0], [5.0, 4.0, 1.0]])
    state = PenaltyState(3, prompt_ids=[])
    state.append(0)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), GREEDY]
    out = Sampler().sample(logits, params, [1, 1], [state, None])
    assert out.token_ids.tolist() == [1, 0]


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = random_logits(5, 200, seed=6)
    state = PenaltyState(200, prompt_ids=[1, 2, 3])
    params = [SamplingParams(temperature=0.5, top_k=20, repetition_penalty=1.5, seed=1), GREEDY,
              SamplingParams(top_p=0.9), SamplingParams(min_p=0.2), SamplingParams(temperature=1.7)]
    out = Sampler().sample(logits, params, [0] * 5, [state, None, None, None, None], top_logprobs=4)
    raw = logits.log_softmax(dim=-1)
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    expected_values, expected_ids = raw.topk(4, dim=-1)
    assert torch.equal(out.top_ids, expected_ids)
    assert torch.allclose(out.top_logprobs, expected_values)
    assert (out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all()
    plain = Sampler().sample(logits, params, [0] * 5, [state, None, None, None, None])
    assert plain.logprobs is None and plain.top_ids is None


def test_penalty_state_rejects_ids_outside_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="prompt_ids.*151936"):
        PenaltyState(10, prompt_ids=[151936])
    state = PenaltyState(10, prompt_ids=[])
    with pytest.raises(ValueError, match="token_id.*10"):
        state.append(10)


def test_invalid_requests_name_the_problem() -> None:
    logits = random_logits(2, 10, seed=7)
    sampler = Sampler()
    with pytest.raises(ValueError, match="row 1 has penalties but no PenaltyState"):
        sampler.sample(logits, [GREEDY, SamplingParams(presence_penalty=1.0)], [0, 0])
    with pytest.raises(ValueError, match="2 logits rows but 1 params"):
        sampler.sample(logits, [GREEDY], [0])
    with pytest.raises(ValueError, match="float32"):
        sampler.sample(logits.half(), [GREEDY, GREEDY], [0, 0])


def test_penalty_book_counts_every_sampled_token_and_starts_rows_over():
    """The executor's history book (what the graphs read by slot): `record` counts device
    tokens per slot, repeated pairs included, like `append`; `start` makes a row one request's
    history again (its prompt, and tokens it generated before a preemption moved it)."""
    book = PenaltyBook(3, 10, "cpu")
    by_append = PenaltyState(10, prompt_ids=[3, 3, 4])
    for token in (1, 7, 1, 9):
        by_append.append(token)
    state = book.start(1, [3, 3, 4])
    book.record(torch.tensor([1, 1, 0]), torch.tensor([1, 7, 5]))
    book.record(torch.tensor([1, 1, 2]), torch.tensor([1, 9, 5]))
    assert torch.equal(state.output_counts, by_append.output_counts)
    assert state.output_counts.tolist() == [0, 2, 0, 0, 0, 0, 0, 1, 0, 1]
    assert state.in_prompt.nonzero().flatten().tolist() == [3, 4]
    assert book.output_counts[0, 5] == 1 and book.output_counts[2, 5] == 1

    resumed = book.start(1, [8], generated=[2, 2, 6])
    assert resumed.output_counts.tolist() == [0, 0, 2, 0, 0, 0, 1, 0, 0, 0]
    assert book.in_prompt[1].nonzero().flatten().tolist() == [8]
    logits = random_logits(1, 10, seed=8)
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2)]
    expected = PenaltyState(10, prompt_ids=[8])
    expected.extend([2, 2, 6])
    assert torch.equal(apply_penalties(logits, params, [resumed]), apply_penalties(logits, params, [expected]))
