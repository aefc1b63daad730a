"""Where a benchmark result came from, and writing it: the commit it ran at (with "-dirty" when
tracked files differ from it), the date, and the JSON printed and saved."""

from __future__ import annotations

import datetime
import json
import subprocess
from pathlib import Path


def commit_and_date() -> dict[str, str | None]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return {"commit": (commit + ("-dirty" if dirty else "")) if commit else None,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def report(result: dict, out: Path | None) -> None:
    """Print `result` as JSON, and write it to `out` when given."""
    print(json.dumps(result, indent=2))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
