"""Public value types of the engine: chats, options, pieces of output, signatures."""

from __future__ import annotations

import json
import math
import numbers
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, NotRequired, TypedDict, cast

from llguidance import LLMatcher, LLTokenizer

from mlx_omnia.engine.errors import InvalidOptionsError
from mlx_omnia.engine.text.tools import ToolCall, ToolCallDelta, ToolChoice

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stub only

Role = Literal["system", "user", "assistant", "tool"]


class TextPart(TypedDict):
    """One text part of a message's content (OpenAI-style content parts)."""

    type: Literal["text"]
    text: str


class ChatMessage(TypedDict):
    """A chat turn. `content` is a string or a list of text parts."""

    role: Role
    content: str | list[TextPart]
    name: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]]]
    tool_call_id: NotRequired[str]
    reasoning_content: NotRequired[str]  # an assistant turn's reasoning (thinking templates)


@dataclass(frozen=True)
class Chat:
    """A conversation, rendered through the checkpoint's chat template with the generation prompt.

    `tools`: functions the model may call, OpenAI's shape (`{"type": "function", "function":
    {"name", "description", "parameters"}}`); calls come back in `Piece.tool_calls` /
    `Completion.tool_calls`. `tool_choice`: "auto" (the model decides), "none" (no calls are
    read from the answer), "required" (the answer is one or more calls, forced by a grammar);
    `allowed_tools`: the names a call may take (all when empty); `parallel_tool_calls`: more
    than one call an answer. Assistant turns carry `tool_calls` (arguments as JSON text or an
    object), tool turns `tool_call_id` and the result as content.

    `thinking`: a thinking template's switch (`enable_thinking`), None for its default;
    `reasoning_effort` reaches templates that read it (gpt-oss); `template_kwargs`: more
    variables for the template. The reasoning comes back on the "reasoning" channel.

    `continue_final`: the last message is an assistant turn to continue (a prefill, as
    Anthropic's API takes one): the prompt ends with its text instead of a new assistant turn,
    and the answer is what follows it. The template must echo that text as given."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    tool_choice: ToolChoice = "auto"
    allowed_tools: tuple[str, ...] = ()
    parallel_tool_calls: bool = True
    continue_final: bool = False
    thinking: bool | None = None
    reasoning_effort: str | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=lambda: dict[str, Any]())

    def template_variables(self) -> dict[str, Any]:
        """What the template is rendered with beyond messages and tools."""
        out = dict(self.template_kwargs)
        if self.thinking is not None:
            out["enable_thinking"] = self.thinking
        if self.reasoning_effort is not None:
            out["reasoning_effort"] = self.reasoning_effort
        return out


# How generated JSON is laid out: one line, a space after ',' and ':' (as json.dumps writes it).
# A fixed layout keeps a small model from spending its tokens on whitespace.
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "
}


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match, enforced token by token (llguidance): a JSON schema, a
    Lark grammar or a regular expression. Build one with `json_schema`, `lark` or `regex`.

    `source` is the schema as JSON text, the grammar or the pattern, as the constructor took it."""

    kind: Literal["json_schema", "lark", "regex"]
    source: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | None = None) -> Constraint:
        """JSON valid under `schema`; without one, any JSON object (OpenAI's json_object mode).
        Written on one line, ", " and ": " between items (a schema's "x-guidance" may say
        otherwise)."""
        return cls("json_schema", json.dumps(dict(schema or {"type": "object"})))

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """Text the Lark grammar's `start` rule derives, in llguidance's Lark dialect (which also
        takes `%json {schema}` rules and special tokens such as `<|im_end|>`)."""
        return cls("lark", grammar)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Text the whole of which matches `pattern` (Rust regex syntax)."""
        return cls("regex", pattern)

    def grammar(self) -> str:
        """The llguidance grammar this constraint compiles to (LLMatcher's input); a constraint
        built by hand with another kind, or a schema that is no JSON object, raises
        InvalidOptionsError."""
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind != "json_schema":
            raise _refused(f"has kind {self.kind!r}; build it with Constraint.json_schema, "
                           "Constraint.lark or Constraint.regex")
        try:
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
        except ValueError as e:
            raise _refused(f"holds a JSON schema that is not a JSON object: {e}") from None

    def check(self, tokenizer: LLTokenizer | None = None) -> None:
        """Raise InvalidOptionsError (option "constraint", llguidance's reason) unless llguidance
        compiles this constraint (against `tokenizer`'s vocabulary when given)."""
        problem = LLMatcher.validate_grammar(self.grammar(), tokenizer)
        if problem:
            raise _refused(f"is not a valid {_CONSTRAINT_NOUNS[self.kind]}: {problem.strip()}")


_CONSTRAINT_NOUNS = {"json_schema": "JSON schema", "lark": "Lark grammar", "regex": "regex"}


def _refused(reason: str) -> InvalidOptionsError:
    return InvalidOptionsError(f"constraint {reason}", option="constraint", reason=reason)

MAX_TOP_LOGPROBS = 20  # alternatives a token (OpenAI's top_logprobs bound)
MAX_SEED = 2**64 - 1  # seeds are unsigned 64-bit (mx.random.key)


@dataclass(frozen=True)
class Bounds:
    """What an option's values may be: numbers at least `ge`, above `gt`, at most `le`; at most
    `max_items` items in a list or mapping; no empty string (`nonempty`). In a list or a mapping
    they bound each item or value."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    max_items: int | None = None
    nonempty: bool = False
    choices: tuple[float, ...] | None = None  # the only values taken

    def within(self, other: Bounds) -> Bounds:
        """The values both allow."""
        lows = [(b, False) for b in (self.ge, other.ge) if b is not None]
        lows += [(b, True) for b in (self.gt, other.gt) if b is not None]
        low, above = max(lows) if lows else (None, False)  # at equal values, `gt` is tighter
        items = [n for n in (self.max_items, other.max_items) if n is not None]
        return Bounds(
            ge=None if above else low,
            gt=low if above else None,
            le=min((b for b in (self.le, other.le) if b is not None), default=None),
            max_items=min(items, default=None),
            nonempty=self.nonempty or other.nonempty,
            choices=self.choices if other.choices is None else (
                other.choices if self.choices is None
                else tuple(c for c in self.choices if c in other.choices)
            ),
        )


def _option(
    *, ge: float | None = None, gt: float | None = None, le: float | None = None,
    choices: tuple[float, ...] | None = None, token_ids: bool = False, tokens: bool = False,
) -> dict[str, Any]:
    """A GenerationOptions field's metadata: the bounds of its values (or the `choices` alone it
    takes); `token_ids`: the items (or keys) are token ids, bounded by the model's vocabulary;
    `tokens`: the value counts tokens, at most the model's context length."""
    bounds = Bounds(ge=ge, gt=gt, le=le, choices=choices)
    return {"bounds": bounds, "token_ids": token_ids, "tokens": tokens}


@dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """How to generate. A field left as None takes the checkpoint's generation_config.json default,
    then the engine's default (greedy for temperature only when the checkpoint says nothing).

    Each field's type and metadata say what it takes; a model's Signature is derived from them."""

    # At most the model's context length (no answer can be longer); an answer that would not
    # fit after the prompt stops when the context is full (finish_reason "length").
    max_tokens: int | None = field(default=None, metadata=_option(ge=0, tokens=True))
    temperature: float | None = field(default=None, metadata=_option(ge=0.0))  # 0: greedy
    top_p: float | None = field(default=None, metadata=_option(gt=0.0, le=1.0))
    top_k: int | None = field(default=None, metadata=_option(ge=0))  # 0: no top-k
    min_p: float | None = field(default=None, metadata=_option(ge=0.0, le=1.0))
    repetition_penalty: float | None = field(default=None, metadata=_option(gt=0.0))
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(
        default_factory=lambda: dict[int, float](), metadata=_option(token_ids=True)
    )
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = field(default=(), metadata=_option(token_ids=True))
    seed: int | None = field(default=None, metadata=_option(ge=0, le=MAX_SEED))
    context_limit: int | None = field(default=None, metadata=_option(gt=0))
    # None: no log-probabilities; n (0-20): each generated token's log-probability under the
    # model (log-softmax of its logits, before biases, penalties and temperature) and the n
    # likeliest tokens' (Piece.logprobs).
    logprobs: int | None = field(default=None, metadata=_option(ge=0, le=MAX_TOP_LOGPROBS))
    # Tokens a thinking template's reasoning may take; then its end marker is forced and the
    # answer follows (None: no limit but max_tokens).
    reasoning_budget: int | None = field(default=None, metadata=_option(ge=0, tokens=True))
    # What the output must match (JSON schema, Lark grammar, regex); the answer ends with an end
    # token once the constraint is complete (finish_reason "stop").
    constraint: Constraint | None = None
    # This answer's KV cache as affine 8- or 4-bit codes (the model's group size, else the
    # largest of 64 and 32 that its heads take), read directly by attention; None: the model's
    # own format (Model.quantize_kv_cache, as computed unless set). Not every model takes it:
    # its Signature leaves it out where the cache cannot be quantized.
    kv_bits: int | None = field(default=None, metadata=_option(choices=(4, 8)))


_NOUNS: dict[type, str] = {
    int: "integer", float: "finite number", str: "string", Constraint: "Constraint",
}


@dataclass(frozen=True)
class OptionSpec:
    """What one generation option takes: a value of `type`, a list of them (`sequence`) or token
    ids mapped to them (`mapping`), within `bounds`; token ids (`token_ids`: the list's items,
    the mapping's keys) from 0 to `vocab_size` - 1 when that is known."""

    name: str
    type: type
    shape: Literal["value", "sequence", "mapping"] = "value"
    bounds: Bounds = Bounds()
    token_ids: bool = False
    vocab_size: int | None = None
    why_le: str = ""  # what the upper bound is, said when a value passes it
    # A Constraint compiles against this vocabulary when given (a model's; built on first use),
    # else its grammar alone is checked. Not part of what the spec says (two loads of one model
    # have equal signatures).
    grammar_tokenizer: Callable[[], LLTokenizer] | None = field(
        default=None, compare=False, repr=False
    )

    def within(self, bounds: Bounds) -> OptionSpec:
        """This option under tighter bounds (an API's own limits)."""
        return replace(self, bounds=self.bounds.within(bounds))

    def check(self, value: object) -> None:
        """Raise InvalidOptionsError naming this option unless it takes `value`."""
        if self.shape == "value":
            self._value(value, "")
            return
        container = Mapping if self.shape == "mapping" else Sequence
        if not isinstance(value, container) or isinstance(value, str):
            raise self._error(self._kind())
        items = cast(Sequence[object] | Mapping[object, object], value)
        if self.bounds.max_items is not None and len(items) > self.bounds.max_items:
            raise self._error(f"must hold at most {self.bounds.max_items} values")
        if isinstance(items, Mapping):
            for key, item in items.items():
                self._token(key)
                self._value(item, "values ", key)
            return
        for item in items:
            if self.token_ids:
                self._token(item)
            else:
                self._value(item, "items ")

    def _value(self, value: object, whose: str, key: object = None) -> None:
        if not self._is_type(value):
            raise self._error(self._kind())
        if isinstance(value, Constraint):
            value.check(None if self.grammar_tokenizer is None else self.grammar_tokenizer())
            return
        b = self.bounds
        if isinstance(value, str):
            if b.nonempty and not value:
                raise self._error("must not hold an empty string" if whose else "must not be empty")
            return
        x = cast(float, value)
        if b.choices is not None and x not in b.choices:
            raise self._error(f"{whose}must be {' or '.join(_num(c) for c in b.choices)}")
        if (
            (b.ge is not None and x < b.ge)
            or (b.gt is not None and x <= b.gt)
            or (b.le is not None and x > b.le)
        ):
            if self.why_le and b.le is not None and x > b.le:
                raise self._error(f"{whose}must be at most {_num(b.le)} ({self.why_le})")
            which = "" if key is None else f" (token {key} has {_num(x)})"
            raise self._error(f"{whose}must be {self._range()}{which}")

    def _is_type(self, value: object) -> bool:
        if self.type in (str, Constraint):
            return isinstance(value, self.type)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        if self.type is int:
            return isinstance(value, numbers.Integral)
        return math.isfinite(value)

    def json_schema(self) -> dict[str, object]:
        """The bounds as JSON Schema keywords (an API's documentation of what `check` takes): on
        the value itself, or on a list's items or a mapping's values. Types are the API's own
        (a Constraint has none: each API writes its own response_format)."""
        b = self.bounds
        one: dict[str, object] = {}
        for key, bound in (("minimum", b.ge), ("exclusiveMinimum", b.gt), ("maximum", b.le)):
            if bound is not None:
                one[key] = int(bound) if self.type is int else bound
        if b.nonempty:
            one["minLength"] = 1
        if b.choices is not None:
            one["enum"] = [int(c) if self.type is int else c for c in b.choices]
        if self.shape == "value":
            return one
        count, inner = ("maxItems", "items") if self.shape == "sequence" else (
            "maxProperties", "additionalProperties"
        )
        many: dict[str, object] = {} if b.max_items is None else {count: b.max_items}
        if one and not (self.token_ids and self.shape == "sequence"):  # items: ids, not values
            many[inner] = one
        return many

    def _token(self, key: object) -> None:
        if isinstance(key, bool) or not isinstance(key, numbers.Integral):
            raise self._error(self._kind())
        top = self.vocab_size
        if int(key) < 0 or (top is not None and int(key) >= top):
            raise self._error(f"names token {key}, outside 0..{'' if top is None else top - 1}")

    def _kind(self) -> str:
        noun = _NOUNS[self.type]
        if self.shape == "sequence":
            return f"must be a list of {'token ids' if self.token_ids else noun + 's'}"
        if self.shape == "mapping":
            return f"must map token ids to {noun}s"
        return f"must be {'an' if noun[0] in 'aeiouAEIOU' else 'a'} {noun}"

    def _range(self) -> str:
        b = self.bounds
        low = b.gt if b.gt is not None else b.ge
        if low is not None and b.le is not None:
            if self.type is int and b.gt is None:
                return f"between {_num(low)} and {_num(b.le)}"
            return f"in {'(' if b.gt is not None else '['}{_num(low)}, {_num(b.le)}]"
        if low is not None:
            return f"{'>' if b.gt is not None else '>='} {_num(low)}"
        return f"<= {_num(b.le or 0)}"

    def _error(self, reason: str) -> InvalidOptionsError:
        return InvalidOptionsError(f"{self.name} {reason}", option=self.name, reason=reason)


def _num(x: float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _spec(
    f: Field[Any],
    hint: object,
    vocab_size: int | None,
    context_length: int | None,
    grammar_tokenizer: Callable[[], LLTokenizer] | None,
) -> OptionSpec:
    if isinstance(hint, UnionType):  # `X | None`: None is the field's "not set"
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    shape: Literal["value", "sequence", "mapping"] = "value"
    kind: object = hint
    if origin is Mapping:
        shape, kind = "mapping", args[1]
    elif origin is Sequence:
        shape, kind = "sequence", args[0]
    assert kind in _NOUNS, f"GenerationOptions.{f.name}: a type the option specs cannot check"
    bounds: Bounds = f.metadata.get("bounds", Bounds())
    why_le = ""
    if f.metadata.get("tokens", False) and context_length is not None:
        bounds = bounds.within(Bounds(le=context_length))
        why_le = "the model's context length"
    return OptionSpec(
        f.name,
        cast(type, kind),
        shape,
        bounds,
        bool(f.metadata.get("token_ids", False)),
        vocab_size,
        why_le,
        grammar_tokenizer if kind is Constraint else None,
    )


def generation_options(
    vocab_size: int | None = None,
    context_length: int | None = None,
    grammar_tokenizer: Callable[[], LLTokenizer] | None = None,
) -> dict[str, OptionSpec]:
    """Every GenerationOptions field's spec, from its type and metadata; token ids bounded by
    `vocab_size`, token counts by `context_length` and constraints compiled against
    `grammar_tokenizer()` when given (a model's Signature), else token ids only by 0, counts not
    at all and constraints checked as grammars alone."""
    hints = typing.get_type_hints(GenerationOptions)
    return {
        f.name: _spec(f, hints[f.name], vocab_size, context_length, grammar_tokenizer)
        for f in fields(GenerationOptions)
    }


def _unset(f: Field[Any], value: object) -> bool:
    default: object = f.default
    if f.default_factory is not MISSING:
        default = f.default_factory()
    empty = isinstance(value, Sequence | Mapping) and not isinstance(value, str) and not value
    return value is None or empty or value == default


FinishReason = Literal["stop", "length", "tool_calls"]  # tool_calls: it ended after calls


@dataclass(frozen=True)
class Usage:
    """Token counts of one generation."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class TopLogprob:
    """One of the likeliest tokens at a step: its id, the bytes it stands for in a text (part
    of a character, maybe), its log-probability."""

    token_id: int
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the model, and the likeliest tokens' at that
    step (best first)."""

    token_id: int
    token_bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Piece:
    """One streamed piece of output. `text` is always whole UTF-8 characters."""

    text: str
    token_ids: tuple[int, ...]
    channel: Literal["content", "reasoning"] = "content"  # reasoning: a thinking template's
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_sequence: str | None = None  # on the last piece: the stop string that ended it, if any
    # with GenerationOptions.logprobs: one a token of token_ids, but an end token's
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCallDelta, ...] = ()  # parts of calls, after `text`


@dataclass(frozen=True)
class Completion:
    """The whole output of `Model.generate`."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""  # the reasoning channel's text


ContentType = Literal["text"]
OutputType = Literal["text"]


@dataclass(frozen=True)
class Signature:
    """What a model takes and gives: input content types, outputs and the options it honours
    (each GenerationOptions field's spec, see `generation_options`).

    Loading, scheduling and serving work from this alone (design rule 1)."""

    inputs: frozenset[ContentType]
    outputs: frozenset[OutputType]
    options: Mapping[str, OptionSpec]
    context_length: int
    # Whether generations share decode steps (continuous batching, `Batch`); a model that
    # cannot batch still serves many requests, one after another.
    batched: bool = True

    def check(self, options: GenerationOptions) -> None:
        """Raise InvalidOptionsError naming the first option set to something this model does not
        take: a value out of its spec, or an option it does not honour."""
        for f in fields(options):
            value = getattr(options, f.name)
            if _unset(f, value):
                continue
            spec = self.options.get(f.name)
            if spec is None:
                reason = "is not supported by this model"
                raise InvalidOptionsError(f"{f.name} {reason}", option=f.name, reason=reason)
            spec.check(value)
