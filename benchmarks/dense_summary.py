"""Gather one device session's dense-model figures (#47's Qwen3-8B-shape targets) into one results
file, the keys the issue names, each figure beside its target and whether it met it; a figure not
given is recorded as null ("not measured"), never guessed.

    python3 benchmarks/dense_summary.py --decode-c1 C1.json --decode-32k C32K.json \\
        --serving SERVING_DIR --gpu-tests LOG... --out benchmarks/results/h200-dense.json

C1.json / C32K.json: `benchmarks/decode_c1.py --out` at `--context 1024` and `--context 32768`;
SERVING_DIR: `benchmarks/h200_serving.sh`'s OUTDIR (bench-c64.json, bench-c64-decode-heavy.json,
startup-cold.txt, startup-warm.txt); LOG: pytest output of the GPU tests (their last "N passed, M
failed" line each). The device is the decode runs' (`--device` where there are none).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from provenance import commit_and_date, report

# Targets of #47 on the H200 (a figure from another device is recorded against them all the same);
# the c=1 roofline fraction has none of its own there (86.3 % measured), the tests must all pass.
TARGETS = {
    "bench_c64_output_tok_s": (">=", 6000.0),
    "bench_c64_decode_heavy_output_tok_s": (">=", 9500.0),
    "startup_cold_s": ("<=", 30.0),
    "startup_warm_s": ("<=", 10.0),
    "tpot_32k_roofline_fraction": (">=", 0.85),
    "gpu_tests_failed": ("<=", 0),
}


def _json(path: Path | None) -> dict | None:
    return json.loads(path.read_text()) if path is not None and path.exists() else None


def _startup(path: Path) -> float | None:
    """The seconds of a `startup_cold_s 37.5` line h200_serving.sh writes."""
    return float(path.read_text().split()[1]) if path.exists() else None


def test_counts(logs: list[Path]) -> tuple[int, int] | None:
    """Passed and failed tests over pytest logs, from each one's last summary line."""
    if not logs:
        return None
    passed = failed = 0
    for log in logs:
        summaries = [line for line in log.read_text().splitlines() if re.search(r"\d+ (passed|failed)", line)]
        if not summaries:
            raise SystemExit(f"{log}: no pytest summary line (did the run finish?)")
        last = summaries[-1]
        passed += sum(int(n) for n in re.findall(r"(\d+) passed", last))
        failed += sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", last))
    return passed, failed


def summary(decode_c1: dict | None, decode_32k: dict | None, serving: Path | None,
            tests: tuple[int, int] | None) -> dict:
    c64 = _json(serving / "bench-c64.json") if serving else None
    heavy = _json(serving / "bench-c64-decode-heavy.json") if serving else None
    figures = {
        "decode_c1_roofline_fraction": decode_c1["roofline_fraction_c1"] if decode_c1 else None,
        "bench_c64_output_tok_s": c64["metrics"]["output_throughput"] if c64 else None,
        "bench_c64_decode_heavy_output_tok_s": heavy["metrics"]["output_throughput"] if heavy else None,
        "startup_cold_s": _startup(serving / "startup-cold.txt") if serving else None,
        "startup_warm_s": _startup(serving / "startup-warm.txt") if serving else None,
        "tpot_32k_roofline_fraction": decode_32k["roofline_fraction_weights_kv"] if decode_32k else None,
        "gpu_tests_passed": tests[0] if tests else None,
        "gpu_tests_failed": tests[1] if tests else None,
    }
    met = {}
    for key, (op, bound) in TARGETS.items():
        value = figures[key]
        met[key] = None if value is None else (value >= bound if op == ">=" else value <= bound)
    return {**figures, "targets": {k: f"{op} {bound}" for k, (op, bound) in TARGETS.items()}, "met": met}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-c1", type=Path)
    parser.add_argument("--decode-32k", type=Path)
    parser.add_argument("--serving", type=Path)
    parser.add_argument("--gpu-tests", type=Path, nargs="*", default=[])
    parser.add_argument("--device", help="the device, where no decode run names it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    decode_c1, decode_32k = _json(args.decode_c1), _json(args.decode_32k)
    if decode_32k is not None and decode_32k.get("context") != 32768:
        raise SystemExit(f"--decode-32k: a run at context {decode_32k.get('context')}, not 32768")
    devices = {d["device"] for d in (decode_c1, decode_32k) if d is not None} | ({args.device} if args.device else set())
    if len(devices) != 1:
        raise SystemExit(f"one device per summary, got {sorted(devices) or 'none (give --device)'}")
    result = summary(decode_c1, decode_32k, args.serving, test_counts(args.gpu_tests))
    report({**result, "device": devices.pop(), **commit_and_date()}, args.out)


if __name__ == "__main__":
    main()
