"""Streaming tool-call parser for Kimi K2 output:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>...<|tool_call_end|><|tool_calls_section_end|>

(without the line break). The streaming machinery is the core's marked tool-call parser
(flare_core.api.MarkedToolCallParser, shared with DeepSeek V3 / V3.1); see it for the
`feed`/`finish` behaviour and for what the server must do so that the markers survive
detokenization. Kimi K2's published template has no reasoning, so there is no reasoning parser.
"""

from __future__ import annotations

import re

from flare_core.api import MarkedToolCallParser, Parser, ToolCallFormat, ToolCallMarkers

# Kimi K2 writes `functions.NAME:INDEX` (the form its template renders); the prefix and index are
# accepted as optional so a call written as plain `NAME` is not lost.
_HEADER = re.compile(r"(?P<prefix>functions\.)?(?P<name>[^\s:]+)(?P<index>:\d+)?")


class KimiK2ToolParser(MarkedToolCallParser):
    """Kimi K2: `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>ARGUMENTS<|tool_call_end|>`.

    The call id is the model's own `functions.NAME:INDEX` when it wrote one: the template shows a
    tool result to the model as "## Return of {tool_call_id}", so handing that id back keeps the
    form it was trained on. Other headers leave the id to the protocol adapter.
    """

    markers = ToolCallMarkers(
        section_begin="<|tool_calls_section_begin|>",
        section_end="<|tool_calls_section_end|>",
        call_begin="<|tool_call_begin|>",
        call_end="<|tool_call_end|>",
        header_end="<|tool_call_argument_begin|>",
    )

    def parse_header(self, header: str) -> tuple[str | None, str] | None:
        text = header.strip()
        match = _HEADER.fullmatch(text)
        if match is None:
            return None
        own_id = match.group("prefix") and match.group("index")
        return (text if own_id else None), match.group("name")


# The form the template renders, `functions.NAME:INDEX`, the index numbered by the model.
KIMI_K2_CALLS = ToolCallFormat(call_begin="<|tool_call_begin|>functions.{name}:{index}<|tool_call_argument_begin|>",
                               call_end="<|tool_call_end|>", section_begin="<|tool_calls_section_begin|>",
                               section_end="<|tool_calls_section_end|>")

KIMI_PARSERS: tuple[Parser, ...] = (Parser("kimi-k2-tools", "tool", KimiK2ToolParser, call_format=KIMI_K2_CALLS),)
"""What flare-recipe-kimi's `flare_parsers` hook returns."""
