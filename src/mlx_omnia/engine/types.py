"""Public value types of the engine: chats, options, pieces of output, signatures."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

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


@dataclass(frozen=True)
class Chat:
    """A conversation, rendered through the checkpoint's chat template with the generation prompt.

    `continue_final`: the last message is an assistant turn to continue (a prefill, as
    Anthropic's API takes one): the prompt ends with its text instead of a new assistant turn,
    and the answer is what follows it. The template must echo that text as given."""

    messages: tuple[ChatMessage, ...]
    tools: tuple[Mapping[str, Any], ...] = ()
    continue_final: bool = False


@dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """How to generate. A field left as None takes the checkpoint's generation_config.json default,
    then the engine's default (greedy for temperature only when the checkpoint says nothing)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=lambda: dict[int, float]())
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    context_limit: int | None = None
    # None: no log-probabilities; n (0-20): each generated token's log-probability under the
    # model (log-softmax of its logits, before biases, penalties and temperature) and the n
    # likeliest tokens' (Piece.logprobs).
    logprobs: int | None = None


FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Usage:
    """Token counts of one generation."""

    prompt_tokens: int
    completion_tokens: int

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
    channel: Literal["content"] = "content"
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stop_sequence: str | None = None  # on the last piece: the stop string that ended it, if any
    # with GenerationOptions.logprobs: one a token of token_ids, but an end token's
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Completion:
    """The whole output of `Model.generate`."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()


ContentType = Literal["text"]
OutputType = Literal["text"]


@dataclass(frozen=True)
class Signature:
    """What a model takes and gives: input content types, outputs and the options it honours.

    Loading, scheduling and serving work from this alone (design rule 1)."""

    inputs: frozenset[ContentType]
    outputs: frozenset[OutputType]
    options: frozenset[str]
    context_length: int


TEXT_GENERATION_OPTIONS: frozenset[str] = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "stop",
        "stop_token_ids",
        "seed",
        "context_limit",
    }
)
