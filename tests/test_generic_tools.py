"""Tools on a core whose recipe declares no tool format (SmolLM2: its ChatML template ignores
`tools`): Flare's generic format describes the tools in a system block, writes the tool history
as text, forces calls with a grammar built from the tools' schemas and parses them, through a real
`flare run` of the real weights and the clients people use (openai, anthropic, instructor,
langchain)."""

from __future__ import annotations

import json

import pytest

MODEL = "smollm2-135m-instruct.q4_1"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def openai_client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _weather_arguments(text: str) -> dict:
    """A forced call's arguments: compact JSON (as response_format writes it) that the schema allows."""
    arguments = json.loads(text)
    assert json.dumps(arguments) == text, text  # ", " and ": " separators, no other whitespace
    assert set(arguments) == {"city", "unit"} and isinstance(arguments["city"], str), arguments
    assert arguments["unit"] in ("celsius", "fahrenheit"), arguments
    return arguments


def test_the_core_says_flare_describes_its_tools(server):
    card = server.get("/v1/models").json()["data"][0]
    assert card["tool_calls"] == {"parser": "hermes", "described_by": "flare"}, card
    shown = server.post("/api/show", {"model": MODEL}).json()
    assert "tools" in shown["capabilities"], shown["capabilities"]


def test_tools_reach_the_model_and_forced_calls_are_parsed(openai_client, smollm2_reference_tokenizer):
    client = openai_client
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1, temperature=0)
    offered = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=1,
                                             temperature=0)
    schema_tokens = len(smollm2_reference_tokenizer.encode(json.dumps(WEATHER)))
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + schema_tokens, (offered.usage, plain.usage)

    one = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=60, temperature=0)
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert "Paris" in _weather_arguments(call.function.arguments)["city"]  # greedy: the trained model's reading
    assert not choice.message.content

    named = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], max_tokens=60,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0.8, seed=3, stream=True)
    pieces = {}
    for chunk in named:
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            entry = pieces.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert finish == "tool_calls" and list(pieces) == [0] and pieces[0]["name"] == "get_weather", pieces
    _weather_arguments(pieces[0]["arguments"])


def test_tool_history_is_written_for_the_model(openai_client, smollm2_reference_tokenizer):
    """A past call and its result reach the model as the generic format writes them: the call in the
    assistant's text, the result as a user message, both in their blocks (the reference renders the
    expected conversation with SmolLM2's own template)."""
    history = [*QUESTION,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    reply = openai_client.chat.completions.create(model=MODEL, messages=history, max_tokens=1, temperature=0)
    expected = [*QUESTION,
                {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
                                                 '"unit": "celsius"}}\n</tool_call>'},
                {"role": "user", "content": "<tool_response>\n18 degrees, sunny\n</tool_response>"}]
    ids = smollm2_reference_tokenizer.apply_chat_template(expected, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False)
    assert reply.usage.prompt_tokens == len(ids), (reply.usage, len(ids))


def test_anthropic_tool_choice_and_token_count(server):
    from anthropic import Anthropic

    client = Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    for choice in ({"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}):
        message = client.messages.create(model=MODEL, max_tokens=60, messages=QUESTION, tools=[tool],
                                         tool_choice=choice, extra_body={"temperature": 0})
        assert message.stop_reason == "tool_use" and [block.type for block in message.content] == ["tool_use"], message
        use = message.content[0]
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        _weather_arguments(json.dumps(use.input))
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION, tools=[tool])
    usage = message.usage  # the second request reads the first one's prompt from the prefix cache
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens, (counted, usage)
    assert counted.input_tokens > client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens + 40


def _city_model():
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        country: str

    return City


CITY_QUESTION = "Paris is the capital of which country? Give the city and its country."


def test_instructor_tools_mode(server):
    """instructor's default mode forces a call of a tool named after the response model and
    validates its arguments into an instance."""
    import instructor
    from openai import OpenAI

    City = _city_model()
    client = instructor.from_openai(OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                           timeout=300), mode=instructor.Mode.TOOLS)
    city = client.chat.completions.create(model=MODEL, response_model=City, max_retries=0, max_tokens=60,
                                          temperature=0, messages=[{"role": "user", "content": CITY_QUESTION}])
    assert isinstance(city, City) and "France" in city.country, city


def test_langchain_structured_output_by_function_calling(server):
    from langchain_openai import ChatOpenAI

    City = _city_model()
    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=60,
                      max_retries=0, timeout=300)
    city = chat.with_structured_output(City, method="function_calling").invoke(CITY_QUESTION)
    assert isinstance(city, City) and "France" in city.country, city
    calls = chat.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?").tool_calls
    assert [call["name"] for call in calls] == ["get_weather"], calls
    _weather_arguments(json.dumps(calls[0]["args"]))
