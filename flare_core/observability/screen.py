"""Rendering a telemetry snapshot into the dashboard's text lines: a pure function, so it is
testable without a terminal. The terminal side (flare_core.observability.terminal) only positions
these lines on the screen."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from flare_core.observability.telemetry import FINISHED, TelemetrySnapshot

KEY_HINT = "Tab/←/→ switch pane · q or Ctrl-C quit"
_LOG_TITLE = "── log "
_MIN_LOG_ROWS = 3


class Pane(enum.Enum):
    OVERVIEW = "overview"
    SCHEDULER = "scheduler"
    REQUESTS = "requests"

    def step(self, offset: int) -> Pane:
        """The pane `offset` places to the right, wrapping around."""
        panes = list(Pane)
        return panes[(panes.index(self) + offset) % len(panes)]


def render_lines(snapshot: TelemetrySnapshot, pane: Pane, width: int, height: int, *, title: str = "",
                 logs: Sequence[str] = (), hint: str = "") -> list[str]:
    """At most `height` lines of at most `width` characters: title, the `hint` line if any (what
    to try against the server), pane tabs, the pane's body, then the newest log lines in the rows
    the body leaves (at least a few when they exist)."""
    if width < 1 or height < 1:
        return []
    uptime = f"up {_duration(snapshot.taken_at - snapshot.started_at)}"
    header = [_spread(title, uptime, width), *([hint] if hint else []), _tabs(pane) + "   " + KEY_HINT]
    body = {Pane.OVERVIEW: _overview, Pane.SCHEDULER: _scheduler, Pane.REQUESTS: _requests}[pane](snapshot)
    body_room = height - len(header) - 1
    # Logs get the rows the body leaves, and at least a few (never more than half the room).
    reserved = min(_MIN_LOG_ROWS, (body_room - 1) // 2)
    log_rows = max(min(len(logs), max(body_room - len(body) - 1, reserved)), 0)
    room = body_room - (log_rows + 1 if log_rows else 0)
    if len(body) > room:
        hidden = len(body) - room + 1
        body = body[:max(room - 1, 0)] + ([f"… {hidden} more lines (enlarge the window)"] if room > 0 else [])
    lines = header + [""] + body
    if log_rows:
        lines += [""] * (height - len(lines) - log_rows - 1)
        lines += [_LOG_TITLE + "─" * max(width - len(_LOG_TITLE), 0)] + list(logs[-log_rows:])
    return [_fit(line, width) for line in lines[:height]]


def _overview(s: TelemetrySnapshot) -> list[str]:
    reuse = f"{s.reused_tokens} of {s.prompt_tokens} prompt tokens reused"
    if s.prompt_tokens:
        reuse += f" ({100.0 * s.reused_tokens / s.prompt_tokens:.1f}%)"
    pages = "no steps yet" if s.pages is None else (f"free {s.pages.free}   cached {s.pages.cached}   "
                                                    f"total {s.pages.total}")
    return [
        f"throughput ({s.window_s:g} s)  prefill {s.prefill_rate:10.1f} tok/s   "
        f"generation {s.generation_rate:10.1f} tok/s",
        f"tokens            prefill {s.prefill_tokens:10d}         generated  {s.generated_tokens:10d}"
        f"         steps {s.steps}",
        f"requests          active {s.active}   queued {s.queued}   completed {s.completed}   "
        f"cancelled {s.cancelled}   failed {s.failed}",
        f"prefix cache      {reuse}",
        f"KV pages          {pages}",
    ]


def _scheduler(s: TelemetrySnapshot) -> list[str]:
    lines = ["step buckets: captured graphs (kind, capacity) on GPU, planned capacities on the eager path", "",
             f"{'kind':<9}{'capacity':>9}{'calls':>10}{'mean ms':>11}{'max ms':>11}{'share of time':>15}"]
    total = sum(b.total_s for b in s.buckets)
    for b in s.buckets:
        share = 100.0 * b.total_s / total if total > 0 else 0.0
        lines.append(f"{b.kind:<9}{b.capacity:>9}{b.calls:>10}{1e3 * b.mean_s:>11.2f}{1e3 * b.max_s:>11.2f}"
                     f"{share:>14.1f}%")
    if not s.buckets:
        lines.append("no steps yet")
    if s.drafts is not None:
        d = s.drafts
        widths = ", ".join(f"{width}: {rows}" for width, rows in enumerate(d.widths) if rows)
        lines += ["", f"speculative decoding: {d.rounds} decode rows checked {d.drafts} drafts, kept {d.kept} "
                      f"({d.kept / d.rounds:.2f} per row, {100.0 * d.kept / max(d.drafts, 1):.0f}%)",
                  f"  {1 + d.kept / d.rounds:.2f} tokens per round; rows by drafts checked: {widths or '-'}"]
    return lines


def _requests(s: TelemetrySnapshot) -> list[str]:
    lines = [f"{'request':<34}{'phase':<10}{'prompt':>7}{'cached':>7}{'generated':>10}{'ttft ms':>9}"
             f"{'since token ms':>15}{'max gap ms':>11}  finish"]
    for r in s.requests:
        ttft = "-" if r.first_token_at is None else f"{1e3 * (r.first_token_at - r.submitted_at):.0f}"
        since = "-" if r.last_token_at is None or r.phase == FINISHED else f"{1e3 * (s.taken_at - r.last_token_at):.0f}"
        lines.append(f"{r.request_id[:33]:<34}{r.phase:<10}{r.prompt_tokens:>7}{r.cached_tokens:>7}"
                     f"{r.generated_tokens:>10}{ttft:>9}{since:>15}{1e3 * r.max_gap_s:>11.0f}  "
                     f"{r.finish_reason or ''}")
    if not s.requests:
        lines.append("no requests yet")
    return lines


def _tabs(active: Pane) -> str:
    return " ".join(f"[{p.value}]" if p is active else f" {p.value} " for p in Pane)


def _spread(left: str, right: str, width: int) -> str:
    gap = width - len(left) - len(right)
    return left + " " * gap + right if gap >= 1 else left + " " + right


def _fit(line: str, width: int) -> str:
    # Control characters would move the cursor; tabs have no fixed width.
    clean = "".join(ch if ch.isprintable() else " " for ch in line)
    return clean[:width]


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"
