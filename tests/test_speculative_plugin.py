"""A way of proposing draft tokens that a plugin adds (`flare_proposers()` -> `ProposerFactory`),
served by `flare run CORE --spec-method NAME`.

The test-only plugin tests/plugins/flare-recipe-scripted registers `scripted-repeat`, which guesses
a request's last token again. Its scripted model emits a fixed token script: two runs of one token
each, so the guesses are right inside a run and wrong where the next run starts. The answer through
the openai SDK is the script (what plain decoding emits), and /metrics counts rounds, drafts
checked and drafts kept. A name no installed plugin registers fails `flare run` before the core
loads, naming the methods there are.
"""

from __future__ import annotations

import openai
import pytest

from flare_testing.plugins import require_test_recipe
from flare_testing.server import ServerProcess
from test_serving_scripted import write_scripted_checkpoint

PROMPT = list(range(1000, 1012))
SCRIPT = [6386] * 14 + [11386] * 14  # two runs of one token each


@pytest.fixture(scope="module")
def scripted_core(tmp_path_factory, session_flare):
    require_test_recipe("scripted")
    checkpoint = write_scripted_checkpoint(tmp_path_factory.mktemp("scripted-runs") / "checkpoint", len(PROMPT),
                                           SCRIPT)
    return session_flare.export(checkpoint, "--dtype", "float32"), checkpoint


def spec_totals(server: ServerProcess) -> dict[str, float]:
    """The flare_spec_* counters' totals (rounds summed over their widths)."""
    totals: dict[str, float] = {}
    for line in server.get("/metrics").body.decode().splitlines():
        name = line.split("{")[0].split()[0] if line.startswith("flare_spec_") else ""
        if name.endswith("_total"):
            totals[name] = totals.get(name, 0.0) + float(line.split()[-1])
    return totals


def test_a_plugins_proposer_serves_by_its_name(session_flare, scripted_core, tmp_path):
    from transformers import AutoTokenizer

    core, checkpoint = scripted_core
    server = ServerProcess(session_flare.config_path, core, tmp_path / "run.log", "--no-dashboard",
                           "--served-name", "scripted", "--spec-method", "scripted-repeat",
                           "--spec-draft-tokens", "4").wait_ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="scripted", prompt=PROMPT, max_tokens=len(SCRIPT) + 8, temperature=0)
        assert reply.choices[0].text == AutoTokenizer.from_pretrained(checkpoint).decode(SCRIPT)
        assert reply.usage.completion_tokens == len(SCRIPT) + 1  # the script, then the end token
        assert reply.choices[0].finish_reason == "stop"
        totals = spec_totals(server)
        rounds, proposed, kept = (totals["flare_spec_rounds_total"], totals["flare_spec_proposed_tokens_total"],
                                  totals["flare_spec_accepted_tokens_total"])
        assert rounds > 0 and proposed > kept > 0, totals  # kept inside the runs, refused where " ho" starts
    finally:
        server.stop()


def test_an_unknown_method_fails_before_the_core_loads(session_flare, scripted_core):
    result = session_flare("run", scripted_core[0], "--device", "cpu", "--trust-publisher", "--spec-method", "eagle",
                           expect_ok=False)
    assert result.exit_code != 0
    assert ("--spec-method eagle: no such method is installed (methods: prompt-lookup, draft, mtp, scripted-repeat)"
            in result.output), result.output


def test_a_proposer_that_cannot_be_built_fails_the_start_naming_the_flag(session_flare, scripted_core):
    import functools
    import types

    import torch

    from flare_core.cli import open_verified_core
    from flare_core.config import load_config
    from flare_core.contract import ProposerFactory
    from flare_core.engine.build import build_engine
    from flare_core.engine.load import load_core
    from flare_core.engine.memory import plan_kv
    from flare_core.plugins import hookimpl, load_registry

    def broken(context):
        raise OSError(f"no n-gram table for {context.recipe}")

    registry = load_registry(extra_plugins=[("broken", types.SimpleNamespace(flare_proposers=hookimpl(
        lambda: [ProposerFactory("ngram-table", broken), ProposerFactory("nothing", lambda context: object())])))])
    loaded = load_core(open_verified_core(load_config(session_flare.config_path), str(scripted_core[0]),
                                          trust_publisher=True), registry, torch.device("cpu"))
    kv = functools.partial(plan_kv, loaded.cache_scheme, loaded.capacities, 2, torch.device("cpu"), "0.9", "16M")
    build = functools.partial(build_engine, loaded, kv, registry, max_concurrency=2, queue_capacity=4,
                              spec_draft_tokens=4)
    with pytest.raises(ValueError, match=r"--spec-method ngram-table: the plugin's proposer could not be built "
                                         r"\(OSError\('no n-gram table for scripted'\)\)"):
        build(spec_method="ngram-table")
    with pytest.raises(ValueError, match=r"--spec-method nothing: the plugin built object, which lacks samples, "
                                         r"propose, seconds"):
        build(spec_method="nothing")
