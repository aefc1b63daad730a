"""DeepSeek-V3.1 and Kimi K2 end to end: tiny random-weight checkpoints of the DeepSeek-V3
architecture (MLA + MoE, a dense first layer, an MTP layer for DeepSeek) with their real chat
templates and a small byte-level tokenizer holding their special tokens, exported through the
CLI and served by real `flare run` processes on the CPU eager path over the paged latent cache.
Greedy output must equal Transformers `generate` on the same weights, for raw token prompts
(several at once, one longer than the prefill chunk) and for chat prompts rendered by
Transformers' own `apply_chat_template`. The DeepSeek core is also served with its MTP layer
proposing draft tokens (`--spec-method mtp`): the same outputs.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, PreTrainedTokenizerFast

from conftest import FIXTURES
from flare_testing.server import Flare, ServerProcess, stop_all, write_config
from flare_core.core import open_core
from flare_testing.deepseek import add_mtp_layer, ascii_tokenizer_json, random_model, save_model, write_frontend

MAX_TOKENS = 12
PREFILL_CHUNK = 128
MIN_GREEDY_MARGIN = 1e-3
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1, first_k_dense_replace=1,
            max_position_embeddings=1024, architectures=["DeepseekV3ForCausalLM"])
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 1.0,
        "mscale_all_dim": 1.0}


@dataclass(frozen=True)
class Family:
    name: str
    config: dict
    model_type: str | None  # written into config.json in place of "deepseek_v3"
    template: str
    special_tokens: tuple[str, ...]
    bos: str
    stop: str
    export_flags: tuple[str, ...]


DEEPSEEK = Family(
    "tiny-deepseek-v3.1",
    {**TINY, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2,
     "num_nextn_predict_layers": 1, "rope_parameters": {**YARN, "rope_theta": 10000.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0}},
    None, "deepseek-ai-DeepSeek-V3.1.jinja",
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
     "</think>"),
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ("--recipe", "deepseek-v3.1"))
KIMI = Family(
    "tiny-kimi-k2",
    {**TINY, "n_routed_experts": 16, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4,
     "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
     "rope_parameters": {**YARN, "rope_theta": 50000.0, "beta_fast": 1.0, "beta_slow": 1.0}},
    "kimi_k2", "moonshotai-Kimi-K2.jinja",
    ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),
    "[BOS]", "<|im_end|>", ())


MTP_NAME = "tiny-deepseek-v3.1-mtp"


@dataclass
class Served:
    family: Family
    process: ServerProcess
    reference: torch.nn.Module
    tokenizer: Tokenizer
    stop_id: int
    directory: Path  # the checkpoint
    plan: str  # what `flare export` printed
    config_path: Path  # the flare config it was exported and is served with

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.process.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def greedy(self, prompt: list[int]) -> list[int]:
        with torch.no_grad():
            out = self.reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                          eos_token_id=self.stop_id, pad_token_id=self.stop_id,
                                          output_scores=True, return_dict_in_generate=True)
        top2 = torch.stack([scores[0].topk(2).values for scores in out.scores])
        margin = float((top2[:, 0] - top2[:, 1]).min())
        assert margin > MIN_GREEDY_MARGIN, f"reference greedy margin {margin} is float noise"
        return out.sequences[0, len(prompt):].tolist()

    def expected(self, prompt: list[int]) -> tuple[str, int, str]:
        ids = self.greedy(prompt)
        visible = ids[:-1] if ids[-1] == self.stop_id else ids
        return (self.tokenizer.decode(visible, skip_special_tokens=False), len(ids),
                "stop" if ids[-1] == self.stop_id else "length")


def prepare(flare: Flare, root: Path, family: Family) -> tuple[Path, torch.nn.Module, str]:
    directory = root / family.name
    # Every id the model can produce is a token of the tokenizer, so generated text shows every id.
    vocab_size = len(Tokenizer.from_str(ascii_tokenizer_json(family.special_tokens)).get_vocab())
    config = DeepseekV3Config(**family.config, vocab_size=vocab_size)
    reference = random_model(config, seed=11)
    save_model(directory, reference, family.model_type)
    if config.num_nextn_predict_layers:
        add_mtp_layer(directory, config)
    write_frontend(directory, vocab_size=vocab_size, special_tokens=family.special_tokens,
                   chat_template=(FIXTURES / "chat_templates" / family.template).read_text(encoding="utf-8"),
                   bos_token=family.bos, eos_token=family.stop, stop_token=family.stop)
    result = flare("export", directory, *family.export_flags, "--dtype", "float32", "--max-concurrency", "4",
                   "--context-length", "1024", "--prefill-chunk-size", str(PREFILL_CHUNK), "--no-progress")
    return Path(result.output.strip().splitlines()[-1]), reference, result.output


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> dict[str, Served]:
    root = tmp_path_factory.mktemp("deepseek-serving")
    flare = Flare(write_config(root / "flare"))
    prepared = {family.name: (family, *prepare(flare, root, family)) for family in (DEEPSEEK, KIMI)}
    # The DeepSeek core once more, its draft head proposing (MTP_NAME).
    prepared[MTP_NAME] = prepared[DEEPSEEK.name]
    processes = {name: ServerProcess(flare.config_path, core, root / f"{name}.log", "--served-name", name,
                                     *(("--spec-method", "mtp", "--spec-draft-tokens", "3") if name == MTP_NAME else ()))
                 for name, (_, core, _, _) in prepared.items()}
    try:
        result = {}
        for name, (family, core, reference, plan) in prepared.items():
            tokenizer = Tokenizer.from_file(str(root / family.name / "tokenizer.json"))
            result[name] = Served(family, processes[name].wait_ready(), reference, tokenizer,
                                  tokenizer.token_to_id(family.stop), root / family.name, plan, flare.config_path)
        yield result
    finally:
        stop_all(processes.values())


def test_export_plans_and_manifests(served):
    deepseek, kimi = served[DEEPSEEK.name], served[KIMI.name]
    assert "recipe        deepseek-v3.1 0.1.0 (DeepseekV3ForCausalLM)" in deepseek.plan
    assert "cache scheme  mla-latent" in deepseek.plan
    assert "note          draft head: the checkpoint's multi-token-prediction module is stored" in deepseek.plan
    assert "draft head    " in deepseek.plan and "(flare run --spec-method mtp)" in deepseek.plan
    assert ("recipe        kimi-k2 0.1.0 (DeepseekV3ForCausalLM), chosen as the recipe for DeepseekV3ForCausalLM "
            "with model_type kimi_k2") in kimi.plan
    assert "draft head" not in kimi.plan
    core = Path(deepseek.plan.strip().splitlines()[-1])
    manifest = open_core(core).manifest
    assert manifest["draft_head"]["tensors"] == sum(n.startswith("draft_head.") for n in open_core(core).tensor_names())
    assert "draft_head" not in open_core(Path(kimi.plan.strip().splitlines()[-1])).manifest
    assert [s["name"] for s in manifest["cache_scheme"]["paged"]] == ["ckv", "kpe"]
    assert manifest["frontend"]["template_options"] == {"thinking": False}
    assert manifest["sampling"]["defaults"]["temperature"] == 0.6


def test_deepseek_checkpoint_without_recipe_is_ambiguous(served, tmp_path):
    flare = Flare(write_config(tmp_path / "flare"))
    result = flare("export", served[DEEPSEEK.name].directory, "--no-progress", expect_ok=False)
    assert result.exit_code != 0
    assert "deepseek-v3, deepseek-v3.1" in result.output and "--recipe" in result.output


@pytest.mark.parametrize("name", [DEEPSEEK.name, KIMI.name, MTP_NAME])
def test_greedy_completions_match_transformers(served, name):
    server = served[name]
    generator = torch.Generator().manual_seed(3)
    # Token-id prompts over the ordinary (non-special) vocabulary; the longest is prefilled in two chunks.
    prompts = [torch.randint(1, 98, (n,), generator=generator).tolist() for n in (6, 57, 190)]
    assert len(prompts[-1]) > PREFILL_CHUNK

    def complete(prompt):
        return server.client().completions.create(model=name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                  extra_body={"skip_special_tokens": False})

    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(complete, prompts))
    for prompt, response in zip(prompts, responses):
        text, count, finish = server.expected(prompt)
        assert response.choices[0].text == text, f"prompt of {len(prompt)} tokens"
        assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == count
        assert response.choices[0].finish_reason == finish


@pytest.mark.parametrize("name", [DEEPSEEK.name, KIMI.name])
def test_greedy_chat_matches_transformers_template_and_generate(served, name):
    server = served[name]
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name three rivers in Europe, please."}]
    template = (FIXTURES / "chat_templates" / server.family.template).read_text(encoding="utf-8")
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=server.tokenizer, bos_token=server.family.bos)
    prompt = hf_tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                              tokenize=True, return_dict=False, thinking=False)
    response = server.client().chat.completions.create(model=name, messages=messages, max_tokens=MAX_TOKENS,
                                                       temperature=0, extra_body={"skip_special_tokens": False})
    text, count, finish = server.expected(list(prompt))
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == count and response.choices[0].finish_reason == finish
    assert response.choices[0].message.content == text


@pytest.mark.parametrize("name", [DEEPSEEK.name, KIMI.name])
def test_second_chat_turn_reuses_the_first_turns_complete_messages(served, name):
    """The template patch marks message ends: turn 2 restores every complete page of turn 1's
    system + user messages from the prefix cache instead of recomputing them."""
    server = served[name]
    first = [{"role": "system", "content": "You answer questions about geography, briefly and precisely."},
             {"role": "user", "content": "Which rivers flow through Vienna, Budapest and Belgrade? " * 3}]
    client = server.client()
    reply = client.chat.completions.create(model=name, messages=first, max_tokens=MAX_TOKENS, temperature=0)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content or "The Danube."},
                      {"role": "user", "content": "And which sea does it reach?"}]
    again = client.chat.completions.create(model=name, messages=second, max_tokens=MAX_TOKENS, temperature=0)

    template = (FIXTURES / "chat_templates" / server.family.template).read_text(encoding="utf-8")
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=server.tokenizer, bos_token=server.family.bos)
    complete = hf_tokenizer.apply_chat_template(first, chat_template=template, add_generation_prompt=False,
                                                tokenize=True, return_dict=False, thinking=False)
    reusable = len(complete) // 64 * 64  # the prefix cache shares whole 64-token pages
    assert reusable >= 64
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert reusable <= cached < again.usage.prompt_tokens


def test_the_draft_head_proposed_what_was_checked(served):
    # Runs after the completions above on the MTP server (any order: it sends its own request first).
    # Whether a request gets drafts is the server's call (its width rule prices rounds by measured
    # step costs, and with two steps in flight the head may hold no state for it yet; one that gets
    # none decodes plainly past these 12 tokens): on a loaded 2-core CI machine one request got
    # none. So requests are sent, each checked against Transformers, until the head has proposed.
    server = served[MTP_NAME]
    generator = torch.Generator().manual_seed(9)
    for _ in range(8):
        prompt = torch.randint(1, 98, (40,), generator=generator).tolist()
        response = server.client().completions.create(model=MTP_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0, extra_body={"skip_special_tokens": False})
        assert response.choices[0].text == server.expected(prompt)[0]
        metrics = httpx.get(server.process.url + "/metrics", timeout=30).text
        proposed = [line for line in metrics.splitlines() if line.startswith("flare_spec_proposed_tokens_total")]
        if proposed and float(proposed[0].split()[-1]) > 0:
            break
    assert proposed and float(proposed[0].split()[-1]) > 0, proposed
    # The head's records come from a pool planned with the KV pool, which the start-up line reports.
    assert "draft_pool_mib=" in server.process.log() and "draft_pool_mib=" not in served[DEEPSEEK.name].process.log()


def test_a_core_without_a_draft_head_refuses_mtp(served):
    core = Path(served[KIMI.name].plan.strip().splitlines()[-1])
    run = subprocess.run([sys.executable, "-m", "flare_core.cli", "--config", str(served[KIMI.name].config_path),
                          "run", str(core), "--device", "cpu", "--port", "0", "--no-dashboard", "--trust-publisher",
                          "--spec-method", "mtp"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "--spec-method mtp: the core carries no draft head" in run.stderr, run.stderr
