"""Tool calls: how a checkpoint's chat template asks for them, and reading them back.

A chat with tools is rendered through the template, which describes the tools its own way; the
model answers in the template's call format, which a `ToolFormat` knows: the markup around a
call and its arguments, a streaming parser, and a grammar that forces a call when the request
says one must come. Templates that know no tools get the generic form: the tools described in a
system turn and the calls asked as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
"""

from __future__ import annotations

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_omnia.engine.text.tools.calls import (
    JSON_LAYOUT,
    Event,
    Thought,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolChoice,
    ToolFormat,
    merge_calls,
)
from mlx_omnia.engine.text.tools.deepseek import DEEPSEEK
from mlx_omnia.engine.text.tools.glm import GLM45
from mlx_omnia.engine.text.tools.harmony import HARMONY
from mlx_omnia.engine.text.tools.json_calls import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    JsonFormat,
)

__all__ = [
    "DEEPSEEK",
    "GENERIC",
    "GLM45",
    "HARMONY",
    "HERMES",
    "JSON_LAYOUT",
    "LLAMA3_JSON",
    "MISTRAL",
    "Event",
    "JsonFormat",
    "Thought",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolChoice",
    "ToolFormat",
    "merge_calls",
    "tool_format",
]


def tool_format(template_source: str | None) -> ToolFormat:
    """The call format a chat template asks for, read from its text; the generic form for a
    template that never reads `tools` (it would drop them), unless it renders calls of its
    own (DeepSeek's, whose tools go in a system turn we write)."""
    if not template_source:
        return GENERIC
    if DEEPSEEK.calls_begin in template_source:
        return DEEPSEEK
    if "tools" not in _variables(template_source):
        return GENERIC
    if "<|channel|>" in template_source and "<|call|>" in template_source:
        return HARMONY
    if "<arg_key>" in template_source:
        return GLM45
    if "[TOOL_CALLS]" in template_source:
        return MISTRAL
    if "<tool_call>" in template_source:
        return HERMES
    if "<|python_tag|>" in template_source or '"parameters"' in template_source:
        return LLAMA3_JSON
    return HERMES


def _variables(source: str) -> set[str]:
    try:
        return jinja2.meta.find_undeclared_variables(ImmutableSandboxedEnvironment().parse(source))
    except jinja2.TemplateSyntaxError:
        return set()
