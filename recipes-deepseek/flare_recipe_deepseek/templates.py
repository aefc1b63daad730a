"""Template patches for the published DeepSeek V3 and V3.1 chat templates.

Both templates render `bos_token`, then every system message joined into one
system prompt, then the other messages in order. No message opens with a text
token: a user turn is `<｜User｜>` + content, an assistant turn starts with
`<｜Assistant｜>` (or, after tool results, with the results' closing token or its
own content), a tool result is wrapped in `<｜tool▁output▁begin｜>` /
`<｜tool▁output▁end｜>`. So the end of every message is a clean token boundary, and
a mark sits after:

* the system prompt (right after `bos_token` when there is none), shared by every
  conversation with the same system prompt;
* each user message;
* each assistant message: one with tool calls (closed by
  `<｜tool▁calls▁end｜><｜end▁of▁sentence｜>`), one answering tool results, and a
  plain one;
* each tool result.

Unlike Qwen3, neither template renders a message differently once later messages
arrive, so every mark describes a prefix later requests of the same conversation
share. The exceptions are inputs, not positions: a system message added later in a
conversation is moved into the system prompt at the start, and an assistant turn is
rendered without the reasoning the model produced (V3.1 writes `</think>` + the
answer; both drop text before `</think>`), so the tokens generated after a
thinking prompt are not the tokens the next request renders. Prefix reuse compares
tokens, so such checkpoints simply stop matching.

The template text that only closes a conversation is left unmarked: V3's
`<｜tool▁outputs▁end｜>` after a final run of tool results and both templates'
generation prompts end the prompt, where the runtime checkpoints anyway. A V3.1
generation prompt ends with `<think>` when the `thinking` template option is on and
with `</think>` when it is off.

Offsets are byte offsets into the exact published template bytes (see the assets'
SOURCES.md for their provenance), computed with `flare_core.frontend.make_template_patch`.
"""

from __future__ import annotations

from flare_core.api import TemplatePatch, MARK_TAG

DEEPSEEK_V3_TEMPLATE_PATCH = TemplatePatch(
    # deepseek-ai/DeepSeek-V3 (DeepSeek's deepseek_v3_tokenizer.zip), the template without thinking.
    id="deepseek-v3-v1",
    source_sha256="3a3036eeb96ca0e48565fc1f19b4d7d3fa17ada32bb1b3d5ed539ae74cf22923",
    result_sha256="4a9015a47ff781d198993559af4fd79862f7ac7dbac1f91abc5e4ecf06443004",
    insertions=(
        (557, MARK_TAG),  # system prompt
        (691, MARK_TAG),  # user
        (1776, MARK_TAG),  # assistant with tool calls
        (1967, MARK_TAG),  # assistant after tool results
        (2201, MARK_TAG),  # plain assistant
        (2435, MARK_TAG),  # first tool result (opens <｜tool▁outputs▁begin｜>)
        (2571, MARK_TAG),  # later tool results
    ),
)

DEEPSEEK_V3_1_TEMPLATE_PATCH = TemplatePatch(
    # deepseek-ai/DeepSeek-V3.1, thinking switched by the `thinking` template option.
    id="deepseek-v3.1-v1",
    source_sha256="45690185067ea25c073bff2d3e425a45ee2564d2bbf6cdf7d885e139d460b8e0",
    result_sha256="592b1867665f1e6768d9e9d2b3366b714bcb1a59bc2253036409ad358ef6fab4",
    insertions=(
        (622, MARK_TAG),  # system prompt
        (821, MARK_TAG),  # user
        (1870, MARK_TAG),  # assistant with tool calls
        (2292, MARK_TAG),  # assistant after tool results
        (2512, MARK_TAG),  # plain assistant
        (2723, MARK_TAG),  # tool result
    ),
)

DEEPSEEK_TEMPLATE_PATCHES: tuple[TemplatePatch, ...] = (
    DEEPSEEK_V3_TEMPLATE_PATCH,
    DEEPSEEK_V3_1_TEMPLATE_PATCH,
)
