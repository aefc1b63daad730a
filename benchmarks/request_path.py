"""Which Flare modules one chat request runs code in, and on which thread.

Serves CORE in this process (the CPU path, the server app of `flare run` over aiohttp's test
server), sends one warm-up chat completion, then traces a second one: every Python function
call on every thread (sys.setprofile / threading.setprofile) is recorded by its module, kept
when the module is `flare_core`'s. Prints (and with --out writes) the modules per thread and the count.

    python benchmarks/request_path.py CORE [--out FILE]

The model's forward runs (the request is real), so its layers' modules count: the list says
which are the model's (`flare_core.ops`) and which are the request path's.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import re
import sys
import threading
from collections import defaultdict
from pathlib import Path

from provenance import commit_and_date, report

BODY = {"model": "bench", "max_tokens": 8, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": "What is the capital of France?"}]}


def build(core: Path):
    import torch

    from flare_core.config import ServerConfig
    from flare_core.core import open_core
    from flare_core.engine.build import build_engine
    from flare_core.engine.load import load_core
    from flare_core.engine.memory import plan_kv
    from flare_core.plugins import load_registry
    from flare_core.server.app import build_app

    registry = load_registry()
    loaded = load_core(open_core(core), registry, torch.device("cpu"))
    kv = functools.partial(plan_kv, loaded.cache_scheme, loaded.capacities, 4, torch.device("cpu"), "0.9", "64M")
    engine = build_engine(loaded, kv, registry, max_concurrency=4, queue_capacity=8, served_names=("bench",))
    return engine, build_app(engine, ServerConfig())


async def traced_request(core: Path) -> dict[str, set[str]]:
    from aiohttp.test_utils import TestClient, TestServer

    seen: dict[str, set[str]] = defaultdict(set)
    recording = threading.Event()

    def profile(frame, event, arg):
        if recording.is_set() and event == "call":
            module = frame.f_globals.get("__name__", "")
            if module.startswith("flare_core"):
                seen[threading.current_thread().name].add(module)

    # Set before the engine's model thread and the frontend pool start: a thread takes the
    # profile function when it starts (Python 3.11 has no setprofile_all_threads).
    threading.setprofile(profile)
    engine, app = build(core)
    engine.start()
    try:
        async with TestClient(TestServer(app)) as client:
            (await client.post("/v1/chat/completions", json=BODY)).raise_for_status()  # warm-up
            sys.setprofile(profile)
            recording.set()
            response = await client.post("/v1/chat/completions", json=BODY)
            await response.read()
            recording.clear()
            sys.setprofile(None)
            threading.setprofile(None)
            response.raise_for_status()
    finally:
        await engine.aclose()
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("core", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    seen = asyncio.run(traced_request(args.core))
    threads: dict[str, set[str]] = defaultdict(set)
    for name, modules in seen.items():  # pool threads by their pool's name
        threads[re.sub(r"[_-]\d+$", "", name)] |= modules
    every = sorted({m for modules in seen.values() for m in modules})
    path = [m for m in every if not m.startswith("flare_core.ops")]
    report({**commit_and_date(), "command": "python benchmarks/request_path.py CORE", "core": args.core.name,
            "device": "cpu", "modules": len(every), "modules_outside_ops": len(path),
            "threads": {name: sorted(modules) for name, modules in sorted(threads.items())}}, args.out)


if __name__ == "__main__":
    main()
