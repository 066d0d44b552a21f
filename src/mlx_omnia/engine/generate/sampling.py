"""Turning logits into the next token: biases, penalties, temperature and truncations."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import numpy as np
from llguidance import LLTokenizer

from mlx_omnia.engine.core.mxcompat import evaluate, evaluate_async
from mlx_omnia.engine.generate.grammar import GrammarMask
from mlx_omnia.engine.types import Constraint


@dataclass(frozen=True)
class SamplingParams:
    """Fully resolved sampling settings (checkpoint defaults already applied)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None  # each token's log-probability and this many alternatives'


@dataclass(frozen=True)
class SampledLogprobs:
    """A sampled token's log-probability under the model (log-softmax of the raw logits, before
    biases, penalties and temperature) and the `n` likeliest tokens', best first (lazy)."""

    logprob: mx.array  # float32 scalar
    top_ids: mx.array  # int32 [n]
    top_logprobs: mx.array  # float32 [n]


class Sampler:
    """Stateful sampler for one sequence: it tracks token counts for the penalties and owns the
    random key, so a fixed seed reproduces a sequence exactly.

    With a `constraint` (compiled against `grammar_tokenizer`, the model's vocabulary) only the
    tokens it allows can be sampled: `follow` must be given each token before the next is
    sampled (`constrained` says so)."""

    def __init__(
        self,
        params: SamplingParams,
        vocab_size: int,
        prompt_ids: list[int],
        constraint: Constraint | None = None,
        grammar_tokenizer: LLTokenizer | None = None,
    ) -> None:
        self._bias: mx.array | None = None
        if params.logit_bias:
            bias = np.zeros((vocab_size,), np.float32)
            for token_id, value in params.logit_bias.items():
                bias[token_id] += value
            self._bias = mx.array(bias)
        # Repetition penalty (HF semantics) covers prompt and output; presence/frequency
        # penalties (OpenAI semantics) cover the output only.
        self._seen: mx.array | None = None
        if params.repetition_penalty != 1.0:
            seen = np.zeros((vocab_size,), np.bool_)
            seen[[t for t in prompt_ids if 0 <= t < vocab_size]] = True
            self._seen = mx.array(seen.tolist())
        self._counts: mx.array | None = None
        if params.presence_penalty or params.frequency_penalty:
            self._counts = mx.zeros((vocab_size,), mx.float32)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = mx.random.key(seed)
        self.logprobs: deque[SampledLogprobs] = deque()  # one a call, while params.logprobs
        self._grammar: GrammarMask | None = None
        if constraint is not None:
            if grammar_tokenizer is None:
                raise ValueError("a constraint needs the model's grammar_tokenizer")
            self._grammar = GrammarMask(constraint, grammar_tokenizer)
        plain = (
            params.temperature <= 0.0 and params.logprobs is None
            and self._bias is None and self._seen is None and self._counts is None
            and self._grammar is None
        )
        self._argmax_rows = vocab_size if plain else None
        # Sampled with nothing but its setting and its key: many such rows of one setting can
        # be sampled in one call (sample_rows), each with its own key.
        alone = replace_none(params)
        self.row_setting: tuple[SamplingParams, int] | None = (
            (alone, vocab_size)
            if params.temperature > 0.0 and params.logprobs is None and self._bias is None
            and self._seen is None and self._counts is None and self._grammar is None
            else None
        )
        # One compiled step for the sequence: the setting is baked in, the bias values, the
        # key, the penalty state and the constraint's mask are its inputs.
        self._step = _compiled_step(
            replace_none(params), vocab_size,
            self._bias is not None, self._seen is not None, self._counts is not None,
            self._grammar is not None,
        )

    @property
    def constrained(self) -> bool:
        return self._grammar is not None

    @property
    def key(self) -> mx.array:
        """The random key the next sample splits (a batch sampling rows together sets it)."""
        return self._key

    @key.setter
    def key(self, key: mx.array) -> None:
        self._key = key

    @property
    def argmax_rows(self) -> int | None:
        """The logits rows whose argmax is this sampler's token (greedy, and no bias, penalty,
        grammar or log-probabilities), so a batch may take it for many sequences at once; None
        when sampling needs this sampler's own step."""
        return self._argmax_rows

    def follow(self, token: int) -> None:
        """The sequence took `token`: move the constraint past it and compute what may come next
        (host work: the loop runs it while the device computes the next logits)."""
        if self._grammar is not None:
            self._grammar.follow(token)

    def __call__(self, logits: mx.array) -> mx.array:
        """logits [V] (any float dtype) -> token id, an int32 scalar array (lazy)."""
        state = [a for a in (self._bias, self._seen, self._counts) if a is not None]
        if self._grammar is not None:
            state.append(self._grammar.allowed())
        token, self._key, *tracked = self._step(logits, self._key, *state)
        if self._seen is not None:
            self._seen = tracked.pop(0)
        if self._counts is not None:
            self._counts = tracked.pop(0)
        if tracked:  # the log-probabilities: queued in step order for the caller to take
            record = SampledLogprobs(*tracked)
            evaluate_async(record.logprob, record.top_ids, record.top_logprobs)
            self.logprobs.append(record)
        return token


def replace_none(p: SamplingParams) -> SamplingParams:
    """The setting without its per-sequence values (bias, seed): what a compiled step bakes in."""
    return dataclasses.replace(p, logit_bias=None, seed=None)


@functools.lru_cache(maxsize=16)
def sample_rows(p: SamplingParams, vocab_size: int) -> Callable[[mx.array, mx.array], list[mx.array]]:
    """Many rows of one setting sampled in one compiled call: (logits [n, V], keys [n, 2]) ->
    [tokens [n], keys [n, 2]], each row exactly as its own Sampler step would (vmapped)."""
    step = _step(p, vocab_size, False, False, False, False)
    return cast(Callable[[mx.array, mx.array], list[mx.array]], mx.compile(mx.vmap(step)))


@functools.lru_cache(maxsize=64)  # API clients send many temperatures
def _compiled_step(
    p: SamplingParams, vocab_size: int, bias: bool, seen: bool, counts: bool, masked: bool
) -> Callable[..., list[mx.array]]:
    """One sampling step as one compiled function, (logits, key, [bias], [seen], [counts],
    [mask]) -> [token, key, [seen], [counts], [logprob, top ids, top logprobs]]: a handful of
    primitives a token instead of ~20 dispatched one by one. Shared by every sequence with the
    same setting, in any thread (the logit bias values, the seed and the constraint's mask words
    are inputs, not constants)."""
    return mx.compile(_step(p, vocab_size, bias, seen, counts, masked))


def _step(
    p: SamplingParams, vocab_size: int, bias: bool, seen: bool, counts: bool, masked: bool
) -> Callable[..., list[mx.array]]:
    """The sampling step `_compiled_step` compiles."""
    # Evaluated here: a lazy constant would stay bound to this thread's stream, and a step
    # used from another thread then failed with "no Stream(cpu, N) in current thread".
    ids = mx.arange(vocab_size)
    places = [ids // 32, ids % 32] if masked else []  # token i's word and bit in the mask
    evaluate(ids, *places)

    def step(logits: mx.array, key: mx.array, *state: mx.array) -> list[mx.array]:
        rest = list(state)
        x = logits.astype(mx.float32)[:vocab_size]
        raw = x
        if bias:
            x = x + rest.pop(0)[: x.shape[0]]
        seen_ids = rest.pop(0) if seen else None
        counts_v = rest.pop(0) if counts else None
        mask = rest.pop(0) if masked else None
        if seen_ids is not None:
            rp = p.repetition_penalty
            penalized = mx.where(x < 0, x * rp, x / rp)
            x = mx.where(seen_ids[: x.shape[0]], penalized, x)
        if counts_v is not None:
            c = counts_v[: x.shape[0]]
            x = x - p.frequency_penalty * c - p.presence_penalty * (c > 0)
        if mask is not None:  # a token the constraint does not allow next is never sampled
            word, bit = places
            allowed = mx.bitwise_and(mx.right_shift(mask[word], bit), 1) != 0
            x = mx.where(allowed[: x.shape[0]], x, -mx.inf)
        if p.temperature <= 0.0:
            token = mx.argmax(x, axis=-1).astype(mx.int32)
        else:
            key, sub = mx.random.split(key)
            token = mx.random.categorical(truncate(x / p.temperature, p), key=sub).astype(mx.int32)
        out = [token, key]
        hit = ids == token
        if seen_ids is not None:
            out.append(seen_ids | hit)
        if counts_v is not None:
            out.append(counts_v + hit)
        if p.logprobs is not None:
            lp = raw - mx.logsumexp(raw, axis=-1)
            n = min(p.logprobs, vocab_size)
            top = mx.argpartition(-lp, n - 1)[:n] if n else mx.zeros((0,), mx.int32)
            top = top[mx.argsort(-lp[top])] if n else top
            out += [lp[token], top.astype(mx.int32), lp[top]]
        return out

    return step


def truncate(x: mx.array, p: SamplingParams) -> mx.array:
    """Logits [V] (already divided by the temperature) with the tokens that top-k, min-p and
    top-p (in that order) leave out set to -inf.

    top-k keeps every value >= the k-th largest (ties included), found with `mx.topk` (no sort
    of the vocabulary). top-p keeps the smallest prefix of the values in decreasing order whose
    probability mass reaches top_p (the first always stays), then every value >= the last one
    kept; after top-k only the k candidates are sorted."""
    k = p.top_k if 0 < p.top_k < x.shape[0] else 0
    if k:
        x = mx.where(x < mx.topk(x, k).min(), -mx.inf, x)
    if p.min_p > 0.0:
        probs = mx.softmax(x, axis=-1)
        x = mx.where(probs < p.min_p * probs.max(), -mx.inf, x)
    if p.top_p < 1.0:
        # The candidates in decreasing order: the top k when top-k ran (the rest are -inf and
        # carry no mass), else the whole vocabulary; probabilities as softmax over all of x.
        vals = -mx.sort(-(mx.topk(x, k) if k else x))
        top = x.max()
        probs = mx.exp(vals - top) / mx.exp(x - top).sum()
        before = mx.cumsum(probs) - probs
        kept = mx.where(before < p.top_p, vals, mx.inf)
        x = mx.where(x >= kept.min(), x, -mx.inf)
    return x
