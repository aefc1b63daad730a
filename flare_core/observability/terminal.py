"""The live dashboard on stderr's terminal, drawn with plain ANSI escape codes from the server's
event loop.

While it runs it owns the terminal: the alternate screen, keys read from stdin without echo or
line buffering, and every Python-level write to stderr (structlog, logging, warnings) captured
by the LogSink into its log pane. ISIG stays on, so Ctrl-C still reaches the process as SIGINT
and the server's own handler drains gracefully; 'q' sends that same signal. Output flow control
(Ctrl-S) is turned off: a stopped terminal would block the event loop in its next redraw. When
the server stops (the task is cancelled) the terminal is restored and the last log lines are
printed.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import termios
from collections.abc import Callable
from typing import TextIO

import structlog

from flare_core.observability.logsink import LogSink
from flare_core.observability.screen import Pane, render_lines
from flare_core.observability.telemetry import Telemetry

REFRESH_S = 0.25
FINAL_LOG_LINES = 20

NEXT_PANE = "next"
PREVIOUS_PANE = "previous"
QUIT = "quit"

_KEYS = ((b"\x1b[C", NEXT_PANE), (b"\x1bOC", NEXT_PANE), (b"\t", NEXT_PANE),
         (b"\x1b[D", PREVIOUS_PANE), (b"\x1bOD", PREVIOUS_PANE), (b"\x1b[Z", PREVIOUS_PANE),
         (b"q", QUIT), (b"Q", QUIT), (b"\x03", QUIT))
_OTHER_SEQUENCE = re.compile(rb"\x1b\[[0-9;]*[@-~]|\x1bO.")

_ENTER = "\x1b[?1049h\x1b[?25l"  # alternate screen, hide the cursor
_LEAVE = "\x1b[0m\x1b[?25h\x1b[?1049l"
_REVERSE, _PLAIN = "\x1b[7m", "\x1b[0m"

_log = structlog.get_logger("flare.dashboard")


def parse_keys(data: bytes) -> list[str]:
    """Dashboard actions in the bytes read from the terminal; other keys and sequences are skipped.
    (Ctrl-C arrives as a byte only where the terminal does not turn it into SIGINT.)"""
    actions = []
    i = 0
    while i < len(data):
        for sequence, action in _KEYS:
            if data.startswith(sequence, i):
                actions.append(action)
                i += len(sequence)
                break
        else:
            match = _OTHER_SEQUENCE.match(data, i)
            i = match.end() if match else i + 1
    return actions


def _key_mode(mode: list) -> list:
    """`mode` (termios attributes) with keys delivered one by one, unechoed, and no flow control."""
    iflag, oflag, cflag, lflag, ispeed, ospeed, cc = mode
    cc = list(cc)
    cc[termios.VMIN], cc[termios.VTIME] = 1, 0
    return [iflag & ~termios.IXON, oflag, cflag, lflag & ~(termios.ECHO | termios.ICANON), ispeed, ospeed, cc]


class Dashboard:
    """Draws `telemetry` on the terminal of `out_fd` (stderr), reading keys from `in_fd` (stdin)
    when that is a terminal. `logs` must be the stream structlog writes to."""

    def __init__(self, telemetry: Telemetry, logs: LogSink, *, title: str, out_fd: int = 2, in_fd: int = 0,
                 hint: Callable[[str], str] | None = None):
        self.telemetry = telemetry
        self.logs = logs
        self.title = title
        self.hint = hint  # hint(url): a line kept under the title (what to try against the server)
        self.pane = Pane.OVERVIEW
        self._out_fd = out_fd
        self._in_fd = in_fd
        self._saved_mode: list | None = None
        self._saved_stderr: TextIO | None = None
        self._url = ""

    async def run(self, url: str) -> None:
        """Own the terminal until cancelled. A failure of the dashboard itself restores the
        terminal and is logged; the server keeps running with plain logs."""
        self._url = url
        loop = asyncio.get_running_loop()
        try:
            try:
                self._enter(loop)
                while True:
                    self._draw()
                    await asyncio.sleep(REFRESH_S)
            finally:
                self._leave(loop)
        except Exception:
            _log.exception("the dashboard failed; logging to stderr from now on")

    def _enter(self, loop: asyncio.AbstractEventLoop) -> None:
        self.logs.capture()
        self._saved_stderr, sys.stderr = sys.stderr, self.logs
        if os.isatty(self._in_fd):
            self._saved_mode = termios.tcgetattr(self._in_fd)
            termios.tcsetattr(self._in_fd, termios.TCSANOW, _key_mode(self._saved_mode))
            loop.add_reader(self._in_fd, self._on_input)
        self._write(_ENTER)

    def _leave(self, loop: asyncio.AbstractEventLoop) -> None:
        """Undo what `_enter` did, also after it failed halfway."""
        try:
            if self._saved_mode is not None:
                loop.remove_reader(self._in_fd)
                termios.tcsetattr(self._in_fd, termios.TCSADRAIN, self._saved_mode)
                self._saved_mode = None
            self._write(_LEAVE)
        finally:
            if self._saved_stderr is not None:
                sys.stderr, self._saved_stderr = self._saved_stderr, None
            lines = self.logs.release()
        if lines:
            self._write("".join(line + "\n" for line in lines[-FINAL_LOG_LINES:]))

    def _on_input(self) -> None:
        try:
            data = os.read(self._in_fd, 256)
        except OSError:
            data = b""
        if not data:  # the terminal went away: stop reading keys
            asyncio.get_running_loop().remove_reader(self._in_fd)
            return
        for action in parse_keys(data):
            if action == QUIT:
                os.kill(os.getpid(), signal.SIGINT)  # the server's handler drains and stops
            else:
                self.pane = self.pane.step(1 if action == NEXT_PANE else -1)
        self._draw()

    def _draw(self) -> None:
        columns, rows = os.get_terminal_size(self._out_fd)
        # One column stays free: erasing after a character in the last column would erase it.
        width = max(columns - 1, 1)
        title = f"flare  {self.title}  {self._url}"
        lines = render_lines(self.telemetry.snapshot(), self.pane, width, rows, title=title,
                             logs=self.logs.tail(rows), hint=self.hint(self._url) if self.hint else "")
        parts = []
        for row, line in enumerate(lines, start=1):
            text = f"{_REVERSE}{line.ljust(width)}{_PLAIN}" if row == 1 else line
            parts.append(f"\x1b[{row};1H{text}\x1b[K")
        if len(lines) < rows:
            parts.append(f"\x1b[{len(lines) + 1};1H\x1b[J")
        self._write("".join(parts))

    def _write(self, text: str) -> None:
        data = text.encode("utf-8", errors="replace")
        while data:
            written = os.write(self._out_fd, data)
            data = data[written:]
