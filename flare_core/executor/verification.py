"""Speculative verification: the target model scored a request's pending token and its D draft
tokens in one step (logits at D+1 positions); which drafts it keeps, and the token after them.

Two rules, both exact (the output is distributed as plain decoding's):
- **Coupled sampling**, for proposals without probabilities (prompt lookup, a draft drawn with the
  request's own noise, flare_core.engine.drafting): each position's token is sampled as plain
  decoding samples it — the same filters, and the same noise key (seed, tokens generated before
  it), see `flare_core.executor.sampling` — and drafts are kept while they equal those tokens. For
  a one-hot proposal this accepts draft d with probability p(d), as rejection sampling would; a
  draft drawn from q with the same noise is kept with probability at least (1 - d) / (1 + d), d
  the total variation distance of p and q (Daliri et al. 2024). A seeded request's output is token
  for token the one it gets without speculation. What the engine uses.
- **Rejection sampling** (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
  Decoding", Algorithm 1), for drafts sampled from a distribution q the proposer reports (no
  proposer reports one: the engine does not use it): draft d
  is kept with probability min(1, p(d) / q(d)); at the first rejection the token is drawn from
  max(p - q, 0) renormalised; after D kept drafts, the bonus token from p.
Greedy rows (temperature 0) keep drafts equal to the argmax and take the argmax after them, under
either rule.

Shapes: B requests, D draft slots (a request may fill fewer: `widths`), V tokens. Graph-capturable
like `sample_rows`: no host synchronisation, shapes fixed by (B, D, V), randomness from the keys.
"""

from __future__ import annotations

import torch

from flare_core.executor.sampling import (exponential_noise, filter_weights, first_argmax, row_keys, sample_rows,
                                          uniform_noise)

# Keys the acceptance draws apart from the noise of the token race at the same step.
_ACCEPT_SALT = 0x68E31DA4


def _per_position(values: torch.Tensor, positions: int) -> torch.Tensor:
    """[B] -> [B * positions], each row's value repeated for its positions."""
    return values.repeat_interleave(positions, dim=0)


def verify(logits: torch.Tensor, drafts: torch.Tensor, widths: torch.Tensor, temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
           seeded: torch.Tensor, unseeded_seed: torch.Tensor, draft_probs: torch.Tensor | None = None,
           candidates: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, D+1] int64, accepted [B] int64): row b's output is tokens[b, :accepted[b] + 1],
    its first accepted[b] entries being its kept drafts.

    `logits` [B, D+1, V] fp32, already penalised as plain decoding would at each position (counting
    the drafts before it as output); `drafts` [B, D] int64, of which the first widths[b] are row
    b's; per-row sampling values as `sample_rows` takes them, `steps[b]` the tokens row b generated
    before position 0; `draft_probs` [B, D, V]: the distributions the drafts were drawn from (None:
    coupled sampling)."""
    batch, positions, vocab = logits.shape
    slots = positions - 1
    flat = logits.reshape(batch * positions, vocab)
    offsets = torch.arange(positions, dtype=torch.int64, device=logits.device).repeat(batch)
    flat_steps = _per_position(steps, positions) + offsets
    flat_temperature = _per_position(temperature, positions)
    row_values = [_per_position(v, positions) for v in (top_k, top_p, min_p, seeds, seeded)]
    flat_top_k, flat_top_p, flat_min_p, flat_seeds, flat_seeded = row_values
    in_width = torch.arange(slots, device=logits.device)[None, :] < widths[:, None]

    if draft_probs is None:
        sampled = sample_rows(flat, flat_temperature, flat_top_k, flat_top_p, flat_min_p, flat_seeds, flat_steps,
                              flat_seeded, unseeded_seed, candidates).view(batch, positions)
        kept = (sampled[:, :slots] == drafts) & in_width
        return sampled, kept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    weights = filter_weights(flat, flat_temperature, flat_top_k, flat_top_p, flat_min_p, candidates)
    target = (weights / weights.sum(dim=-1, keepdim=True)).view(batch, positions, vocab)
    greedy = first_argmax(flat).view(batch, positions)
    keys = row_keys(flat_seeds, flat_steps, flat_seeded, unseeded_seed)
    uniform = uniform_noise(keys, _ACCEPT_SALT).view(batch, positions)[:, :slots]

    p_draft = target[:, :slots].gather(2, drafts[:, :, None]).squeeze(2)
    q_draft = draft_probs.gather(2, drafts[:, :, None]).squeeze(2)
    is_greedy = (temperature == 0)[:, None]
    kept = torch.where(is_greedy, drafts == greedy[:, :slots], uniform * q_draft <= p_draft) & in_width
    accepted = kept.to(torch.int64).cumprod(dim=1).sum(dim=1)

    # The token after the kept drafts: from the residual max(p - q, 0) where a draft was refused,
    # from p after all of a row's drafts (no draft there: q counts as 0).
    q_padded = torch.cat([draft_probs * in_width[:, :, None], draft_probs.new_zeros(batch, 1, vocab)], dim=1)
    residual = (target - q_padded).clamp_(min=0.0).view(batch * positions, vocab)
    drawn = first_argmax(residual / exponential_noise(keys, vocab)).view(batch, positions)
    tokens = torch.cat([drafts, drafts.new_zeros(batch, 1)], dim=1)
    last = torch.where(is_greedy.squeeze(1), greedy.gather(1, accepted[:, None]).squeeze(1),
                       drawn.gather(1, accepted[:, None]).squeeze(1))
    return tokens.scatter(1, accepted[:, None], last[:, None]), accepted
