"""Grammar compile time as a client sees it, against a running `flare run`: the median time to
first token of a one-token /v1/completions request with no grammar, with a JSON schema the
server has not seen (each request renames one property, so each compiles: cold), and with the
same schema again (cached). The schema is benchmarks/note_schema.json.

    python3 benchmarks/grammar_compile.py --base-url http://127.0.0.1:8000 --out compile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

SCHEMA = json.loads((Path(__file__).parent / "note_schema.json").read_text())


def first_token_ms(base_url: str, model: str, schema: dict | None) -> float:
    body = {"model": model, "prompt": "Write a note.", "max_tokens": 1, "temperature": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "note", "schema": schema}}
    request = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as response:
        reply = json.load(response)
    assert reply["usage"]["completion_tokens"] == 1, reply
    return (time.perf_counter() - started) * 1e3


def renamed(index: int) -> dict:
    """The schema with its `title` property renamed: a source the server has not compiled."""
    properties = {(f"title_{index}" if k == "title" else k): v for k, v in SCHEMA["properties"].items()}
    required = [f"title_{index}" if k == "title" else k for k in SCHEMA["required"]]
    return {**SCHEMA, "properties": properties, "required": required}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with urllib.request.urlopen(args.base_url + "/v1/models", timeout=30) as response:
        model = json.load(response)["data"][0]["id"]
    first_ever = first_token_ms(args.base_url, model, renamed(-1))  # includes the vocabulary's set-up
    runs = {"none": [], "cold": [], "cached": []}
    for index in range(args.repeats):
        runs["none"].append(first_token_ms(args.base_url, model, None))
        runs["cold"].append(first_token_ms(args.base_url, model, renamed(index)))
        runs["cached"].append(first_token_ms(args.base_url, model, renamed(index)))
    result = {"first_grammar_request_ms": round(first_ever, 1)}
    result.update({f"ttft_{name}_median_ms": round(statistics.median(values), 2) for name, values in runs.items()})
    result["compile_cold_ms"] = round(result["ttft_cold_median_ms"] - result["ttft_none_median_ms"], 2)
    result["compile_cached_ms"] = round(result["ttft_cached_median_ms"] - result["ttft_none_median_ms"], 2)
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
