"""Template patch for the published Kimi K2 chat template.

The template renders an optional tool declaration block, a default system message
when the conversation does not start with one, then every message as
`<|im_system|>` / `<|im_user|>` / `<|im_assistant|>` + role + `<|im_middle|>` +
body + `<|im_end|>`. Each block ends with the special token `<|im_end|>` and the
next one opens with a special token, so every block end is a clean token boundary.
A mark sits after:

* the tool declaration block, shared by every conversation offering the same tools;
* the default system message, shared by every conversation without a system message;
* each message.

No message renders differently once later messages arrive (the tool call ids
`functions.NAME:INDEX` count within one assistant message), so every mark
describes a prefix later requests of the same conversation share.

The published file has CRLF line endings; offsets are byte offsets into those exact
bytes (see the assets' SOURCES.md), computed with `flare_core.frontend.make_template_patch`.
"""

from __future__ import annotations

from flare_core.api import TemplatePatch, MARK_TAG

KIMI_K2_TEMPLATE_PATCH = TemplatePatch(
    # moonshotai/Kimi-K2-Instruct, the first (July 2025) template.
    id="kimi-k2-v1",
    source_sha256="99645b3f43c27dfeef00be0cdbfdde649ef89b3449192b5bb2ff3e7f972d3329",
    result_sha256="0dde5e39bd43f79eabc37dab5b46eb6319e6125b6290fa82ef42d2b2d7f21a62",
    insertions=(
        (88, MARK_TAG),  # tool declaration
        (272, MARK_TAG),  # default system message
        (1769, MARK_TAG),  # each message
    ),
)

KIMI_TEMPLATE_PATCHES: tuple[TemplatePatch, ...] = (KIMI_K2_TEMPLATE_PATCH,)
