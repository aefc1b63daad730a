"""xgrammar against llguidance for JSON-schema constrained decoding, on the host (no GPU needed):
grammar compile time (cold and cached), and per generated token the time to compute the next
token's bitmask and to advance the matcher, with the real Qwen3 tokenizer (151,643 + special
tokens). The output of each step is a valid JSON instance of the schema, tokenized as the model
would emit it. Decides the library for structured output (issue: structured output).

    pip install xgrammar==0.2.9 llguidance==1.9.1     # not Flare dependencies (yet)
    python3 benchmarks/grammar_libs.py --out benchmarks/results/cpu-grammar-libs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {  # an agent-style tool argument object: nested objects, arrays, enums, numbers, strings
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "units": {"type": "string", "enum": ["metric", "imperial"]},
        "include": {"type": "array", "items": {"type": "string", "enum": ["rain", "wind", "uv", "pollen"]}},
        "location": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                     "required": ["lat", "lon"], "additionalProperties": False},
        "note": {"type": ["string", "null"]},
    },
    "required": ["city", "days", "units", "include", "location", "note"],
    "additionalProperties": False,
}
INSTANCE = {"city": "Paris", "days": 3, "units": "metric", "include": ["rain", "wind"],
            "location": {"lat": 48.8566, "lon": 2.3522}, "note": "a weekend trip, check the evenings"}


def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    from flare_core.frontend.tokenizer import build_tokenizer_json

    text = build_tokenizer_json(ROOT / "tests" / "fixtures" / "tokenizers" / "qwen3")
    path = Path("/tmp/flare-grammar-bench-tokenizer.json")
    path.write_text(text)
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_us": round(statistics.median(ordered) * 1e6, 1),
            "p99_us": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e6, 1)}


def run_xgrammar(tokenizer, tokens: list[int], vocab_size: int) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=True)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA))
    cold = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA))
    cached = time.perf_counter() - started
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    masks, advances = [], []
    for token in tokens:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert matcher.accept_token(token), f"xgrammar refused token {token}"
        advances.append(time.perf_counter() - started)
    assert matcher.is_terminated() or matcher.accept_token(tokenizer.eos_token_id)
    return {"tokenizer_setup_s": round(setup, 3), "compile_cold_ms": round(cold * 1e3, 2),
            "compile_cached_ms": round(cached * 1e3, 3), "mask": summary(masks), "advance": summary(advances)}


def run_llguidance(tokenizer, tokens: list[int], vocab_size: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    started = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup = time.perf_counter() - started
    started = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    cold = time.perf_counter() - started
    assert not matcher.is_error(), matcher.get_error()
    started = time.perf_counter()
    llguidance.LLMatcher(ll_tokenizer, grammar)
    again = time.perf_counter() - started
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
    masks, advances = [], []
    for token in tokens:
        started = time.perf_counter()
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        masks.append(time.perf_counter() - started)
        started = time.perf_counter()
        assert matcher.consume_token(token), f"llguidance refused token {token}: {matcher.get_error()}"
        advances.append(time.perf_counter() - started)
    return {"tokenizer_setup_s": round(setup, 3), "compile_cold_ms": round(cold * 1e3, 2),
            "compile_again_ms": round(again * 1e3, 3), "mask": summary(masks), "advance": summary(advances)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=5, help="generations of the instance per library")
    args = parser.parse_args()
    tokenizer = hf_tokenizer()
    vocab_size = 151936  # Qwen3's embedding rows (the tokenizer has fewer entries)
    tokens = tokenizer.encode(json.dumps(INSTANCE), add_special_tokens=False)
    results: dict = {"schema_tokens": len(tokens), "vocab_size": vocab_size}
    for name, run in (("xgrammar", run_xgrammar), ("llguidance", run_llguidance)):
        runs = [run(tokenizer, tokens, vocab_size) for _ in range(args.repeats)]
        results[name] = runs[-1] | {"compile_cold_ms_first": runs[0]["compile_cold_ms"]}
        print(name, json.dumps(results[name]))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    results.update(machine=f"{platform.processor() or platform.machine()}, {platform.python_version()}",
                   commit=commit.strip(), date=time.strftime("%Y-%m-%d"))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
