"""Random-weight Qwen3 models of real shapes for GPU benchmarks (speed of a dense model does
not depend on its weight values)."""

from __future__ import annotations

import torch


def qwen3_config(layers: int = 36, hidden: int = 4096, intermediate: int = 12288, heads: int = 32):
    """Qwen3-8B's shape by default: 36 layers, hidden 4096, 32/8 heads, head_dim 128 (Qwen3-32B's:
    hidden 5120, intermediate 25600, 64 heads)."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1_000_000.0,
                       bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")


def qwen3_moe_config(layers: int = 12):
    """Qwen3-30B-A3B's shape cut to `layers` layers (the MoE issue's benchmark: 12): hidden 2048,
    128 experts with top-8 routing, moe_intermediate_size 768, 32/4 heads, head_dim 128."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=layers,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          tie_word_embeddings=False, rope_theta=1_000_000.0, bos_token_id=151643,
                          eos_token_id=151645, torch_dtype="bfloat16")


def draw(name: str, tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Fill `tensor` (the model's tensor `name`) in place: norms 1, biases 0, the rest ~ N(0, 0.02)."""
    if name.endswith("norm.weight"):
        return tensor.fill_(1.0)
    if name.endswith("bias"):
        return tensor.zero_()
    return tensor.normal_(0.0, 0.02, generator=generator)


def fill_random(model, device: torch.device):
    """`model` with its parameters drawn in place (`draw`)."""
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            draw(name, param, generator)
    return model


def random_hf_model(config, device: torch.device):
    """The Transformers model (Qwen3 or Qwen3-MoE, by the config) in bf16 on `device`, weights
    ~ N(0, 0.02), norms 1."""
    from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    moe = config.model_type == "qwen3_moe"
    with torch.device("meta"):
        model = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(config)
    model = fill_random(model.to_empty(device=device).to(torch.bfloat16), device)
    # Its inv_freq was left on meta.
    model.model.rotary_emb = (Qwen3MoeRotaryEmbedding if moe else Qwen3RotaryEmbedding)(config).to(device)
    return model.eval()
