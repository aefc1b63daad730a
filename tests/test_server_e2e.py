"""End to end: real `flare run` processes (CPU eager path, the tiny random-weight Qwen3-MoE core
with the real Qwen3 tokenizer and chat template) driven by the official openai and anthropic
SDKs and by raw HTTP.

Three servers start together for the module:
- main: the protocol tests and the error matrix (two served names, a 64 KiB body limit);
- guarded: API key, --max-concurrency 1, queue_capacity 1, --no-prefix-cache: auth, admission
  (503), ingress (429) and disconnects, with KV pages checked back to their startup count;
- draining: SIGTERM during active streams (a grace period that a second SIGTERM ends).
The MoE core's untied random head gives near-uniform logits, so seeded sampling is a real test
(different seeds give different text) and generations do not stop early.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest

from flare_testing.server import ServerProcess, SseReader, stop_all, wait_until, write_server_config

SERVED = "flare-e2e"
ALIAS = "org/flare-e2e"  # served names may hold "/" (Hugging Face repo ids)
CONTEXT = 1024  # the qwen3_moe_core fixture's --context-length
BODY_LIMIT = 65536
API_KEY = "sk-flare-e2e-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GRACE_S = 600.0  # longer than any test: the draining test ends it with a second signal
ARCHITECTURE = "Qwen3MoeForCausalLM"
LONG = 900  # tokens: a generation that outlasts any test that holds it open
EVENT_TIMEOUT_S = 60.0


@dataclass
class Servers:
    main: ServerProcess
    guarded: ServerProcess
    draining: ServerProcess
    guarded_free_pages: float  # flare_kv_pages_free right after startup (no prefix cache: all pages)


def _config(root: Path, name: str, server_section: str) -> Path:
    return write_server_config(root / name, server_section)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, qwen3_moe_core) -> Servers:
    root = tmp_path_factory.mktemp("e2e")
    key_file = root / "api_key"
    key_file.write_text(API_KEY + "\n")
    # All three start at once: startup is mostly imports and core verification.
    main = ServerProcess(_config(root, "main", f"max_body_bytes = {BODY_LIMIT}\n"), qwen3_moe_core,
                         root / "main.log", "--served-name", SERVED, "--served-name", ALIAS)
    guarded = ServerProcess(_config(root, "guarded", "queue_capacity = 1\n"), qwen3_moe_core, root / "guarded.log",
                            "--served-name", SERVED, "--max-concurrency", "1", "--no-prefix-cache",
                            "--api-key-file", str(key_file))
    draining = ServerProcess(_config(root, "draining", f"shutdown_grace_s = {GRACE_S}\n"), qwen3_moe_core,
                             root / "draining.log", "--served-name", SERVED)
    started = [main, guarded, draining]
    try:
        for server in started:
            server.wait_ready()
        yield Servers(main, guarded, draining, guarded.metrics()["flare_kv_pages_free"])
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def main(servers) -> ServerProcess:
    return servers.main


@pytest.fixture(scope="module")
def oai(main) -> openai.OpenAI:
    return openai.OpenAI(base_url=main.url + "/v1", api_key="unused", max_retries=0, timeout=EVENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def claude(main) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=main.url, api_key="unused", max_retries=0, timeout=EVENT_TIMEOUT_S)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


# ---- models ------------------------------------------------------------------------------------

def test_startup_line_splits_where_the_time_went(main):
    """The `core loaded` line says where start-up went: verifying the core's hashes while the
    plugins load, moving the weights, building the engine; `load_s` covers them all."""
    line = next(line for line in main.log().splitlines() if "core loaded" in line)
    phases = {name: float(re.search(rf"\b{name}=([0-9.]+)", line).group(1))
              for name in ("verify_s", "plugins_s", "weights_s", "engine_s", "load_s")}
    assert all(seconds >= 0 for seconds in phases.values()), line
    overlapped = max(phases["verify_s"], phases["plugins_s"])
    assert overlapped + phases["weights_s"] + phases["engine_s"] <= phases["load_s"] + 0.05, line


def test_models_list_and_retrieve(oai, claude):
    listed = oai.models.list()
    assert [model.id for model in listed.data] == [SERVED, ALIAS]
    assert all(model.max_model_len == CONTEXT for model in listed.data)
    assert oai.models.retrieve(SERVED).max_model_len == CONTEXT
    assert oai.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError) as missing:
        oai.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    assert [model.id for model in claude.models.list().data] == [SERVED, ALIAS]


def test_ollama_tags_ps_and_show(main):
    tags = main.get("/api/tags")
    assert tags.status == 200
    models = tags.json()["models"]
    assert [model["name"] for model in models] == [SERVED, ALIAS]
    assert models[0]["details"]["family"] == ARCHITECTURE and models[0]["size"] > 0

    loaded = main.get("/api/ps")  # what Ollama clients call to see what is in memory
    assert loaded.status == 200
    running = loaded.json()["models"]
    assert [model["name"] for model in running] == [SERVED, ALIAS]
    assert running[0]["size"] == models[0]["size"] and running[0]["size_vram"] == 0  # served on the CPU
    assert running[0]["context_length"] == CONTEXT and running[0]["expires_at"].startswith("9999-")

    shown = main.post("/api/show", {"model": SERVED})
    assert shown.status == 200
    body = shown.json()
    assert body["model_info"][f"{ARCHITECTURE}.context_length"] == CONTEXT
    assert {"completion", "tools", "thinking"} <= set(body["capabilities"])
    assert "<|im_start|>" in body["template"]
    assert main.post("/api/show", {"model": f"{SERVED}:latest"}).status == 200

    unknown = main.post("/api/show", {"model": "no-such-model"})
    assert unknown.status == 404
    assert "no-such-model" in unknown.json()["error"]


# ---- OpenAI chat completions -------------------------------------------------------------------

def test_chat_completion_and_its_stream_agree(oai):
    kwargs = dict(model=SERVED, messages=_user("Name three colours."), max_tokens=12, temperature=0)
    raw = oai.chat.completions.with_raw_response.create(**kwargs)
    assert "x-flare-clamped" not in raw.headers
    completion = raw.parse()
    choice = completion.choices[0]
    assert completion.object == "chat.completion" and completion.model == SERVED
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    usage = completion.usage
    assert usage.completion_tokens == 12 and usage.prompt_tokens > 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: streaming and not give the same tokens
    assert all(c.usage is None for c in chunks[:-1])
    final = chunks[-1]
    assert final.choices == [] and final.usage.completion_tokens == 12
    assert final.usage.prompt_tokens == usage.prompt_tokens


def test_chat_stream_without_include_usage_has_no_usage_chunk(oai):
    chunks = list(oai.chat.completions.create(model=SERVED, messages=_user("Hi"), max_tokens=3, temperature=0,
                                              stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_logprobs_and_top_logprobs(oai):
    kwargs = dict(model=SERVED, messages=_user("Count to five."), max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=3)
    choice = oai.chat.completions.create(**kwargs).choices[0]
    entries = choice.logprobs.content
    assert len(entries) == 6
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        # Greedy: the chosen token is the most likely one.
        assert entry.token == entry.top_logprobs[0].token
        assert entry.logprob == pytest.approx(values[0], abs=1e-4)
        assert entry.bytes == list(entry.token.encode("utf-8"))

    streamed = [entry for chunk in oai.chat.completions.create(**kwargs, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-4)


def test_prefix_cache_hits_are_reported_as_cached_prompt_tokens(oai, main):
    # A unique opening makes the first request's blocks new to the cache.
    messages = _user(f"Session {uuid.uuid4()}. " + "The cache keeps pages of prompt tokens. " * 30)
    kwargs = dict(model=SERVED, messages=messages, max_tokens=2, temperature=0)
    hits_before = main.metrics()["flare_prefix_cache_hits_total"]
    first = oai.chat.completions.create(**kwargs).usage
    assert first.prompt_tokens > 128 and first.prompt_tokens_details.cached_tokens == 0
    second = oai.chat.completions.create(**kwargs).usage
    assert second.prompt_tokens == first.prompt_tokens
    assert second.prompt_tokens_details.cached_tokens == first.prompt_tokens  # an exact hit: the whole prompt
    final = list(oai.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))[-1]
    assert final.usage.prompt_tokens_details.cached_tokens == first.prompt_tokens
    assert main.metrics()["flare_prefix_cache_hits_total"] >= hits_before + 2


# ---- OpenAI completions ------------------------------------------------------------------------

def test_completion_and_its_stream_agree(oai):
    kwargs = dict(model=SERVED, prompt="The quick brown fox", max_tokens=10, temperature=0)
    completion = oai.completions.create(**kwargs)
    choice = completion.choices[0]
    assert completion.object == "text_completion"
    assert choice.finish_reason == "length" and choice.text
    assert completion.usage.completion_tokens == 10 and completion.usage.prompt_tokens == 4

    chunks = list(oai.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_a_completion_without_max_tokens_takes_openais_default_of_16(oai):
    completion = oai.completions.create(model=SERVED, prompt="The quick brown fox", temperature=0,
                                        extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"


def test_completion_logprobs_and_echo(oai):
    completion = oai.completions.create(model=SERVED, prompt="The quick brown fox", max_tokens=5, temperature=0,
                                        logprobs=2, echo=True)
    choice = completion.choices[0]
    assert choice.text.startswith("The quick brown fox")
    logprobs = choice.logprobs
    # With echo the prompt's 4 tokens come first (the first without a logprob), then the 5 generated.
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 9
    assert "".join(logprobs.tokens[:4]) == "The quick brown fox"
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(value < 0 and len(top) == 2
               for top, value in zip(logprobs.top_logprobs[1:4], logprobs.token_logprobs[1:4]))
    # Greedy: each generated token is its row's most probable one.
    assert all(len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-4)
               for top, value in zip(logprobs.top_logprobs[4:], logprobs.token_logprobs[4:]))
    # Offsets count characters of the returned text, echo included.
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset[4] == len("The quick brown fox")
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_seeded_sampling_is_reproducible_through_the_api(oai):
    def sample(seed: int | None) -> str:
        return oai.completions.create(model=SERVED, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                      top_p=1.0, extra_body={"top_k": 0}, seed=seed).choices[0].text

    # Two at once (sampled in one batch) and one alone: a seed fixes the text regardless.
    with ThreadPoolExecutor(2) as pool:
        together = list(pool.map(sample, [1234, 1234]))
    alone = sample(1234)
    assert together == [alone, alone]
    assert sample(4321) != alone
    assert sample(None) != sample(None)


def test_clamped_sampling_values_are_reported(oai, main):
    raw = oai.chat.completions.with_raw_response.create(model=SERVED, messages=_user("Hi"), max_tokens=2,
                                                        temperature=3.0, presence_penalty=-1.0)
    clamped = raw.headers["x-flare-clamped"]
    assert "temperature=3.0->2.0" in clamped and "presence_penalty=-1.0->0.0" in clamped
    assert raw.parse().choices[0].finish_reason == "length"

    stream = SseReader(main.url, "/v1/completions", {"model": SERVED, "prompt": "Hi", "max_tokens": 2,
                                                     "stream": True, "temperature": 7})
    assert stream.response.getheader("x-flare-clamped") == "temperature=7.0->2.0"
    assert stream.events()[-1] == "[DONE]"
    stream.close()

    # Outside what the parameter can mean at all is a 400 naming the field and the limit, not a clamp.
    refused = main.post("/v1/completions", {"model": SERVED, "prompt": "Hi", "max_tokens": 2, "top_p": 7})
    assert _openai_error(refused, 400)["message"] == "'top_p': must be at most 1.0, got 7"

    response = oai.responses.create(model=SERVED, input="Hi", max_output_tokens=2, temperature=3.0)
    assert response.temperature == 2.0


# ---- OpenAI Responses --------------------------------------------------------------------------

def test_embeddings_are_a_404_that_says_so(oai, main):
    with pytest.raises(openai.NotFoundError, match="/v1/embeddings: embeddings are not served"):
        oai.embeddings.create(model=SERVED, input="hello")
    ollama_style = main.post("/api/embed", {"model": SERVED, "input": "hello"})
    assert ollama_style.status == 404 and "embeddings are not served" in ollama_style.json()["error"]


def test_responses_input_tokens_count_what_a_response_would_read(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    kwargs = dict(model=SERVED, instructions="Be brief.", input="Write a haiku.")
    counted = oai.responses.input_tokens.count(**kwargs)
    assert counted.object == "response.input_tokens"
    assert counted.input_tokens == oai.responses.create(**kwargs, max_output_tokens=1).usage.input_tokens
    with_tools = oai.responses.input_tokens.count(**kwargs, tools=tools, tool_choice="auto")
    assert with_tools.input_tokens > counted.input_tokens  # the template describes the tools
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        oai.responses.input_tokens.count(**kwargs, previous_response_id="resp_1")


def test_responses_create_and_stream_events(oai):
    kwargs = dict(model=SERVED, input="Tell me a story.", instructions="Be brief.", max_output_tokens=8,
                  temperature=0)
    response = oai.responses.create(**kwargs)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text and response.usage.output_tokens == 8 and response.usage.input_tokens > 5

    events = list(oai.responses.create(**kwargs, stream=True))
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-4].text == response.output_text
    final = events[-1].response
    assert final.output_text == response.output_text and final.usage.output_tokens == 8
    # The same prompt again: an exact prefix-cache hit.
    assert final.usage.input_tokens_details.cached_tokens == final.usage.input_tokens == response.usage.input_tokens


# ---- Anthropic Messages ------------------------------------------------------------------------

def test_an_anthropic_beta_flare_does_not_serve_is_a_400(claude):
    import anthropic

    kwargs = dict(model=SERVED, max_tokens=2, extra_body={"temperature": 0}, messages=_user("Hi"))
    with pytest.raises(anthropic.BadRequestError, match="anthropic-beta: interleaved-thinking-2025-05-14 is not "
                                                        "served here"):
        claude.messages.create(**kwargs, extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    served = claude.messages.create(**kwargs, extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"})
    assert served.usage.output_tokens == 2


def test_messages_create_stream_and_count_tokens(claude):
    # This SDK version has no sampling arguments; the API still takes them.
    kwargs = dict(model=SERVED, max_tokens=8, extra_body={"temperature": 0}, system="Be brief.",
                  messages=_user("Write a haiku."))
    message = claude.messages.create(**kwargs)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
    assert re.fullmatch(r"[0-9a-f]{32}", message._request_id or "")  # the SDK reads the request-id header
    assert [block.type for block in message.content] == ["text"] and message.content[0].text
    counted = claude.messages.count_tokens(model=SERVED, system="Be brief.", messages=_user("Write a haiku."))
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens

    events = list(claude.messages.create(**kwargs, stream=True))
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[2:-3]) == {"content_block_delta"}
    assert "".join(event.delta.text for event in events if event.type == "content_block_delta") \
        == message.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == "max_tokens" and delta.usage.output_tokens == 8
    # The same prompt again: an exact prefix-cache hit, reported as cache reads — from message_start
    # on, as Anthropic reports them (#50: message_start said uncached and message_delta corrected it).
    assert delta.usage.cache_read_input_tokens == counted.input_tokens and delta.usage.input_tokens == 0
    start = events[0].message.usage
    assert (start.cache_read_input_tokens, start.input_tokens) == (counted.input_tokens, 0)

    with claude.messages.stream(**kwargs) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == final.content[0].text == message.content[0].text


def test_messages_stop_sequence(claude):
    kwargs = dict(model=SERVED, max_tokens=24, extra_body={"temperature": 0}, messages=_user("Say something long."))
    text = claude.messages.create(**kwargs).content[0].text
    # A stop sequence taken from the middle of the greedy text ends it exactly there.
    cut = next(i for i in range(len(text) // 3, len(text) - 2) if text.find(text[i:i + 2]) == i
               and text[i:i + 2].strip())
    stop = text[cut:cut + 2]
    stopped = claude.messages.create(**kwargs, stop_sequences=[stop])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[:cut]


# ---- errors (raw HTTP) -------------------------------------------------------------------------

def _openai_error(reply, status: int) -> dict:
    assert reply.status == status, reply.body
    assert reply.headers["Content-Type"].startswith("application/json")
    return reply.json()["error"]


def test_malformed_json_is_a_400_in_each_api_format(main):
    error = _openai_error(main.post("/v1/chat/completions", raw=b'{"model": "flare-e2e", "messages": ['), 400)
    assert "not valid JSON" in error["message"] and error["type"] == "invalid_request_error"
    anthropic_reply = main.post("/v1/messages", raw=b"{nope")
    assert anthropic_reply.status == 400
    body = anthropic_reply.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert main.post("/v1/completions", raw=b"[1, 2]").json()["error"]["message"] == \
        "request body must be a JSON object, got array"


@pytest.mark.parametrize("path, body, field, expected", [
    ("/v1/chat/completions", {"messages": "hello"}, "messages", "must be an array, got string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
     "max_tokens", "must be an integer, got string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "must be a string or an array of content parts, got integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature", "must be a number, got string"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream", "must be a boolean, got string"),
    ("/v1/responses", {"input": 7}, "input", "must be a string or an array of input items, got integer"),
])
def test_wrong_types_name_the_field(main, path, body, field, expected):
    error = _openai_error(main.post(path, {"model": SERVED, **body}), 400)
    assert error["param"] == field
    assert error["message"] == f"'{field}': {expected}"


def test_anthropic_validation_names_the_field(main):
    reply = main.post("/v1/messages", {"model": SERVED, "messages": _user("hi")})
    assert reply.status == 400 and reply.json()["error"]["message"] == "'max_tokens': is required"
    reply = main.post("/v1/messages", {"model": SERVED, "max_tokens": 4, "messages": _user("hi"), "colour": 1})
    assert reply.status == 400 and "colour: Extra inputs are not permitted" in reply.json()["error"]["message"]


def test_unknown_model_is_a_json_404(main):
    for path, body in [("/v1/chat/completions", {"messages": _user("hi")}), ("/v1/completions", {"prompt": "hi"}),
                       ("/v1/responses", {"input": "hi"})]:
        error = _openai_error(main.post(path, {"model": "no-such-model", **body}), 404)
        assert error["code"] == "model_not_found" and "'no-such-model'" in error["message"]
    assert _openai_error(main.get("/v1/models/no-such-model"), 404)["code"] == "model_not_found"
    reply = main.post("/v1/messages", {"model": "no-such-model", "max_tokens": 4, "messages": _user("hi")})
    assert reply.status == 404 and reply.json()["error"]["type"] == "not_found_error"
    assert _openai_error(main.get("/v1/no-such-route"), 404)["message"] == "GET /v1/no-such-route: Not Found"


def test_oversized_bodies_are_refused_with_413(main):
    body = {"model": SERVED, "messages": _user("x" * BODY_LIMIT)}
    error = _openai_error(main.post("/v1/chat/completions", body), 413)
    assert f"limit of {BODY_LIMIT} bytes" in error["message"] and "max_body_bytes" in error["message"]

    # Without a Content-Length (chunked upload) the limit holds while reading.
    host, port = main.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=EVENT_TIMEOUT_S)
    payload = json.dumps(body).encode("utf-8")
    connection.request("POST", "/v1/chat/completions", body=iter([payload[:1000], payload[1000:]]),
                       headers={"Content-Type": "application/json"}, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413
    assert f"limit of {BODY_LIMIT} bytes" in json.loads(response.read())["error"]["message"]
    connection.close()
    assert main.get("/health").status == 200


def test_context_overflow_names_both_counts_the_context_and_the_setting(main, oai, claude):
    error = _openai_error(main.post("/v1/completions", {"model": SERVED, "prompt": [100] * 1000,
                                                        "max_tokens": 100}), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    message = error["message"]
    assert "1000 tokens" in message and "up to 100 more" in message and "1100 tokens" in message
    assert f"context length of {CONTEXT} tokens" in message and "--context-length" in message

    error = _openai_error(main.post("/v1/completions", {"model": SERVED, "prompt": [100] * CONTEXT}), 400)
    assert f"{CONTEXT} tokens, which leaves no room" in error["message"] and "--context-length" in error["message"]

    prompt_tokens = oai.chat.completions.create(model=SERVED, messages=_user("Hi"), max_tokens=1).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as chat_overflow:
        oai.chat.completions.create(model=SERVED, messages=_user("Hi"), max_tokens=CONTEXT)
    assert f"{prompt_tokens} tokens and max_tokens asks for up to {CONTEXT} more" in str(chat_overflow.value)
    with pytest.raises(anthropic.BadRequestError) as messages_overflow:
        claude.messages.create(model=SERVED, max_tokens=CONTEXT, messages=_user("Hi"))
    assert f"context length of {CONTEXT} tokens" in str(messages_overflow.value)


# ---- auth, admission, ingress, disconnects (guarded server) -----------------------------------

@pytest.fixture(scope="module")
def guarded(servers) -> ServerProcess:
    return servers.guarded


def test_api_key_is_required_except_for_health_and_metrics(guarded):
    rejected = guarded.metrics().get('flare_requests_rejected_total{status="401"}', 0.0)
    assert _openai_error(guarded.get("/v1/models"), 401)["code"] == "invalid_api_key"
    assert guarded.post("/v1/chat/completions", {"model": "x"}, headers={"Authorization": "Bearer wrong"}).status \
        == 401
    reply = guarded.post("/v1/messages", {"model": "x"})
    assert reply.status == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert guarded.get("/health").status == 200
    assert guarded.metrics()['flare_requests_rejected_total{status="401"}'] == rejected + 3

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=API_KEY, max_retries=0)
    assert [model.id for model in client.models.list().data] == [SERVED]
    # Anthropic clients send x-api-key.
    claude = anthropic.Anthropic(base_url=guarded.url, api_key=API_KEY, max_retries=0)
    assert claude.messages.create(model=SERVED, max_tokens=2, messages=_user("Hi")).usage.output_tokens == 2


def _long_completion(stream: bool = True) -> dict:
    return {"model": SERVED, "prompt": "Keep going", "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def _open_body(server: ServerProcess) -> http.client.HTTPConnection:
    """A request whose body never finishes arriving (until the server's body timeout)."""
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=EVENT_TIMEOUT_S)
    connection.putrequest("POST", "/v1/completions")
    for name, value in {**AUTH, "Content-Type": "application/json", "Content-Length": "1000"}.items():
        connection.putheader(name, value)
    connection.endheaders()
    connection.send(b'{"model": ')
    return connection


def _settled(servers: Servers) -> dict[str, float]:
    """Wait until the guarded server holds nothing: no live or waiting request, no HTTP request
    in flight, and every KV page free again (no prefix cache keeps any)."""
    return servers.guarded.wait_metrics({"flare_slots_live": 0.0, "flare_requests_waiting": 0.0,
                                         "flare_http_requests_in_flight": 0.0,
                                         "flare_kv_pages_free": servers.guarded_free_pages})


def test_admission_full_is_503_and_ingress_full_is_429(servers):
    guarded = servers.guarded
    before = _settled(servers)
    running = SseReader(guarded.url, "/v1/completions", _long_completion(), AUTH)
    assert running.status == 200 and isinstance(running.next_event(), dict)
    queued = SseReader(guarded.url, "/v1/completions", _long_completion(), AUTH)
    assert queued.status == 200
    guarded.wait_metrics({"flare_slots_live": 1.0, "flare_requests_waiting": 1.0})
    open_bodies: list[http.client.HTTPConnection] = []
    try:
        # max_concurrency 1 + queue_capacity 1 are taken: the engine refuses more.
        full = guarded.post("/v1/completions", _long_completion(stream=False), headers=AUTH)
        assert "admission is full" in _openai_error(full, 503)["message"] and full.headers["Retry-After"] == "1"
        overloaded = guarded.post("/v1/messages", {"model": SERVED, "max_tokens": 4,
                                                   "messages": _user("hi")}, headers=AUTH)
        assert overloaded.status == 503 and overloaded.json()["error"]["type"] == "overloaded_error"

        # Requests still receiving their bodies hold no ingress reservation (test_hostile_clients
        # covers the ingress 429 and the upload limit): other clients are still served.
        open_bodies = [_open_body(guarded) for _ in range(2)]
        guarded.wait_metrics({"flare_http_uploads_in_progress": 2.0, "flare_http_requests_in_flight": 2.0})
        assert guarded.get("/v1/models", headers=AUTH).status == 200
        assert guarded.get("/health").status == 200 and guarded.get("/metrics").status == 200
    finally:
        for connection in open_bodies:
            connection.close()
        running.close()
        queued.close()

    after = _settled(servers)
    assert after['flare_requests_rejected_total{status="503"}'] == \
        before.get('flare_requests_rejected_total{status="503"}', 0.0) + 2
    assert after["flare_requests_cancelled_total"] == before["flare_requests_cancelled_total"] + 2
    # The slot is usable again.
    reply = guarded.post("/v1/completions", {"model": SERVED, "prompt": "Hi", "max_tokens": 3}, headers=AUTH)
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 3


def _disconnect_raw(guarded: ServerProcess) -> None:
    stream = SseReader(guarded.url, "/v1/completions", _long_completion(), AUTH)
    for _ in range(3):
        assert isinstance(stream.next_event(), dict)
    stream.close()


def _disconnect_openai(guarded: ServerProcess) -> None:
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=API_KEY, max_retries=0)
    stream = client.chat.completions.create(model=SERVED, messages=_user("Go on"), max_tokens=LONG, stream=True,
                                            extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    stream.close()


def _disconnect_anthropic(guarded: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=guarded.url, api_key=API_KEY, max_retries=0)
    stream = client.messages.create(model=SERVED, max_tokens=LONG, messages=_user("Go on"), stream=True)
    for _, _event in zip(range(3), stream):
        pass
    stream.close()


@pytest.mark.parametrize("disconnect", [_disconnect_raw, _disconnect_openai, _disconnect_anthropic],
                         ids=["raw-completions", "openai-chat", "anthropic-messages"])
def test_client_disconnect_mid_stream_frees_the_slot(servers, disconnect):
    before = _settled(servers)
    disconnect(servers.guarded)
    after = _settled(servers)
    assert after["flare_requests_cancelled_total"] == before["flare_requests_cancelled_total"] + 1
    assert after["flare_generation_tokens_total"] < before["flare_generation_tokens_total"] + LONG


# ---- SIGTERM (draining server) -----------------------------------------------------------------

def test_sigterm_drains_then_marks_cut_streams_and_exits_0(servers):
    """Ordering, not timing: the grace period is longer than the test, so the short stream always
    completes; a second SIGTERM then ends the grace and the long streams are cut, each ending with
    its protocol's error event (never a finish reason of a complete answer)."""
    server = servers.draining
    started = {key: threading.Event() for key in ("short", "openai", "anthropic")}

    def short() -> list:
        stream = SseReader(server.url, "/v1/completions", {"model": SERVED, "prompt": "Short", "max_tokens": 40,
                                                           "temperature": 0, "ignore_eos": True, "stream": True,
                                                           "stream_options": {"include_usage": True}})
        events = [stream.next_event()]
        started["short"].set()
        return events + stream.events()

    def with_openai() -> tuple[list, Exception | None]:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        chunks = []
        try:
            for chunk in client.chat.completions.create(model=SERVED, messages=_user("Go on"), max_tokens=LONG,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True},
                                                        extra_body={"ignore_eos": True}):
                chunks.append(chunk)
                if chunk.choices and chunk.choices[0].delta.content:
                    started["openai"].set()
        except openai.APIError as error:
            return chunks, error
        return chunks, None

    def with_anthropic() -> tuple[list, Exception | None]:
        client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        events = []
        try:
            for event in client.messages.create(model=SERVED, max_tokens=LONG, messages=_user("Go on"), stream=True,
                                                extra_body={"temperature": 0}):
                events.append(event)
                if event.type == "content_block_delta":
                    started["anthropic"].set()
        except anthropic.APIError as error:
            return events, error
        return events, None

    with ThreadPoolExecutor(3) as pool:
        long_futures = [pool.submit(with_openai), pool.submit(with_anthropic)]
        for key in ("openai", "anthropic"):
            assert started[key].wait(EVENT_TIMEOUT_S), f"the {key} stream produced no output"
        short_future = pool.submit(short)
        assert started["short"].wait(EVENT_TIMEOUT_S)
        server.terminate()

        # Draining: admission is closed while the active streams finish.
        wait_until(lambda: server.get("/health").status == 503, EVENT_TIMEOUT_S, "/health to report draining")
        assert server.get("/health").json() == {"status": "draining"}
        refused = server.post("/v1/completions", {"model": SERVED, "prompt": "Hi", "max_tokens": 2})
        assert "shutting down" in _openai_error(refused, 503)["message"]

        # The grace period outlasts the short stream: it runs to its full length.
        short_events = short_future.result(timeout=EVENT_TIMEOUT_S)
        assert short_events[-1] == "[DONE]"
        assert short_events[-2]["usage"]["completion_tokens"] == 40
        assert short_events[-3]["choices"][0]["finish_reason"] == "length"

        # Decode steps batch all three, so the long streams are far from their end: a second
        # signal ends the grace and cuts them.
        server.terminate()
        (chunks, openai_error), (events, anthropic_error) = (future.result(timeout=EVENT_TIMEOUT_S)
                                                             for future in long_futures)

    assert chunks and all(chunk.choices[0].finish_reason is None for chunk in chunks if chunk.choices)
    assert isinstance(openai_error, openai.APIError) and "shut down before this response was complete" in \
        str(openai_error)
    assert events[-1].type == "content_block_delta"  # no message_delta with a stop reason
    assert isinstance(anthropic_error, anthropic.APIError) and "shut down before this response was complete" in \
        str(anthropic_error)

    assert server.wait_exit() == 0
    log = server.log()
    assert re.search(r"draining\s+active_responses=[23] ", log)
    assert re.search(r"cancelled_after_grace\s+requests=2\b", log)


# ---- forced tool calls -------------------------------------------------------------------------

FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "days": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}}},
]
FORCED_ARGUMENTS = {"get_weather": ({"city", "days"}, {"Paris", "Rome", 1, 2, 3}),
                    "get_time": ({"zone"}, {"UTC", "CET"})}


def _valid_call(name: str, arguments: dict) -> bool:
    keys, values = FORCED_ARGUMENTS[name]
    return set(arguments) == keys and set(arguments.values()) <= values


def test_forced_tool_calls_through_every_sdk(oai, claude):
    """tool_choice "required" and a named tool (OpenAI chat and Responses), "any" and "tool"
    (Anthropic): the output is the core's tool-call format (Hermes here) with arguments that
    follow each tool's schema, parsed by the core's tool parser, with thinking off (the
    grammar then applies from the first token) and with it on (the grammar waits for </think>,
    which this random model does not write: its calls cannot be forced, and nothing breaks)."""
    messages = _user("What's the weather in Paris, and the time?")
    named = oai.chat.completions.create(model=SERVED, messages=messages, tools=FORCED_TOOLS, temperature=0.8, seed=4,
                                        tool_choice={"type": "function", "function": {"name": "get_time"}},
                                        reasoning_effort="none", max_tokens=100)
    [call] = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    assert _valid_call("get_time", json.loads(call.function.arguments))
    # Compact JSON, as response_format writes it: no whitespace but the ", " and ": " separators.
    assert json.dumps(json.loads(call.function.arguments)) == call.function.arguments
    required = oai.chat.completions.create(model=SERVED, messages=messages, tools=FORCED_TOOLS, temperature=0,
                                           tool_choice="required", parallel_tool_calls=False,
                                           reasoning_effort="none", max_tokens=100)
    [call] = required.choices[0].message.tool_calls
    assert _valid_call(call.function.name, json.loads(call.function.arguments))
    assert json.dumps(json.loads(call.function.arguments)) == call.function.arguments
    streamed = oai.chat.completions.create(model=SERVED, messages=messages, tools=FORCED_TOOLS, temperature=0,
                                           tool_choice="required", parallel_tool_calls=False,
                                           reasoning_effort="none", max_tokens=100, stream=True)
    pieces = [delta for chunk in streamed if chunk.choices for delta in chunk.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name == call.function.name
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments

    response = oai.responses.create(model=SERVED, input="Weather?", tools=[
        {"type": "function", **tool["function"]} for tool in FORCED_TOOLS], tool_choice="required",
        parallel_tool_calls=False, reasoning={"effort": "none"}, max_output_tokens=100, temperature=0)
    [item] = [item for item in response.output if item.type == "function_call"]
    assert _valid_call(item.name, json.loads(item.arguments))

    message = claude.messages.create(model=SERVED, max_tokens=100, messages=messages,
                                     tools=[{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                                            for t in FORCED_TOOLS],
                                     tool_choice={"type": "tool", "name": "get_weather"},
                                     extra_body={"temperature": 0, "thinking": {"type": "disabled"}})
    [block] = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and block.name == "get_weather" and _valid_call(block.name, block.input)

    thinking = oai.chat.completions.create(model=SERVED, messages=messages, tools=FORCED_TOOLS, temperature=0,
                                           tool_choice="required", max_tokens=16)
    assert thinking.choices[0].finish_reason == "length"  # still reasoning: the grammar has not started
    with pytest.raises(openai.BadRequestError, match="names no tool the request offers"):
        oai.chat.completions.create(model=SERVED, messages=messages, tools=FORCED_TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "absent"}})
