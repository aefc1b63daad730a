"""The short convolution of a delta-rule layer's decode step, side by side in one process: three
ways to run SiLU(depthwise causal conv) over one new input per request, continuing each
request's window in its state row, each captured as one CUDA graph over `--layers` layers of
distinct state (as a decode step holds them):

  * torch: `flare_core.kernels.delta_rule._conv_one_token` then SiLU under torch.compile (the path
    before `flare::conv_step`: gather the rows' windows, the taps, write the rows back);
  * fla: flash-linear-attention's `causal_conv1d_update` (one window per batch entry, with the
    token's slot) between a gather of the rows into its window layout and a scatter back;
  * flare: `flare::conv_step`, one Triton kernel reading and shifting the rows in place.

The geometry is the recipe's state tensor "conv" ([channels, kernel - 1]) of the named shape
(benchmarks/hybrid_decode.py's configs). Each way starts from the same rows and inputs; the
results and the rows after one step are checked against the torch way.

    python benchmarks/conv_step.py --shape kimi-linear --batch 1 64 --out benchmarks/results/conv-step.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from hybrid_decode import shape
from moe_decode import graph_us
from provenance import commit_and_date, report


def conv_geometry(name: str) -> tuple[int, int]:
    """(channels, window = kernel - 1) of the shape's "conv" state tensor."""
    from flare_core.plugins import load_registry

    config, recipe, _, _ = shape(name)
    scheme = load_registry().cache_schemes[recipe.cache_scheme].build(config, "bfloat16")
    conv = next(state for state in scheme.state if state.name == "conv")
    return conv.shape


def ways(x, windows, rows, weight, bias):
    """name -> a function of one layer's (x, windows) running that way (windows in place)."""
    from fla.modules.causal_conv1d import causal_conv1d_update

    from flare_core.kernels.delta_rule import _conv_one_token, conv_step

    compiled = torch.compile(lambda x, windows: F.silu(_conv_one_token(x, windows, rows, weight, bias)))
    taps = weight[:, 0, :].contiguous()  # fla's [channels, kernel]

    def fla(x, windows):
        # fla's window holds the kernel's width: its slot 0 (the oldest input) goes unread.
        cache = F.pad(windows.index_select(0, rows), (1, 0))
        out, cache = causal_conv1d_update(x, cache, weight=taps, bias=bias, activation="silu")
        windows.index_copy_(0, rows, cache[:, :, 1:])
        return out

    return {"torch": compiled, "fla": fla, "flare": lambda x, windows: conv_step(x, windows, rows, weight, bias)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="kimi-linear", choices=["qwen3.5", "kimi-linear"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layers", type=int, default=20, help="layers of distinct rows in one graph")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    channels, window = conv_geometry(args.shape)
    device = torch.device("cuda")
    torch.manual_seed(0)
    weight = torch.randn(channels, 1, window + 1, device=device, dtype=torch.bfloat16) * 0.5
    bias = None  # neither family's convolution has one
    results = {}
    for batch in args.batch:
        pool = batch + 8
        # The requests' rows in shuffled order, as a running batch holds them.
        rows = torch.randperm(pool, device=device)[:batch]
        inputs = [torch.randn(batch, channels, device=device, dtype=torch.bfloat16) for _ in range(args.layers)]
        start = [torch.randn(pool, channels, window, device=device, dtype=torch.bfloat16)
                 for _ in range(args.layers)]
        by_way, outputs, after = {}, {}, {}
        for name, run in ways(inputs[0], start[0], rows, weight, bias).items():
            windows = [w.clone() for w in start]
            outputs[name] = run(inputs[0], windows[0]).float()
            after[name] = windows[0].float()
            layers = [w.clone() for w in start]
            by_way[name] = {"us_per_layer": round(graph_us(
                lambda: [run(x, w) for x, w in zip(inputs, layers)], args.repeats) / args.layers, 2)}
        for name in by_way:
            by_way[name]["max_abs_error"] = (outputs[name] - outputs["torch"]).abs().max().item()
            by_way[name]["rows_equal"] = bool(torch.equal(after[name], after["torch"]))
        results[str(batch)] = by_way
        print(batch, by_way, flush=True)
    report({"benchmark": "conv_step", "shape": args.shape, "channels": channels, "window": window,
            "layers": args.layers, "results": results, "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, **commit_and_date()}, args.out)


if __name__ == "__main__":
    main()
