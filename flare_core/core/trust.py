"""The user's trusted publishers: a small JSON file the caller locates (config decides).

Format::

    {"version": 1,
     "publishers": {"ed25519:0123456789abcdef":
                    {"name": "alice@box", "public_key": "<base64>", "added": "2025-01-31T12:00:00+00:00"}}}

The file is re-read on every query, so trust granted by one process (e.g. an
interactive ``flare run``) is seen by others, and rewritten atomically.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from flare_core.core.errors import CoreError
from flare_core.core.signing import Publisher

TRUST_FILE_VERSION = 1


@dataclass(frozen=True)
class TrustedPublisher:
    publisher: Publisher
    added: datetime


class TrustStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def is_trusted(self, publisher: Publisher) -> bool:
        # Compare the full key: the fingerprint is only a short label.
        trusted = self._read().get(publisher.fingerprint)
        return trusted is not None and trusted.publisher.public_key == publisher.public_key

    def trust(self, publisher: Publisher) -> None:
        """Trust `publisher` from now on (keeps the original date if already trusted)."""
        entries = self._read()
        if publisher.fingerprint in entries and entries[publisher.fingerprint].publisher == publisher:
            return
        entries[publisher.fingerprint] = TrustedPublisher(publisher, datetime.now(timezone.utc))
        self._write(entries)

    def remove(self, publisher_fingerprint: str) -> None:
        entries = self._read()
        if publisher_fingerprint not in entries:
            known = ", ".join(sorted(entries)) or "none"
            raise CoreError(f"publisher {publisher_fingerprint} is not in {self.path} (trusted: {known})")
        del entries[publisher_fingerprint]
        self._write(entries)

    def publishers(self) -> list[TrustedPublisher]:
        return sorted(self._read().values(), key=lambda entry: entry.added)

    def _read(self) -> dict[str, TrustedPublisher]:
        if not self.path.exists():
            return {}
        try:
            stored = json.loads(self.path.read_text(encoding="utf-8"))
            if stored.get("version") != TRUST_FILE_VERSION:
                raise ValueError(f"version {stored.get('version')!r}, expected {TRUST_FILE_VERSION}")
            entries = {}
            for key_fingerprint, entry in stored["publishers"].items():
                publisher = Publisher(entry["name"], base64.b64decode(entry["public_key"], validate=True))
                if publisher.fingerprint != key_fingerprint:
                    raise ValueError(f"entry {key_fingerprint} holds a key with fingerprint {publisher.fingerprint}")
                entries[key_fingerprint] = TrustedPublisher(publisher, datetime.fromisoformat(entry["added"]))
            return entries
        except (OSError, ValueError, KeyError, TypeError, AttributeError, binascii.Error, CoreError) as error:
            raise CoreError(f"trust store {self.path} is unreadable or malformed: {error}") from None

    def _write(self, entries: dict[str, TrustedPublisher]) -> None:
        stored = {
            "version": TRUST_FILE_VERSION,
            "publishers": {
                key_fingerprint: {
                    "name": entry.publisher.name,
                    "public_key": base64.b64encode(entry.publisher.public_key).decode("ascii"),
                    "added": entry.added.isoformat(),
                }
                for key_fingerprint, entry in sorted(entries.items())
            },
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex}")
        try:
            temporary.write_text(json.dumps(stored, indent=2) + "\n", encoding="utf-8")
            os.replace(temporary, self.path)
        finally:
            temporary.unlink(missing_ok=True)
