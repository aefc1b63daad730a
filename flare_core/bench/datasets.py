"""Benchmark workloads: what each request sends, built before the run so sending costs nothing.

Synthetic prompts are token-id lists (the OpenAI Completions API accepts them), so the client
needs no tokenizer and every prompt has exactly the requested length. Ids are drawn uniformly
from TOKEN_ID_RANGE: clear of the low ids (bytes, punctuation) and below the large vocabularies
(Llama 3: 128k, Qwen: 152k, DeepSeek: 129k), hence never a special token. A server that reports
a smaller `vocab_size` (Flare's /v1/models does; SmolLM2 has 49,152 tokens) gets ids below it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
TOKEN_ID_RANGE = (1000, 100_000)


@dataclass(frozen=True)
class BenchRequest:
    """One request: the route and the body fields of the workload (the client adds model and streaming)."""

    path: str
    body: dict[str, Any]


def _positive(name: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def token_id_range(vocab_size: int | None) -> tuple[int, int]:
    """Where synthetic token ids are drawn from for a vocabulary of `vocab_size` (None: unknown)."""
    low, high = TOKEN_ID_RANGE
    if vocab_size is None or vocab_size >= high:
        return low, high
    if vocab_size < 2 * low:
        raise ValueError(f"the server's vocabulary ({vocab_size} tokens) is too small for synthetic prompts, "
                         f"which avoid the lowest {low} ids")
    return low, vocab_size


def _token_ids(rng: random.Random, count: int, id_range: tuple[int, int]) -> list[int]:
    return [rng.randrange(*id_range) for _ in range(count)]


def random_requests(num_prompts: int, input_len: int, output_len: int, seed: int,
                    vocab_size: int | None = None) -> list[BenchRequest]:
    """`num_prompts` independent prompts of exactly `input_len` random token ids."""
    _positive("num_prompts", num_prompts)
    _positive("random input length", input_len)
    _positive("random output length", output_len)
    rng, id_range = random.Random(seed), token_id_range(vocab_size)
    return [BenchRequest(COMPLETIONS_PATH, {"prompt": _token_ids(rng, input_len, id_range), "max_tokens": output_len})
            for _ in range(num_prompts)]


def shared_prefix_requests(num_prompts: int, prefix_len: int, suffix_len: int, output_len: int,
                           seed: int, vocab_size: int | None = None) -> list[BenchRequest]:
    """Prompts sharing one `prefix_len`-token prefix (a long system prompt), each followed by its
    own `suffix_len` random tokens: the prefix cache should serve the prefix after the first request."""
    _positive("num_prompts", num_prompts)
    _positive("shared prefix length", prefix_len)
    _positive("shared suffix length", suffix_len, minimum=0)
    _positive("shared output length", output_len)
    rng, id_range = random.Random(seed), token_id_range(vocab_size)
    prefix = _token_ids(rng, prefix_len, id_range)
    return [BenchRequest(COMPLETIONS_PATH,
                         {"prompt": prefix + _token_ids(rng, suffix_len, id_range), "max_tokens": output_len})
            for _ in range(num_prompts)]


def conversation_requests(path: Path, num_prompts: int, output_len: int) -> list[BenchRequest]:
    """Chat requests from a JSONL file, one conversation per line: {"messages": [...]} with the
    whole (multi-turn) history, optionally "max_tokens" (else `output_len`). The first
    `num_prompts` lines are used; blank lines are skipped."""
    _positive("num_prompts", num_prompts)
    _positive("jsonl output length", output_len)
    requests: list[BenchRequest] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if len(requests) == num_prompts:
                break
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not valid JSON ({exc})") from exc
            if not isinstance(record, dict) or not isinstance(record.get("messages"), list) or not record["messages"]:
                raise ValueError(f"{where}: expected an object with a non-empty \"messages\" array")
            max_tokens = record.get("max_tokens", output_len)
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"{where}: \"max_tokens\" must be a positive integer, got {max_tokens!r}")
            requests.append(BenchRequest(CHAT_PATH, {"messages": record["messages"], "max_tokens": max_tokens}))
    if not requests:
        raise ValueError(f"{path}: no conversations in the file")
    return requests
