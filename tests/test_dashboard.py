"""The terminal dashboard: telemetry aggregation, rendering snapshots into lines, key parsing, the
log sink, and `flare run` end to end under a pseudo-terminal (dashboard, Tab, Ctrl-C exits 0)
and with stderr redirected to a file (plain log lines)."""

from __future__ import annotations

import fcntl
import io
import os
import re
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable

import pytest

from flare_core.observability import LogSink, Pane, Telemetry, parse_keys, render_lines
from flare_core.observability.telemetry import DECODE, FINISHED, QUEUED
from flare_core.observability.terminal import NEXT_PANE, PREVIOUS_PANE, QUIT
from flare_testing.server import ServerProcess, http_request

PAGES = dict(total_pages=64, free_pages=50, cached_pages=6)
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Clock:
    """A clock the test advances by hand, so rates and gaps have exact expected values."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _served_two_requests(clock: Clock) -> Telemetry:
    """a: 96-token prompt (64 reused), prefill then 3 tokens, finished by length; b: queued, then
    prefill 32 tokens and one token; c: queued only."""
    telemetry = Telemetry(window_s=5.0, keep_finished=8, clock=clock)
    telemetry.request_queued("a", 96)
    telemetry.request_queued("b", 32)
    telemetry.request_queued("c", 10)
    telemetry.request_started("a", 64)
    clock.now += 1.0
    telemetry.record_step("prefill", 128, 0.030, prefill_tokens=32, sampled=["a"], **PAGES)
    telemetry.request_started("b", 0)
    clock.now += 0.5
    telemetry.record_step("mixed", 64, 0.020, prefill_tokens=32, sampled=["a", "b"], **PAGES)
    clock.now += 0.25
    telemetry.record_step("decode", 2, 0.010, prefill_tokens=0, sampled=["a", "b"], **PAGES)
    telemetry.request_finished("a", "length", **PAGES)
    return telemetry


def test_telemetry_aggregates_buckets_tokens_and_phases():
    clock = Clock()
    telemetry = _served_two_requests(clock)
    clock.now += 0.25  # 2.0 s since start
    snap = telemetry.snapshot()

    assert [(b.kind, b.capacity, b.calls) for b in snap.buckets] == [("decode", 2, 1), ("mixed", 64, 1),
                                                                      ("prefill", 128, 1)]
    prefill_bucket = snap.buckets[2]
    assert prefill_bucket.total_s == pytest.approx(0.030) and prefill_bucket.max_s == pytest.approx(0.030)
    assert (snap.prefill_tokens, snap.generated_tokens, snap.steps) == (64, 5, 3)
    # Less than a window has passed: the rates average over the 2 s since start.
    assert snap.prefill_rate == pytest.approx(64 / 2.0)
    assert snap.generation_rate == pytest.approx(5 / 2.0)
    assert (snap.queued, snap.active, snap.completed, snap.cancelled, snap.failed) == (1, 1, 1, 0, 0)
    assert (snap.prompt_tokens, snap.reused_tokens) == (96 + 32, 64)
    assert (snap.pages.total, snap.pages.free, snap.pages.cached) == (64, 50, 6)

    rows = {r.request_id: r for r in snap.requests}
    assert [r.request_id for r in snap.requests] == ["b", "c", "a"]  # live first, then finished
    a, b, c = rows["a"], rows["b"], rows["c"]
    assert (a.phase, a.finish_reason, a.generated_tokens, a.cached_tokens) == (FINISHED, "length", 3, 64)
    assert a.first_token_at == pytest.approx(101.0) and a.last_token_at == pytest.approx(101.75)
    assert a.max_gap_s == pytest.approx(0.5)
    assert (b.phase, b.generated_tokens, b.max_gap_s) == (DECODE, 2, pytest.approx(0.25))
    assert (c.phase, c.generated_tokens, c.first_token_at) == (QUEUED, 0, None)


def test_telemetry_windows_rates_and_ignores_tokens_after_finish():
    clock = Clock()
    telemetry = _served_two_requests(clock)
    telemetry.request_finished("b", "cancelled", **PAGES)
    telemetry.request_started("c", 0)
    clock.now += 10.0
    telemetry.record_step("decode", 2, 0.012, prefill_tokens=0, sampled=["b", "c"], **PAGES)
    snap = telemetry.snapshot()
    # Only the last step is inside the 5 s window; b's token arrived after it was cancelled.
    assert snap.generation_rate == pytest.approx(1 / 5.0) and snap.prefill_rate == 0.0
    assert snap.generated_tokens == 6
    decode = next(b for b in snap.buckets if b.kind == "decode")
    assert (decode.calls, decode.max_s) == (2, pytest.approx(0.012))
    assert decode.mean_s == pytest.approx((0.010 + 0.012) / 2)
    assert (snap.active, snap.queued, snap.completed, snap.cancelled) == (1, 0, 1, 1)
    assert {r.request_id: r.phase for r in snap.requests} == {"c": DECODE, "b": FINISHED, "a": FINISHED}


def test_telemetry_bounds_finished_rows_and_rejects_unknown_reasons():
    telemetry = Telemetry(keep_finished=2, clock=Clock())
    for name in "wxyz":
        telemetry.request_queued(name, 4)
        telemetry.request_finished(name, "stop", **PAGES)
    telemetry.request_finished("never-queued", "error", **PAGES)  # rejected at admission
    snap = telemetry.snapshot()
    assert [r.request_id for r in snap.requests] == ["z", "y"]
    assert (snap.completed, snap.failed) == (4, 1)
    with pytest.raises(ValueError, match="unknown finish reason 'timeout'"):
        telemetry.request_finished("q", "timeout", **PAGES)
    with pytest.raises(ValueError, match="window_s must be > 0"):
        Telemetry(window_s=0)


def _snapshot():
    clock = Clock()
    telemetry = _served_two_requests(clock)
    clock.now += 0.25
    return telemetry.snapshot()


def test_render_overview_pane():
    lines = render_lines(_snapshot(), Pane.OVERVIEW, 110, 30, title="flare  tiny on cpu", logs=["line one", "two"])
    text = "\n".join(lines)
    assert len(lines) == 30 and all(len(line) <= 110 for line in lines)
    assert lines[0].startswith("flare  tiny on cpu") and lines[0].endswith("up 0m02s")
    assert "[overview]" in lines[1] and " scheduler " in lines[1]
    assert re.search(r"prefill\s+32\.0 tok/s\s+generation\s+2\.5 tok/s", text)
    assert "active 1   queued 1   completed 1   cancelled 0   failed 0" in text
    assert "64 of 128 prompt tokens reused (50.0%)" in text
    assert "free 50   cached 6   total 64" in text
    # The log pane sits at the bottom: its title, then the newest lines.
    assert lines[-3].startswith("── log ──") and lines[-2:] == ["line one", "two"]


def test_a_hint_stays_under_the_title():
    """`flare demo`'s curl line lives on the dashboard (under the title), not in the scrolled logs."""
    hint = "try: curl http://127.0.0.1:8000/v1/chat/completions"
    lines = render_lines(_snapshot(), Pane.OVERVIEW, 110, 30, title="flare  tiny on cpu", logs=["a"], hint=hint)
    assert lines[1] == hint and "[overview]" in lines[2] and len(lines) == 30
    assert render_lines(_snapshot(), Pane.OVERVIEW, 110, 30, title="t")[1].startswith("[overview]")


def test_render_scheduler_pane_shares_step_time():
    lines = render_lines(_snapshot(), Pane.SCHEDULER, 100, 20)
    assert "[scheduler]" in lines[1]
    rows = {line.split()[0]: line.split() for line in lines if re.match(r"(decode|mixed|prefill)\s+\d", line)}
    assert rows["prefill"] == ["prefill", "128", "1", "30.00", "30.00", "50.0%"]
    assert rows["mixed"] == ["mixed", "64", "1", "20.00", "20.00", "33.3%"]
    assert rows["decode"] == ["decode", "2", "1", "10.00", "10.00", "16.7%"]
    assert not any("speculative" in line for line in lines)


def test_scheduler_pane_shows_how_many_drafts_are_kept():
    clock = Clock()
    telemetry = _served_two_requests(clock)
    telemetry.record_drafts(rounds=40, drafts=160, kept=117, widths=(0, 0, 4, 0, 36))
    lines = render_lines(telemetry.snapshot(), Pane.SCHEDULER, 100, 20)
    assert "speculative decoding: 40 decode rows checked 160 drafts, kept 117 (2.92 per row, 73%)" in lines
    assert "  3.92 tokens per round; rows by drafts checked: 2: 4, 4: 36" in lines


def test_render_requests_pane_with_gaps():
    lines = render_lines(_snapshot(), Pane.REQUESTS, 120, 20)
    rows = {line.split()[0]: line.split() for line in lines[4:] if line.strip()}
    # id, phase, prompt, cached, generated, ttft ms, ms since the last token, max gap ms, finish
    assert rows["b"] == ["b", "decode", "32", "0", "2", "1500", "250", "250"]
    assert rows["c"] == ["c", "queued", "10", "0", "0", "-", "-", "0"]
    assert rows["a"] == ["a", "finished", "96", "64", "3", "1000", "-", "500", "length"]


def test_render_fits_small_windows():
    snap = _snapshot()
    lines = render_lines(snap, Pane.REQUESTS, 40, 6, logs=[f"log {i}" for i in range(50)])
    assert len(lines) <= 6 and all(len(line) <= 40 for line in lines)
    assert any("more lines" in line for line in lines)
    assert render_lines(snap, Pane.OVERVIEW, 0, 10) == []
    # Control characters in log lines never reach the terminal.
    assert render_lines(snap, Pane.OVERVIEW, 80, 12, logs=["a\x1b[2Jb\tc"])[-1] == "a [2Jb c"


def test_keys_and_panes():
    assert parse_keys(b"\t\x1b[C\x1bOC") == [NEXT_PANE] * 3
    assert parse_keys(b"\x1b[D\x1b[Z") == [PREVIOUS_PANE] * 2
    # Up/down arrows and function keys are skipped whole: their final letters are no keys.
    assert parse_keys(b"\x1b[A\x1b[15~xq") == [QUIT]
    assert parse_keys(b"\x03") == [QUIT]
    assert Pane.OVERVIEW.step(1) is Pane.SCHEDULER and Pane.OVERVIEW.step(-1) is Pane.REQUESTS
    assert Pane.REQUESTS.step(1) is Pane.OVERVIEW


def test_log_sink_passes_through_then_captures():
    target = io.StringIO()
    sink = LogSink(target, keep=3)
    sink.write("before\n")
    sink.capture()
    sink.write("\x1b[32mgreen\x1b[0m line\nsecond ")
    sink.write("half\nthird\nfourth")
    assert target.getvalue() == "before\n"  # nothing written while captured
    assert sink.tail(10) == ["green line", "second half", "third"]
    assert not sink.isatty()
    assert sink.release() == ["second half", "third", "fourth"]  # the newest `keep`, partial line included
    sink.write("after\n")
    assert target.getvalue() == "before\nafter\n"
    assert sink.tail(1) == ["after"]


# ---- end to end --------------------------------------------------------------------------------

ROWS, COLUMNS = 40, 120
DEADLINE_S = 60.0
_LISTENING = re.compile(r"\blistening\b.*?\burl=(http://[0-9.:]+)")


class PtyOutput:
    """Everything a child writes to the pty master, collected by a reader thread (a full pty
    would block the child's event loop)."""

    def __init__(self, master: int):
        self.master = master
        self._data = bytearray()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # EIO: every slave end is closed
                chunk = b""
            with self._changed:
                if not chunk:
                    self._changed.notify_all()
                    return
                self._data += chunk
                self._changed.notify_all()

    def text(self, start: int = 0) -> str:
        with self._changed:
            return _ESCAPES.sub("", self._data[start:].decode("utf-8", errors="replace"))

    def position(self) -> int:
        with self._changed:
            return len(self._data)

    def wait_for(self, found: Callable[[str], object], what: str, start: int = 0):
        deadline = time.monotonic() + DEADLINE_S
        with self._changed:
            while True:
                text = _ESCAPES.sub("", self._data[start:].decode("utf-8", errors="replace"))
                result = found(text)
                if result:
                    return result
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    raise AssertionError(f"no {what} in the terminal output:\n{text[-3000:]}")
                self._changed.wait(left)

    def raw(self) -> bytes:
        with self._changed:
            return bytes(self._data)


def _controlling_terminal() -> None:
    # Runs in the child after setsid: the pty on fd 0 becomes its controlling terminal, so the
    # Ctrl-C byte makes the line discipline send SIGINT.
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


def _chat(url: str, max_tokens: int) -> dict:
    reply = http_request("POST", url + "/v1/chat/completions",
                         {"model": "flare-dash", "messages": [{"role": "user", "content": "Hello!"}],
                          "max_tokens": max_tokens, "ignore_eos": True})
    assert reply.status == 200, reply.body
    return reply.json()


def test_flare_run_dashboard_under_a_terminal(session_flare, qwen3_core):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
    command = [sys.executable, "-m", "flare_core.cli", "--config", str(session_flare.config_path), "run",
               str(qwen3_core), "--device", "cpu", "--port", "0", "--trust-publisher", "--served-name", "flare-dash"]
    process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
                               preexec_fn=_controlling_terminal)
    os.close(slave)
    output = PtyOutput(master)
    try:
        url = output.wait_for(lambda text: (m := _LISTENING.search(text)) and m.group(1), "listening line")
        output.wait_for(lambda text: "[overview]" in text, "dashboard")
        assert _chat(url, 6)["usage"]["completion_tokens"] == 6
        output.wait_for(lambda text: re.search(r"completed 1\b", text), "completed request count")
        assert "request finished" in output.text()  # the log pane shows the engine's line

        switched = output.position()
        os.write(master, b"\t")
        output.wait_for(lambda text: "[scheduler]" in text and re.search(r"decode\s+1\s+5\s", text),
                        "scheduler pane with 5 decode steps of capacity 1", start=switched)
        os.write(master, b"\x03")  # Ctrl-C
        assert process.wait(timeout=DEADLINE_S) == 0, output.text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output.wait_for(lambda text: "stopped" in text, "final log lines")
    raw = output.raw()
    ended = raw.rfind(b"\x1b[?1049l")  # the terminal left the alternate screen ...
    assert ended > raw.rfind(b"\x1b[?1049h") > 0
    tail = _ESCAPES.sub("", raw[ended:].decode("utf-8", errors="replace"))
    assert "draining" in tail and "stopped" in tail  # ... then the last log lines were printed
    os.close(master)


def test_flare_run_with_redirected_stderr_logs_plain_lines(session_flare, qwen3_core, tmp_path):
    server = ServerProcess(session_flare.config_path, qwen3_core, tmp_path / "run.log",
                           "--served-name", "flare-dash").wait_ready()
    try:
        assert _chat(server.url, 3)["usage"]["completion_tokens"] == 3
    finally:
        server.stop()
    log = server.log()
    assert "\x1b" not in log
    lines = [line for line in log.splitlines() if line.strip()]
    assert any("request finished" in line for line in lines) and "stopped" in lines[-1]
    # Every structlog line: timestamp, level, event.
    structured = [line for line in lines if re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d \[info\s*\] ", line)]
    assert len(structured) >= 4 and "[overview]" not in log
