"""Template patches for the published Qwen chat templates.

Every Qwen template closes a message with `<|im_end|>\\n`, after which the next
message opens with the special token `<|im_start|>`, so a mark there is always a
clean token boundary. Marks sit after:

* the opening system block: the tools preamble (which includes the system message
  when there is one), the plain system message, or Qwen2.5's default system prompt;
  the latter two without a system message are shared by every conversation that
  uses the same tools / no system prompt;
* each user message (and each later system message);
* the last tool message of a run of consecutive tool messages (the template only
  closes the run with `<|im_end|>\\n` there);
* Qwen2.5 only: each assistant message.

Qwen3 has no mark after assistant messages. Its template renders an assistant
message differently depending on where it stands: after the last user query it
keeps its `<think>` reasoning (an empty `<think>\\n\\n</think>\\n\\n` block when it
is the final message), before the last user query the reasoning is dropped. So the
text of turn N's reply changes once turn N+1's user message arrives, and a mark
after it would not describe a prefix later requests share. Everything up to the
end of the last user query never changes as the conversation grows, so the marks
up to there are reused across turns. Marks after the last user query (the end of a
tool-result run inside an agentic tool loop) hold while the loop goes on, which is
when they are reused; once a new user query arrives, the earlier reasoning is
dropped and those checkpoints simply stop matching (prefix reuse compares tokens,
so a stale checkpoint is never used wrongly).

Qwen3.5's template (Qwen3.5-27B, -35B-A3B, ...: images and videos in content, Qwen's XML tool
calls, a reasoning block opened by the generation prompt) follows the same rules and gets the
same marks: after the tools preamble or system message, each user message and the end of a run
of tool messages.

Offsets are byte offsets into the exact published template bytes (see the
fixtures' SOURCES.md for their provenance), computed with
`flare_core.frontend.make_template_patch`.
"""

from __future__ import annotations

from flare_core.api import TemplatePatch, MARK_TAG

QWEN3_V1_TEMPLATE_PATCH = TemplatePatch(
    # The first Qwen3 template (Qwen/Qwen3-0.6B, May 2025).
    id="qwen3-v1",
    source_sha256="87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
    result_sha256="5c6abaa1a309f12073afb0f7cc98cc39736342f19a7643ef1c771b267bd97b86",
    insertions=((675, MARK_TAG), (807, MARK_TAG), (1518, MARK_TAG), (3854, MARK_TAG)),
)

QWEN3_V2_TEMPLATE_PATCH = TemplatePatch(
    # The later Qwen3 template, which also accepts non-string content and reasoning_content.
    id="qwen3-v2",
    source_sha256="a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
    result_sha256="3452bd7b5bdec418a8522753b97633d7b1fa750d1313b7b6b33d7061bc264cfa",
    insertions=((675, MARK_TAG), (807, MARK_TAG), (1690, MARK_TAG), (3906, MARK_TAG)),
)

QWEN2_5_TEMPLATE_PATCH = TemplatePatch(
    # Qwen/Qwen2.5-*-Instruct.
    id="qwen2.5-v1",
    source_sha256="cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    result_sha256="2af36551f4d2fcd74169091cc0b7942c3a0c25f95c85061ce9d7a9934041c02c",
    insertions=(
        (778, MARK_TAG),
        (916, MARK_TAG),
        (1050, MARK_TAG),
        (1351, MARK_TAG),
        (1979, MARK_TAG),
        (2372, MARK_TAG),
    ),
)

QWEN3_5_TEMPLATE_PATCH = TemplatePatch(
    # Qwen/Qwen3.5-35B-A3B's chat_template.jinja (recipes-qwen/tests/fixtures/qwen3.5/SOURCES.md).
    id="qwen3.5-v1",
    source_sha256="a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715",
    result_sha256="609e5afe05f79e961c214e07637c0de883d8e48909e5a7fb403a8a06007a48f2",
    insertions=((3364, MARK_TAG), (3567, MARK_TAG), (4666, MARK_TAG), (7312, MARK_TAG), (7376, MARK_TAG)),
)

QWEN_TEMPLATE_PATCHES: tuple[TemplatePatch, ...] = (
    QWEN3_V1_TEMPLATE_PATCH,
    QWEN3_V2_TEMPLATE_PATCH,
    QWEN2_5_TEMPLATE_PATCH,
    QWEN3_5_TEMPLATE_PATCH,
)
