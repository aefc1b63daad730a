"""A core split over two tensor-parallel ranks (`flare export --tp 2`) served by `flare run
--device cpu`: the server is rank 0 and leads one worker process over a gloo group. Through the
openai SDK it answers greedy requests token for token as the unsplit core does (Qwen3,
Qwen3-MoE and DeepSeek-V3), reuses a shared prefix (cached tokens > 0, same answer), survives a client that hangs
up mid-stream with every slot back, and stops its worker on SIGTERM; a worker that dies fails the
server (exit status 1), not a hang. A recipe without a tensor-parallel declaration, or a config
that does not divide, is refused at export. DeepSeek-V3 also with its routed experts
expert-parallel (`--expert-parallel`: half of the experts whole on each rank)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import openai
import pytest
from tokenizers import Tokenizer

from conftest import FIXTURES
from flare_testing.server import ServerProcess, SseReader, wait_until

SERVED = "tiny"
PROMPTS = ["Write a haiku about the sea.", "List three prime numbers.", "What is the capital of Italy?"]
EXPORT = ("--dtype", "float32", "--max-concurrency", "4", "--context-length", "1024", "--prefill-chunk-size", "128")


def deepseek_v3_checkpoint(directory: Path) -> Path:
    """A tiny DeepSeek-V3 (MLA, a dense first layer, group-limited MoE with a shared expert) with
    DeepSeek-V3's real chat template and a byte-level tokenizer holding its special tokens."""
    from transformers import DeepseekV3Config

    from flare_testing.deepseek import ascii_tokenizer_json, random_model, save_model, write_frontend

    special = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
    vocab_size = len(Tokenizer.from_str(ascii_tokenizer_json(special)).get_vocab())
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, first_k_dense_replace=1, max_position_embeddings=1024, architectures=["DeepseekV3ForCausalLM"])
    save_model(directory, random_model(config, seed=5))
    write_frontend(directory, vocab_size=vocab_size, special_tokens=special,
                   chat_template=(FIXTURES / "chat_templates" / "deepseek-ai-DeepSeek-V3.jinja").read_text("utf-8"),
                   bos_token=special[0], eos_token=special[1], stop_token=special[1])
    return directory


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe", "deepseek-v3", "deepseek-v3-expert-parallel"])
def servers(request, session_flare, qwen3_checkpoint, qwen3_moe_checkpoint, tmp_path_factory):
    """(split server, whole server) over the same checkpoint."""
    root = tmp_path_factory.mktemp(f"tp-{request.param}")
    checkpoint, flags = {"qwen3": (qwen3_checkpoint, ()), "qwen3-moe": (qwen3_moe_checkpoint, ())}.get(
        request.param) or (deepseek_v3_checkpoint(root / "checkpoint"), ("--recipe", "deepseek-v3"))
    expert_parallel = ("--expert-parallel",) if request.param.endswith("expert-parallel") else ()
    split_core = session_flare.export(checkpoint, *EXPORT, *flags, "--tp", "2", *expert_parallel)
    whole_core = session_flare.export(checkpoint, *EXPORT, *flags)
    split = ServerProcess(session_flare.config_path, split_core, root / "split.log", "--served-name", SERVED)
    split.expert_parallel = bool(expert_parallel)
    whole = ServerProcess(session_flare.config_path, whole_core, root / "whole.log", "--served-name", SERVED)
    try:
        for server in (split, whole):
            server.wait_ready()
        yield split, whole
    finally:
        for server in (split, whole):
            if server.process.poll() is None:
                server.stop()


def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(server: ServerProcess, prompt: str):
    return client(server).chat.completions.create(model=SERVED, messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=16, temperature=0)


def test_split_core_answers_as_the_whole_core(servers):
    split, whole = servers
    assert "tensor-parallel over 2 ranks" in split.log()
    assert f"expert_parallel={split.expert_parallel}" in split.log()
    counts = [server.post("/api/show", {"model": SERVED}).json()["model_info"]["general.parameter_count"]
              for server in (split, whole)]
    assert counts[0] == counts[1]  # the whole model's, not rank 0's share
    for prompt in PROMPTS:
        ours, reference = greedy(split, prompt), greedy(whole, prompt)
        assert ours.choices[0].message.content == reference.choices[0].message.content, prompt
        assert ours.usage.completion_tokens == reference.usage.completion_tokens


def test_a_shared_prefix_is_reused_and_answers_the_same(servers):
    split, whole = servers
    messages = [{"role": "system", "content": "You are a terse assistant who answers in one line."},
                {"role": "user", "content": "Name a river in France."}]

    def chat(server):
        return client(server).chat.completions.create(model=SERVED, messages=messages, max_tokens=12, temperature=0)

    first, second, reference = chat(split), chat(split), chat(whole)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert first.choices[0].message == second.choices[0].message == reference.choices[0].message


def test_a_client_hanging_up_mid_stream_frees_its_slot(servers):
    split, _ = servers
    stream = SseReader(split.url, "/v1/chat/completions",
                       {"model": SERVED, "messages": [{"role": "user", "content": "Count to one hundred."}],
                        "max_tokens": 200, "stream": True, "temperature": 0, "ignore_eos": True})
    assert stream.status == 200
    assert isinstance(stream.next_event(), dict)  # generation has started on both ranks
    stream.close()
    split.wait_metrics({"flare_slots_live": 0.0, "flare_requests_waiting": 0.0})
    after = greedy(split, PROMPTS[0])  # and the group still steps together
    assert after.choices[0].message.content == greedy(servers[1], PROMPTS[0]).choices[0].message.content


def test_export_plans_the_split_and_refuses_what_does_not_split(flare, qwen3_checkpoint, qwen3_moe_checkpoint,
                                                                tmp_path):
    from transformers import LlamaConfig

    from conftest import write_checkpoint

    plan = flare("export", qwen3_moe_checkpoint, *EXPORT, "--tp", "2", "--no-progress").output
    assert "tensor parallelism: 2 ranks" in plan and "the head split over the vocabulary (75968 rows each)" in plan
    plan = flare("export", qwen3_checkpoint, *EXPORT, "--tp", "2", "--no-progress").output
    assert "the head whole on every rank (tied to the embeddings" in plan
    plan = flare("export", qwen3_moe_checkpoint, *EXPORT, "--tp", "2", "--expert-parallel", "--no-progress").output
    assert ("the routed experts expert-parallel: 2 of the 4 whole on each rank" in plan
            and "1/2 of num_attention_heads, num_key_value_heads, intermediate_size, the routed" in plan)
    assert sorted(line.split()[3:5] for line in flare("cores").output.splitlines()) == [
        ["float32", "tp2"], ["float32", "tp2"], ["float32", "tp2-ep"]]
    result = flare("export", qwen3_checkpoint, *EXPORT, "--tp", "2", "--expert-parallel", "--no-progress",
                   expect_ok=False)
    assert result.exit_code != 0 and "recipe qwen3: the recipe declares no expert parallelism" in result.output
    result = flare("export", qwen3_moe_checkpoint, *EXPORT, "--expert-parallel", "--no-progress", expect_ok=False)
    assert result.exit_code != 0 and "--expert-parallel spreads the routed experts over the ranks of --tp N" in \
        result.output
    result = flare("export", qwen3_checkpoint, *EXPORT, "--tp", "4", "--no-progress", expect_ok=False)
    assert result.exit_code != 0 and "config.num_key_value_heads = 2 does not divide over 4" in result.output
    llama = write_checkpoint(tmp_path / "llama", LlamaConfig(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024))
    result = flare("export", llama, *EXPORT, "--recipe", "llama", "--tp", "2", "--no-progress", expect_ok=False)
    assert result.exit_code != 0 and "recipe llama declares no tensor parallelism" in result.output


def worker_pids(server: ServerProcess) -> list[int]:
    match = re.search(r"tensor-parallel ranks .*worker_pids=\[([0-9, ]+)\]", server.log())
    assert match, server.log()
    return [int(pid) for pid in match.group(1).split(",")]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_sigterm_stops_the_workers_and_a_dead_worker_fails_the_server(session_flare, qwen3_checkpoint, tmp_path):
    core = session_flare.export(qwen3_checkpoint, *EXPORT, "--tp", "2")
    server = ServerProcess(session_flare.config_path, core, tmp_path / "stopped.log", "--served-name", SERVED)
    server.wait_ready()
    [pid] = worker_pids(server)
    assert greedy(server, PROMPTS[1]).usage.completion_tokens > 0
    server.stop()  # SIGTERM: exit status 0
    wait_until(lambda: gone(pid), 30, f"worker {pid} to exit")

    server = ServerProcess(session_flare.config_path, core, tmp_path / "killed.log", "--served-name", SERVED)
    server.wait_ready()
    [pid] = worker_pids(server)
    os.kill(pid, 9)  # no request follows: the server must notice on its own, while idle
    assert server.wait_exit() == 1, server.log()
    assert f"tensor-parallel worker flare-rank-1 (pid {pid}) exited with status -9" in server.log()


@pytest.mark.parametrize("flags,message", [
    (("--gpus", "0,0"), "distinct GPU indices"),
    (("--gpus", "0,x"), "comma-separated GPU indices"),
    (("--gpus", "0,1", "--device", "cpu"), "--gpus serves on CUDA devices: it does not go with --device cpu"),
])
def test_gpus_flag_is_checked_before_loading(session_flare, qwen3_checkpoint, flags, message):
    """`flare run --gpus` names what is wrong with the list before anything is loaded."""
    core = session_flare.export(qwen3_checkpoint, *EXPORT, "--tp", "2")
    result = session_flare("run", core, "--port", "0", "--no-dashboard", *flags, expect_ok=False)
    assert result.exit_code != 0
    assert message in result.output, result.output
