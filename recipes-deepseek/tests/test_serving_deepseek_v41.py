"""A DeepSeek V4.1 core served by `flare run` on the CPU reference path, asked through the openai
and anthropic SDKs.

The checkpoint is the tiny V4.1 reference configuration "v41-tiny-ced" (KV and index sources in
ratio-2 and ratio-1 groups, the two-level candidate top-k, Engram at two layers; its weights and
tokenizer from this directory's fixtures/deepseek-v41), named as Transformers names
it. Greedy answers must be what the served model computes for the prompt V4.1's encoder renders,
one request at a time with the chunks a server with state snapshots uses; the second turn of a
chat must resume from the first turn's snapshot and still answer the same.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest

from flare_testing.server import Flare, ServerProcess, write_config

SERVED = "deepseek-v41-tiny"
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
FIXTURES = Path(__file__).parent / "fixtures" / "deepseek-v41"


@pytest.fixture(scope="module")
def session_flare(tmp_path_factory) -> Flare:
    """`flare` commands against a config of this module's own (the core suite's fixture of the name)."""
    return Flare(write_config(tmp_path_factory.mktemp("flare")))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, session_flare):
    """(core path, the export's printed plan, the tiny reference with its model, the tokenizer)."""
    from flare_core.frontend import Tokenizer
    from flare_testing.deepseek_v41 import TinyV41, write_checkpoint

    root = tmp_path_factory.mktemp("deepseek-v41")
    tiny = TinyV41(FIXTURES, "v41-tiny-ced")
    write_checkpoint(tiny, root / "checkpoint", FIXTURES)
    tokenizer = Tokenizer.from_str((FIXTURES / "tokenizer.json").read_text(encoding="utf-8"))
    printed = session_flare("export", root / "checkpoint", "--dtype", "float32", "--context-length", "512",
                            "--no-progress").output
    tiny.model = tiny.served()  # the same weights in this process: what the answers must equal
    tiny.checkpoint_directory = root / "checkpoint"
    return Path(printed.strip().splitlines()[-1]), printed, tiny, tokenizer


@pytest.fixture(scope="module")
def served(exported, session_flare, tmp_path_factory):
    core, printed, tiny, tokenizer = exported
    process = ServerProcess(session_flare.config_path, core, tmp_path_factory.mktemp("v41-server") / "server.log",
                            "--served-name", SERVED)
    try:
        yield process.wait_ready(), tiny, tokenizer, printed
    finally:
        process.stop()


def expected(tiny, tokenizer, messages, max_tokens: int) -> tuple[int, str]:
    """(prompt tokens, greedy answer text) of V4.1's prompt for `messages` in chat mode."""
    from flare_recipe_deepseek.v4_encoder import V41, render
    from flare_testing.deepseek_v41 import greedy

    prompt = tokenizer.encode_prompt(render(messages, thinking=False, dialect=V41))
    tokens = greedy(tiny.model, tiny.config, prompt.ids, prompt.message_ends, max_tokens, eos=tiny.config.eos_token_id)
    return len(prompt.ids), tokenizer.decode(tokens, skip_special_tokens=True)


def test_chat_turns_answer_as_the_model_and_the_second_resumes_from_the_first(served):
    process, tiny, tokenizer, _ = served
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime, please."}]
    first = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=10, temperature=0,
                                           extra_body=NO_THINKING)
    prompt_tokens, answer = expected(tiny, tokenizer, messages, 10)
    assert first.usage.prompt_tokens == prompt_tokens
    assert first.choices[0].message.content == answer

    turn = [*messages, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And another?"}]
    second = client.chat.completions.create(model=SERVED, messages=turn, max_tokens=10, temperature=0,
                                            extra_body=NO_THINKING)
    prompt_tokens, answer = expected(tiny, tokenizer, turn, 10)
    assert second.usage.prompt_tokens == prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # restored at the first turn's marks
    assert second.choices[0].message.content == answer


def test_a_core_split_over_two_ranks_answers_as_the_model(exported, session_flare, tmp_path):
    """`flare export --tp 2 --expert-parallel`: two gloo ranks (half the query heads and output
    groups, half the routed experts whole each; Engram, compressors, indexer and caches whole)
    answer the chat as the whole model does."""
    _, _, tiny, tokenizer = exported
    core = session_flare.export(tiny.checkpoint_directory, "--dtype", "float32", "--context-length", "512", "--tp", "2",
                                "--expert-parallel")
    process = ServerProcess(session_flare.config_path, core, tmp_path / "split.log", "--served-name", SERVED)
    try:
        process.wait_ready()
        assert "tensor-parallel over 2 ranks" in process.log()
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime, please."}]
        answer = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=10, temperature=0,
                                                extra_body=NO_THINKING)
        assert answer.choices[0].message.content == expected(tiny, tokenizer, messages, 10)[1]
    finally:
        process.stop()


def test_the_anthropic_sdk_gets_the_same_answer(served):
    process, tiny, tokenizer, _ = served
    client = anthropic.Anthropic(base_url=process.url, api_key="unused", max_retries=0, timeout=120)
    reply = client.messages.create(model=SERVED, system="Be terse.", max_tokens=10,
                                   messages=[{"role": "user", "content": "Name a prime, please."}],
                                   extra_body={"temperature": 0, "thinking": {"type": "disabled"}})
    prompt_tokens, answer = expected(tiny, tokenizer, [{"role": "system", "content": "Be terse."},
                                                        {"role": "user", "content": "Name a prime, please."}], 10)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == prompt_tokens  # Anthropic's split
    assert "".join(block.text for block in reply.content if block.type == "text") == answer


def test_image_content_is_refused(served):
    process, _, _, _ = served
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=SERVED, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_the_export_plan_says_what_the_core_holds(served):
    printed = served[3]
    assert "recipe        deepseek-v4.1" in printed and "cache scheme  shared-compressed-attention" in printed
    assert "the vision tower (vision.*, aligner.*) stays in the checkpoint" in printed
    assert ("tables        2 embedding table(s), 936 rows of 32 (0.1 MiB as float32): stored in the core, their rows "
            "read per step from disk or host RAM") in printed


def test_an_offline_export_of_the_alias_names_the_repository(session_flare):
    result = session_flare("export", "deepseek-v4.1-flash", "--offline", "--no-progress", expect_ok=False)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "deepseek-ai/DeepSeek-V4.1-Flash is not in the hub cache" in result.output and "--offline" in result.output


def test_the_openai_reasoning_effort_is_rendered_or_refused(served):
    """OpenAI's reasoning_effort reaches V4.1's encoder (low / high / xhigh / max; thinking on), and
    an effort V4.1 does not know is a 400 naming the field."""
    from flare_recipe_deepseek.v4_encoder import V41, render

    process, _, tokenizer, _ = served
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a prime, please."}]
    lengths = {effort: len(tokenizer.encode_prompt(render(messages, thinking=True, reasoning_effort=effort,
                                                          dialect=V41)).ids) for effort in ("high", "max")}
    assert lengths["max"] != lengths["high"]  # "Reasoning Effort: 100" against "... 50"
    reply = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2, reasoning_effort="max")
    assert reply.usage.prompt_tokens == lengths["max"]
    with pytest.raises(openai.BadRequestError, match="'reasoning_effort': must be an integer from 1 to 100 or one of "
                                                     "low, high, xhigh, max, got 'medium'"):
        client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2, reasoning_effort="medium")


def engram_totals(process) -> dict[str, float]:
    """The flare_engram_* samples summed over the tables."""
    totals: dict[str, float] = {}
    for sample, value in process.metrics().items():
        if sample.startswith("flare_engram_"):
            name = sample.split("{")[0]
            totals[name] = totals.get(name, 0.0) + value
    return totals


def test_the_engram_row_cache_counts_misses_then_hits(exported, session_flare, tmp_path):
    """Rows come from the core file through the host row cache (disk storage, the default): on a
    fresh server a first answer misses, the same answer again finds its rows cached (its prompt is
    restored from the prefix cache, its decode steps look up the same n-grams)."""
    process = ServerProcess(session_flare.config_path, exported[0], tmp_path / "server.log", "--served-name",
                            SERVED).wait_ready()
    try:
        check_row_cache_counters(process)
    finally:
        process.stop()


def check_row_cache_counters(process) -> None:
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Count to three, slowly."}]
    assert engram_totals(process)["flare_engram_cache_misses_total"] == 0
    client.chat.completions.create(model=SERVED, messages=messages, max_tokens=6, temperature=0, extra_body=NO_THINKING)
    first = engram_totals(process)
    assert first["flare_engram_cache_misses_total"] > 0
    assert first["flare_engram_disk_read_bytes_total"] == first["flare_engram_cache_misses_total"] * 32 * 4
    assert first["flare_engram_cache_capacity_rows"] == 936  # both tables fit the default 1 GiB cache
    client.chat.completions.create(model=SERVED, messages=messages, max_tokens=6, temperature=0, extra_body=NO_THINKING)
    second = engram_totals(process)
    assert second["flare_engram_cache_hits_total"] > first["flare_engram_cache_hits_total"]
    assert second["flare_engram_cache_misses_total"] == first["flare_engram_cache_misses_total"]
    assert second["flare_engram_gathers_total"] > first["flare_engram_gathers_total"]


def test_tables_in_ram_answer_as_tables_on_disk(exported, served, session_flare, tmp_path):
    process, tiny, tokenizer, _ = served
    ram = ServerProcess(session_flare.config_path, exported[0], tmp_path / "server.log", "--served-name", SERVED,
                        "--embedding-table-storage", "ram").wait_ready()
    try:
        messages = [{"role": "user", "content": "Name a colour."}]
        answers = []
        for server in (process, ram):
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            answers.append(client.chat.completions.create(model=SERVED, messages=messages, max_tokens=8, temperature=0,
                                                          extra_body=NO_THINKING).choices[0].message.content)
        assert answers[0] == answers[1] == expected(tiny, tokenizer, messages, 8)[1]
        totals = engram_totals(ram)
        assert totals["flare_engram_cache_capacity_rows"] == 0 and totals["flare_engram_cache_misses_total"] == 0
        assert totals["flare_engram_gathers_total"] > 0
    finally:
        ram.stop()


@pytest.mark.parametrize("storage, cache", [("ram", "1G"), ("disk", "0"), ("disk", "1K")])
def test_every_table_storage_gives_the_same_logits(exported, storage, cache):
    """One core loaded with its tables on disk through a row cache of 1 GiB (the reference here),
    in RAM, on disk with no cache, and with a cache of 1 KiB (8 rows of 32 float32: it evicts):
    the logits of a sequence are equal bit for bit."""
    import torch

    from flare_core.core import open_core
    from flare_core.engine.load import load_core
    from flare_core.engine.memory import parse_size
    from flare_core.engine.tables import TableOptions
    from flare_core.plugins import load_registry
    from flare_testing.deepseek_v41 import run_chunks

    core, _, tiny, _ = exported
    ids = tiny.sequence(1)[0][:96]
    logits = []
    for options in (TableOptions(), TableOptions(storage, parse_size(cache, "cache")[0])):
        loaded = load_core(open_core(core), load_registry(), torch.device("cpu"), tables=options)
        logits.append(run_chunks(loaded.model, tiny.config, ids, [40, 30, 1, 1, 24]))
        stats = [store.stats for store in loaded.tables.values()]
        for store in loaded.tables.values():
            store.close()
    assert torch.equal(logits[0], logits[1])
    assert sum(s.gathers for s in stats) == 2 * 5  # two tables, five forwards
    if cache == "1K":
        assert sum(s.evictions for s in stats) > 0 and all(s.cached_rows == 8 for s in stats)
    if cache == "0":
        assert sum(s.hits for s in stats) == 0 and sum(s.misses for s in stats) > 0


@pytest.mark.parametrize("flags, message", [
    (("--embedding-table-cache-size", "-1G"), "--embedding-table-cache-size '-1G': must be a size, not a reserve"),
    (("--embedding-table-cache-size", "lots"), "--embedding-table-cache-size 'lots': expected a size"),
])
def test_a_bad_table_flag_is_refused_naming_it(exported, session_flare, flags, message):
    result = session_flare("run", exported[0], "--port", "0", "--no-dashboard", *flags, expect_ok=False)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert message in result.output


def test_a_row_outside_the_table_is_an_error_not_a_read_past_it(exported):
    import torch

    from flare_core.core import open_core
    from flare_core.engine.load import load_core
    from flare_core.plugins import load_registry

    loaded = load_core(open_core(exported[0]), load_registry(), torch.device("cpu"))
    store = next(iter(loaded.tables.values()))
    with pytest.raises(IndexError, match=r"row ids must lie in \[0, "):
        store.gather(torch.tensor([0, store.table.rows]))
    assert store.stats.gathers == 0
    store.close()


def test_the_tables_row_caches_count_in_the_cpu_memory_plan(exported):
    """On the CPU the KV pool is host memory as the tables' row caches are: a plan whose pool and
    caches exceed what the host has available is refused naming both flags; without tables'
    caches to come the same pool is planned."""
    import torch

    from flare_core.core import open_core
    from flare_core.engine.load import load_core
    from flare_core.engine.memory import MemoryPlanError, available_host_bytes, plan_kv
    from flare_core.plugins import load_registry

    loaded = load_core(open_core(exported[0]), load_registry(), torch.device("cpu"))
    args = (loaded.cache_scheme, loaded.capacities, 2, torch.device("cpu"), "0.9", "64M")
    assert plan_kv(*args).num_pages == plan_kv(*args, host_reserved=1 << 20).num_pages
    with pytest.raises(MemoryPlanError, match="lower --kv-cache-limit or --embedding-table-cache-size"):
        plan_kv(*args, host_reserved=available_host_bytes())
    for store in loaded.tables.values():
        store.close()
