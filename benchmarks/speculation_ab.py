"""Speculative decoding side by side: the same greedy chat requests, one at a time, against a
server without speculation and one with it (`flare run CORE --spec-method prompt-lookup`), both
already running on the same machine. Prints (and with --out writes) per prompt the median wall
time of each, whether the answers are token for token equal (logprobs' tokens), and the spec
server's drafts checked / kept per round from /metrics.

    python3 benchmarks/speculation_ab.py --plain http://127.0.0.1:8125 --spec http://127.0.0.1:8124 \
        --model smollm2-135m-instruct.q4_1 [--repeats 3] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import time
import urllib.request

from prompt_lookup_acceptance import PROMPTS


def spec_counters(url: str) -> dict[str, float]:
    """The speculative counters' totals (rounds summed over their widths)."""
    text = urllib.request.urlopen(url + "/metrics").read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split()[0] if line.startswith("flare_spec_") else ""
        if name.endswith("_total"):
            totals[name] = totals.get(name, 0.0) + float(line.split()[-1])
    return totals


def ask(url: str, model: str, request: str, max_tokens: int) -> tuple[float, list[str]]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": request}], "temperature": 0,
                       "max_tokens": max_tokens, "logprobs": True}).encode()
    started = time.perf_counter()
    reply = json.loads(urllib.request.urlopen(urllib.request.Request(
        url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})).read())
    return time.perf_counter() - started, [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plain", required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    rows = []
    for name, request in PROMPTS.items():
        before = spec_counters(args.spec)
        times: dict[str, list[float]] = {"plain": [], "spec": []}
        answers = {}
        for _ in range(args.repeats):
            for label, url in (("plain", args.plain), ("spec", args.spec)):
                seconds, tokens = ask(url, args.model, request, args.max_tokens)
                times[label].append(seconds)
                answers[label] = tokens
        after = spec_counters(args.spec)
        rounds, kept = (after.get(name, 0.0) - before.get(name, 0.0)
                        for name in ("flare_spec_rounds_total", "flare_spec_accepted_tokens_total"))
        plain_s, spec_s = statistics.median(times["plain"]), statistics.median(times["spec"])
        row = {"prompt": name, "output_tokens": len(answers["plain"]),
               "same_tokens": answers["plain"] == answers["spec"],
               "plain_s": round(plain_s, 3), "spec_s": round(spec_s, 3), "speedup": round(plain_s / spec_s, 2),
               "kept_per_round": round(kept / rounds, 2) if rounds else None, "rounds": int(rounds)}
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.write_text(json.dumps({
            "command": f"python3 benchmarks/speculation_ab.py --plain {args.plain} --spec {args.spec} --model "
                       f"{args.model} --repeats {args.repeats}",
            "tree": commit, "date": datetime.date.today().isoformat(), "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
