"""A real `flare run` server in a subprocess, for end-to-end tests, `flare` commands run in-process
against an isolated config (`Flare`, `write_config`), and small raw-HTTP helpers.

The server binds port 0; its bound URL is read from the `listening` log line. Readiness and
state changes are observed by polling (/health, /metrics) against a deadline, never by sleeping
a fixed time.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
from contextlib import contextmanager
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from click.testing import CliRunner

from flare_core.cli import main


def write_config(directory: Path) -> Path:
    """A config whose paths all live under `directory`, so tests never touch the user's files."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "config.toml"
    path.write_text('[paths]\ncore_cache = "cores"\nhub_cache = "hub"\nkeys = "keys"\ntrust_store = "trust.json"\n'
                    'checkpoint_cache = "checkpoints"\ncompile_cache = "compiled"\n[defaults]\ndevice = "cpu"\n')
    return path


def write_server_config(directory: Path, server_section: str) -> Path:
    """`write_config` plus a [server] section (TOML lines)."""
    path = write_config(directory)
    path.write_text(path.read_text() + "[server]\n" + server_section)
    return path


class Flare:
    """Runs `flare` commands in-process against an isolated config."""

    def __init__(self, config_path: Path):
        self.config_path = config_path
        self.runner = CliRunner()

    def __call__(self, *args: str, expect_ok: bool = True, input: str | None = None):
        result = self.runner.invoke(main, ["--config", str(self.config_path), *map(str, args)], input=input,
                                    catch_exceptions=False)
        if expect_ok:
            assert result.exit_code == 0, result.output
        return result

    def export(self, *args: str) -> Path:
        result = self("export", *args, "--no-progress")
        return Path(result.output.strip().splitlines()[-1])


# Generous: the suite must pass on a loaded machine, where start-up (imports, core verification)
# can take minutes. Nothing waits this long unless something is wrong.
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.02
_LISTENING = re.compile(r"\blistening\b.*\burl=(http://\S+)")

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout: float, what: str) -> T:
    """Poll `condition` until it returns a truthy value (returned) or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(POLL_INTERVAL_S)


@dataclass
class HttpReply:
    status: int
    headers: Mapping[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def http_request(method: str, url: str, body: Any = None, *, raw: bytes | None = None,
                 headers: Mapping[str, str] | None = None, timeout: float = 60.0) -> HttpReply:
    """One request; `body` is sent as JSON, `raw` as is. Error statuses are returned, not raised."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode("utf-8"))
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return HttpReply(response.status, dict(response.headers), response.read())
    except urllib.error.HTTPError as error:
        with error:
            return HttpReply(error.code, dict(error.headers), error.read())


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {"name{labels}": value} (comments skipped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


class SseReader:
    """An SSE response read incrementally over its own connection (so a test can hang up)."""

    def __init__(self, base_url: str, path: str, body: Mapping[str, Any],
                 headers: Mapping[str, str] | None = None, timeout: float = 60.0):
        host, port = base_url.removeprefix("http://").split(":")
        self.connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
        self.connection.request("POST", path, body=json.dumps(body),
                                headers={"Content-Type": "application/json", **(headers or {})})
        self.response = self.connection.getresponse()
        self.status = self.response.status

    def next_event(self) -> dict[str, Any] | str | None:
        """The next event's data (parsed JSON, or the raw string such as "[DONE]"); None at the end."""
        data_lines = []
        while True:
            line = self.response.readline()
            if not line:
                return None
            line = line.decode("utf-8").rstrip("\r\n")
            if line.startswith("data:"):
                data_lines.append(line[5:].strip())
            elif line == "" and data_lines:
                data = "\n".join(data_lines)
                return data if not data.startswith(("{", "[{")) else json.loads(data)

    def events(self) -> list[dict[str, Any] | str]:
        """Every remaining event until the server ends the body."""
        collected = []
        while (event := self.next_event()) is not None:
            collected.append(event)
        return collected

    def close(self) -> None:
        """Hang up (a client disconnecting mid-stream)."""
        self.response.close()
        self.connection.close()


class ServerProcess:
    """`python -m flare_core.cli --config CONFIG run CORE --device cpu --port 0 ...` as a child process."""

    def __init__(self, config: Path, core: Path, log_path: Path, *flags: str):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        command = [sys.executable, "-m", "flare_core.cli", "--config", str(config), "run", str(core),
                   "--device", "cpu", "--port", "0", "--trust-publisher", *flags]
        self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        self.url = ""

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        """Wait for the `listening` line, then for /health to answer 200."""
        def listening() -> str | None:
            if self.process.poll() is not None:
                raise AssertionError(f"flare run exited with {self.process.returncode} during startup:\n{self.log()}")
            match = _LISTENING.search(self.log())
            return match.group(1) if match else None

        try:
            self.url = wait_until(listening, timeout, f"the listening line in {self.log_path}")
            wait_until(lambda: self.get("/health").status == 200, timeout, f"{self.url}/health")
        except AssertionError as error:
            raise AssertionError(f"{error}; the server's log:\n{self.log()}") from None
        return self

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> HttpReply:
        return http_request("GET", self.url + path, headers=headers)

    def post(self, path: str, body: Any = None, **kwargs: Any) -> HttpReply:
        return http_request("POST", self.url + path, body, **kwargs)

    def metrics(self) -> dict[str, float]:
        reply = self.get("/metrics")
        assert reply.status == 200, reply.body
        return parse_metrics(reply.body.decode("utf-8"))

    def wait_metrics(self, expected: Mapping[str, float], timeout: float = 60.0) -> dict[str, float]:
        """Poll /metrics until every named sample has its expected value; the last scrape is returned."""
        last: dict[str, float] = {}

        def matches() -> dict[str, float] | None:
            nonlocal last
            last = self.metrics()
            return last if all(last.get(name) == value for name, value in expected.items()) else None

        try:
            return wait_until(matches, timeout, f"metrics {dict(expected)}")
        except AssertionError as error:
            raise AssertionError(f"{error}; last values: "
                                 f"{ {name: last.get(name) for name in expected} }") from None

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(f"flare run did not exit within {timeout} s of SIGTERM:\n{self.log()}") from None
        finally:
            self._log.close()

    def stop(self) -> None:
        """SIGTERM, then require a clean exit (status 0)."""
        self.terminate()
        code = self.wait_exit()
        assert code == 0, f"flare run exited with {code}:\n{self.log()}"


def stop_all(servers) -> None:
    """Stop every server (SIGTERM, a clean exit required of each), then fail naming each that did
    not exit cleanly."""
    failures = []
    for server in servers:
        try:
            server.stop()
        except AssertionError as error:
            failures.append(str(error))
    assert not failures, "\n\n".join(failures)


@contextmanager
def with_and_without_prefix_cache(config: Path, core: Path, root: Path, served_name: str):
    """Official openai clients of two `flare run` servers of `core` named `served_name`, ready:
    (with the prefix cache, with --no-prefix-cache); both servers stopped on exit."""
    import openai

    servers = (ServerProcess(config, core, root / "cached.log", "--served-name", served_name),
               ServerProcess(config, core, root / "uncached.log", "--served-name", served_name, "--no-prefix-cache"))
    try:
        for server in servers:
            server.wait_ready()
        yield [openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120) for s in servers]
    finally:
        for server in servers:
            server.stop()


# The first turn of the two-turn chats the prefix-cache tests hold.
WEATHER_TURN = [{"role": "system", "content": "You answer questions about mountain weather in two sentences."},
                {"role": "user", "content": "What is the forecast for Davos tomorrow morning?"}]


def second_turn_restores_the_first(cached, uncached, model: str, turn1: list[dict], follow_up: str,
                                   max_tokens: int = 12, **fields):
    """A chat of two turns, greedy, through the openai clients of a server with the prefix cache
    (`cached`) and one without: both answer the first turn alike; the second turn reuses cached
    prompt tokens on the first server only, and both answer it alike, to the token. Returns the
    cached server's answers to the two turns."""
    def chat(client, messages):
        return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                              **fields)

    first = chat(cached, turn1)
    assert first.choices[0].message == chat(uncached, turn1).choices[0].message
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content or "ok"},
                     {"role": "user", "content": follow_up}]
    second, reference = chat(cached, turn2), chat(uncached, turn2)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert reference.usage.prompt_tokens_details.cached_tokens == 0
    assert second.choices[0].message == reference.choices[0].message
    assert second.usage.completion_tokens == reference.usage.completion_tokens
    return first, second
