"""The per-request output processor alone, over the real Qwen3 tokenizer: token ids in, events
out (text, stop strings withheld across token boundaries, stop tokens, max_tokens, logprob text,
prompt scores emitted once per position)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flare_core.frontend import Tokenizer, build_tokenizer_json
from flare_core.frontend.output import Finish, OutputProcessor
from flare_core.requests import GenerationRequest

QWEN3 = Path(__file__).parent / "fixtures" / "tokenizers" / "qwen3"
IM_END = 151645


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_str(build_tokenizer_json(QWEN3))


def run(processor: OutputProcessor, ids: list[int]) -> tuple[str, Finish | None, int]:
    text, finish, fed = "", None, 0
    for token in ids:
        event, finish = processor.token(token)
        fed += 1
        text += event.text if event is not None else ""
        if finish is not None:
            break
    return text, finish, fed


def test_text_stop_strings_stop_tokens_and_length(tokenizer):
    ids = tokenizer.encode("Hello there, general Kenobi! You are a bold one.")
    request = GenerationRequest(prompt_ids=(1,), max_tokens=100)
    text, finish, _ = run(OutputProcessor(request, tokenizer, frozenset({IM_END})), ids + [IM_END, 5])
    assert text == "Hello there, general Kenobi! You are a bold one." and finish == Finish("stop", IM_END)

    # A stop string spanning tokens ends the request and is withheld, with what follows it.
    request = GenerationRequest(prompt_ids=(1,), max_tokens=100, stop_strings=("general Ken",))
    text, finish, fed = run(OutputProcessor(request, tokenizer, frozenset()), ids)
    assert text == "Hello there, " and finish == Finish("stop", "general Ken") and fed < len(ids)

    # max_tokens ends it with "length" and releases held text; ignore_eos drops the core's stops.
    request = GenerationRequest(prompt_ids=(1,), max_tokens=3, ignore_eos=True)
    processor = OutputProcessor(request, tokenizer, frozenset({IM_END}))
    text, finish, fed = run(processor, [IM_END] + ids)
    assert finish == Finish("length") and fed == 3 and processor.generated == 3
    assert text == tokenizer.decode([IM_END] + ids[:2], skip_special_tokens=True)


def test_logprobs_carry_token_text(tokenizer):
    ids = tokenizer.encode("Paris")
    request = GenerationRequest(prompt_ids=(1,), max_tokens=5, logprobs=True, top_logprobs=1)
    event, finish = OutputProcessor(request, tokenizer, frozenset()).token(ids[0], -0.5, ((ids[0], -0.5),))
    assert finish is None
    (logprob,) = event.logprobs
    assert (logprob.token_id, logprob.token, logprob.logprob) == (ids[0], tokenizer.decode([ids[0]]), -0.5)
    assert logprob.top == ((ids[0], tokenizer.decode([ids[0]]), -0.5),)


def test_prompt_scores_are_emitted_once_per_position(tokenizer):
    prompt = tuple(tokenizer.encode("The capital of France is Paris."))
    request = GenerationRequest(prompt_ids=prompt, max_tokens=0, prompt_logprobs=1)
    processor = OutputProcessor(request, tokenizer, frozenset())
    k = len(prompt) - 1
    values = [-float(i) for i in range(k)]
    tops = [[prompt[i + 1], 7] for i in range(k)]
    first = processor.prompt_scores(0, values[:3], tops[:3], [[v, -9.0] for v in values[:3]])
    assert [p.token_id for p in first.prompt_logprobs] == list(prompt[1:4])
    assert all(len(p.top) == 1 for p in first.prompt_logprobs)
    # A preempted request computes its prompt again from the start: only new positions come out.
    again = processor.prompt_scores(0, values, tops, [[v, -9.0] for v in values])
    assert [p.token_id for p in again.prompt_logprobs] == list(prompt[4:])
    assert [p.logprob for p in again.prompt_logprobs] == values[3:]
    assert processor.prompt_scores(0, values, tops, [[v, -9.0] for v in values]) is None
    # Scoring only: the token sampled after the prompt is not output.
    assert processor.token(5) == (None, Finish("length")) and processor.generated == 0
