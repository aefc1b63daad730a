"""The vectorised sampling core against a straightforward per-row reference of the same semantics."""

from __future__ import annotations

import torch

from flare_core.executor.sampling import (VOCAB_SLICES, exponential_noise, filter_weights, first_argmax, noise_keys, sample_rows)

VOCAB = 400
ROWS = 48


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row, the plain way: sort, cut by rank and mass (keeping ties with each cut's last
    token), then min-p on the renormalised probabilities."""
    scaled = logits / (temperature if temperature > 0 else 1.0)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    ordered = scaled.sort(descending=True).values
    if top_k > 0:
        keep &= scaled >= ordered[min(top_k, scaled.numel()) - 1]
    if top_p < 1.0:
        kept_sorted = scaled[keep].sort(descending=True).values
        probs = kept_sorted.softmax(dim=-1)
        mass = 0.0
        last = kept_sorted[0]
        for value, prob in zip(kept_sorted.tolist(), probs.tolist()):
            if mass >= top_p:
                break
            last = value
            mass += prob
        keep &= scaled >= last
    probs = scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def random_case(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    # Rounded logits: many exact ties, so the tie rules are exercised.
    logits = (torch.randn(ROWS, VOCAB, generator=generator) * 4).round() / 2

    def pick(choices: list, dtype: torch.dtype) -> torch.Tensor:
        index = torch.randint(len(choices), (ROWS,), generator=generator)
        return torch.tensor(choices, dtype=dtype)[index]

    return {
        "logits": logits,
        "temperature": pick([0.0, 0.3, 0.6, 1.0, 1.7], torch.float32),
        "top_k": pick([0, 1, 3, 20, 50, VOCAB + 5], torch.int64),
        "top_p": pick([1.0, 0.95, 0.5, 0.1, 0.0], torch.float32),
        "min_p": pick([0.0, 0.05, 0.3], torch.float32),
    }


def test_filtered_probabilities_match_the_per_row_reference() -> None:
    for seed in range(3):
        case = random_case(seed)
        weights = filter_weights(case["logits"], case["temperature"], case["top_k"], case["top_p"], case["min_p"])
        probs = weights / weights.sum(dim=-1, keepdim=True)
        for row in range(ROWS):
            expected = reference_probs(case["logits"][row], case["temperature"][row].item(),
                                       case["top_k"][row].item(), case["top_p"][row].item(),
                                       case["min_p"][row].item())
            assert torch.equal(probs[row] > 0, expected > 0), (seed, row)
            assert torch.allclose(probs[row], expected, atol=1e-6), (seed, row)


def test_the_sliced_argmax_is_argmax_ties_and_masks_included() -> None:
    generator = torch.Generator().manual_seed(11)
    # Vocabularies below, at and past the slice count, divisible by it or not (a padded slice).
    for vocab in (1, 7, VOCAB_SLICES, VOCAB_SLICES * 9, VOCAB_SLICES * 9 + 5, 151936):
        logits = (torch.randn(6, vocab, generator=generator) * 3).round()  # many exact ties
        logits[1] = 2.0  # one value everywhere: the lowest id wins
        logits[2] = float("-inf")  # a mask that leaves nothing
        logits[3, :] = float("-inf")
        logits[3, vocab // 2:] = 1.0  # ties that start mid-row
        if vocab > 3:
            logits[4, -1] = logits[4].max() + 1  # the maximum in the last (padded) slice
        for row in logits:  # one row at a time: sliced
            assert torch.equal(first_argmax(row[None]), row[None].argmax(dim=-1)), vocab
        assert torch.equal(first_argmax(logits), logits.argmax(dim=-1)), vocab


def test_a_candidate_window_covering_every_top_k_changes_nothing() -> None:
    case = random_case(7)
    case["top_k"] = case["top_k"].clamp(1, 50)
    args = (case["logits"], case["temperature"], case["top_k"], case["top_p"], case["min_p"])
    assert torch.equal(filter_weights(*args, candidates=50), filter_weights(*args))


def test_sampled_tokens_are_the_exponential_race_over_the_reference_probabilities() -> None:
    case = random_case(11)
    seeds = torch.arange(ROWS, dtype=torch.int64) * 1_000_003 - 7
    steps = torch.arange(ROWS, dtype=torch.int64) % 5
    seeded = torch.ones(ROWS, dtype=torch.bool)
    tokens = sample_rows(case["logits"], case["temperature"], case["top_k"], case["top_p"], case["min_p"],
                         seeds, steps, seeded, torch.tensor(0))
    noise = exponential_noise(noise_keys(seeds, steps), VOCAB)
    for row in range(ROWS):
        temperature = case["temperature"][row].item()
        if temperature == 0:
            expected = case["logits"][row].argmax().item()
        else:
            probs = reference_probs(case["logits"][row], temperature, case["top_k"][row].item(),
                                    case["top_p"][row].item(), case["min_p"][row].item())
            expected = (probs / noise[row]).argmax().item()
        assert tokens[row].item() == expected, row


def test_noise_is_positive_exponential_and_keyed_only_by_seed_and_step() -> None:
    seeds = torch.tensor([5, 5, 6, -1, 2**62], dtype=torch.int64)
    steps = torch.tensor([0, 1, 0, 0, 3], dtype=torch.int64)
    noise = exponential_noise(noise_keys(seeds, steps), 50_000)
    assert (noise > 0).all() and torch.isfinite(noise).all()
    assert abs(noise.mean().item() - 1.0) < 0.01 and abs(noise.var().item() - 1.0) < 0.03
    for a in range(5):
        for b in range(a + 1, 5):
            assert abs(torch.corrcoef(noise[[a, b]])[0, 1].item()) < 0.02
    reordered = exponential_noise(noise_keys(seeds.flip(0), steps.flip(0)), 50_000)
    assert torch.equal(reordered.flip(0), noise)


def test_unseeded_rows_differ_from_each_other_and_follow_the_call_seed() -> None:
    logits = torch.zeros(4, 1000)  # uniform: the noise alone decides
    parameters = (torch.ones(4), torch.zeros(4, dtype=torch.int64), torch.ones(4), torch.zeros(4))
    seeded = torch.tensor([False, False, False, True])
    seeds = torch.tensor([0, 0, 0, 9], dtype=torch.int64)
    steps = torch.zeros(4, dtype=torch.int64)
    first = sample_rows(logits, *parameters, seeds, steps, seeded, torch.tensor(1))
    again = sample_rows(logits, *parameters, seeds, steps, seeded, torch.tensor(1))
    other = sample_rows(logits, *parameters, seeds, steps, seeded, torch.tensor(2))
    assert torch.equal(first, again)
    assert len(set(first[:3].tolist())) == 3
    assert not torch.equal(first[:3], other[:3]) and first[3] == other[3]


def test_core_runs_on_fixed_shape_plain_tensors() -> None:
    """The graph-capture contract on CPU: plain tensors in, a [B] int64 tensor out on the same
    device, nothing but tensors (no Python per-row values) needed."""
    case = random_case(3)
    out = sample_rows(case["logits"], case["temperature"], case["top_k"], case["top_p"], case["min_p"],
                      torch.zeros(ROWS, dtype=torch.int64), torch.zeros(ROWS, dtype=torch.int64),
                      torch.zeros(ROWS, dtype=torch.bool), torch.tensor(3), candidates=VOCAB)
    assert out.shape == (ROWS,) and out.dtype == torch.int64 and out.device == case["logits"].device
    assert ((out >= 0) & (out < VOCAB)).all()
