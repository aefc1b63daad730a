"""Kimi Linear (recipe kimi-linear) end to end on the CPU: a tiny random-weight checkpoint as
Transformers saves it (Kimi Linear's own tensor names, config.json model_type "kimi_linear") with
a small byte-level tokenizer holding Kimi's chat tokens, exported through the CLI without
--recipe and served by real `flare run` processes.

Kimi Linear's own chat template is no fixture: the checkpoint carries Kimi K2's published
template (the core suite's tests/fixtures/chat_templates/moonshotai-Kimi-K2.jinja), which gets K2's
message marks.

* Export picks kimi-linear by architecture and model_type and plans KDA state rows beside MLA
  latent pages.
* Greedy completions equal Transformers `generate` (several prompts at once, one longer than a
  prompt chunk, so its KDA state continues across chunks).
* Chat turn 2 restores turn 1's state snapshot (cached tokens > 0) and answers as a server
  without a prefix cache.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import KimiLinearConfig
from transformers.models.kimi_linear import modeling_kimi_linear as kl

from flare_core.contract.types import NEUTRAL_SAMPLING
from flare_core.core import open_core
from flare_testing.deepseek import ascii_tokenizer_json, scale_random_weights, write_frontend
from flare_testing.server import Flare, second_turn_restores_the_first, with_and_without_prefix_cache, write_config

# Kimi K2's published template, kept with the core suite's templates (as test_kimi_parity.py reads it).
KIMI_TEMPLATE = Path(__file__).parents[2] / "tests" / "fixtures" / "chat_templates" / "moonshotai-Kimi-K2.jinja"

SPECIAL_TOKENS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")
VOCAB = len(Tokenizer.from_str(ascii_tokenizer_json(SPECIAL_TOKENS)).get_vocab())
# KDA, KDA, MLA, KDA; a dense first MLP, then MoE of 8 experts (2 chosen) with a shared expert.
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=96, moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            n_shared_experts=1, n_group=1, topk_group=1, linear_num_heads=2, linear_head_dim=16,
            linear_conv_kernel_dim=4, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"], max_position_embeddings=1024,
            pad_token_id=0, bos_token_id=VOCAB - 7, eos_token_id=VOCAB - 5)
PREFILL_CHUNK, MAX_TOKENS, MIN_GREEDY_MARGIN = 64, 12, 1e-3
NAME = "tiny-kimi-linear"


def random_model(seed: int = 0) -> kl.KimiLinearForCausalLM:
    """Random float32 weights drawn as flare_testing.deepseek draws DeepSeek's: every
    sublayer matters and routing is clear-cut."""
    torch.manual_seed(seed)
    model = kl.KimiLinearForCausalLM(KimiLinearConfig(**TINY)).to(torch.float32).eval()
    return scale_random_weights(model, kl.KimiLinearExperts, kl.KimiLinearTopkRouter)


@pytest.fixture(scope="module")
def session_flare(tmp_path_factory) -> Flare:
    """`flare` commands against a config of this module's own (the core suite's fixture of the name)."""
    return Flare(write_config(tmp_path_factory.mktemp("flare")))


@pytest.fixture(scope="module")
def served(tmp_path_factory, session_flare):
    directory = tmp_path_factory.mktemp(NAME)
    reference = random_model()
    reference.save_pretrained(directory)
    # The template's exact bytes (CRLF line ends), which K2's patch was made for.
    template = KIMI_TEMPLATE.read_bytes().decode("utf-8")
    write_frontend(directory, vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, bos_token="[BOS]",
                   eos_token="<|im_end|>", stop_token="<|im_end|>", chat_template=template)
    result = session_flare("export", directory, "--dtype", "float32", "--max-concurrency", "4", "--context-length",
                           "1024", "--prefill-chunk-size", str(PREFILL_CHUNK), "--no-progress")
    core = Path(result.output.strip().splitlines()[-1])
    root = tmp_path_factory.mktemp("kimi-linear-servers")
    with with_and_without_prefix_cache(session_flare.config_path, core, root, NAME) as clients:
        yield reference, Tokenizer.from_file(str(directory / "tokenizer.json")), result.output, core, clients


def test_export_picks_kimi_linear_and_plans_state_rows(served):
    _, _, plan, core, _ = served
    assert "recipe        kimi-linear 0.1.0 (KimiLinearForCausalLM)" in plan
    assert "cache scheme  kda-mla-hybrid" in plan
    assert "3 KDA layers keep per-request state rows" in plan and "1 MLA layers keep latent pages" in plan
    manifest = open_core(core).manifest
    assert [s["name"] for s in manifest["cache_scheme"]["paged"]] == ["ckv", "kpe"]
    assert [s["name"] for s in manifest["cache_scheme"]["state"]] == ["conv", "recurrent"]
    assert manifest["frontend"]["template_patch"] == "kimi-k2-v1"
    assert manifest["sampling"]["defaults"] == NEUTRAL_SAMPLING  # the model card recommends none


def test_greedy_completions_match_transformers(served):
    reference, tokenizer, _, _, (client, _) = served
    stop = tokenizer.token_to_id("<|im_end|>")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 98, (n,), generator=generator).tolist() for n in (6, 57, 150)]
    assert len(prompts[-1]) > 2 * PREFILL_CHUNK

    def complete(prompt):
        return client.completions.create(model=NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"skip_special_tokens": False})

    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(complete, prompts))
    for prompt, response in zip(prompts, responses):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     eos_token_id=stop, pad_token_id=stop, output_scores=True,
                                     return_dict_in_generate=True)
        top2 = torch.stack([scores[0].topk(2).values for scores in out.scores])
        assert float((top2[:, 0] - top2[:, 1]).min()) > MIN_GREEDY_MARGIN, "the reference's greedy choice is noise"
        ids = out.sequences[0, len(prompt):].tolist()
        visible = ids[:-1] if ids[-1] == stop else ids
        assert response.choices[0].text == tokenizer.decode(visible, skip_special_tokens=False), \
            f"prompt of {len(prompt)} tokens"
        assert response.usage.completion_tokens == len(ids)


def test_turn_two_restores_turn_one_and_answers_as_without_cache(served):
    *_, (cached, uncached) = served

    turn1 = [{"role": "system", "content": "You answer questions about geography, briefly and precisely."},
             {"role": "user", "content": "Which rivers flow through Vienna, Budapest and Belgrade?"}]
    second_turn_restores_the_first(cached, uncached, NAME, turn1, "And which sea does it reach?", max_tokens=MAX_TOKENS)
