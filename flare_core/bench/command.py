"""The `flare bench` command."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import click

from flare_core.bench.client import BenchError
from flare_core.bench.datasets import BenchRequest, conversation_requests, random_requests, shared_prefix_requests
from flare_core.bench.metrics import compute_metrics
from flare_core.bench.report import format_table, result_json
from flare_core.bench.runner import normalize_base_url, run_benchmark

DATASETS = ("random", "shared-prefix", "jsonl")


def _read_api_key(path: Path | None) -> dict[str, str]:
    if path is None:
        return {}
    key = path.read_text(encoding="utf-8").strip()
    if not key:
        raise click.BadParameter(f"{path} is empty", param_hint="--api-key-file")
    return {"Authorization": f"Bearer {key}"}


def _read_response_format(path: Path | None) -> dict | None:
    """The `response_format` that constrains output to the JSON schema in `path`."""
    if path is None:
        return None
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise click.BadParameter(f"{path} is not JSON: {exc}", param_hint="--json-schema") from exc
    if not isinstance(schema, dict):
        raise click.BadParameter(f"{path} holds no JSON object", param_hint="--json-schema")
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema, "strict": True}}


def _build_requests(params: dict, card: dict) -> list[BenchRequest]:
    """The workload for the served model `card` (its vocab_size, where the server reports one,
    bounds synthetic token ids)."""
    dataset, count, seed = params["dataset"], params["num_prompts"], params["seed"]
    vocab_size = card.get("vocab_size") if isinstance(card.get("vocab_size"), int) else None
    if dataset == "random":
        return random_requests(count, params["random_input_len"], params["random_output_len"], seed, vocab_size)
    if dataset == "shared-prefix":
        return shared_prefix_requests(count, params["shared_prefix_len"], params["shared_suffix_len"],
                                      params["shared_output_len"], seed, vocab_size)
    return conversation_requests(params["dataset_path"], count, params["jsonl_output_len"])


@click.command("bench")
@click.option("--base-url", default="http://127.0.0.1:8000", show_default=True, help="The server to load.")
@click.option("--model", default=None, help="Model name to request (default: the first of /v1/models).")
@click.option("--api-key-file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="File holding the bearer token the server expects.")
@click.option("--dataset", type=click.Choice(DATASETS), default="random", show_default=True,
              help="random: token-id prompts of exact length; shared-prefix: one long shared prefix + a "
                   "unique suffix each; jsonl: chat conversations from --dataset-path.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=1000, show_default=True,
              help="Requests to send (jsonl: at most the file's conversations).")
@click.option("--random-input-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--random-output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--shared-prefix-len", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--shared-suffix-len", type=click.IntRange(min=0), default=128, show_default=True)
@click.option("--shared-output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--dataset-path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help='JSONL file, one {"messages": [...], "max_tokens"?: N} conversation per line.')
@click.option("--jsonl-output-len", type=click.IntRange(min=1), default=256, show_default=True,
              help="max_tokens of conversations that set none.")
@click.option("--json-schema", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Constrain every request's output to this JSON schema (response_format json_schema).")
@click.option("--ignore-eos", is_flag=True, help="Generate exactly max_tokens tokens (ignore end-of-sequence).")
@click.option("--max-concurrency", type=click.IntRange(min=1), default=None,
              help="Requests in flight at most (default: unlimited).")
@click.option("--request-rate", type=float, default=math.inf, show_default=True,
              help="Poisson arrival rate in requests/s; inf sends all at once.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of prompts and arrival times.")
@click.option("--num-warmups", type=click.IntRange(min=0), default=0, show_default=True,
              help="Unmeasured requests sent one by one first (the dataset's first requests).")
@click.option("--result-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the metrics, this configuration and the server's models as JSON.")
def bench(**params) -> None:
    """Benchmark a running OpenAI-compatible server (`flare run`, vLLM, ...) with streamed requests:
    TTFT, TPOT, ITL, end-to-end latency, throughput and prefix-cache reuse."""
    if not params["request_rate"] > 0:
        raise click.BadParameter(f"must be positive (or inf), got {params['request_rate']}",
                                 param_hint="--request-rate")
    if params["dataset"] == "jsonl" and params["dataset_path"] is None:
        raise click.BadParameter("--dataset jsonl needs --dataset-path FILE", param_hint="--dataset-path")
    headers = _read_api_key(params["api_key_file"])

    response_format = _read_response_format(params["json_schema"])

    def workload(card: dict) -> list[BenchRequest]:
        requests = _build_requests(params, card)
        if response_format is not None:
            requests = [BenchRequest(r.path, {**r.body, "response_format": response_format}) for r in requests]
        click.echo(f"sending {len(requests)} {params['dataset']} requests to {params['base_url']}", err=True)
        return requests

    try:
        run = asyncio.run(run_benchmark(
            params["base_url"], workload, model=params["model"], headers=headers, ignore_eos=params["ignore_eos"],
            max_concurrency=params["max_concurrency"], request_rate=params["request_rate"], seed=params["seed"],
            num_warmups=params["num_warmups"]))
    except (BenchError, ValueError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    metrics = compute_metrics(run.results, run.duration_s)
    click.echo(format_table(metrics, max_concurrency=params["max_concurrency"], request_rate=params["request_rate"]))
    if params["result_file"] is not None:
        result = result_json(run, metrics, params, normalize_base_url(params["base_url"]))
        params["result_file"].write_text(json.dumps(result, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        click.echo(f"result written to {params['result_file']}", err=True)
    if metrics.failed:
        first_error = next(result.error for result in run.results if not result.ok)
        raise click.ClickException(f"{metrics.failed} of {len(run.results)} requests failed; first error: "
                                   f"{first_error}")
