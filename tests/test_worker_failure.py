"""A request can only fail itself; a model worker that really fails is visible and ends the process.

- A request whose sampling values no sampler can use (NaN top_p) that reaches the engine anyway
  fails alone, while the requests beside it finish and later ones are served.
- The test-only scripted recipe can raise on its N-th forward call: in-process (the real app over
  a real engine) /health then answers 503 and new requests get 503; as a real `flare run`
  process the open stream ends with an error event and the process exits with status 1, the
  cause logged once with its traceback. Clients and probes are never told the cause (an
  exception's text can name source paths and allocator state): the error names the request id
  under which the log holds it.
- Ingress: requests waiting for the frontend pool hold reservations; past the limit a 429.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading

import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer

from flare_core.config import ServerConfig
from flare_core.requests import WORKER_FAILED, GenerationRequest, SamplingError, SamplingParams
from flare_core.server.app import build_app
from flare_core.server.state import STATE
from flare_testing.server import ServerProcess
from flare_testing.engine import make_engine
from test_serving_scripted import write_scripted_checkpoint
from flare_testing.plugins import require_test_recipe

SERVED = "failing"
FAIL_AT_STEP = 3  # the prompt's step, one decode step, then the raise
PROMPT_LENGTH = 4
SCRIPT = [9707, 11, 1879, 0] * 40  # "Hello, world!" over and over: never the end token


@pytest.fixture(scope="module")
def failing_core(tmp_path_factory, session_flare):

    require_test_recipe("scripted")
    root = tmp_path_factory.mktemp("failing")
    checkpoint = write_scripted_checkpoint(root / "failing", PROMPT_LENGTH, SCRIPT, fail_at_step=FAIL_AT_STEP)
    return session_flare.export(checkpoint, "--dtype", "float32")


async def _events(response) -> list:
    """The data of each SSE event of a streamed response, parsed."""
    events = []
    async for line in response.content:
        line = line.decode().strip()
        if line.startswith("data:"):
            data = line[5:].strip()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_unusable_sampling_values_cannot_be_made_and_an_unusable_request_fails_alone(session_flare, qwen3_core):
    """Sampling values are checked where they are made: no SamplingParams with a value no sampler
    can use exists to reach the engine. What the engine admits and cannot serve (a token id
    beyond the vocabulary) fails that request alone."""
    for values, parameter in (({"top_p": float("nan")}, "top_p"), ({"temperature": -1.0}, "temperature"),
                              ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"top_k": 2.5}, "top_k"),
                              ({"seed": 2**64}, "seed")):
        with pytest.raises(SamplingError, match=parameter):
            SamplingParams(**values)
    engine = make_engine(session_flare, qwen3_core, frames=1)

    async def run():
        engine.start()
        try:
            bad = engine.submit(GenerationRequest(prompt_ids=(5, 6, 10**9), max_tokens=4))
            good = engine.submit(GenerationRequest(prompt_ids=(8, 9, 10), max_tokens=4, ignore_eos=True))
            bad_events = [event async for event in bad]
            good_events = [event async for event in good]
            later = engine.submit(GenerationRequest(prompt_ids=(11, 12), max_tokens=3, ignore_eos=True))
            return bad_events, good_events, [event async for event in later]
        finally:
            await engine.aclose()

    bad, good, later = asyncio.run(run())
    assert bad[-1].finish_reason == "error" and "prompt_ids" in bad[-1].error
    assert good[-1].finish_reason == "length" and good[-1].usage.completion_tokens == 4
    assert later[-1].finish_reason == "length" and later[-1].usage.completion_tokens == 3
    assert engine.failure is None


def test_after_a_step_failure_health_and_new_requests_are_503(session_flare, failing_core):
    engine = make_engine(session_flare, failing_core, frames=1)

    async def run():
        app = build_app(engine, ServerConfig())
        engine.start()
        async with TestClient(TestServer(app)) as client:
            streamed = await client.post("/v1/completions", json={"prompt": [1, 2, 3, 4],
                                                                   "max_tokens": 50, "stream": True})
            assert streamed.status == 200
            events = await _events(streamed)
            health = await client.get("/health")
            refused = await client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 2})
            result = events, health.status, await health.json(), refused.status, await refused.json()
        await engine.aclose()
        return result

    events, health_status, health, refused_status, refused = asyncio.run(run())
    assert events[-1]["error"]["code"] == "execution_failed"
    assert re.search(r"request id [0-9a-f]{32}", events[-1]["error"]["message"]), events[-1]
    assert all("error" not in event for event in events[:-1]) and len(events) > 1  # text came first
    assert health_status == 503
    assert health == {"status": "failed", "cause": WORKER_FAILED}
    assert refused_status == 503 and refused["error"]["message"] == WORKER_FAILED
    for answer in (events[-1], health, refused):
        assert "scripted model failure" not in json.dumps(answer), answer


def test_a_failed_worker_ends_the_stream_with_an_error_and_the_process_exits_1(tmp_path, session_flare,
                                                                                 failing_core):
    process = ServerProcess(session_flare.config_path, failing_core, tmp_path / "server.log", "--served-name",
                            SERVED)
    process.wait_ready()
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    texts = []
    with pytest.raises(openai.APIError, match="request id") as failed:
        for chunk in client.completions.create(model=SERVED, prompt=[1, 2, 3, 4], max_tokens=50, stream=True):
            texts.append(chunk.choices[0].text)
    assert "scripted model failure" not in str(failed.value)
    request_id = re.search(r"request id ([0-9a-f]{32})", str(failed.value)).group(1)
    assert "".join(texts)  # the tokens before the failure were delivered
    assert process.wait_exit() == 1
    log = process.log()
    failed_lines = [line for line in log.splitlines() if "generation_failed" in line]
    assert len(failed_lines) == 1 and request_id in failed_lines[0], failed_lines
    assert f"scripted model failure at step {FAIL_AT_STEP}" in failed_lines[0]
    assert len(re.findall(r"model worker failed", log.split("stopped after")[0])) == 1
    assert "Traceback" in log and f"RuntimeError: scripted model failure at step {FAIL_AT_STEP}" in log
    assert "stopped after the model worker failed" in log
    assert "Error: the model worker failed" in log  # the command's own last word, exit status 1


def test_requests_waiting_for_the_frontend_pool_hold_ingress_and_the_next_is_a_429(session_flare, qwen3_core):
    engine = make_engine(session_flare, qwen3_core, frames=1)
    release = threading.Event()

    async def run():
        app = build_app(engine, ServerConfig(frontend_workers=1))
        state = app[STATE]
        engine.start()
        async with TestClient(TestServer(app)) as client:
            blocker = state.frontend_pool.submit(release.wait)  # the pool's one worker is busy
            body = {"prompt": "Hi", "max_tokens": 2}
            waiting = [asyncio.ensure_future(client.post("/v1/completions", json=body))
                       for _ in range(state.ingress_limit)]
            while state.in_flight < state.ingress_limit:
                await asyncio.sleep(0.01)  # polling the server's own count, not a fixed wait
            refused = await client.post("/v1/completions", json=body)
            refused_status, refused_body = refused.status, await refused.json()
            release.set()
            blocker.result()
            statuses = [response.status for response in await asyncio.gather(*waiting)]
        await engine.aclose()
        return refused_status, refused_body, statuses, state.ingress_limit

    refused_status, refused_body, statuses, limit = asyncio.run(run())
    assert refused_status == 429 and f"already holds {limit} requests" in refused_body["error"]["message"]
    # Released at once, the held requests meet the engine's own admission limit (its 503), never a 429.
    assert set(statuses) <= {200, 503} and statuses.count(200) >= limit // 2


def test_a_core_file_truncated_while_serving_changes_nothing(tmp_path, session_flare, qwen3_core):
    """#45 item 6: truncating the core's weights under a serving CPU process killed it with
    SIGBUS (exit 135, in-flight requests unanswered). The weights are private copies now: the
    server goes on answering, and stops cleanly."""
    core = shutil.copytree(qwen3_core, tmp_path / "core")
    process = ServerProcess(session_flare.config_path, core, tmp_path / "server.log", "--served-name", "truncated")
    try:
        process.wait_ready()
        payloads = [path for path in core.rglob("*") if path.is_file() and path.stat().st_size > 1 << 20]
        assert payloads, "the core holds no weights file to truncate"
        for path in payloads:
            with open(path, "r+b") as file:
                file.truncate(0)
        for _ in range(3):
            reply = process.post("/v1/completions", {"model": "truncated", "prompt": "Hello there", "max_tokens": 8,
                                                     "ignore_eos": True})
            assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 8, reply.body
        assert process.get("/health").status == 200
        process.terminate()
        assert process.wait_exit() == 0, process.log()
    finally:
        process.stop()
