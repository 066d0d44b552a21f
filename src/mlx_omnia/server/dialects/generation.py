"""What every dialect does to generate: gather a request's options under the names it sent them,
check them in one place (the engine's option specs under the API's own limits), start a stream
before answering so that errors come with a status, stop as soon as the client leaves, and say
engine errors in the client's names."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar, cast

from fastapi import Request

from mlx_omnia import (
    Bounds,
    Chat,
    Constraint,
    GenerationOptions,
    InvalidOptionsError,
    OmniaError,
    OptionSpec,
    Piece,
    TokenLogprob,
    ToolCall,
    Usage,
    generation_options,
)
from mlx_omnia.server.dialects.errors import from_engine
from mlx_omnia.server.errors import ApiError
from mlx_omnia.server.scheduler import Job
from mlx_omnia.server.state import ServerState, state_of

T = TypeVar("T")


@functools.cache
def _specs() -> Mapping[str, OptionSpec]:
    return generation_options()


def documented(
    option: str, limits: Mapping[str, Bounds] | None = None, *, single: bool = False
) -> dict[str, Any]:
    """The OpenAPI documentation of a request field carrying `option`: JSON Schema keywords for
    the bounds `Options.checked` enforces (the same spec under the API's `limits`). `single`: the
    field also takes one item where a list is allowed, bounded as the list's items are."""
    spec = _specs()[option]
    if limits and option in limits:
        spec = spec.within(limits[option])
    schema = spec.json_schema()
    items = schema.get("items")
    if single and isinstance(items, dict):
        schema = {**schema, **cast(dict[str, Any], items)}
    return schema


def json_schema(schema: object, where: str) -> Constraint:
    """The constraint of a JSON schema a request sent in its field `where` (refused by that name
    unless it is a JSON object; llguidance's verdict on it comes when the options are checked)."""
    if not isinstance(schema, dict):
        raise ApiError("invalid_request", f"{where} must be a JSON schema object", where)
    return Constraint.json_schema(cast(dict[str, Any], schema))


class Options:
    """A request's generation options in engine terms, each with the request's name for it, checked
    against the engine's option specs under the API's own tighter `limits` (OpenAI's temperature
    stops at 2, Anthropic's at 1). A model's own signature is checked when it generates."""

    def __init__(self, limits: Mapping[str, Bounds] | None = None) -> None:
        self.limits = limits or {}
        self.values: dict[str, object] = {}
        self.names: dict[str, str] = {}

    def set(self, option: str, value: object, sent_as: str | None = None) -> None:
        """The GenerationOptions field `option` takes `value` (None: not sent), which came in the
        request's field `sent_as` (by default the option's own name)."""
        if value is not None:
            self.values[option] = value
            self.names[option] = sent_as or option

    def checked(self) -> GenerationOptions:
        """The options, or an ApiError naming the first field that is out of bounds."""
        for option, value in self.values.items():
            spec = _specs()[option]
            if option in self.limits:
                spec = spec.within(self.limits[option])
            try:
                spec.check(value)
            except InvalidOptionsError as e:
                raise from_engine(e, names=self.names) from None
        return GenerationOptions(**cast(dict[str, Any], self.values))

    def generation(self, model_id: str, input: Chat | str, input_field: str) -> Generation:
        return Generation(model_id, input, self.checked(), input_field, dict(self.names))


@dataclass(frozen=True)
class Generation:
    """One request's generation, with the request's names for what it sent: the field holding the
    input (context-length errors name it) and each option's field."""

    model_id: str
    input: Chat | str
    options: GenerationOptions
    input_field: str
    names: Mapping[str, str] = field(default_factory=lambda: dict[str, str]())

    def choices(self, n: int) -> list[Generation]:
        """This generation `n` times over (an API's n alternatives): with a seed, the i-th uses
        seed + i, so they differ and each is reproducible."""
        seed = self.options.seed
        return [
            self if seed is None else replace(
                self, options=replace(self.options, seed=(seed + i) % 2**64)
            )
            for i in range(n)
        ]

    def error(self, error: BaseException) -> ApiError:
        """Any failure of this generation as the HTTP layer's error, named as the client sent it."""
        if isinstance(error, ApiError):
            return error
        if isinstance(error, OmniaError):
            return from_engine(error, self.input_field, self.names)
        return ApiError("internal", f"generation failed: {error}")

    def _job(self, request: Request) -> tuple[ServerState, Job]:
        """The scheduler's job for this generation, once the server allows what it asks."""
        state = state_of(request)
        if self.options.kv_bits is not None and not state.settings.request_kv_bits:
            where = self.names.get("kv_bits", "kv_bits")
            raise ApiError("invalid_request", f"{where}: this server takes no KV cache format per "
                           "request (start omnia-server with --request-kv-bits)", where)
        return state, state.job(self.model_id, self.input, self.options)

    async def run(self, request: Request) -> Answer:
        """Generate to the end, or until the client leaves."""
        state, job = self._job(request)
        try:
            pieces = await unless_gone(request, state.scheduler.run(job))
        except Exception as e:
            raise self.error(e) from e
        last = pieces[-1]
        if last.usage is None:
            raise ApiError("internal", "generation ended without a finish")
        text = "".join(p.text for p in pieces if p.channel == "content")
        calls = ToolCall.joined([d for p in pieces for d in p.tool_calls])
        thought = [p for p in pieces if p.channel == "reasoning"]
        return Answer(
            text, tuple(e for p in pieces for e in p.logprobs), last, last.usage, calls,
            "".join(p.text for p in thought), sum(len(p.token_ids) for p in thought),
        )

    async def stream(self, request: Request) -> Stream:
        """Start generating and wait for the first piece, so that model, input and option errors
        answer with a status instead of a broken stream (a client that leaves while it waits in
        the queue or its prompt is read ends it there)."""
        state, job = self._job(request)
        pieces = state.scheduler.stream(job)
        try:
            first = await unless_gone(request, anext(pieces))
        except StopAsyncIteration:
            first = None
        except Exception as e:
            raise self.error(e) from e
        return Stream(self, first, pieces, job)


async def _gone(request: Request) -> None:
    """Return when the client has closed its connection (the body is read: only a disconnect can
    come)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_gone(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ApiError client_closed once the client leaves first (`work` is then
    cancelled: a generation it waits on stops)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_gone(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, gone):
            if not t.done():
                t.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    await asyncio.gather(task, return_exceptions=True)  # let its clean-up run
    raise ApiError("client_closed", "the client closed the connection before the answer")


async def _all(works: Sequence[Awaitable[T]]) -> list[T]:
    """Every result of `works`, run together. If one fails (a full queue, say), the others are
    cancelled, a stream one of them had started is closed (nobody would read them), and the
    failure is raised."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(result, Stream):
                await result.aclose()
        raise


async def run_all(request: Request, generation: Generation, n: int) -> list[Answer]:
    """The n choices' answers (one generation each, see Generation.choices)."""
    return await _all([g.run(request) for g in generation.choices(n)])


async def stream_all(request: Request, generation: Generation, n: int) -> list[Stream]:
    """The n choices' streams, each started (errors before the response have a status)."""
    return await _all([g.stream(request) for g in generation.choices(n)])


async def merged(streams: Sequence[Stream]) -> AsyncGenerator[tuple[int, Piece], None]:
    """The pieces of several started streams (an API's n choices) as they come, each with its
    stream's index; the first failure is raised. Closing it closes every stream."""
    if len(streams) == 1:  # the usual case: no tasks, no queue between the tokens
        try:
            async for piece in streams[0]:
                yield 0, piece
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Piece | Exception | None]] = asyncio.Queue()

    async def pump(i: int, stream: Stream) -> None:
        try:
            async for piece in stream:
                await queue.put((i, piece))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    running = len(streams)
    try:
        while running:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item is None:
                running -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


@dataclass(frozen=True)
class Answer:
    """A whole generation: its text and log-probabilities, its last piece (finish reason, stop
    sequence), usage and tool calls."""

    text: str
    logprobs: tuple[TokenLogprob, ...]
    last: Piece
    usage: Usage
    tool_calls: tuple[ToolCall, ...] = ()
    reasoning: str = ""  # a thinking template's reasoning, apart from the text
    reasoning_tokens: int = 0


class Stream:
    """A started generation: `first` has come; iterating yields it and the pieces after it.
    `aclose` when done (a client that leaves stops the generation at its next token)."""

    def __init__(
        self,
        generation: Generation,
        first: Piece | None,
        rest: AsyncGenerator[Piece, None],
        job: Job | None = None,
    ) -> None:
        self.generation = generation
        self.first = first
        self._rest = rest
        self._job = job

    @property
    def prompt_usage(self) -> Usage | None:
        """The prompt's tokens and how many of them the prefix cache supplied (no completion
        tokens): known once the engine took the request, before the last piece's usage."""
        taken = self._job.generation if self._job is not None else None
        if taken is None:
            return None
        return Usage(len(taken.prompt), 0, taken.cached_tokens)

    def __aiter__(self) -> AsyncIterator[Piece]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[Piece]:
        piece = self.first
        while piece is not None:
            yield piece
            piece = await anext(self._rest, None)

    async def aclose(self) -> None:
        await self._rest.aclose()

    def error(self, error: BaseException) -> ApiError:
        """A failure after the response began, for the dialect to send in its own framing."""
        return self.generation.error(error)
