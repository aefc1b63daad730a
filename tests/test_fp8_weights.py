"""FP8 weights kept in the core (`flare export --quantize fp8`, flare_core.ops.fp8): the decoder
layers' linear weights are stored as float8_e4m3fn with one float32 scale per 128x128 block,
everything else in the export dtype; the CPU path serves such a core, dequantizing in each call.
Its logits equal those of the same prepared weights dequantized to float32, and stay close to the
unquantized model's; SmolLM2-135M-Instruct's real weights, quantized, still answer a question
correctly through `flare run` and the openai SDK."""

from __future__ import annotations

import pytest
import torch

from flare_core.core import open_core
from flare_core.engine.load import load_core
from flare_core.kernels.fp8 import FP8_MAX, dequantize_blocks, quantize_blocks
from flare_core.plugins import load_registry
from flare_testing.parity import serve_paged
from flare_testing.server import ServerProcess

EXPORT = ("--max-concurrency", "4", "--context-length", "1024", "--prefill-chunk-size", "128", "--no-progress")


def test_blocks_round_trip_within_e4m3_precision():
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 200)
    weight[128:256, 128:] = 0.0  # an all-zero block keeps a finite scale
    fp8, scale_inv = quantize_blocks(weight)
    assert fp8.dtype == torch.float8_e4m3fn and fp8.shape == weight.shape
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 2)  # partial last blocks
    assert scale_inv[1, 1] == 1.0
    torch.testing.assert_close(scale_inv[0, 0], weight[:128, :128].abs().max() / FP8_MAX)
    restored = dequantize_blocks(fp8, scale_inv)
    # e4m3 keeps 3 mantissa bits: within 2**-4 of each value, or of the block's smallest normal.
    block_scale = scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((restored - weight).abs() <= weight.abs() * 2 ** -4 + block_scale * 2 ** -6).all()


def test_power_of_two_blocks_and_fp4_groups_quantize_back_to_their_values():
    """What a split FP8 core relies on (flare_core.prepare.export._quantize_rank_fp8): a weight
    published with power-of-two block scales, or as FP4 groups, quantized again, whole or any slice
    of it (here across block boundaries), gives back exactly its values; FP4 rounds a midpoint to
    the even code (round half to even, as DeepSeek V4.1's quantizers do)."""
    from flare_core.kernels.fp4 import dequantize_fp4, quantize_fp4

    generator = torch.Generator().manual_seed(3)
    published = dequantize_blocks(*quantize_blocks(torch.randn(300, 260, generator=generator), powers=True))
    for part in (published, published[:150], published[64:200, 130:], published[:, 7:9]):
        assert torch.equal(dequantize_blocks(*quantize_blocks(part, powers=True)), part)
    groups = dequantize_fp4(*quantize_fp4(torch.randn(2, 16, 128, generator=generator) * 0.02))
    for part in (groups, groups[:, 3:9], groups[..., 32:96]):
        assert torch.equal(dequantize_fp4(*quantize_fp4(part)), part)
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] + [0.0] * 24)
    assert dequantize_fp4(*quantize_fp4(-midpoints[None]))[0, :8].tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0,
                                                                                -4.0, -6.0]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """A stored FP8 weight in float32: a matrix, or packed experts expert by expert."""
    if weight.dim() == 3:
        return torch.stack([dequantize_blocks(w, s) for w, s in zip(weight, scale_inv)])
    return dequantize_blocks(weight, scale_inv)


@pytest.fixture(scope="module")
def fp8_core(session_flare, qwen3_moe_checkpoint):
    result = session_flare("export", qwen3_moe_checkpoint, "--dtype", "float32", "--quantize", "fp8", *EXPORT)
    plan, core = result.output, result.output.strip().splitlines()[-1]
    return plan, open_core(core)


def test_export_keeps_the_linear_layers_and_experts_as_fp8(fp8_core, session_flare, qwen3_moe_checkpoint):
    plan, core = fp8_core
    assert "fp8: the 4 linear layers and 4 packed routed-expert tensors of the decoder layers kept as " \
           "float8_e4m3fn" in plan
    assert "embeddings, norms, routers and the head stay float32" in plan
    assert core.manifest["quantization"] == {"method": "fp8", "format": "float8_e4m3fn",
                                             "weight_block_size": [128, 128], "weights": 8}
    tensors = core.load_tensors(device="cpu")
    layer = "model.layers.1."
    assert tensors[f"{layer}self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"{layer}self_attn.qkv_proj.weight_scale_inv"].shape == (1, 1)  # 128 rows x 64 columns
    assert tensors[f"{layer}self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    experts = f"{layer}mlp.experts."
    assert tensors[f"{experts}gate_up_proj"].dtype == torch.float8_e4m3fn  # [4 experts, 64, 64]
    assert tensors[f"{experts}gate_up_proj_scale_inv"].shape == (4, 1, 1)
    assert tensors[f"{experts}down_proj_scale_inv"].shape == (4, 1, 1)
    for kept in ("model.embed_tokens.weight", "lm_head.weight", f"{layer}mlp.gate.weight",
                 f"{layer}input_layernorm.weight"):
        assert tensors[kept].dtype == torch.float32, kept
    whole = open_core(session_flare.export(qwen3_moe_checkpoint, "--dtype", "float32", *EXPORT[:-1]))
    assert "quantization" not in whole.manifest


def test_fp8_core_computes_its_dequantized_weights(fp8_core, qwen3_moe_checkpoint):
    from transformers import AutoModelForCausalLM

    from flare_core.ops.loading import load_prepared_weights

    _, core = fp8_core
    registry = load_registry()
    loaded = load_core(core, registry, torch.device("cpu"))
    recipe = registry.recipes[loaded.recipe_name]
    stored = core.load_tensors(device="cpu")
    dequantized = {name: dequantize(tensor, stored[name + "_scale_inv"]) if tensor.dtype == torch.float8_e4m3fn
                   else tensor for name, tensor in stored.items() if not name.endswith("_scale_inv")}
    reference = load_prepared_weights(recipe.build_model(loaded.model_config, torch.float32), dequantized, "cpu")
    unquantized = AutoModelForCausalLM.from_pretrained(qwen3_moe_checkpoint, dtype=torch.float32).eval()
    sequences = [torch.randint(0, 151936, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 70)]
    ours = list(serve_paged(loaded.model, loaded.cache_scheme, sequences, [9, 66], page_tokens=16))
    theirs = list(serve_paged(reference, loaded.cache_scheme, sequences, [9, 66], page_tokens=16))
    assert len(ours) == len(theirs) > 0
    worst = 0.0
    for (r, consumed, logits), (_, _, expected) in zip(ours, theirs):
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            exact = unquantized(torch.tensor([sequences[r][:consumed]])).logits[0, -1]
        worst = max(worst, float((logits - exact).abs().max() / exact.std()))
    print(f"FP8 logits vs unquantized: {worst:.4f} standard deviations at most")
    assert worst < 0.05, f"FP8 logits differ from the unquantized model's by {worst:.3f} standard deviations"


def test_flare_cores_shows_fp8_and_a_split_core_quantizes_each_ranks_slices(session_flare, qwen3_moe_checkpoint,
                                                                           fp8_core):
    """`--quantize fp8 --tp 2` of an unquantized checkpoint: each rank's slices of the weights that
    the whole core keeps as FP8 are quantized on their own block grid (a rank's 16 of the 32 expert
    features in one block of its own), so each rank loads FP8 layers where the whole core has them,
    and each slice's values are within e4m3's precision of the checkpoint's."""
    from safetensors.torch import load_file

    _, whole = fp8_core
    split = open_core(session_flare.export(qwen3_moe_checkpoint, "--dtype", "float32", "--quantize", "fp8",
                                           "--tp", "2", *EXPORT[:-1]))
    for core, form in ((whole, ["float32", "fp8"]), (split, ["float32", "fp8", "tp2"])):
        listed = next(line for line in session_flare("cores").output.splitlines() if line.startswith(core.path.name))
        assert listed.split()[3:3 + len(form)] == form  # flare cores: name, recipe, form, ...
    assert split.manifest["quantization"]["weights"] == whole.manifest["quantization"]["weights"] == 8
    checkpoint = load_file(qwen3_moe_checkpoint / "model.safetensors")
    fp8 = lambda model: sorted(n for n, t in model.state_dict().items() if t.dtype == torch.float8_e4m3fn)  # noqa: E731
    expected = fp8(load_core(whole, load_registry(), torch.device("cpu")).model)
    tensors = split.load_tensors(device="cpu")
    for rank in (0, 1):
        assert fp8(load_core(split, load_registry(), torch.device("cpu"), rank=rank).model) == expected
        down = dequantize(tensors[f"rank{rank}.model.layers.1.mlp.experts.down_proj"],
                          tensors[f"rank{rank}.model.layers.1.mlp.experts.down_proj_scale_inv"])
        whole_down = checkpoint["model.layers.1.mlp.experts.3.down_proj.weight"]  # [hidden, 32 features]
        share = whole_down.chunk(2, dim=1)[rank]
        assert ((down[3] - share).abs() <= share.abs() * 2 ** -4 + share.abs().max() / FP8_MAX * 2 ** -6).all()


PARAGRAPH = ("The Eiffel Tower was built for the 1889 World's Fair in Paris. At first many artists disliked it, "
             "but it soon became the most famous symbol of the city, and millions of people climb it every year.")


def next_token_choices(loaded, tokens: list[int]) -> list[int]:
    """The model's argmax after every prefix of `tokens`, from one prompt step that scores every
    position (teacher forcing)."""
    from flare_core.executor.storage import allocate_cache_storage
    from flare_core.ops.attention import AttentionBatch, ForwardContext

    page_tokens = 16
    pages = list(range(-(-len(tokens) // page_tokens)))
    batch = AttentionBatch.build([(len(tokens), 0, pages)], page_tokens, "cpu", every_row=[True])
    storage = allocate_cache_storage(loaded.cache_scheme, len(pages), page_tokens, "cpu")
    with torch.no_grad():
        logits = loaded.model(torch.tensor(tokens), batch.positions(),
                              ForwardContext(batch, storage, layer_map=loaded.cache_scheme.layer_map()))
    return logits.argmax(-1).tolist()


def greedy(loaded, prompt: list[int], tokens: int) -> list[int]:
    sequence = list(prompt)
    for _ in range(tokens):
        *_, (_, _, logits) = serve_paged(loaded.model, loaded.cache_scheme, [sequence], [len(sequence)], 16)
        sequence.append(int(logits.argmax()))
    return sequence[len(prompt):]


def test_real_weights_quantized_predict_as_unquantized_and_serve(session_flare, smollm2_gguf, smollm2_core, tmp_path):
    """SmolLM2-135M-Instruct's real weights: teacher-forced over an English paragraph, the FP8
    core's next-token choice is the unquantized core's at most positions (a 135M model whose
    weights were 4-bit already is a hard case); `flare run` of
    the FP8 core continues a prompt greedily as its weights compute in-process."""
    from openai import OpenAI

    core = session_flare.export(smollm2_gguf, "--dtype", "float32", "--quantize", "fp8", "--max-concurrency", "4",
                                "--context-length", "2048", "--prefill-chunk-size", "256")
    assert open_core(core).manifest["quantization"]["weights"] == 30 * 4  # qkv, o, gate_up, down
    registry = load_registry()
    fp8, whole = (load_core(open_core(path), registry, torch.device("cpu")) for path in (core, smollm2_core))
    text = list(whole.tokenizer.encode(PARAGRAPH))
    choices = [next_token_choices(loaded, text) for loaded in (fp8, whole)]
    agreement = sum(a == b for a, b in zip(*choices)) / len(choices[1])
    print(f"SmolLM2 FP8 next-token agreement with the unquantized core: {agreement:.3f} over {len(text)} tokens")
    # Measured: 42 of 48 (Transformers' model with each of its matrices quantized alone: 43 of 48).
    assert len(choices[1]) == len(text) and agreement >= 0.8, agreement

    prompt = "The capital of France is"
    expected = fp8.tokenizer.decode(greedy(fp8, list(fp8.tokenizer.encode(prompt)), 8))
    server = ServerProcess(session_flare.config_path, core, tmp_path / "run.log", "--no-dashboard",
                           "--served-name", "smollm2-fp8").wait_ready()
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        reply = client.completions.create(model="smollm2-fp8", prompt=prompt, temperature=0, max_tokens=8)
        assert reply.choices[0].text == expected
        assert server.post("/api/show", {"model": "smollm2-fp8"}).json()["details"]["quantization_level"] == "FP8"
    finally:
        server.stop()


def fp8_checkpoint(directory, source):
    """`source` (a saved checkpoint) as Qwen publishes its -FP8 releases: every linear weight of
    the decoder layers float8_e4m3fn with a float32 weight_scale_inv per 128x128 block."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, directory)
    tensors = load_file(directory / "model.safetensors")
    for name in [n for n in tensors if ".layers." in n and n.endswith("_proj.weight")]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(tensors[name])
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory, tensors


def assert_same_logits(kept, dequantized) -> None:
    """An FP8 core serves its dequantized twin's logits over a 30-token prompt."""
    registry = load_registry()
    models = [load_core(core, registry, torch.device("cpu")) for core in (kept, dequantized)]
    sequence = torch.randint(0, 151936, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    ours, theirs = ([logits for *_, logits in serve_paged(m.model, m.cache_scheme, [sequence], [30], 16)]
                    for m in models)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_qwen_fp8_checkpoint_is_read_through_its_scales(session_flare, qwen3_checkpoint, tmp_path):
    """Qwen's -FP8 layout read by the Qwen3 recipe: dequantized through the block scales (not cast),
    or with --quantize fp8 kept as published where a layer's blocks line up."""
    directory, on_disk = fp8_checkpoint(tmp_path / "qwen3-fp8", qwen3_checkpoint)
    dequantized = open_core(session_flare.export(directory, "--dtype", "float32", *EXPORT[:-1]))
    tensors = dequantized.load_tensors(device="cpu")
    o_proj = "model.layers.0.self_attn.o_proj.weight"
    torch.testing.assert_close(tensors[o_proj], dequantize_blocks(on_disk[o_proj], on_disk[o_proj + "_scale_inv"]),
                               rtol=0, atol=0)
    assert "quantization" not in dequantized.manifest

    result = session_flare("export", directory, "--dtype", "float32", "--quantize", "fp8", *EXPORT)
    assert "fp8           6 of 8 weights kept as the checkpoint's fp8 blocks; 2 dequantized" in result.output
    kept = open_core(result.output.strip().splitlines()[-1])
    stored = kept.load_tensors(device="cpu")
    assert torch.equal(stored[o_proj].view(torch.uint8), on_disk[o_proj].view(torch.uint8))
    qkv = "model.layers.0.self_attn.qkv_proj.weight"  # q has 64 rows: no whole block row
    assert stored[qkv].dtype == torch.float32 and torch.equal(stored[qkv], tensors[qkv])
    assert_same_logits(kept, dequantized)


def test_a_moe_fp8_checkpoint_keeps_each_experts_blocks(session_flare, tmp_path):
    """Packed routed experts from an fp8 checkpoint: expert e's gate/up is its own gate and up
    blocks (128 rows each: they line up), stacked over the experts; the served logits are the
    dequantized model's."""
    from conftest import write_checkpoint
    from flare_testing.qwen import tiny_qwen3_moe_config

    source = write_checkpoint(tmp_path / "moe", tiny_qwen3_moe_config(moe_intermediate_size=128))
    directory, on_disk = fp8_checkpoint(tmp_path / "moe-fp8", source)
    result = session_flare("export", directory, "--dtype", "float32", "--quantize", "fp8", *EXPORT)
    # qkv (64 query rows) does not line up; o_proj and both layers' experts do
    assert "fp8           6 of 8 weights kept as the checkpoint's fp8 blocks" in result.output
    kept = open_core(result.output.strip().splitlines()[-1])
    stored = kept.load_tensors(device="cpu")
    experts = "model.layers.1.mlp.experts."
    expected = torch.stack([torch.cat([on_disk[f"{experts}{e}.{part}_proj.weight"] for part in ("gate", "up")])
                            for e in range(4)])
    assert torch.equal(stored[f"{experts}gate_up_proj"].view(torch.uint8), expected.view(torch.uint8))
    assert stored[f"{experts}gate_up_proj_scale_inv"].shape == (4, 2, 1)
    dequantized = open_core(session_flare.export(directory, "--dtype", "float32", *EXPORT[:-1]))
    assert_same_logits(kept, dequantized)
