"""DeepSeek V4 on the CUDA runner (opt in: FLARE_TEST_GPU=1): its compressed attention is a
`BatchAttention`, so the executor plans no kernel for it, prompt chunks run eagerly and decode steps
replay captured graphs whose page table is an input (flare_core.executor.backends.PageTableInput),
the narrowest that holds the step's longest row (graphs.decode_widths).
In lockstep with the CPU reference over the same bf16 weights (the tiny V4 of flare_testing: every
layer kind, CSA rate 4, HCA rate 32, an 8-token window), the logits of every step agree within 3 %
of their range across compression boundaries and past the window, one request cancelled mid-way,
and decode graphs of several batch sizes were replayed.

Two discrete choices are taken out, since bf16 rounding flips them: top-k expert routing (hash
routing in every layer) and the indexer's selection (it keeps 64, more than the records there are;
its top-k and the gather of what it chose still run). With them, this tiny model in bf16 parts from
its own float32 run by up to 26 % of the logits' range on the CPU alone (6.5 % at the very step where
an H100's bf16 graphs parted from the CPU's bf16 run, 2026-12-07); without them by 1.6 %. The
selection and the routing are checked against Transformers on the CPU (test_deepseek_v4.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]


@pytest.mark.parametrize("compile_model", [False, True], ids=["captured", "compiled"])
def test_deepseek_v4_decode_graphs_track_the_cpu_reference(tmp_path, compile_model):
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_recipe_deepseek.v4 import compressed_attention_scheme, map_weights
    from flare_recipe_deepseek.v4_recipe import DEEPSEEK_V4
    from flare_testing.deepseek import tiny_v4_config, write_v4_checkpoint
    from lockstep import run_lockstep
    from test_hybrid_gpu import lockstep_executors

    write_v4_checkpoint(tmp_path, tiny_v4_config(mlp_layer_types=["hash_moe"] * 4, index_topk=64))
    config = AutoConfig.from_pretrained(tmp_path)
    prepared = dict(map_weights(config, load_file(tmp_path / "model.safetensors"), torch.bfloat16))
    models = [load_prepared_weights(serving_model(DEEPSEEK_V4, config, torch.bfloat16,
                                                  ServingOptions(gemv=where.type == "cuda")), prepared, where)
              for where in (torch.device("cpu"), torch.device("cuda"))]
    # Decode graphs at page tables of 1, 4, 16 and 33 pages of 64 tokens: rows of up to 110 tokens
    # replay the 1- and 4-page ones.
    reference, graphs, schedulers = lockstep_executors(models, compressed_attention_scheme(config, "bfloat16"),
                                                       config.vocab_size, compile_model, narrowest_decode_tokens=64)
    assert [g.width for g in graphs.graphs.decode_graphs[1].narrower] == [1, 4, 16]
    assert not graphs.graphs.prefill_graphs, "BatchAttention prompt chunks run eagerly"
    generator = torch.Generator().manual_seed(3)
    # Prompts of 1 to 70 tokens, answers of 40: decode crosses CSA and HCA window ends and the window.
    prompts = {f"r{i}": torch.randint(4, config.vocab_size, (n,), generator=generator).tolist()
               for i, n in enumerate((1, 5, 31, 33, 70))}
    result = run_lockstep(reference, graphs, schedulers, prompts, max_tokens=40, tolerance=0.03)
    every = [g for top in graphs.graphs.decode_graphs.values() for g in (top, *top.narrower)]
    replayed = {g.capacity for g in every if g.replays}
    assert len(replayed) >= 2, f"decode graphs of several batch sizes must have been replayed, got {replayed}"
    widths = {g.width for g in every if g.replays}
    assert {1, 4} <= widths and 33 not in widths, f"page tables of 1 and 4 pages, not the whole context: {widths}"
    assert result.compared > 100
    print(f"compared {result.compared} logits rows, worst max|diff|/range {result.worst:.4f}, "
          f"decode graphs replayed {sorted(replayed)}")
