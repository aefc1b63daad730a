"""DeepSeek V4.1's configuration, read from a checkpoint's config.json while no Transformers
release defines `deepseek_v41` (Transformers' main branch does:
`src/transformers/models/deepseek_v41/configuration_deepseek_v41.py` at commit
0a2080b43eb64e6d448186a4f3f0bc9c618f4797, whose fields, defaults and derivations these classes
follow; the text and the code here are Flare's own).

The composite `deepseek_v41` config holds the text model's (`text_config`, `deepseek_v41_text`)
and the vision tower's (kept as a dict: Flare serves the text model). `register()` makes both
model types known to `AutoConfig` unless the installed Transformers already knows them.

What the text config derives when config.json leaves it out (the tiny reference configs do):

* `compress_ratios`: the released 40-layer schedule `[0, 0] + [2] * 18 + [1] * 20`, or for another
  depth two sliding-window-only layers, then ratio-2 "encoder" layers (half the rest, rounded
  up), then ratio-1 "decoder" layers;
* `kv_source_layer_ids`: the released `[2, 8, 14, 20]` with the released schedule, else the first
  layer of each run of equal non-zero ratios; `index_source_layer_ids`: the released
  `[2, 8, 14, 20, 24, 28, 32, 36]` with the released sources, else the KV sources;
* `candidate_source_layer_id`: the last KV source (negative: no two-level top-k);
* `layer_types`: "shared_compressed_attention" at KV sources, else "sliding_attention";
* `rope_parameters`: `main` (rope_theta, no scaling) and `compress` (compress_rope_theta with the
  checkpoint's `rope_scaling`, YaRN without its attention factor), both on the last
  `qk_rope_head_dim` channels of a head.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig

RELEASED_RATIOS = [0, 0] + [2] * 18 + [1] * 20
RELEASED_KV_SOURCES = [2, 8, 14, 20]
RELEASED_INDEX_SOURCES = [2, 8, 14, 20, 24, 28, 32, 36]
SLIDING, SHARED_COMPRESSED = "sliding_attention", "shared_compressed_attention"

# Fields and defaults of the text config (the released Flash model's values).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1280, "qk_rope_head_dim": 64,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "rope_parameters": None, "rope_scaling": None,
    "max_position_embeddings": 1048576, "attention_bias": False, "attention_dropout": 0.0,
    "sliding_window": 128, "compress_ratios": None, "kv_source_layer_ids": None, "index_source_layer_ids": None,
    "candidate_source_layer_id": None, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "o_groups": 8, "o_lora_rank": 1024,
    "moe_intermediate_size": 2304, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "scoring_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "topk_method": "noaux_tc", "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1.0e-6,
    "engram_layer_ids": None, "engram_vocab_size": 16000000, "engram_num_embeddings": None,
    "engram_max_ngram_size": 4, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_id": 2,
    "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
    "dspark_noise_token_id": 128799, "dspark_target_layer_ids": None, "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3, "hidden_act": "silu",
    "initializer_range": 0.02, "rms_norm_eps": 1.0e-20, "use_cache": True, "layer_types": None,
}


class DeepseekV41TextConfig(PreTrainedConfig):
    model_type = "deepseek_v41_text"
    base_config_key = "text_config"

    def __init__(self, **kwargs: Any):
        values = {name: kwargs.pop(name, default) for name, default in TEXT_DEFAULTS.items()}
        # Set after the base class's checks, which know neither V4.1's layer types nor its two
        # rope-parameter sets (the layer types are derived again below in any case).
        late = {name: values.pop(name) for name in ("layer_types", "rope_parameters")}
        # The checkpoint's flat YaRN parameters; `rope_scaling` is Transformers' legacy alias of
        # rope_parameters, so it is no attribute of its own here.
        rope_scaling = values.pop("rope_scaling")
        for name, value in values.items():
            setattr(self, name, value)
        kwargs.setdefault("eos_token_id", 1)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        for name, value in late.items():
            setattr(self, name, value)
        self._derive(rope_scaling)

    def _derive(self, rope_scaling: dict | None) -> None:
        n, drafts = self.num_hidden_layers, self.num_nextn_predict_layers
        if self.compress_ratios is None:
            if n == len(RELEASED_RATIOS):
                self.compress_ratios = list(RELEASED_RATIOS)
            else:
                sliding = min(2, n)
                encoder = max(0, (n - sliding + 1) // 2)
                self.compress_ratios = [0] * sliding + [2] * encoder + [1] * max(0, n - sliding - encoder)
        ratios = list(self.compress_ratios)
        if not n <= len(ratios) <= n + drafts:
            raise ValueError(f"compress_ratios has {len(ratios)} entries; the model has {n} layers and {drafts} "
                             f"draft layers")
        # Draft (DSpark) layers keep a sliding window only.
        self.compress_ratios = ratios[:n] + ratios[n:] + [0] * (n + drafts - len(ratios))
        backbone = self.compress_ratios[:n]
        if self.kv_source_layer_ids is None:
            self.kv_source_layer_ids = (list(RELEASED_KV_SOURCES) if backbone == RELEASED_RATIOS[:n] else
                                        [i for i in range(n) if backbone[i] > 0 and (i == 0 or backbone[i - 1]
                                                                                      != backbone[i])])
        if self.index_source_layer_ids is None:
            self.index_source_layer_ids = (list(RELEASED_INDEX_SOURCES)
                                           if self.kv_source_layer_ids == RELEASED_KV_SOURCES
                                           else list(self.kv_source_layer_ids))
        if self.dspark_target_layer_ids is None:
            self.dspark_target_layer_ids = sorted(i for i in range(n) if i not in self.kv_source_layer_ids)[-3:]
        if self.candidate_source_layer_id is None:
            self.candidate_source_layer_id = self.kv_source_layer_ids[-1] if self.kv_source_layer_ids else -1
        self._check_sources(backbone)
        self.layer_types = [SHARED_COMPRESSED if i in self.kv_source_layer_ids else SLIDING for i in range(n)]
        if self.engram_layer_ids is None:
            self.engram_layer_ids = []
        if self.engram_num_embeddings is None:
            self.engram_num_embeddings = [0] * len(self.engram_layer_ids)
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ValueError("engram_num_embeddings must give one table size per engram_layer_ids entry")
        parameters = self.rope_parameters or {}
        if not (isinstance(parameters.get("main"), dict) and isinstance(parameters.get("compress"), dict)):
            partial = self.qk_rope_head_dim / self.head_dim
            yarn = dict(rope_scaling or {})
            compress = {"rope_type": "default", **yarn, "rope_theta": self.compress_rope_theta,
                        "partial_rotary_factor": partial}
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)
            parameters = {"main": {"rope_type": "default", "rope_theta": self.rope_theta,
                                   "partial_rotary_factor": partial}, "compress": compress}
        self.rope_parameters = {"main": parameters["main"], "compress": parameters["compress"]}

    def _check_sources(self, backbone: list[int]) -> None:
        n, kv, index = self.num_hidden_layers, list(self.kv_source_layer_ids), list(self.index_source_layer_ids)
        if any(not 0 <= i < n or backbone[i] == 0 for i in kv):
            raise ValueError(f"kv_source_layer_ids {kv} must be layers with a compress ratio above 0")
        if any(backbone[i] == 0 or not any(s <= i for s in kv) for i in index):
            raise ValueError(f"index_source_layer_ids {index} must be compressed layers at or after a KV source")
        if self.candidate_source_layer_id >= 0 and self.candidate_source_layer_id not in index:
            raise ValueError(f"candidate_source_layer_id {self.candidate_source_layer_id} must be an index source")
        if any(backbone[i] > 0 and not any(s <= i for s in kv) for i in range(n)):
            raise ValueError("every compressed layer needs a KV source at or before it")


class DeepseekV41Config(PreTrainedConfig):
    """The composite config of the released checkpoints: `text_config` (a DeepseekV41TextConfig)
    and `vision_config` (kept as given)."""

    model_type = "deepseek_v41"
    sub_configs = {"text_config": DeepseekV41TextConfig}

    def __init__(self, text_config: Any = None, vision_config: Any = None, image_token_id: int = 129264,
                 **kwargs: Any):
        if isinstance(text_config, DeepseekV41TextConfig):
            self.text_config = text_config
        else:
            self.text_config = DeepseekV41TextConfig(**(text_config or {}))
        self.vision_config = vision_config
        self.image_token_id = image_token_id
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def get_text_config(self, *args: Any, **kwargs: Any) -> DeepseekV41TextConfig:
        return self.text_config


def register() -> None:
    """Make `deepseek_v41` and `deepseek_v41_text` known to AutoConfig (unless Transformers has them)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for config_class in (DeepseekV41Config, DeepseekV41TextConfig):
        if config_class.model_type not in CONFIG_MAPPING:
            AutoConfig.register(config_class.model_type, config_class)
