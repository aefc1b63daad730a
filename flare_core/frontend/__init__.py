"""Frontend: tokenizer, chat templates with `{% mark %}`, template patches, streaming detokenization,
and `Frontend`, the text side of a served core."""

from flare_core.frontend.detokenizer import IncrementalDetokenizer
from flare_core.frontend.literals import ForgedLiteral
from flare_core.frontend.marks import mark_token_endpoints
from flare_core.frontend.patches import (
    TemplatePatchError,
    apply_template_patch,
    make_template_patch,
    sha256_hex,
    strip_marks,
)
from flare_core.frontend.served import Frontend
from flare_core.frontend.template import ChatTemplate, ConversationRenderer, RenderedPrompt, TemplateError
from flare_core.frontend.tokenizer import Tokenizer, build_tokenizer_json

__all__ = [
    "ChatTemplate",
    "ConversationRenderer",
    "ForgedLiteral",
    "Frontend",
    "IncrementalDetokenizer",
    "RenderedPrompt",
    "TemplateError",
    "TemplatePatchError",
    "Tokenizer",
    "apply_template_patch",
    "build_tokenizer_json",
    "make_template_patch",
    "mark_token_endpoints",
    "sha256_hex",
    "strip_marks",
]
