"""What a serving process shows of itself: Prometheus metrics (`metrics`), and the terminal
dashboard of `flare run` (telemetry the engine feeds while it is on, pure rendering of snapshots
into text lines, the live terminal view). Both read the engine core's Activity records."""

from flare_core.observability.logsink import LogSink
from flare_core.observability.screen import Pane, render_lines
from flare_core.observability.telemetry import (DraftCounts, PageCounts, RequestRow, StepBucket, Telemetry,
                                                TelemetrySnapshot)
from flare_core.observability.terminal import Dashboard, parse_keys

__all__ = ["Dashboard", "DraftCounts", "LogSink", "PageCounts", "Pane", "RequestRow", "StepBucket", "Telemetry",
           "TelemetrySnapshot", "parse_keys", "render_lines"]
