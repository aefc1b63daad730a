"""Terminal dashboard of `flare run`: telemetry the engine feeds while it is on, pure rendering
of snapshots into text lines, and the live terminal view."""

from flare_core.dashboard.logsink import LogSink
from flare_core.dashboard.screen import Pane, render_lines
from flare_core.dashboard.telemetry import PageCounts, RequestRow, StepBucket, Telemetry, TelemetrySnapshot
from flare_core.dashboard.terminal import Dashboard, parse_keys

__all__ = ["Dashboard", "LogSink", "PageCounts", "Pane", "RequestRow", "StepBucket", "Telemetry",
           "TelemetrySnapshot", "parse_keys", "render_lines"]
