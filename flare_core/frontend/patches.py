"""Applying, making and undoing template patches, byte-exact.

Templates are handled as the exact UTF-8 bytes that were published (CRLF line
endings included): offsets are byte offsets and hashes cover those bytes, so read
template files with `Path.read_bytes().decode("utf-8")`, never in text mode.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from flare_core.contract.template_patch import MARK_TAG, TemplatePatch


class TemplatePatchError(ValueError):
    """A template patch does not fit the template it is applied to."""


def sha256_hex(text: str) -> str:
    """Lowercase hex sha256 of the UTF-8 bytes of `text`."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def apply_template_patch(source: str, patch: TemplatePatch) -> str:
    """Insert the patch's mark tags into `source`; the source and result hashes must both match."""
    source_sha256 = sha256_hex(source)
    if source_sha256 != patch.source_sha256:
        raise TemplatePatchError(
            f"template patch {patch.id!r} is for a template with sha256 {patch.source_sha256}, "
            f"but this template has sha256 {source_sha256}"
        )
    source_bytes = source.encode("utf-8")
    if patch.insertions and patch.insertions[-1][0] > len(source_bytes):
        raise TemplatePatchError(
            f"template patch {patch.id!r}: insertion offset {patch.insertions[-1][0]} is past the template end "
            f"({len(source_bytes)} bytes)"
        )
    result_bytes = _insert(source_bytes, patch.insertions)
    result_sha256 = hashlib.sha256(result_bytes).hexdigest()
    if result_sha256 != patch.result_sha256:
        raise TemplatePatchError(
            f"template patch {patch.id!r}: the patched template has sha256 {result_sha256}, "
            f"expected {patch.result_sha256}"
        )
    # The result hash matched bytes made by the patch author from valid UTF-8, so this cannot split a character.
    return result_bytes.decode("utf-8")


def strip_marks(annotated: str) -> str:
    """Remove every mark tag, giving back the unpatched template text."""
    return annotated.replace(MARK_TAG, "")


def make_template_patch(patch_id: str, source: str, offsets: Iterable[int]) -> TemplatePatch:
    """Build the patch that inserts one mark tag at each byte offset of `source` (for recipe maintainers)."""
    if MARK_TAG in source:
        raise TemplatePatchError(
            f"template patch {patch_id!r}: the source already contains {MARK_TAG!r}, "
            "so stripping marks could not restore it exactly"
        )
    source_bytes = source.encode("utf-8")
    insertions = []
    for offset in sorted(offsets):
        if not 0 <= offset <= len(source_bytes):
            raise TemplatePatchError(
                f"template patch {patch_id!r}: offset {offset} is outside the template (0..{len(source_bytes)} bytes)"
            )
        if 0 < offset < len(source_bytes) and source_bytes[offset] & 0xC0 == 0x80:
            raise TemplatePatchError(f"template patch {patch_id!r}: offset {offset} splits a UTF-8 character")
        insertions.append((offset, MARK_TAG))
    return TemplatePatch(
        id=patch_id,
        source_sha256=hashlib.sha256(source_bytes).hexdigest(),
        result_sha256=hashlib.sha256(_insert(source_bytes, insertions)).hexdigest(),
        insertions=tuple(insertions),
    )


def _insert(source_bytes: bytes, insertions: Iterable[tuple[int, str]]) -> bytes:
    pieces: list[bytes] = []
    start = 0
    for offset, text in insertions:
        pieces.append(source_bytes[start:offset])
        pieces.append(text.encode("utf-8"))
        start = offset
    pieces.append(source_bytes[start:])
    return b"".join(pieces)
