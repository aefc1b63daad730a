"""A short chat's latency on an idle server and under one client's load (#45 item 5): against a
running `flare demo` (SmolLM2-135M-Instruct, CPU: 8 state rows, 4,096-token context), the median
of three idle chats (16 tokens, greedy, ignore_eos), then one chat once the load holds its rows:
one ~3,800-token prompt (`long1`), eight of them (`long8`), or one request of 60 choices
(`n60`). The load is sent from 127.0.0.2, another client address than the chat's; the process
exits after the chat, which cancels the load (restart the server between loads).

    flare demo --device cpu --port 8123 &
    python3 benchmarks/short_chat_under_load.py 8123 long1
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import time
import urllib.request

MODEL = "smollm2-135m-instruct.q4_1"
SHORT = "What is the capital of France?"
LONG = " ".join(f"lorem{i} ipsum" for i in range(490))
LOADS = {"long1": [(LONG, 16, 1)], "long8": [(f"{i} {LONG}", 16, 1) for i in range(8)],
         "n60": [("Tell me a story.", 64, 60)]}


def body(content: str, max_tokens: int, n: int) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "n": n, "temperature": 0, "ignore_eos": True}).encode()


def chat(url: str) -> float:
    started = time.perf_counter()
    request = urllib.request.Request(url + "/v1/chat/completions", body(SHORT, 16, 1),
                                     {"Content-Type": "application/json"})
    json.load(urllib.request.urlopen(request, timeout=900))
    return time.perf_counter() - started


def live(url: str) -> float:
    for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
        if line.startswith("flare_slots_live "):
            return float(line.split()[1])
    return 0.0


def main() -> None:
    port, kind = int(sys.argv[1]), sys.argv[2]
    url = f"http://127.0.0.1:{port}"
    idle = statistics.median(chat(url) for _ in range(3))
    held = []
    for content, max_tokens, n in LOADS[kind]:
        connection = http.client.HTTPConnection("127.0.0.1", port, source_address=("127.0.0.2", 0))
        connection.request("POST", "/v1/chat/completions", body(content, max_tokens, n),
                           {"Content-Type": "application/json"})
        held.append(connection)
    while live(url) < min(8, sum(n for *_, n in LOADS[kind])):
        time.sleep(0.05)
    loaded = chat(url)
    print(json.dumps({"load": kind, "idle_s": round(idle, 3), "loaded_s": round(loaded, 3),
                      "ratio": round(loaded / idle, 2)}))


if __name__ == "__main__":
    main()
