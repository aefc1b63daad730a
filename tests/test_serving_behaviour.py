"""Serving behaviour end to end: real `flare run` processes on the CPU eager path, driven with the
official openai SDK, checked against Transformers on the same weights.

Three servers start together for the module, all from the session's tiny random-weight cores
(float32, max concurrency 8, prefill chunk 128, context 1024, 64-token pages):
- qwen3: the dense core. Its embeddings are tied, so greedy output repeats the prompt's last
  token: it checks the numerics of the path rather than interesting text;
- moe: the Qwen3-MoE core (untied head: varied multilingual text, small but clear greedy margins);
- moe_uncached: the same MoE core with --no-prefix-cache and --no-mixed-steps, the reference for
  prefix reuse (and a server whose steps each decode or prefill, never both).

Greedy parity compares text and token counts, not token ids: /v1/completions cannot return
generated token ids (its logprobs give token *texts*). Requests set skip_special_tokens=false so
every generated token shows in the text; the expected text is the Transformers ids decoded with
the real Qwen3 tokenizer, minus the final stop token (it ends generation and is never text).
Equal text, equal token count and equal finish reason leave no room for a different sequence in
practice.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch

from flare_testing.server import ServerProcess, stop_all

STOP_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>: the cores' stop tokens (generation_config eos)
MAX_TOKENS = 16
PREFILL_CHUNK = 128  # the session cores' --prefill-chunk-size
PAGE_TOKENS = 64  # prefix reuse is by whole pages of this many tokens
# Greedy choices closer than this could flip on float noise (batch shapes change summation order),
# so a reference this close would make a mismatch meaningless: it is reported instead.
MIN_GREEDY_MARGIN = 1e-4
RAW = {"skip_special_tokens": False}

PASSAGE = ("Section {n}. A runtime core is prepared once and served many times; the scheduler batches "
           "requests, reuses cached prefixes page by page, and streams text as soon as it is certain. "
           "天气很好，我们去公园散步吧。 Numbers like {n}{n} and symbols (#{n}) keep the tokens varied. ")
OTHER = ("Unrelated text about mountains, rivers and the weather in Zürich on day {n}: cloudy, then "
         "sunny, with a light breeze from the west. ")


@dataclass
class Served:
    process: ServerProcess
    name: str  # the served model name
    reference: str  # which Transformers model it must agree with

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.process.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(self, prompt: list[int] | str, **fields):
        """Greedy /v1/completions with every token visible in the text."""
        extra = {**RAW, **fields.pop("extra_body", {})}
        values = {"max_tokens": MAX_TOKENS, "temperature": 0, **fields}
        return self.client().completions.create(model=self.name, prompt=prompt, extra_body=extra, **values)

    def chat(self, messages: list[dict], **fields):
        values = {"max_tokens": MAX_TOKENS, "temperature": 0, **fields}
        return self.client().chat.completions.create(model=self.name, messages=messages, **values)


@dataclass
class Servers:
    qwen3: Served
    moe: Served
    moe_uncached: Served


@pytest.fixture(scope="module")
def servers(tmp_path_factory, session_flare, qwen3_core, qwen3_moe_core) -> Servers:
    root = tmp_path_factory.mktemp("behaviour")
    config = session_flare.config_path

    def start(core: Path, log: str, name: str, *flags: str) -> ServerProcess:
        return ServerProcess(config, core, root / log, "--served-name", name, *flags)

    # Started together: startup is mostly imports and core verification.
    qwen3 = start(qwen3_core, "qwen3.log", "tiny-qwen3")
    moe = start(qwen3_moe_core, "moe.log", "tiny-qwen3-moe")
    moe_uncached = start(qwen3_moe_core, "moe-uncached.log", "tiny-qwen3-moe", "--no-prefix-cache",
                         "--no-mixed-steps")
    started = [qwen3, moe, moe_uncached]
    try:
        for server in started:
            server.wait_ready()
        yield Servers(Served(qwen3, "tiny-qwen3", "qwen3"), Served(moe, "tiny-qwen3-moe", "moe"),
                      Served(moe_uncached, "tiny-qwen3-moe", "moe"))
    finally:
        stop_all(started)


@pytest.fixture(scope="module")
def tokenizer(qwen3_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_checkpoint)


@pytest.fixture(scope="module")
def references(qwen3_checkpoint, qwen3_moe_checkpoint):
    """Transformers models on the exact weights the cores were exported from."""
    from transformers import AutoModelForCausalLM

    return {name: Reference(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
            for name, path in (("qwen3", qwen3_checkpoint), ("moe", qwen3_moe_checkpoint))}


@dataclass(frozen=True)
class Greedy:
    ids: list[int]
    margin: float  # the smallest gap between the best and the second-best logit over the steps


class Reference:
    """Transformers greedy generation, remembered per prompt (the tests ask for the same ones often)."""

    def __init__(self, model):
        self.model = model
        self._greedy: dict[tuple[int, ...], Greedy] = {}

    def greedy(self, prompt: list[int]) -> Greedy:
        key = tuple(prompt)
        if key not in self._greedy:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                          eos_token_id=list(STOP_IDS), pad_token_id=STOP_IDS[1],
                                          output_scores=True, return_dict_in_generate=True)
            top2 = torch.stack([scores[0].topk(2).values for scores in out.scores])
            self._greedy[key] = Greedy(out.sequences[0, len(prompt):].tolist(),
                                       float((top2[:, 0] - top2[:, 1]).min()))
        return self._greedy[key]


def expected_text(tokenizer, ids: list[int]) -> str:
    visible = ids[:-1] if ids and ids[-1] in STOP_IDS else ids
    return tokenizer.decode(visible, skip_special_tokens=False)


def check_parity(tokenizer, model: Reference, prompt: list[int], response) -> None:
    reference = model.greedy(prompt)
    assert reference.margin > MIN_GREEDY_MARGIN, f"reference greedy margin {reference.margin} is float noise"
    choice = response.choices[0]
    assert choice.text == expected_text(tokenizer, reference.ids), f"prompt of {len(prompt)} tokens"
    assert response.usage.prompt_tokens == len(prompt)
    assert response.usage.completion_tokens == len(reference.ids)
    assert choice.finish_reason == ("stop" if reference.ids[-1] in STOP_IDS else "length")


def cached_tokens(response) -> int:
    return response.usage.prompt_tokens_details.cached_tokens


def parity_prompts(tokenizer) -> list[list[int]]:
    """Eight token-id prompts of 7..344 tokens: four longer than the prefill chunk (prefilled in
    several chunks), several sharing prefixes (base[:100], base[:150], base[:333])."""
    base = tokenizer.encode("".join(PASSAGE.format(n=n) for n in range(12)))
    other = tokenizer.encode("".join(OTHER.format(n=n) for n in range(12)))
    return [base[:7], base[:40], base[:100], base[:100] + other[:25], base[:150], base[:150] + other[:50],
            other[:260], base[:333] + other[:11]]


@pytest.mark.parametrize("which", ["qwen3", "moe", "moe_uncached"])
def test_greedy_output_matches_transformers(servers, tokenizer, references, which):
    """One request, then eight concurrent ones, then (with the prefix cache) the eight again. The
    concurrent ones run in mixed steps too (decode rows beside prompt chunks), except on the
    server started with --no-mixed-steps, whose steps each decode or prefill."""
    served: Served = getattr(servers, which)
    model = references[served.reference]
    prompts = parity_prompts(tokenizer)
    single = prompts[-1][:333]
    assert len(single) > 2 * PREFILL_CHUNK  # prefilled in three chunks
    check_parity(tokenizer, model, single, served.complete(single))

    def concurrently() -> list:
        with ThreadPoolExecutor(len(prompts)) as pool:
            responses = list(pool.map(served.complete, prompts))
        for prompt, response in zip(prompts, responses):
            check_parity(tokenizer, model, prompt, response)
        return responses

    first = concurrently()
    # While some of the eight decoded, the others' prompts were computed in the same (mixed) steps;
    # with --no-mixed-steps, in prompt-only steps between decode steps.
    metrics = served.process.metrics()
    steps = {kind: metrics.get(f'flare_steps_total{{kind="{kind}"}}', 0) for kind in ("decode", "prefill", "mixed")}
    if which == "moe_uncached":
        assert steps["mixed"] == 0 and steps["decode"] > 0 and steps["prefill"] > 0, steps
    else:
        assert steps["mixed"] > 0, steps
    if which == "moe_uncached":
        assert [cached_tokens(r) for r in first] == [0] * len(prompts)
        return
    # The last prompt extends the single one: its complete pages were reused and only the rest
    # was computed, on top of the reused K/V.
    assert cached_tokens(first[-1]) >= len(single) // PAGE_TOKENS * PAGE_TOKENS
    again = concurrently()  # exact repeats: restored whole, the first token from stored logits
    assert [cached_tokens(r) for r in again] == [len(p) for p in prompts]


SYSTEM = ("You are the forecasting assistant of a small alpine weather service. Answer in two short "
          "sentences, name the valley you mean, give temperatures in degrees Celsius, mention wind only "
          "when it is stronger than twenty kilometres per hour, and never invent a station that the "
          "user did not name. If the user asks about avalanches, refer them to the official bulletin "
          "and do not give your own assessment. Stations: Davos, Arosa, Zermatt, Saas-Fee, Andermatt, "
          "Grindelwald, Engelberg, Lenzerheide and Pontresina; each reports every ten minutes.")


def test_multi_turn_chat_reuses_the_first_turn(servers, tokenizer):
    """The second turn re-sends the first turn's messages; the prefix cache must reuse them, and
    the output must not change because of it (the --no-prefix-cache server is the reference)."""
    turn1 = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": "What is the forecast for Davos tomorrow morning?"}]
    first = servers.moe.chat(turn1)
    assert first.choices[0].message == servers.moe_uncached.chat(turn1).choices[0].message
    assert cached_tokens(first) == 0  # nothing of this conversation was cached before

    reply = first.choices[0].message
    turn2 = turn1 + [{"role": "assistant", "content": reply.content or ""},
                     {"role": "user", "content": "And for Zermatt in the afternoon?"}]
    second = servers.moe.chat(turn2)
    reference = servers.moe_uncached.chat(turn2)
    assert second.choices[0].message == reference.choices[0].message
    assert second.choices[0].finish_reason == reference.choices[0].finish_reason
    assert second.usage.prompt_tokens == reference.usage.prompt_tokens
    assert cached_tokens(reference) == 0

    # What the cache must hold after turn 1, in tokens of the real Qwen3 template + tokenizer:
    # - `marked`: the system and first user message, up to the template's mark after the user
    #   message. This prefix never changes as the conversation grows. The cache keeps it in whole
    #   pages (partial pages only behind prompt-end resume points), so at least `marked` rounded
    #   down to a page is reused: the floor prefix caching guarantees for any conversation.
    # - `opened`: turn 1's whole prompt (its generation prompt included). Here turn 2 starts
    #   with it token for token, so turn 1's prompt-end resume point (its partial last page copied)
    #   extends the reuse to exactly there, or further through complete pages of the reply.
    # Never the whole prompt: turn 2's new user message was never seen.
    def render(messages: list[dict], generation_prompt: bool) -> list[int]:
        return tokenizer.apply_chat_template(messages, tokenize=True,
                                             add_generation_prompt=generation_prompt)["input_ids"]

    marked, opened, whole = len(render(turn1, False)), render(turn1, True), render(turn2, True)
    assert len(whole) == second.usage.prompt_tokens and whole[:len(opened)] == opened
    assert marked >= 2 * PAGE_TOKENS, "the first turn must span pages for this test to mean anything"
    assert marked // PAGE_TOKENS * PAGE_TOKENS <= len(opened) <= cached_tokens(second) < len(whole)

    repeat = servers.moe.chat(turn2)  # an exact repeat is an exact hit
    assert cached_tokens(repeat) == repeat.usage.prompt_tokens
    assert repeat.choices[0].message == second.choices[0].message


def test_seeded_sampling_is_reproducible(servers):
    served = servers.moe
    prompt = "Tell me a story about a lighthouse keeper."

    def sample(seed: int) -> str:
        response = served.complete(prompt, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
        assert response.usage.completion_tokens == MAX_TOKENS
        return response.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first

    # The same seed gives the same text while other requests share its steps: start streams
    # that run far longer, wait until each produced text (they are running), sample, and check
    # they were still running when the seeded request finished.
    background = [served.client().completions.create(
        model=served.name, prompt=f"Background request {n} with some text.", max_tokens=600, temperature=1.0,
        stream=True, extra_body={"ignore_eos": True}) for n in range(3)]
    try:
        for stream in background:
            next(iter(stream))
        assert sample(1234) == first
        assert served.process.get("/health").json()["active_requests"] >= 1
    finally:
        for stream in background:
            stream.close()  # the server cancels them


def test_stop_string_spanning_tokens_is_cut_exactly(servers):
    served = servers.moe
    prompt = "你好，世界"
    free = served.complete(prompt, logprobs=0)
    text, pieces = free.choices[0].text, free.choices[0].logprobs.tokens
    assert "".join(pieces) == text and free.usage.completion_tokens == MAX_TOKENS  # no stop, clean pieces
    # A stop string from the middle of one token, across the next, into the middle of a third.
    starts = [sum(map(len, pieces[:i])) for i in range(len(pieces) + 1)]
    candidates = [i for i in range(1, len(pieces) - 2)
                  if all(len(pieces[j]) >= 2 for j in (i, i + 1, i + 2))
                  and text.find(text[starts[i] + 1:starts[i + 2] + 1]) == starts[i] + 1]
    assert candidates, f"no token triple to build a stop string from in {pieces!r}"
    cut = starts[candidates[0]] + 1
    stop = text[cut:starts[candidates[0] + 2] + 1]

    stopped = served.complete(prompt, stop=[stop])
    assert stopped.choices[0].text == text[:cut]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == stop

    chunks = list(served.complete(prompt, stop=[stop], stream=True))
    deltas = [chunk.choices[0].text for chunk in chunks if chunk.choices]
    assert "".join(deltas) == text[:cut]  # nothing of the stop string was ever sent
    assert sum(1 for delta in deltas if delta) > 1  # it did stream, token by token
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "stop"
