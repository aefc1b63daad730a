"""DeepSeek V4.1's Engram conditional memory: the n-gram hashes that address its tables, and the
layer that gates the rows it reads into the residual streams. Facts from Transformers' main
branch, `src/transformers/models/deepseek_v41/modeling_deepseek_v41.py` at
0a2080b43eb64e6d448186a4f3f0bc9c618f4797 (`EngramLayout`, `build_compressed_token_map`,
`compute_hash_multipliers`, `DeepseekV41NgramHashState`, `DeepseekV41Engram`); the code is
Flare's own.

Per token, the `max_ngram_size - 1` n-grams ending at it (2- to N-grams) are hashed over a
compressed vocabulary (token ids whose text normalizes alike share an id): the compressed ids
of the token and the ones before it, each times its own odd multiplier, XORed one look-back at a
time; the n-gram's hash modulo a prime per (n-gram size, head) picks a row of that pair's bucket
range in the layer's table. Look-back stops at the start of the sequence: a missing token counts
as the compressed id of `engram_pad_id`. Each engram layer reads `(N - 1) * heads` rows per
token, projects them to one key per residual stream and a shared value, and adds the value to
each stream gated by a signed-sqrt sigmoid of the stream's normalized agreement with its key.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from flare_core.api import TableRows


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    divisor = 3
    while divisor * divisor <= n:
        if n % divisor == 0:
            return False
        divisor += 2
    return True


def bucket_primes(config: Any) -> list[list[list[int]]]:
    """[engram layer][n-gram size - 2][head] bucket sizes: primes above `engram_vocab_size - 1`,
    drawn in order (layer, n-gram size, head), none twice; each head's search starts again from
    `engram_vocab_size - 1`."""
    seen: set[int] = set()
    layers = []
    for _ in config.engram_layer_ids:
        per_ngram = []
        for _ in range(config.engram_max_ngram_size - 1):
            sizes, current = [], config.engram_vocab_size - 1
            for _ in range(config.engram_n_heads):
                current += 1
                while not _is_prime(current) or current in seen:
                    current += 1
                seen.add(current)
                sizes.append(current)
            per_ngram.append(sizes)
        layers.append(per_ngram)
    return layers


def hash_multipliers(config: Any) -> Tensor:
    """[engram layers, max_ngram_size] odd int64 multipliers, one per look-back, from a NumPy
    generator seeded per layer (10007 * layer id), bounded so that id * multiplier stays in int64."""
    bound = max(1, (np.iinfo(np.int64).max // config.engram_compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(config.engram_max_ngram_size,),
                                                           dtype=np.int64) * 2 + 1
            for layer in config.engram_layer_ids]
    return torch.tensor(np.stack(rows)) if rows else torch.zeros(0, config.engram_max_ngram_size, dtype=torch.int64)


def compressed_token_map(tokenizer_json: str) -> tuple[list[int], int]:
    """token id -> compressed id, and the compressed vocabulary's size, from a tokenizer.json:
    each id decoded alone (special tokens kept) and normalized (NFKC, NFD, accents stripped,
    lowercase, whitespace runs as one space, stripped unless it is a lone space); ids whose text
    holds U+FFFD (partial UTF-8) keep their raw token string. Ids are numbered by first appearance."""
    from tokenizers import Regex, Tokenizer, normalizers

    tokenizer = Tokenizer.from_str(tokenizer_json)
    lone_space = "\ue000"  # a private-use stand-in, so that Strip keeps a token that is one space
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), lone_space),
        normalizers.Strip(), normalizers.Replace(lone_space, " ")])
    ids: dict[str, int] = {}
    lookup = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        key = tokenizer.id_to_token(token_id) if "\ufffd" in text else (normalizer.normalize_str(text) or text)
        lookup.append(ids.setdefault(key, len(ids)))
    return lookup, len(ids)


class NgramHashes(nn.Module):
    """The hash ids of every engram layer for a request's new tokens (buffers built from the config
    at build time; the token map is a prepared tensor, derived from the tokenizer at export)."""

    def __init__(self, config: Any):
        super().__init__()
        primes = bucket_primes(config)
        self.max_ngram = config.engram_max_ngram_size
        self.register_buffer("token_map", torch.zeros(config.vocab_size, dtype=torch.int64))
        with torch.device("cpu"):
            self.register_buffer("primes", torch.tensor(primes, dtype=torch.int64), persistent=False)
            offsets = [np.concatenate([[0], np.cumsum([p for sizes in layer for p in sizes])[:-1]]).tolist()
                       for layer in primes]
            self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.int64), persistent=False)
            self.register_buffer("multipliers", hash_multipliers(config), persistent=False)
        self.pad = config.engram_pad_id

    def forward(self, input_ids: Tensor, history: Tensor, first: int) -> Tensor:
        """[tokens, engram layers, hash columns] row ids for a request's tokens `input_ids` at
        positions first, first + 1, ...; `history` [max_ngram - 1] holds the compressed ids of
        the tokens before `first` by position modulo its length, and takes this chunk's last ones."""
        tokens = input_ids.shape[0]
        compressed = self.token_map[input_ids]
        span = history.shape[0]
        earlier = torch.arange(max(0, first - span), first, device=input_ids.device)
        known = torch.cat([history[earlier % span], compressed])  # ids from position first - len(earlier)
        kept = min(tokens, span)
        history[torch.arange(first + tokens - kept, first + tokens, device=input_ids.device) % span] = \
            compressed[tokens - kept:]
        pad = self.token_map[self.pad]
        positions = torch.arange(first, first + tokens, device=input_ids.device)
        index = positions[:, None] - torch.arange(self.max_ngram, device=input_ids.device)  # [tokens, look-back]
        grams = known[(index - (first - earlier.shape[0])).clamp_min(0)]
        return self._rows(torch.where(index >= 0, grams, pad))

    def decode(self, input_ids: Tensor, history: Tensor, rows: Tensor, positions: Tensor) -> Tensor:
        """`forward` for one new token per request, all at once from device tensors: `input_ids`
        [B] at `positions` [B], `history` the layer's [state rows, max_ngram - 1] (rows `rows`)."""
        compressed = self.token_map[input_ids]
        span = history.shape[1]
        earlier = positions[:, None] - torch.arange(1, self.max_ngram, device=input_ids.device)  # [B, look-back 1..]
        known = history[rows[:, None], earlier % span]
        grams = torch.cat([compressed[:, None], torch.where(earlier >= 0, known, self.token_map[self.pad])], dim=1)
        history[rows, positions % span] = compressed  # after reading: it replaces the oldest look-back
        return self._rows(grams)

    def _rows(self, grams: Tensor) -> Tensor:
        """The row ids [tokens, layers, columns] of the n-grams `grams` [tokens, look-back] end."""
        products = grams[:, None, :] * self.multipliers[None]  # [tokens, layers, look-back]
        rolling, hashes = products[..., 0], []
        for back in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., back])
            hashes.append(rolling[..., None] % self.primes[None, :, back - 1])
        return torch.cat(hashes, dim=-1) + self.offsets[None]


class Engram(nn.Module):
    """One engram layer's table lookup gated into the residual streams (module docstring)."""

    def __init__(self, config: Any, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.table_index = config.engram_layer_ids.index(layer_idx)
        self.hidden_size, self.hc_mult, self.eps = config.hidden_size, config.hc_mult, config.rms_norm_eps
        columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        # ~384 M rows per table in the published model: read per step from the core (disk or host
        # RAM, flare run --embedding-table-storage), never loaded as a weight.
        self.embed = TableRows(config.engram_num_embeddings[self.table_index], config.engram_head_dim,
                               torch.float32, per_token=columns)  # build_model gives it the served dtype
        self.wkv = nn.Linear(columns * config.engram_head_dim, config.hidden_size * (config.hc_mult + 1), bias=False)
        self.q_weight = nn.Parameter(torch.empty(config.hc_mult, config.hidden_size))
        self.k_weight = nn.Parameter(torch.empty(config.hc_mult, config.hidden_size))

    def forward(self, streams: Tensor, rows: Tensor | None) -> Tensor:
        """streams [tokens, hc, hidden], rows [tokens, columns] (None: staged before a captured step,
        flare_core.api.TableRows.staged) -> streams with the gated value added."""
        table = self.embed.staged(streams.shape[0]) if rows is None else self.embed(rows)
        kv = self.wkv(table.flatten(-2).to(streams.dtype))  # the served dtype (an FP8 wkv reads it)
        key, value = kv.split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.hidden_size))
        h = streams.float()
        # Normalized per token and stream over the hidden channels; the two weights only as a product.
        rstd = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.hidden_size ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
