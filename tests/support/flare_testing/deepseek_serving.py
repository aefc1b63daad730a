"""Tiny random-weight checkpoints of the DeepSeek-V3 architecture (MLA + MoE, a dense first layer)
served end to end by real `flare run` processes on the CPU, for the families that share it
(DeepSeek-V3.1 in flare-recipe-deepseek's tests, Kimi K2 in flare-recipe-kimi's): a `Family`
names its config, chat template, special tokens and export flags; `prepare` writes and exports
its checkpoint; a `Served` core's greedy output is checked against Transformers `generate`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, PreTrainedTokenizerFast

from flare_testing.deepseek import add_mtp_layer, ascii_tokenizer_json, random_model, save_model, write_frontend
from flare_testing.server import Flare, ServerProcess

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
    template: Path  # its published chat template
    special_tokens: tuple[str, ...]
    bos: str
    stop: str
    export_flags: tuple[str, ...]


@dataclass
class Served:
    name: str  # the served model name
    family: Family
    process: ServerProcess
    reference: torch.nn.Module
    tokenizer: Tokenizer
    stop_id: int
    directory: Path  # the checkpoint
    plan: str  # what `flare export` printed
    config_path: Path  # the flare config it was exported and is served with

    @property
    def core(self) -> Path:
        return Path(self.plan.strip().splitlines()[-1])

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

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        """The messages as Transformers' `apply_chat_template` renders and tokenizes them."""
        hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer, bos_token=self.family.bos)
        return list(hf_tokenizer.apply_chat_template(
            messages, chat_template=self.family.template.read_text(encoding="utf-8"),
            add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False, thinking=False))


def prepare(flare: Flare, root: Path, family: Family) -> tuple[Path, torch.nn.Module, str]:
    """Write `family`'s tiny checkpoint under `root` (an MTP layer where the config asks for one)
    and export it: (core, the Transformers model, the export's output)."""
    directory = root / family.name
    # Every id the model can produce is a token of the tokenizer, so generated text shows every id.
    vocab_size = len(Tokenizer.from_str(ascii_tokenizer_json(family.special_tokens)).get_vocab())
    config = DeepseekV3Config(**family.config, vocab_size=vocab_size)
    reference = random_model(config, seed=11)
    save_model(directory, reference, family.model_type)
    if config.num_nextn_predict_layers:
        add_mtp_layer(directory, config)
    write_frontend(directory, vocab_size=vocab_size, special_tokens=family.special_tokens,
                   chat_template=family.template.read_text(encoding="utf-8"),
                   bos_token=family.bos, eos_token=family.stop, stop_token=family.stop)
    result = flare("export", directory, *family.export_flags, "--dtype", "float32", "--max-concurrency", "4",
                   "--context-length", "1024", "--prefill-chunk-size", str(PREFILL_CHUNK), "--no-progress")
    return Path(result.output.strip().splitlines()[-1]), reference, result.output


def served_cores(flare: Flare, root: Path, runs: dict[str, tuple[Family, tuple[str, ...]]]) -> dict[str, Served]:
    """Each run name -> (family, flare run flags) served by its own `flare run` (every family
    exported once); the caller stops them (flare_testing.server.stop_all over `.process`)."""
    exported = {}
    for family, _ in runs.values():
        if family.name not in exported:
            exported[family.name] = prepare(flare, root, family)
    processes = {name: ServerProcess(flare.config_path, exported[family.name][0], root / f"{name}.log",
                                     "--served-name", name, *flags) for name, (family, flags) in runs.items()}
    result = {}
    try:
        for name, (family, _) in runs.items():
            _, reference, plan = exported[family.name]
            tokenizer = Tokenizer.from_file(str(root / family.name / "tokenizer.json"))
            result[name] = Served(name, family, processes[name].wait_ready(), reference, tokenizer,
                                  tokenizer.token_to_id(family.stop), root / family.name, plan, flare.config_path)
    except BaseException:
        for process in processes.values():  # the first failure is the one to report
            try:
                process.stop()
            except AssertionError:
                pass
        raise
    return result


def assert_greedy_chat(server: Served) -> None:
    """A chat completion through the openai SDK answers as `generate` does on the prompt
    Transformers' `apply_chat_template` renders."""
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Name three rivers in Europe, please."}]
    prompt = server.chat_prompt(messages, add_generation_prompt=True)
    response = server.client().chat.completions.create(model=server.name, messages=messages, max_tokens=MAX_TOKENS,
                                                       temperature=0, extra_body={"skip_special_tokens": False})
    text, count, finish = server.expected(prompt)
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == count and response.choices[0].finish_reason == finish
    assert response.choices[0].message.content == text


def assert_second_turn_reuses_the_first(server: Served) -> None:
    """The template patch marks message ends: turn 2 restores every complete page of turn 1's
    system + user messages from the prefix cache instead of recomputing them."""
    first = [{"role": "system", "content": "You answer questions about geography, briefly and precisely."},
             {"role": "user", "content": "Which rivers flow through Vienna, Budapest and Belgrade? " * 3}]
    client = server.client()
    reply = client.chat.completions.create(model=server.name, messages=first, max_tokens=MAX_TOKENS, temperature=0)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content or "The Danube."},
                      {"role": "user", "content": "And which sea does it reach?"}]
    again = client.chat.completions.create(model=server.name, messages=second, max_tokens=MAX_TOKENS, temperature=0)
    reusable = len(server.chat_prompt(first, add_generation_prompt=False)) // 64 * 64  # whole 64-token pages
    assert reusable >= 64
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert reusable <= cached < again.usage.prompt_tokens


def assert_greedy_completions(server: Served) -> None:
    """Token-id prompts over the ordinary (non-special) vocabulary, sent at once through the openai
    SDK, the longest prefilled in two chunks: each answers as `generate` does."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 98, (n,), generator=generator).tolist() for n in (6, 57, 190)]
    assert len(prompts[-1]) > PREFILL_CHUNK

    def complete(prompt):
        return server.client().completions.create(model=server.name, prompt=prompt, max_tokens=MAX_TOKENS,
                                                  temperature=0, extra_body={"skip_special_tokens": False})

    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(complete, prompts))
    for prompt, response in zip(prompts, responses):
        text, count, finish = server.expected(prompt)
        assert response.choices[0].text == text, f"prompt of {len(prompt)} tokens"
        assert response.usage.prompt_tokens == len(prompt) and response.usage.completion_tokens == count
        assert response.choices[0].finish_reason == finish
