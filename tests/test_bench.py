"""`flare bench`: the metrics math on hand-made timings, the workloads and arrival schedules, and
end-to-end runs of the command against a real `flare run` of a tiny core."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from click.testing import CliRunner

from flare_core.bench import (
    RequestResult,
    arrival_offsets,
    compute_metrics,
    conversation_requests,
    percentile,
    random_requests,
    shared_prefix_requests,
)
from flare_core.bench.command import bench
from flare_core.bench.datasets import TOKEN_ID_RANGE
from flare_testing.server import ServerProcess


def test_percentile_interpolates_between_closest_ranks():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)


def test_metrics_of_hand_made_timings():
    results = [
        # 5 output tokens in 4 chunks: TPOT = (1.0 - 0.2) / 4 = 0.2 s
        RequestResult(started=10.0, ok=True, ttft=0.2, e2el=1.0, itl=(0.3, 0.2, 0.3),
                      prompt_tokens=100, output_tokens=5, cached_tokens=64),
        # 3 output tokens: TPOT = (0.6 - 0.4) / 2 = 0.1 s
        RequestResult(started=10.5, ok=True, ttft=0.4, e2el=0.6, itl=(0.2,),
                      prompt_tokens=60, output_tokens=3, cached_tokens=0),
        # one output token has no TPOT and no ITL
        RequestResult(started=11.0, ok=True, ttft=0.3, e2el=0.3, itl=(),
                      prompt_tokens=40, output_tokens=1, cached_tokens=0),
        RequestResult(started=11.0, ok=False, error="HTTP 429: full", e2el=0.01),
    ]
    metrics = compute_metrics(results, duration_s=2.0)
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert (metrics.input_tokens, metrics.output_tokens, metrics.cached_tokens) == (200, 9, 64)
    assert metrics.request_throughput == 1.5
    assert metrics.output_throughput == 4.5
    assert metrics.total_token_throughput == 104.5
    assert metrics.prefix_reuse == 0.32
    assert metrics.ttft_ms.mean == pytest.approx(300.0)
    assert metrics.ttft_ms.median == pytest.approx(300.0)
    assert metrics.ttft_ms.p99 == pytest.approx(398.0)
    assert metrics.tpot_ms.mean == pytest.approx(150.0)
    assert metrics.tpot_ms.p99 == pytest.approx(199.0)
    assert metrics.itl_ms.mean == pytest.approx(250.0)  # pooled: 0.3, 0.2, 0.3, 0.2
    assert metrics.itl_ms.median == pytest.approx(250.0)
    assert metrics.e2el_ms.median == pytest.approx(600.0)
    assert metrics.e2el_ms.mean == pytest.approx(statistics.fmean([1000.0, 600.0, 300.0]))


def test_metrics_without_samples_report_none():
    single_tokens = [RequestResult(started=0.0, ok=True, ttft=0.1, e2el=0.1, prompt_tokens=8, output_tokens=1)]
    metrics = compute_metrics(single_tokens, duration_s=1.0)
    assert metrics.tpot_ms is None and metrics.itl_ms is None
    assert metrics.ttft_ms.p99 == pytest.approx(100.0)
    all_failed = compute_metrics([RequestResult(started=0.0, ok=False, error="boom")], duration_s=1.0)
    assert all_failed.completed == 0 and all_failed.ttft_ms is None and all_failed.prefix_reuse == 0.0
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(single_tokens, duration_s=0.0)


def test_poisson_arrivals_are_seeded_with_the_requested_rate():
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(20_000, 50.0, seed=1)
    assert offsets == arrival_offsets(20_000, 50.0, seed=1)
    assert offsets != arrival_offsets(20_000, 50.0, seed=2)
    gaps = [later - earlier for earlier, later in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and min(gaps) >= 0.0
    assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.stdev(gaps) == pytest.approx(1 / 50.0, rel=0.05)
    with pytest.raises(ValueError, match="request rate"):
        arrival_offsets(1, 0.0, seed=0)


def test_synthetic_prompts_have_exact_lengths_and_share_the_prefix():
    requests = random_requests(3, input_len=50, output_len=7, seed=3)
    assert [len(r.body["prompt"]) for r in requests] == [50, 50, 50]
    assert all(r.body["max_tokens"] == 7 and r.path == "/v1/completions" for r in requests)
    assert all(TOKEN_ID_RANGE[0] <= token < TOKEN_ID_RANGE[1] for r in requests for token in r.body["prompt"])
    assert requests == random_requests(3, input_len=50, output_len=7, seed=3)
    assert requests[0].body["prompt"] != requests[1].body["prompt"]
    shared = shared_prefix_requests(3, prefix_len=40, suffix_len=5, output_len=2, seed=0)
    assert [len(r.body["prompt"]) for r in shared] == [45, 45, 45]
    assert shared[0].body["prompt"][:40] == shared[2].body["prompt"][:40]
    assert shared[0].body["prompt"][40:] != shared[1].body["prompt"][40:]
    with pytest.raises(ValueError, match="random input length must be at least 1, got 0"):
        random_requests(1, input_len=0, output_len=1, seed=0)


def test_synthetic_token_ids_stay_below_the_servers_vocabulary():
    small = random_requests(4, input_len=500, output_len=1, seed=0, vocab_size=49_152)
    ids = [token for r in small for token in r.body["prompt"]]
    assert min(ids) >= TOKEN_ID_RANGE[0] and max(ids) < 49_152 and max(ids) > 40_000
    assert random_requests(2, input_len=50, output_len=1, seed=0, vocab_size=151_936) == \
        random_requests(2, input_len=50, output_len=1, seed=0)
    shared = shared_prefix_requests(2, prefix_len=300, suffix_len=300, output_len=1, seed=0, vocab_size=5_000)
    assert max(token for r in shared for token in r.body["prompt"]) < 5_000
    with pytest.raises(ValueError, match=r"vocabulary \(1500 tokens\) is too small"):
        random_requests(1, input_len=5, output_len=1, seed=0, vocab_size=1_500)


def test_conversation_file(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "Yo"}]}) + "\n")
    requests = conversation_requests(path, num_prompts=10, output_len=9)
    assert [r.body["max_tokens"] for r in requests] == [3, 9]
    assert all(r.path == "/v1/chat/completions" for r in requests)
    assert len(conversation_requests(path, num_prompts=1, output_len=9)) == 1
    path.write_text(json.dumps({"messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"chats.jsonl:1: .*non-empty \"messages\""):
        conversation_requests(path, num_prompts=1, output_len=9)


# --- end to end, against `flare run` -------------------------------------------------------------

@pytest.fixture(scope="module")
def server(session_flare, qwen3_core, tmp_path_factory):
    process = ServerProcess(session_flare.config_path, qwen3_core, tmp_path_factory.mktemp("bench") / "server.log")
    try:
        yield process.wait_ready()
    finally:
        process.stop()


def run_bench(server, tmp_path, *args: str) -> dict:
    result_file = tmp_path / "result.json"
    outcome = CliRunner().invoke(bench, ["--base-url", server.url, "--result-file", str(result_file), *args],
                                 catch_exceptions=False)
    assert outcome.exit_code == 0, outcome.output
    assert "Serving Benchmark Result" in outcome.output
    return json.loads(result_file.read_text())


def check_sane(result: dict, num_prompts: int) -> dict:
    metrics = result["metrics"]
    assert (metrics["completed"], metrics["failed"]) == (num_prompts, 0)
    assert [r["error"] for r in result["requests"]] == [None] * num_prompts
    assert all(0 < r["ttft_ms"] <= r["e2el_ms"] for r in result["requests"])
    assert 0 < metrics["ttft_ms"]["median"] <= metrics["e2el_ms"]["median"]
    assert metrics["request_throughput"] > 0 and metrics["output_throughput"] > 0
    assert result["model"] == result["server"]["models"]["data"][0]["id"]
    return metrics


def test_random_dataset_end_to_end(server, tmp_path):
    result = run_bench(server, tmp_path, "--dataset", "random", "--random-input-len", "40",
                       "--random-output-len", "8", "--ignore-eos", "--max-concurrency", "3", "--num-prompts", "4",
                       "--num-warmups", "1")
    metrics = check_sane(result, 4)
    assert metrics["input_tokens"] == 4 * 40
    assert metrics["output_tokens"] == 4 * 8
    assert [r["output_tokens"] for r in result["requests"]] == [8] * 4
    assert metrics["tpot_ms"]["mean"] > 0
    assert result["config"]["max_concurrency"] == 3 and result["config"]["request_rate"] == "inf"


def test_shared_prefix_dataset_reuses_the_prefix(server, tmp_path):
    # A 192-token prefix fills three 64-token prefix-cache blocks; Poisson arrivals, one at a time.
    result = run_bench(server, tmp_path, "--dataset", "shared-prefix", "--shared-prefix-len", "192",
                       "--shared-suffix-len", "16", "--shared-output-len", "4", "--ignore-eos",
                       "--num-prompts", "4", "--max-concurrency", "1", "--request-rate", "50", "--seed", "5")
    metrics = check_sane(result, 4)
    assert metrics["output_tokens"] == 4 * 4
    assert metrics["input_tokens"] == 4 * 208
    assert result["requests"][0]["cached_tokens"] == 0
    assert all(r["cached_tokens"] >= 128 for r in result["requests"][1:])
    assert metrics["prefix_reuse"] == metrics["cached_tokens"] / metrics["input_tokens"] > 0.4


def test_jsonl_conversations_end_to_end(server, tmp_path):
    path = tmp_path / "chats.jsonl"
    conversations = [
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
         {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
        [{"role": "user", "content": "Count to three."}],
    ]
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    result = run_bench(server, tmp_path, "--dataset", "jsonl", "--dataset-path", str(path), "--num-prompts", "2",
                       "--jsonl-output-len", "5", "--ignore-eos")
    metrics = check_sane(result, 2)
    assert metrics["output_tokens"] == 2 * 5
    assert result["requests"][0]["prompt_tokens"] > result["requests"][1]["prompt_tokens"] > 5


def test_json_schema_constrains_every_request(server, tmp_path):
    # The schema admits one value, so each request ends once it is written, before its 16 tokens.
    schema = tmp_path / "const.json"
    schema.write_text(json.dumps({"const": "yes"}))
    result = run_bench(server, tmp_path, "--random-input-len", "20", "--random-output-len", "16", "--ignore-eos",
                       "--num-prompts", "2", "--json-schema", str(schema))
    check_sane(result, 2)
    assert all(1 <= r["output_tokens"] < 16 for r in result["requests"])
    assert result["config"]["json_schema"] == str(schema)


def test_json_schema_file_must_hold_an_object(tmp_path):
    schema = tmp_path / "list.json"
    schema.write_text("[1]")
    outcome = CliRunner().invoke(bench, ["--json-schema", str(schema), "--num-prompts", "1"])
    assert outcome.exit_code == 2
    assert "holds no JSON object" in outcome.output


def test_unknown_model_is_a_clear_error(server):
    outcome = CliRunner().invoke(bench, ["--base-url", server.url, "--model", "nope", "--num-prompts", "1"])
    assert outcome.exit_code == 1
    assert "--model 'nope': the server serves" in outcome.output
