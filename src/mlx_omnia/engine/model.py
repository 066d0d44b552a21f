"""`Model`: what `load` returns. Streams text for chats and raw prompts."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from llguidance import LLTokenizer

from mlx_omnia.engine.core.binder import bindings, declarations
from mlx_omnia.engine.core.cache import KV_BITS, KVCache, KVFormat, kv_format, set_kv_format
from mlx_omnia.engine.core.layers import AttentionStep, Embedding, Projections
from mlx_omnia.engine.core.moe import ExpertLinear, Route
from mlx_omnia.engine.core.mxcompat import flat_parameters, float_item, named_modules
from mlx_omnia.engine.errors import ContextLengthError, InvalidOptionsError
from mlx_omnia.engine.generate.batch import batchable
from mlx_omnia.engine.generate.budget import ReasoningBudget
from mlx_omnia.engine.generate.loop import Decoding, Network, generate_tokens
from mlx_omnia.engine.generate.sampling import SampledLogprobs, Sampler, SamplingParams
from mlx_omnia.engine.generate.stops import StopMatcher
from mlx_omnia.engine.saving import save_model
from mlx_omnia.engine.text.reasoning import ReasoningFormat, ReasoningSplitter
from mlx_omnia.engine.text.tokenizer import Tokenizer
from mlx_omnia.engine.text.tools import (
    Event,
    Thought,
    ToolCallDelta,
    ToolCallParser,
    merge_calls,
)
from mlx_omnia.engine.types import (
    Chat,
    Completion,
    Constraint,
    FinishReason,
    GenerationOptions,
    Piece,
    Signature,
    TokenLogprob,
    TopLogprob,
    Usage,
    generation_options,
)

# Prompt tokens a continued text's detokenizer is seeded with (IncrementalDecoder.seed).
CONTEXT = 8


@dataclass(frozen=True)
class GenerationDefaults:
    """The checkpoint's generation_config.json, as far as sampling goes. A value its option would
    refuse (a top_p of 0) is left out: the engine's default applies."""

    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> GenerationDefaults:
        specs = generation_options()

        def num(key: str, default: float) -> float:
            value = config.get(key)
            if not isinstance(value, int | float):
                return default
            spec = specs[key]
            try:
                spec.check(int(value) if spec.type is int else float(value))
            except (InvalidOptionsError, ValueError, OverflowError):  # int() of nan, inf
                return default
            return float(value)

        max_new = config.get("max_new_tokens")
        return cls(
            do_sample=bool(config.get("do_sample", False)),
            temperature=num("temperature", 1.0),
            top_p=num("top_p", 1.0),
            top_k=int(num("top_k", 0)),
            min_p=num("min_p", 0.0),
            repetition_penalty=num("repetition_penalty", 1.0),
            max_new_tokens=max_new if isinstance(max_new, int) and max_new > 0 else None,
        )

    def to_dict(self, eos_token_ids: frozenset[int]) -> dict[str, Any]:
        """A generation_config.json with these defaults and end tokens (what saving writes when
        the source checkpoint had none)."""
        out: dict[str, Any] = {"do_sample": self.do_sample}
        if self.do_sample:
            out.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       min_p=self.min_p)
        if self.repetition_penalty != 1.0:
            out["repetition_penalty"] = self.repetition_penalty
        if self.max_new_tokens is not None:
            out["max_new_tokens"] = self.max_new_tokens
        eos = sorted(eos_token_ids)
        if eos:
            out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        return out


class Model:
    """A loaded model: its network, tokenizer, signature and generation defaults."""

    def __init__(
        self,
        *,
        name: str,
        network: nn.Module,
        tokenizer: Tokenizer,
        config: Mapping[str, Any],
        context_length: int,
        defaults: GenerationDefaults,
        source: str,
    ) -> None:
        if not isinstance(network, Network):
            raise TypeError(
                f"{type(network).__name__} is not a decodable network: it needs "
                "__call__(ids, cache, last_only) and make_cache()"
            )
        self.name = name
        self.network = network
        self._decodable: Network = network  # the same module, as the decode driver calls it
        self.tokenizer = tokenizer
        self.config = dict(config)
        self.defaults = defaults
        self.source = source
        self.signature = Signature(
            inputs=frozenset({"text"}),
            outputs=frozenset({"text"}),
            # the tokenizer's method, not the model's: a signature holds no reference to its
            # model (an evicted model is freed at once, not by the garbage collector)
            options=generation_options(
                self._vocab_rows(), context_length,
                functools.partial(tokenizer.grammar_tokenizer, self._vocab_rows()),
            ),
            context_length=context_length,
            batched=batchable(network),
        )
        self._offer_kv_bits()

    @property
    def nbytes(self) -> int:
        """Bytes held by the weights (what residency costs, before KV caches)."""
        return _bytes(self.network)

    @property
    def decode_bytes(self) -> int:
        """Bytes of weights one decode step reads (a bandwidth floor's numerator): all of them,
        except an embedding table that is not also the head (one row a token) and stacked
        experts (the routed share: top_k / n_experts of the Route nearest them)."""
        return decode_weight_bytes(self.network)

    @functools.cached_property
    def identity(self) -> str:
        """A digest of what this model computes with: its config, its weights' dtypes and sizes,
        and its source files (names, sizes, modification times). A prefix cache keys this
        model's keys and values by it, so a changed checkpoint never meets stale state."""
        h = hashlib.sha256(json.dumps(self.config, sort_keys=True, default=str).encode())
        for name, a in sorted(flat_parameters(self.network).items()):
            h.update(f"{name}:{a.dtype}:{a.shape};".encode())
        source = Path(self.source)
        files = sorted(source.iterdir()) if source.is_dir() else [source]
        for f in files:
            if f.is_file():
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        return h.hexdigest()

    @property
    def model_type(self) -> str:
        return str(self.config.get("model_type", ""))

    @property
    def kv_format(self) -> KVFormat | None:
        """How this model's sequences cache keys and values (None: as computed)."""
        return kv_format(self.network)

    def quantize_kv_cache(self, bits: int | None, group_size: int = 64) -> None:
        """Cache every later sequence's keys and values as affine `bits`-bit codes (8 or 4) in
        groups of `group_size` of a head's dims; None caches them as computed. Attention reads
        the codes directly. Raises InvalidOptionsError where the model's attention cannot. (A
        request's own `kv_bits` takes this format's group size.)"""
        if bits is None:
            set_kv_format(self.network, None)
            self._offer_kv_bits()
            return
        try:
            format = KVFormat(bits, group_size)
        except ValueError as e:
            raise InvalidOptionsError(f"kv_bits: {e}") from None
        refusal = self._kv_refusal(format)
        if refusal is not None:
            raise InvalidOptionsError(f"kv_bits: {refusal}")
        set_kv_format(self.network, format)
        self._offer_kv_bits()

    def _kv_refusal(self, format: KVFormat) -> str | None:
        """Why this model's sequences cannot cache in `format` (None: they can)."""
        if any(type(c) is not KVCache for c in self._decodable.make_cache()):
            return f"{self.model_type} keeps a cache of its own; it cannot be quantized"
        for name, m in named_modules(self.network):
            dims = sorted({m.head_dim, m.value_dim}) if isinstance(m, AttentionStep) else []
            if not all(format.fits(d) for d in dims):
                hint = ("pass kv_group_size=32" if all(d % 32 == 0 for d in dims)
                        else "no group size divides them")
                return (f"{name} has heads of {' and '.join(map(str, dims))} dims, not "
                        f"multiples of the group size {format.group_size}: {hint}")
        return None

    def _offer_kv_bits(self) -> None:
        """The signature takes a request's `kv_bits` where the cache can be quantized, in the
        model's own format's group size, else the largest of 64 and 32 its heads take."""
        own = self.kv_format
        groups = (own.group_size,) if own is not None else (64, 32)
        self._request_group = next(
            (g for g in groups if self._kv_refusal(KVFormat(KV_BITS[0], g)) is None), None
        )
        options = dict(self.signature.options)
        if self._request_group is None:
            options.pop("kv_bits", None)
        else:
            options.setdefault("kv_bits", generation_options()["kv_bits"])
        self.signature = replace(self.signature, options=options)

    def sequence_format(self, options: GenerationOptions) -> KVFormat | None:
        """How a generation with `options` caches its keys and values: its `kv_bits` in the
        model's group size, else the model's own format (checked options: see `signature`)."""
        if options.kv_bits is None or self._request_group is None:
            return self.kv_format
        return KVFormat(options.kv_bits, self._request_group)

    def bindings(self) -> dict[str, str]:
        """The implementation bound to each layer declaration, by module path."""
        return bindings(self.network)

    def grammar_tokenizer(self) -> LLTokenizer:
        """This model's vocabulary as llguidance sees it (what a Constraint compiles against):
        one entry a logits row, the model's end tokens as its EOS. Built on first use."""
        return self.tokenizer.grammar_tokenizer(self._vocab_rows())

    # -- inputs ----------------------------------------------------------------------------
    def encode(self, input: Chat | str) -> list[int]:
        """Prompt token ids: a Chat through the chat template, a str as raw text."""
        if isinstance(input, Chat):
            tools = input.tools if input.tool_choice != "none" else ()
            messages, tools = self.tokenizer.tool_format.render(input.messages, tools)
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, continue_final=input.continue_final,
                variables=input.template_variables(),
            )
        return self.tokenizer.encode(input)

    def logits(self, ids: list[int]) -> mx.array:
        """Full-sequence logits [L, V] for `ids` (float32), without a cache."""
        return self._decodable(mx.array([ids], dtype=mx.int32))[0].astype(mx.float32)

    def decoding(self) -> Decoding:
        """A fresh sequence with its own KV cache, fed token ids directly (teacher forcing,
        benchmarks, custom samplers)."""
        return Decoding(self._decodable)

    # -- outputs ---------------------------------------------------------------------------
    def stream(self, input: Chat | str, options: GenerationOptions | None = None) -> Iterator[Piece]:
        """Generate, yielding pieces of text as soon as they are whole characters and cannot
        begin a stop string. The last piece has `finish_reason` and `usage`.

        The input and options are checked here, before the first piece: bad ones raise at the
        call, not at the first `next()` (a server can still answer with an error status)."""
        return self._run(self.generation(input, options))

    def _run(self, generation: Generation) -> Iterator[Piece]:
        if not generation.needs_tokens:
            yield from generation.add(None)
            return
        tokens = generate_tokens(
            self._decodable, generation.prompt, generation.sample, generation.follow,
            generation.kv_format,
        )
        try:
            for token in tokens:
                yield from generation.add(token)
                if generation.done:
                    return
        finally:
            tokens.close()

    def generation(
        self, input: Chat | str, options: GenerationOptions | None = None
    ) -> Generation:
        """A checked, tokenized request whose answer is built token by token (`Generation.add`):
        what `stream` and a `Batch` drive. Bad input or options raise here."""
        options = self._forced_calls(input, options or GenerationOptions())
        self.signature.check(options)
        prompt = self.encode(input)
        if not prompt:
            raise InvalidOptionsError(
                "the prompt is empty (no tokens) and this tokenizer adds no BOS; pass some text"
            )
        limit = self._context_limit(options)
        if len(prompt) >= limit:
            most = self.signature.context_length
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but the context holds {limit}; shorten "
                + (f"the conversation or raise context_limit (up to {most})" if limit < most
                   else f"the conversation: {most} tokens is the most this model takes")
            )
        budget = limit - len(prompt)
        max_tokens = options.max_tokens
        if max_tokens is None:
            max_tokens = self.defaults.max_new_tokens or budget
        max_tokens = min(max_tokens, budget)
        constraint = options.constraint
        sampler = Sampler(
            self._sampling(options), self._vocab_rows(), prompt, constraint,
            None if constraint is None else self.grammar_tokenizer(),
        )
        # A raw prompt or a prefill is continued: its last tokens seed the detokenizer.
        continued = isinstance(input, str) or input.continue_final
        context = prompt[-CONTEXT:] if continued else []
        chat = input if isinstance(input, Chat) else None
        fmt = self.tokenizer.tool_format
        calls = chat is not None and (
            (bool(chat.tools) and chat.tool_choice != "none") or fmt.structured
        )
        # A constrained answer is what its grammar says from the first token: no reasoning.
        thinks = self._reasoning(chat) if options.constraint is None else None
        markers = [*((thinks.begin, thinks.end) if thinks else ()),
                   *(fmt.markers if calls else ())]
        keep = frozenset(self.tokenizer.special_ids(markers).values())
        opened = thinks is not None and thinks.splitter(self._prompt_tail(prompt)).inside
        sample = self._budgeted(sampler, options, thinks, opened)
        text = _Text(self, prompt, sampler, max_tokens, options, context, keep)
        splitter = thinks.splitter(self._prompt_tail(prompt)) if thinks is not None else None
        parser = None
        if calls and chat is not None:
            tools = chat.tools if chat.tool_choice != "none" else ()
            parser = _Calls(fmt.parser(tools), chat.parallel_tool_calls, text)
        follow = sample.follow if isinstance(sample, ReasoningBudget) or sampler.constrained else None
        return Generation(prompt, sample, follow, text, splitter, parser, max_tokens > 0,
                          self.sequence_format(options))

    def _reasoning(self, chat: Chat | None) -> ReasoningFormat | None:
        """The template's reasoning markers, for a chat that may think (not a continued turn,
        not one whose thinking is off: its template closes the block in the prompt)."""
        if chat is None or chat.continue_final:
            return None
        return self.tokenizer.reasoning_format

    def _prompt_tail(self, prompt: list[int]) -> str:
        return self.tokenizer.decode(prompt[-CONTEXT:], skip_special_tokens=False)

    def _budgeted(
        self, sampler: Sampler, options: GenerationOptions, thinks: ReasoningFormat | None,
        opened: bool,
    ) -> Sampler | ReasoningBudget:
        if thinks is None or options.reasoning_budget is None:
            return sampler
        end_ids = self.tokenizer.encode(thinks.end, add_special_tokens=False)
        begin = self.tokenizer.encode(thinks.begin, add_special_tokens=False)
        return ReasoningBudget(
            sampler, options.reasoning_budget, begin[0] if len(begin) == 1 else None, end_ids,
            opened,
        )

    def _forced_calls(self, input: Chat | str, options: GenerationOptions) -> GenerationOptions:
        """The options with a grammar of the template's call format when the chat requires a
        tool call: the answer is then one (or more) calls of allowed tools, arguments valid
        under each tool's schema."""
        if not isinstance(input, Chat) or not input.tools or input.tool_choice != "required":
            return options
        if options.constraint is not None:
            reason = "cannot be combined with a required tool call (the call has its own grammar)"
            raise InvalidOptionsError(f"constraint {reason}", option="constraint", reason=reason)
        fmt = self.tokenizer.tool_format
        grammar = fmt.grammar(
            input.tools, input.allowed_tools, input.parallel_tool_calls,
            self.tokenizer.special_ids(fmt.markers),
        )
        return replace(options, constraint=Constraint.lark(grammar))

    def generate(self, input: Chat | str, options: GenerationOptions | None = None) -> Completion:
        """Generate to the end and return the whole completion."""
        texts: list[str] = []
        ids: list[int] = []
        probs: list[TokenLogprob] = []
        calls: list[ToolCallDelta] = []
        reasoning: list[str] = []
        finish: FinishReason = "length"
        usage = Usage(0, 0)
        for piece in self.stream(input, options):
            if piece.channel == "reasoning":
                reasoning.append(piece.text)
            else:
                texts.append(piece.text)
            ids.extend(piece.token_ids)
            probs.extend(piece.logprobs)
            calls.extend(piece.tool_calls)
            if piece.finish_reason is not None and piece.usage is not None:
                finish, usage = piece.finish_reason, piece.usage
        return Completion(
            "".join(texts), tuple(ids), finish, usage, tuple(probs), merge_calls(calls),
            "".join(reasoning),
        )

    def save(self, path: str | Path) -> Path:
        """Write this model as an MLX-layout checkpoint directory (config.json with its
        quantization, model.safetensors, tokenizer files, generation_config.json); `load` reads
        it back. `path` must be new or empty."""
        return save_model(self, Path(path))

    # -- internals -------------------------------------------------------------------------
    def _context_limit(self, options: GenerationOptions) -> int:
        limit = self.signature.context_length
        if options.context_limit is not None:
            limit = min(limit, options.context_limit)
        return limit

    def _vocab_rows(self) -> int:
        cfg_vocab = self.config.get("vocab_size")
        return int(cfg_vocab) if isinstance(cfg_vocab, int) else self.tokenizer.vocab_size

    def _sampling(self, o: GenerationOptions) -> SamplingParams:
        d = self.defaults
        sampled = d.do_sample
        temperature = o.temperature if o.temperature is not None else (d.temperature if sampled else 0.0)
        top_p = o.top_p if o.top_p is not None else (d.top_p if sampled else 1.0)
        top_k = o.top_k if o.top_k is not None else (d.top_k if sampled else 0)
        min_p = o.min_p if o.min_p is not None else (d.min_p if sampled else 0.0)
        rep = o.repetition_penalty if o.repetition_penalty is not None else d.repetition_penalty
        return SamplingParams(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=rep,
            presence_penalty=o.presence_penalty,
            frequency_penalty=o.frequency_penalty,
            logit_bias={int(k): float(v) for k, v in o.logit_bias.items()} or None,
            seed=o.seed,
            logprobs=o.logprobs,
        )


class Generation:
    """One answer, built from its tokens as they come: `add` takes the next token and gives the
    pieces it completes (text, reasoning, tool calls); `done` once the last piece, with
    `finish_reason` and `usage`, is out. `prompt`, `sample` and `follow` are what a decode loop
    needs (`follow`, when not None, must see each token before the next is sampled)."""

    def __init__(
        self,
        prompt: list[int],
        sample: Sampler | ReasoningBudget,
        follow: Callable[[int], None] | None,
        text: _Text,
        splitter: ReasoningSplitter | None,
        calls: _Calls | None,
        needs_tokens: bool = True,
        kv_format: KVFormat | None = None,
    ) -> None:
        self.prompt = prompt
        self.needs_tokens = needs_tokens  # False: max_tokens is 0, add(None) gives the answer
        self.kv_format = kv_format  # how its sequence caches keys and values
        self.sample = sample
        self.follow = follow
        self._text = text
        self._splitter = splitter
        self._calls = calls
        self.done = False

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens a prefix cache supplied (reported in the usage)."""
        return self._text.cached

    @cached_tokens.setter
    def cached_tokens(self, n: int) -> None:
        self._text.cached = n

    def add(self, token: int | None) -> list[Piece]:
        """The pieces `token` completes (None: no token, the answer ends at its length limit)."""
        if self.done:
            return []
        piece = self._text.add(token)
        if piece is None:
            return []
        if token is None:
            self.done = True
            return [piece]
        pieces = [piece] if self._splitter is None else _split(piece, self._splitter)
        if self._calls is not None:
            pieces = [p for q in pieces for p in self._calls.feed(q)]
            self.done = self._calls.ended
        self.done = self.done or piece.finish_reason is not None
        return pieces


class _Text:
    """Tokens to text pieces: the detokenizer, end tokens, stop strings, the length limit and
    log-probabilities; the last piece carries the finish reason and the usage."""

    def __init__(
        self, model: Model, prompt: list[int], sampler: Sampler, max_tokens: int,
        options: GenerationOptions, context: list[int], keep: frozenset[int],
    ) -> None:
        self._model = model
        self._prompt_tokens = len(prompt)
        self._sampler = sampler
        self._max_tokens = max_tokens
        self._logprobs = options.logprobs is not None
        self._stop_ids = model.tokenizer.eos_token_ids | frozenset(options.stop_token_ids)
        self._decoder = model.tokenizer.incremental_decoder(keep)
        self._decoder.seed(context)
        self._stops = StopMatcher(options.stop)
        self._pending: list[int] = []
        self._probs: list[TokenLogprob] = []
        self.count = 0
        self.cached = 0

    def usage(self, generated: int | None = None) -> Usage:
        count = self.count if generated is None else generated
        return Usage(self._prompt_tokens, count, self.cached)

    def add(self, token: int | None) -> Piece | None:
        if token is None:
            return self._last("length", "")
        self.count += 1
        self._pending.append(token)
        if self._logprobs:
            record = self._sampler.logprobs.popleft()  # this token's (sampled in order)
            if token not in self._stop_ids:
                self._probs.append(_token_logprob(self._model.tokenizer, token, record))
        if token in self._stop_ids:
            return self._last("stop", self._flush_held() + self._stops.flush())
        text, hit = self._stops.feed(self._decoder.add(token))
        if hit:
            return self._last("stop", text)
        if self.count >= self._max_tokens:
            return self._last("length", text + self._flush_held() + self._stops.flush())
        if not text:
            return None
        piece = Piece(text, tuple(self._pending), logprobs=tuple(self._probs))
        self._pending, self._probs = [], []
        return piece

    def _last(self, finish: FinishReason, tail: str) -> Piece:
        return Piece(
            tail, tuple(self._pending), finish_reason=finish, usage=self.usage(),
            stop_sequence=self._stops.matched, logprobs=tuple(self._probs),
        )

    def _flush_held(self) -> str:
        """Text the decoder still held back, run through the stop matcher one last time."""
        text, _ = self._stops.feed(self._decoder.flush())
        return text


def _split(piece: Piece, splitter: ReasoningSplitter) -> list[Piece]:
    """The piece with its text on its channel: reasoning inside the template's markers, content
    after (a piece whose text spans both becomes two)."""
    last = piece.finish_reason is not None
    runs = splitter.feed(piece.text) + (splitter.finish() if last else [])
    runs = runs or [("content", "")]
    out: list[Piece] = []
    for n, (channel, text) in enumerate(runs):
        final = last and n == len(runs) - 1
        out.append(replace(
            piece, text=text, channel="reasoning" if channel == "reasoning" else "content",
            token_ids=piece.token_ids if n == 0 else (),
            logprobs=piece.logprobs if n == 0 else (),
            finish_reason=piece.finish_reason if final else None,
            usage=piece.usage if final else None,
            stop_sequence=piece.stop_sequence if final else None,
        ))
    return out


class _Calls:
    """Tool calls read out of the pieces' text (`Piece.tool_calls`); the answer ends with
    finish_reason "tool_calls" when it ends after calls, and at a second call when only one is
    allowed (`ended`: the answer is over before its tokens are)."""

    def __init__(self, parser: ToolCallParser, parallel: bool, text: _Text) -> None:
        self._parser = parser
        self._parallel = parallel
        self._text = text
        self._generated = 0
        self.ended = False

    def feed(self, piece: Piece) -> list[Piece]:
        if self.ended:
            return []
        self._generated += len(piece.token_ids)
        last = piece.finish_reason is not None
        out: list[Piece] = []
        if piece.channel == "reasoning" and not last:
            return [piece]  # calls are read from the answer, not its reasoning
        if piece.channel == "reasoning":
            out.append(replace(piece, finish_reason=None, usage=None, stop_sequence=None))
            piece = replace(piece, text="", token_ids=(), logprobs=(), channel="content")
        parser = self._parser
        events = parser.feed(piece.text) + (parser.finish() if last else [])
        if not self._parallel and any(isinstance(e, ToolCallDelta) and e.index > 0 for e in events):
            events = [e for e in events if not (isinstance(e, ToolCallDelta) and e.index > 0)]
            last = True  # a second call began: the answer ends before it
            usage = piece.usage or self._text.usage(self._generated)
            piece = replace(piece, finish_reason="stop", usage=usage)
        runs = _runs(events) or [[]]
        for n, run in enumerate(runs):
            final = last and n == len(runs) - 1
            finish = piece.finish_reason if final else None
            if finish == "stop" and parser.calls:
                finish = "tool_calls"
            thought = bool(run) and isinstance(run[0], Thought)
            out.append(Piece(
                "".join(e.text if isinstance(e, Thought) else e for e in run
                        if isinstance(e, str | Thought)),
                piece.token_ids if n == 0 else (),
                channel="reasoning" if thought else "content",
                finish_reason=finish,
                usage=piece.usage if final else None,
                stop_sequence=piece.stop_sequence if final else None,
                logprobs=piece.logprobs if n == 0 else (),
                tool_calls=tuple(e for e in run if isinstance(e, ToolCallDelta)),
            ))
        self.ended = last
        return out


def _token_logprob(tokenizer: Tokenizer, token: int, record: SampledLogprobs) -> TokenLogprob:
    as_bytes = tokenizer.token_bytes
    ids = cast(list[int], record.top_ids.tolist())
    values = cast(list[float], record.top_logprobs.tolist())
    return TokenLogprob(
        token,
        as_bytes(token),
        float_item(record.logprob),
        tuple(TopLogprob(i, as_bytes(i), v) for i, v in zip(ids, values, strict=True)),
    )


def _runs(events: list[Event]) -> list[list[Event]]:
    """Events in runs of one kind (text, calls or reasoning), in order."""
    runs: list[list[Event]] = []
    for e in events:
        if runs and type(runs[-1][0]) is type(e):
            runs[-1].append(e)
        else:
            runs.append([e])
    return runs


def _bytes(module: nn.Module) -> int:
    return sum(a.nbytes for a in flat_parameters(module).values())


def decode_weight_bytes(network: nn.Module) -> int:
    """See Model.decode_bytes."""
    modules = named_modules(network)
    heads = {id(m) for _, p in declarations(network) if isinstance(p, Projections)
             for m in p.matrices}
    routes = [(path, m) for path, m in modules if isinstance(m, Route)]
    total = float(_bytes(network))
    for path, m in modules:
        if isinstance(m, Embedding) and id(m) not in heads and m.num_embeddings > 0:
            total -= _bytes(m) * (1 - 1 / m.num_embeddings)
        elif isinstance(m, ExpertLinear):
            # the Route of the same width that shares the longest module path with the experts
            same = [(p, r) for p, r in routes if r.n_experts == m.n_experts]
            if same:
                _, route = max(same, key=lambda pr: len(_common_prefix(pr[0], path)))
                total -= _bytes(m) * (1 - min(route.top_k, m.n_experts) / m.n_experts)
    return int(total)


def _common_prefix(a: str, b: str) -> list[str]:
    out: list[str] = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        out.append(x)
    return out
