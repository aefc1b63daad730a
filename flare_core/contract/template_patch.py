"""Template patches: where to insert `{% mark %}` tags into a published chat template.

A patch never carries template text. It names the exact source bytes it applies to
(by sha256), the byte offsets to insert at, and the sha256 of the result, so a
recipe can annotate a model's own template without redistributing or rewriting it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MARK_TAG = "{% mark %}"
"""The only text a patch may insert: a Jinja statement that records a message boundary."""

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class TemplatePatch:
    """Insertions of `MARK_TAG` into one exact chat template source.

    id: stable name recipes refer to (e.g. "qwen3-v2").
    source_sha256: lowercase hex sha256 of the UTF-8 bytes of the unpatched template.
    result_sha256: lowercase hex sha256 of the UTF-8 bytes after all insertions.
    insertions: (byte offset into the source, inserted text) pairs, offsets strictly
        increasing; the inserted text is exactly `MARK_TAG`.
    """

    id: str
    source_sha256: str
    result_sha256: str
    insertions: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id.strip():
            raise ValueError(f"TemplatePatch.id must be a non-empty string, got {self.id!r}")
        for field_name in ("source_sha256", "result_sha256"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not _SHA256_HEX.fullmatch(value):
                raise ValueError(
                    f"TemplatePatch {self.id!r}: {field_name} must be 64 lowercase hex characters, got {value!r}"
                )
        if not isinstance(self.insertions, tuple):
            raise ValueError(
                f"TemplatePatch {self.id!r}: insertions must be a tuple, got {type(self.insertions).__name__}"
            )
        previous_offset = -1
        for index, insertion in enumerate(self.insertions):
            if not (isinstance(insertion, tuple) and len(insertion) == 2):
                raise ValueError(
                    f"TemplatePatch {self.id!r}: insertions[{index}] must be an (offset, text) tuple, got {insertion!r}"
                )
            offset, text = insertion
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                raise ValueError(
                    f"TemplatePatch {self.id!r}: insertions[{index}] offset must be an int >= 0, got {offset!r}"
                )
            if offset <= previous_offset:
                raise ValueError(
                    f"TemplatePatch {self.id!r}: insertions offsets must be strictly increasing, "
                    f"insertions[{index}] offset {offset} follows {previous_offset}"
                )
            if text != MARK_TAG:
                raise ValueError(
                    f"TemplatePatch {self.id!r}: insertions[{index}] text must be {MARK_TAG!r}, got {text!r}"
                )
            previous_offset = offset
