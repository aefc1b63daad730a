"""Streaming tool-call parsers for DeepSeek V3 and V3.1 output, on the core's marked tool-call
machinery (flare_core.api.MarkedToolCallParser, which Kimi K2's parser shares).

The models write tool calls as a section of calls framed by marker tokens, as their chat
templates render them back:

    V3:   <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
          ```json
          {"city": "Oslo"}
          ```<｜tool▁call▁end｜>
          <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Oslo"}
          <｜tool▁call▁end｜><｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(V3.1 writes no line breaks: the ones shown only fit the lines here.) The parsers have the
`feed`/`finish` -> `ParsedDelta` interface of `flare_core.frontend.parsers`, which the server
turns into OpenAI tool_calls and Anthropic tool_use blocks. V3.1's reasoning is the built-in
`think` parser's job: its template ends a thinking prompt with `<think>`, so
`prompt_opens_reasoning` starts it inside reasoning; with thinking off, and after tool results,
the prompt opens no reasoning and the output is content.

The parsers read the markers as text, so the detokenizer must keep them (see
flare_core.frontend.tool_calls).
"""

from __future__ import annotations

from flare_core.api import MarkedToolCallParser, Parser, ToolCallFormat, ToolCallMarkers, function_name
from flare_recipe_deepseek.dsml import DsmlToolParser, DsmlV41ToolParser

# The special tokens of DeepSeek V3 and V3.1 tool calls (the same in both).
SECTION_BEGIN, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, TOOL_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV3ToolParser(MarkedToolCallParser):
    """DeepSeek V3: `<｜tool▁call▁begin｜>TYPE<｜tool▁sep｜>NAME` + newline + arguments in a ```json fence."""

    markers = ToolCallMarkers(section_begin=SECTION_BEGIN, section_end=SECTION_END, call_begin=CALL_BEGIN,
                              call_end=CALL_END, header_end="\n", header_separator=TOOL_SEP, fenced_arguments=True)

    def parse_header(self, header: str) -> tuple[str | None, str] | None:
        call_type, separator, name_text = header.partition(self.markers.header_separator)
        name = function_name(name_text)
        if not separator or not call_type.strip() or name is None:
            return None
        return None, name


class DeepSeekV31ToolParser(MarkedToolCallParser):
    """DeepSeek V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`."""

    markers = ToolCallMarkers(section_begin=SECTION_BEGIN, section_end=SECTION_END, call_begin=CALL_BEGIN,
                              call_end=CALL_END, header_end=TOOL_SEP)

    def parse_header(self, header: str) -> tuple[str | None, str] | None:
        name = function_name(header)
        return None if name is None else (None, name)


# The forms the parsers read (and the chat templates render): what a forced call is written as.
DEEPSEEK_V3_CALLS = ToolCallFormat(call_begin=f"{CALL_BEGIN}function{TOOL_SEP}{{name}}\n```json\n",
                                   call_end=f"\n```{CALL_END}", separator="\n",
                                   section_begin=SECTION_BEGIN, section_end=SECTION_END)
DEEPSEEK_V31_CALLS = ToolCallFormat(call_begin=f"{CALL_BEGIN}{{name}}{TOOL_SEP}", call_end=CALL_END,
                                    section_begin=SECTION_BEGIN, section_end=SECTION_END)

DEEPSEEK_PARSERS: tuple[Parser, ...] = (
    Parser("deepseek-v3-tools", "tool", DeepSeekV3ToolParser, call_format=DEEPSEEK_V3_CALLS),
    Parser("deepseek-v3.1-tools", "tool", DeepSeekV31ToolParser, call_format=DEEPSEEK_V31_CALLS),
    # DSML arguments are no JSON object a grammar could force: forced calls are refused.
    Parser("deepseek-v4-tools", "tool", DsmlToolParser),
    Parser("deepseek-v4.1-tools", "tool", DsmlV41ToolParser),
)
"""What flare-recipe-deepseek's `flare_parsers` hook returns. V3.1's reasoning parser is the
built-in "think"; V3's template has no reasoning. V4's and V4.1's DSML calls
(flare_recipe_deepseek.dsml) are for their recipes."""
