"""Where `flare run` writes its log lines: straight to stderr, or, while the dashboard owns the
terminal, into a bounded list of lines the dashboard shows in its log pane (so logs never
scribble over the screen)."""

from __future__ import annotations

import io
import re
import threading
from collections import deque
from typing import TextIO

# Colour and cursor escape sequences (structlog colours its console lines on a terminal).
_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class LogSink(io.TextIOBase):
    """A text stream that keeps its last `keep` complete lines (escape sequences removed) and
    passes writes through to `target`, except between `capture()` and `release()`. So the log
    pane also shows the lines written before the dashboard started. Thread-safe: the model
    thread logs while the event loop reads."""

    def __init__(self, target: TextIO, keep: int = 1000):
        if keep < 1:
            raise ValueError(f"LogSink keep must be >= 1, got {keep}")
        self.target = target
        self._lines: deque[str] = deque(maxlen=keep)
        self._partial = ""
        self._capturing = False
        self._captured = 0  # lines completed since capture()
        self._lock = threading.Lock()

    @property
    def encoding(self) -> str:
        return getattr(self.target, "encoding", None) or "utf-8"

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return not self._capturing and self.target.isatty()

    def write(self, text: str) -> int:
        with self._lock:
            if not self._capturing:
                self.target.write(text)
            pieces = (self._partial + text).split("\n")
            self._partial = pieces.pop()
            self._lines.extend(_ESCAPES.sub("", piece).rstrip() for piece in pieces)
            if self._capturing:
                self._captured += len(pieces)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if not self._capturing:
                self.target.flush()

    def capture(self) -> None:
        with self._lock:
            self.target.flush()
            self._capturing = True
            self._captured = 0

    def release(self) -> list[str]:
        """Write through again; returns the lines captured and not passed through (the newest
        `keep` of them), an unfinished last line included."""
        with self._lock:
            if self._capturing and self._partial:
                self._lines.append(_ESCAPES.sub("", self._partial).rstrip())
                self._partial = ""
                self._captured += 1
            self._capturing = False
            count = min(self._captured, len(self._lines))
            return list(self._lines)[len(self._lines) - count:]

    def tail(self, count: int) -> list[str]:
        with self._lock:
            return list(self._lines)[-count:] if count > 0 else []
