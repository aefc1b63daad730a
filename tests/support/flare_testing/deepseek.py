"""Tiny random-weight checkpoints of the DeepSeek-V3 and V4 architectures for tests: the parity
and export tests of this package and of recipes that reuse its model code (flare-recipe-kimi).

The real DeepSeek and Kimi tokenizers are too large to keep as test fixtures, so a checkpoint
gets a small real `tokenizer.json`: byte-level BPE over printable ASCII (every token decodes to
one visible character, so generated text compares exactly) plus the family's special tokens.

`quantize_fp8_checkpoint` rewrites a saved checkpoint the way DeepSeek and Moonshot publish theirs:
float8_e4m3fn Linear weights with float32 `weight_scale_inv` block scales and a quantization_config.
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

from flare_core.kernels.fp4 import dequantize_fp4
from flare_core.kernels.fp8 import quantize_blocks

UNKNOWN = "<unk>"


def ascii_tokenizer_json(special_tokens: Sequence[str]) -> str:
    """tokenizer.json of a byte-level BPE without merges whose vocabulary is printable ASCII,
    newline and tab (other bytes encode as `<unk>`), followed by `special_tokens` as special
    added tokens. Size: 98 + len(special_tokens)."""
    byte_to_char = _byte_chars()
    symbols = [byte_to_char[b] for b in (9, 10, *range(32, 127))]
    vocab = {UNKNOWN: 0, **{symbol: i + 1 for i, symbol in enumerate(symbols)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tokenizer.to_str()


def _byte_chars() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def random_model(config: ds.DeepseekV3Config, seed: int = 0) -> ds.DeepseekV3ForCausalLM:
    """A float32 Transformers model with random weights scaled so that every sublayer matters.

    Transformers' initialisation (std 0.02) leaves attention and experts so small next to the
    residual stream that a broken attention changes logits by less than a parity tolerance;
    here matrices are drawn with std 1/sqrt(fan_in), embeddings with std 1. Router weights are
    drawn wide and the router bias non-zero, so expert choices are clear-cut rather than decided
    by float noise, and the bias takes part in routing."""
    torch.manual_seed(seed)
    model = ds.DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    return scale_random_weights(model, ds.DeepseekV3Experts, ds.DeepseekV3TopkRouter)


class MtpReference(torch.nn.Module):
    """DeepSeek-V3's multi-token-prediction module over whole sequences, made of Transformers'
    modules: the draft head's reference. A one-layer `DeepseekV3ForCausalLM` (its MoE layer; its
    final norm and head standing for the module's `shared_head`) fed
    eh_proj([enorm(embedding of the token at j + 1, zeroed at position 0); hnorm(h_j)]), as vLLM's
    deepseek_mtp.py (commit 03356f8) computes it; random weights drawn as `random_model` draws them."""

    def __init__(self, config: ds.DeepseekV3Config, seed: int = 1):
        super().__init__()
        values = config.to_dict() | dict(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0,
                                         tie_word_embeddings=False)
        self.layer_model = random_model(ds.DeepseekV3Config(**values), seed)
        hidden = config.hidden_size
        self.enorm = ds.DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hnorm = ds.DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            self.enorm.weight.normal_(1.0, 0.1)
            self.hnorm.weight.normal_(1.0, 0.1)
            self.eh_proj.weight.normal_(0.0, (2 * hidden) ** -0.5)

    @torch.no_grad()
    def forward(self, previous: torch.Tensor, next_tokens: torch.Tensor,
                origin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """At positions origin..origin+T-1, attending over those only: (logits [T, vocab], the
        layer's output [T, hidden] before the norm)."""
        positions = torch.arange(origin, origin + len(next_tokens))
        embedded = self.layer_model.model.embed_tokens(next_tokens).masked_fill((positions == 0)[:, None], 0.0)
        mixed = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))
        outputs: list[torch.Tensor] = []
        hook = self.layer_model.model.layers[0].register_forward_hook(
            lambda module, args, output: outputs.append(output[0] if isinstance(output, tuple) else output))
        try:
            logits = self.layer_model(inputs_embeds=mixed[None], position_ids=positions[None]).logits[0]
        finally:
            hook.remove()
        return logits, outputs[0][0]

    def drafts(self, model: torch.nn.Module, tokens: list[int], width: int, origin: int = 0) -> list[int]:
        """The greedy guesses after `tokens` of this module over the served Transformers `model`'s
        final hidden states from position `origin` on: its guess at the position before the last
        token, then its own output fed back at each further position with its guess as the token."""
        with torch.no_grad():  # the final hidden states are after the final norm
            previous = model.model(torch.tensor([tokens])).last_hidden_state[0, origin:-1]
        following, guesses = list(tokens[origin + 1:]), []
        for _ in range(width):
            logits, output = self(previous, torch.tensor(following), origin)
            guesses.append(int(logits[-1].argmax()))
            previous = torch.cat([previous, output[-1:]])
            following.append(guesses[-1])
        return guesses

    def checkpoint_tensors(self, layer: int, directory: Path) -> dict[str, torch.Tensor]:
        """Its weights named as a DeepSeek-V3 checkpoint stores the module: layer `layer`, with its
        own embedding, shared_head (norm, head) and enorm / hnorm / eh_proj; experts one by one."""
        self.layer_model.save_pretrained(directory)
        own = {"model.embed_tokens.weight": "embed_tokens.weight", "model.norm.weight": "shared_head.norm.weight",
               "lm_head.weight": "shared_head.head.weight"}
        prefix = f"model.layers.{layer}."
        tensors = {prefix + own.get(name, name.removeprefix("model.layers.0.")): tensor
                   for name, tensor in load_file(directory / "model.safetensors").items()}
        for part in ("enorm", "hnorm", "eh_proj"):
            tensors[f"{prefix}{part}.weight"] = getattr(self, part).weight.detach().clone()
        return tensors


def scale_random_weights(model: torch.nn.Module, experts: type, router: type) -> torch.nn.Module:
    """Redraw `model`'s weights in place as `random_model` draws them, for any model with
    DeepSeek-style packed experts (`gate_up_proj` / `down_proj`, `hidden_dim` / `intermediate_dim`)
    and sigmoid routers with a score-correction bias (Kimi Linear's too); returns `model`."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features ** -0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
            elif isinstance(module, experts):
                module.gate_up_proj.normal_(0.0, module.hidden_dim ** -0.5)
                module.down_proj.normal_(0.0, module.intermediate_dim ** -0.5)
            elif isinstance(module, router):
                module.weight.normal_(0.0, 1.0)
                module.e_score_correction_bias.normal_(0.0, 0.1)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model


def save_model(directory: Path, model: ds.DeepseekV3ForCausalLM, model_type: str | None = None) -> Path:
    """save_pretrained(`model`) (per-expert tensor names on disk, as real checkpoints have them);
    `model_type` replaces the config's in config.json -- Kimi K2 checkpoints are DeepSeek-V3
    checkpoints whose config says "kimi_k2"."""
    directory = Path(directory)
    model.save_pretrained(directory)
    if model_type is not None:
        config_file = directory / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": model_type}))
    return directory


def add_mtp_layer(directory: Path, config: ds.DeepseekV3Config, seed: int = 1) -> MtpReference:
    """Add a random multi-token-prediction layer to the checkpoint saved in `directory` (layer
    `num_hidden_layers`, as DeepSeek publishes it); returns its reference."""
    mtp = MtpReference(config, seed)
    weights = Path(directory) / "model.safetensors"
    with tempfile.TemporaryDirectory() as scratch:
        tensors = load_file(weights) | mtp.checkpoint_tensors(config.num_hidden_layers, Path(scratch))
    save_file(tensors, weights, metadata={"format": "pt"})
    return mtp


def write_frontend(directory: Path, *, vocab_size: int, special_tokens: Sequence[str], chat_template: str,
                   bos_token: str, eos_token: str, stop_token: str) -> Path:
    """tokenizer.json (`ascii_tokenizer_json(special_tokens)`), chat_template.jinja,
    tokenizer_config.json naming bos/eos, and generation_config.json whose eos_token_id is
    `stop_token`'s id, next to a checkpoint of `vocab_size` rows."""
    directory = Path(directory)
    tokenizer_json = ascii_tokenizer_json(special_tokens)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"the tokenizer has {size} tokens, more than the model's vocab_size {vocab_size}")
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos_token, "eos_token": eos_token}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.token_to_id(stop_token)}))
    return directory


def fp8_quantization_config(block: tuple[int, int] = (128, 128), **extra) -> dict:
    """config.json quantization_config of DeepSeek-V3's / Kimi K2's published checkpoints."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block),
            **extra}


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    """The tensors DeepSeek quantizes: the Linear weights of attention (q_a/q_b/kv_a_proj_with_mqa/
    kv_b/o_proj) and of the dense and expert MLPs. Embeddings, lm_head, norms and the router
    (`mlp.gate.weight`, its bias) stay as they are."""
    return (tensor.dim() == 2 and name.endswith(".weight") and (".self_attn." in name or ".mlp." in name)
            and not name.endswith(".mlp.gate.weight"))


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv [ceil(rows / block_rows), ceil(cols / block_cols)]):
    scale_inv = amax / 448 per block (edge blocks partial), as `flare export --quantize fp8` does."""
    return quantize_blocks(weight, block)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The float32 value of an fp8 block-quantized weight, block by block (a plain reference)."""
    out = weight.float()
    block_rows, block_cols = block
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * block_rows:(i + 1) * block_rows, j * block_cols:(j + 1) * block_cols] *= scale_inv[i, j]
    return out


def quantize_fp8_checkpoint(directory: Path, block: tuple[int, int] = (128, 128), keep: Sequence[str] = (),
                            **quantization) -> dict[str, torch.Tensor]:
    """Rewrite the single-file checkpoint in `directory` as an fp8 block-quantized one: every
    quantized linear weight (`is_quantized_linear`) not under a module named in `keep` becomes
    float8_e4m3fn with its `weight_scale_inv`; config.json gains `fp8_quantization_config(block)`
    (plus `modules_to_not_convert: keep` when given, plus `quantization`). Returns the checkpoint's
    tensors as a model would see them after dequantization (float32, names as on disk)."""
    directory = Path(directory)
    path = directory / "model.safetensors"
    tensors = load_file(path)
    stored, dequantized = {}, {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if is_quantized_linear(name, tensor) and not any(module == k or module.startswith(k + ".") for k in keep):
            weight, scale_inv = quantize_fp8_blocks(tensor, block)
            stored[name], stored[name + "_scale_inv"] = weight, scale_inv
            dequantized[name] = dequantize_fp8_blocks(weight, scale_inv, block)
        else:
            stored[name] = dequantized[name] = tensor
    save_file(stored, path, metadata={"format": "pt"})
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    declared = fp8_quantization_config(block, **quantization)
    if keep:
        declared["modules_to_not_convert"] = list(keep)
    config_file.write_text(json.dumps({**config, "quantization_config": declared}))
    return dequantized


def dequantized_reference(directory: Path, tensors: dict[str, torch.Tensor], target: Path) -> torch.nn.Module:
    """A float32 Transformers DeepseekV3ForCausalLM of `directory`'s config (minus its
    quantization_config) loaded, every tensor accounted for, from `tensors` (on-disk names, e.g.
    what `quantize_fp8_checkpoint` returns) saved under `target`."""
    target = Path(target)
    target.mkdir(parents=True)
    config = json.loads((Path(directory) / "config.json").read_text())
    config.pop("quantization_config", None)
    # Transformers maps per-expert tensors onto its packed experts for model_type deepseek_v3 only.
    (target / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    save_file({n: t.contiguous() for n, t in tensors.items()}, target / "model.safetensors", metadata={"format": "pt"})
    model, info = ds.DeepseekV3ForCausalLM.from_pretrained(target, dtype=torch.float32, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise AssertionError(f"the dequantized reference did not load exactly: {problems}")
    return model.eval()


def export_checkpoint(directory: Path, root: Path, *args: str) -> tuple[Path, str, Path]:
    """Run `flare export DIRECTORY ARGS --no-progress` with a Flare config whose paths all live
    under `root`. Returns (core path, what export printed, the config file)."""
    from click.testing import CliRunner

    from flare_core.cli import main

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "config.toml"
    config_path.write_text('[paths]\ncore_cache = "cores"\nhub_cache = "hub"\nkeys = "keys"\n'
                           'trust_store = "trust.json"\n[defaults]\ndevice = "cpu"\n')
    result = CliRunner().invoke(main, ["--config", str(config_path), "export", str(directory), *args, "--no-progress"],
                                catch_exceptions=False)
    if result.exit_code != 0:
        raise AssertionError(f"flare export failed:\n{result.output}")
    return Path(result.output.strip().splitlines()[-1]), result.output, config_path


def assert_core_matches(core: Path, config_path: Path, reference: torch.nn.Module,
                        prompt_lens: Sequence[int] = (7, 45), decode_steps: int = 2, atol: float = 1e-4,
                        page_tokens: int = 16) -> None:
    """The exported `core`, verified and loaded as `flare run` loads it, must serve `reference`'s
    logits for random prompts (prefilled in shared chunks over shuffled pages) and decode steps."""
    from flare_core.cli import open_verified_core
    from flare_core.config import load_config
    from flare_core.engine.load import load_core
    from flare_core.plugins import load_registry
    from flare_testing.parity import serve_paged

    loaded = load_core(open_verified_core(load_config(config_path), str(core), trust_publisher=True),
                       load_registry(), torch.device("cpu"))
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, loaded.model_config.vocab_size, (n + decode_steps,), generator=generator).tolist()
                 for n in prompt_lens]
    with torch.no_grad():
        expected = [reference(torch.tensor([s])).logits[0] for s in sequences]
    rows = 0
    for r, consumed, logits in serve_paged(loaded.model, loaded.cache_scheme, sequences, prompt_lens,
                                           page_tokens=page_tokens, step_tokens=32):
        torch.testing.assert_close(logits, expected[r][consumed - 1], atol=atol, rtol=atol,
                                   msg=lambda m: f"request {r} after {consumed} tokens: {m}")
        rows += 1
    if rows < len(prompt_lens) * (decode_steps + 1):
        raise AssertionError(f"only {rows} logits rows for {len(prompt_lens)} requests")


def random_v4_model(config, seed: int = 0) -> torch.nn.Module:
    """A float32 Transformers DeepseekV4ForCausalLM with random weights as `random_model` draws
    them, and the tensors Transformers initialises to constants drawn too: the pooling position
    biases, the attention sinks, the mHC biases, the router bias; `tid2eid` routes each token id
    to distinct experts."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    torch.manual_seed(seed)
    model = v4.DeepseekV4ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            leaf = name.rpartition(".")[2]
            if tensor.dim() == 2 and leaf == "weight":
                tensor.normal_(0.0, tensor.shape[1] ** -0.5)
            elif leaf in ("position_bias", "sinks", "base", "hc_base"):
                tensor.normal_(0.0, 0.5)
        for module in model.modules():
            if isinstance(module, v4.DeepseekV4Experts):
                module.gate_up_proj.normal_(0.0, module.hidden_dim ** -0.5)
                module.down_proj.normal_(0.0, module.intermediate_dim ** -0.5)
            elif isinstance(module, v4.DeepseekV4TopKRouter):
                module.weight.normal_(0.0, 1.0)
                module.e_score_correction_bias.normal_(0.0, 0.1)
            elif isinstance(module, v4.DeepseekV4HashRouter):
                module.weight.normal_(0.0, 1.0)
                module.tid2eid.copy_(torch.stack([torch.randperm(module.num_experts)[:module.top_k]
                                                  for _ in range(module.tid2eid.shape[0])]))
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model


def save_v4_as_published(directory: Path, model: torch.nn.Module) -> Path:
    """The checkpoint of `model` named as DeepSeek publishes V4 (`embed.weight`, `head.weight`,
    `norm.weight`, `hc_head_fn`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
    ...): `save_pretrained` writes DeepSeek's names below the layers but keeps Transformers' at the
    top and a `model.` prefix, which this strips."""
    directory = Path(directory)
    model.save_pretrained(directory)
    top = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
           "hc_head.hc_scale": "hc_head_scale"}
    path = directory / "model.safetensors"
    tensors = {}
    for name, tensor in load_file(path).items():
        name = name.removeprefix("model.")
        tensors[top.get(name, name)] = tensor
    save_file(tensors, path, metadata={"format": "pt"})
    return directory


CSA_RATE, HCA_RATE = 4, 32
V4_SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                     "</think>")


def tiny_v4_config(**overrides):
    """A DeepSeek V4 config with every layer kind: sliding-window only, compressed sparse attention
    (CSA, rate CSA_RATE, the indexer keeping 3 entries), heavily compressed attention (HCA, rate
    HCA_RATE), CSA again; hash routing in layer 0; two mHC streams; a YaRN compress rope. Eight
    indexer heads: the indexer's per-head ReLU scores tie at exactly 0 when every head's dot product
    is negative, and a tie decides top-k by position in the tensor (which differs between a one-shot
    forward and any incremental run, Transformers' own cache path included)."""
    from transformers import DeepseekV4Config

    from flare_recipe_deepseek.v4 import CSA, HCA, SLIDING

    values = dict(vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                  head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=8,
                  layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                  compress_rates={CSA: CSA_RATE, HCA: HCA_RATE}, sliding_window=8, o_groups=2, o_lora_rank=16,
                  index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=2, partial_rotary_factor=0.25,
                  max_position_embeddings=1024,
                  rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
                  bos_token_id=98, eos_token_id=99)  # the ids of V4_SPECIAL_TOKENS' first two in the tokenizer
    return DeepseekV4Config(**{**values, **overrides})


def write_v4_checkpoint(directory: Path, config=None) -> torch.nn.Module:
    """A tiny DeepSeek V4 checkpoint in `directory`, named as published (`save_v4_as_published`),
    with a byte-level tokenizer holding V4's special tokens; returns the Transformers model."""
    directory = Path(directory)
    model = random_v4_model(config or tiny_v4_config())
    save_v4_as_published(directory, model)
    tokenizer_json = ascii_tokenizer_json(V4_SPECIAL_TOKENS)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    bos, eos = V4_SPECIAL_TOKENS[:2]
    if (tokenizer.token_to_id(bos), tokenizer.token_to_id(eos)) != (model.config.bos_token_id,
                                                                   model.config.eos_token_id):
        raise ValueError("the config's bos / eos ids are not the tokenizer's")
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    return model


def quantize_fp4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, cols / 2] e2m1 pairs, float8_e8m0fnu scale [rows, cols / 32]) of a [rows, cols]
    weight as DeepSeek V4 publishes its routed experts (flare_core.kernels.fp4): per group of 32
    columns, the smallest power of two that brings the largest magnitude to at most 6, each value
    rounded to the nearest e2m1 magnitude."""
    from flare_core.kernels.fp4 import E2M1, GROUP

    groups = weight.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 6.0))), torch.ones_like(amax))
    scaled = (groups / scale[..., None]).flatten(-2)
    magnitudes = torch.tensor(E2M1[:8])
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    codes = torch.where(scaled < 0, codes + 8, codes).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8).contiguous(), scale.to(torch.float8_e8m0fnu).contiguous()


def quantize_fp8_powers(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float8_e8m0fnu scale per block) with scale_fmt ue8m0: each block's
    scale the smallest power of two that brings its largest magnitude to at most 448."""
    _, scale_inv = quantize_blocks(weight, block)
    powers = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    expanded = powers.repeat_interleave(block[0], 0)[:weight.shape[0]].repeat_interleave(block[1], 1)[:, :weight.shape[1]]
    return (weight.float() / expanded).clamp(-448, 448).to(torch.float8_e4m3fn), powers.to(torch.float8_e8m0fnu)


# The linear weights DeepSeek V4 keeps out of FP8: the router, and the compressors' and the
# indexer's pooling projections, which Transformers keeps in float32 (`_keep_in_fp32_modules`).
V4_UNQUANTIZED = re.compile(r"\.ffn\.gate\.weight$|\.compressor\.(wkv|wgate)\.weight$|\.indexer\.weights_proj\.weight$")
V4_EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def publish_v4_quantized(directory: Path) -> dict[str, torch.Tensor]:
    """Rewrite the V4 checkpoint in `directory` (`save_v4_as_published`) the way DeepSeek publishes
    V4 Flash: routed experts in FP4 (`quantize_fp4_groups`), the other linear weights of the layers
    in FP8 with power-of-two block scales (`quantize_fp8_powers`), each scale as `X.scale` beside
    `X.weight`; config.json gains "expert_dtype": "fp4" and the fp8 quantization_config with
    scale_fmt ue8m0. Returns the tensors as a model sees them after dequantization (float32,
    on-disk names)."""
    directory = Path(directory)
    path = directory / "model.safetensors"
    stored, dequantized = {}, {}
    for name, tensor in load_file(path).items():
        scale = name.removesuffix(".weight") + ".scale"
        if V4_EXPERT.search(name):
            stored[name], stored[scale] = quantize_fp4_groups(tensor)
            dequantized[name] = dequantize_fp4(stored[name], stored[scale])
        elif name.startswith("layers.") and tensor.dim() == 2 and name.endswith(".weight") \
                and not V4_UNQUANTIZED.search(name):
            stored[name], stored[scale] = quantize_fp8_powers(tensor)
            dequantized[name] = dequantize_fp8_blocks(stored[name], stored[scale].float(), (128, 128))
        else:
            stored[name] = dequantized[name] = tensor
    save_file(stored, path, metadata={"format": "pt"})
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("quantization_config", None)
    config_file.write_text(json.dumps({**config, "expert_dtype": "fp4",
                                       "quantization_config": fp8_quantization_config(scale_fmt="ue8m0")}))
    return dequantized
