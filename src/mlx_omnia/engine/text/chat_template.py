"""Chat templates rendered in jinja2's sandbox with the globals HF templates expect.

A template comes from an untrusted checkpoint: the immutable sandbox denies attribute access to
internals and mutation of the inputs, so a template can only compute a string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn, cast

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_omnia.engine.errors import ChatTemplateError


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF's tojson keeps non-ASCII text as is, unlike jinja2's default filter.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _text_content(message: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `message` whose content, if a list of text parts, is one string (parts joined
    by newlines, as vLLM does), since most templates concatenate `message['content']`."""
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        parts = cast(list[Any], content)
        texts: list[str] = []
        for part in parts:
            if isinstance(part, Mapping):
                entry = cast(Mapping[str, Any], part)
                if entry.get("type") == "text" and isinstance(entry.get("text"), str):
                    texts.append(cast(str, entry["text"]))
                    continue
            raise ChatTemplateError(
                "message content parts must be {'type': 'text', 'text': ...}; this model "
                "takes text only"
            )
        out["content"] = "\n".join(texts)
    return out


class ChatTemplate:
    """A compiled chat template plus the special tokens it may reference."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str | None]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        # jinja2 types globals narrowly; HF templates expect these callables among them.
        template_globals = cast(dict[str, Any], env.globals)
        template_globals["raise_exception"] = _raise_exception
        template_globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the checkpoint's chat template does not parse: {e}") from e
        self.source = source
        self.special_tokens = dict(special_tokens)

    def render_continued(
        self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] = (),
        **extra: Any,
    ) -> str:
        """The conversation rendered up to the end of its last message's text, an assistant
        turn the model continues (what transformers' continue_final_message renders): the
        whole chat without a generation prompt, cut after the last place that text appears.
        An empty final message is a plain generation prompt after the others."""
        if not messages or messages[-1].get("role") != "assistant":
            raise ChatTemplateError("only a final assistant message can be continued")
        final = str(_text_content(messages[-1]).get("content") or "")
        if not final:
            return self.render(messages[:-1], tools=tools, **extra)
        text = self.render(messages, tools=tools, add_generation_prompt=False, **extra)
        at = text.rfind(final)
        if at < 0:  # templates that trim each message (Llama 3's) echo it stripped
            final = final.strip()
            at = text.rfind(final) if final else -1
        if at < 0:
            raise ChatTemplateError(
                "the chat template does not echo the final assistant message as given (it "
                "rewrites it), so that message cannot be continued"
            )
        return text[: at + len(final)]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] = (),
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        context: dict[str, Any] = {
            **{k: v for k, v in self.special_tokens.items() if v is not None},
            "messages": [_text_content(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            # As transformers does: `tools` is always defined, None without tools.
            "tools": [dict(t) for t in tools] if tools else None,
            **extra,
        }
        try:
            return self._template.render(context)
        except ChatTemplateError:
            raise
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"the chat template tried an unsafe operation: {e}") from e
        except Exception as e:
            raise ChatTemplateError(f"rendering the chat template failed: {e}") from e
